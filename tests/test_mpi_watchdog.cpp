// No collective waits forever, and misuse that used to hang, abort in MPI or drift silently is
// a kfac::Error (issues 26, 46): each case runs at 2-4 ranks under the ctest timeout with a 2 s
// watchdog, checks what every rank saw and ends in a plain MPI_Barrier, so that a rank that
// moved on waits for the one that is still timing out.
#include <cstdlib>
#include <functional>
#include <sstream>

#include "mpi_harness.hpp"

using namespace kfac_test;
using namespace kfac_test::mpi;

namespace {

constexpr double kTimeout = 2.0;

kfac::MpiComm watched() { return kfac::MpiComm(MPI_COMM_WORLD).with_timeout(kTimeout); }

kfac::Options options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-3).with_inv_update_steps(2)
      .with_loss_reduction(kfac::LossReduction::sum);
}

std::vector<Layer> net() { return {{"fc1", 5, 4, false}, {"fc2", 4, 3, false}}; }

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The rank that ran alone into a collective timed out: a kfac::Error naming `call`, the
/// other ranks as not arrived, within the timeout plus the grace period; the others saw nothing.
void check_timed_out(const char* fault, const Outcome& o, bool alone, const std::string& call) {
  report(fault, o, 0);
  INFO(fault << " on rank " << rank_in() << ": " << o.what);
  if (alone) {
    CHECK(o.kfac_error);
    CHECK(has(o.what, call));
    CHECK(has(o.what, "did not complete within"));
    CHECK(has(o.what, "rank(s) that did not arrive: "));
    for (int r = 1; r < size_of(); ++r) CHECK(has(o.what, std::to_string(r) + " (no answer"));
    CHECK(o.seconds >= kTimeout);
    CHECK(o.seconds < kTimeout + 3.0);
  } else {
    CHECK_FALSE(o.threw);
  }
}

/// Every rank threw the same kfac::Error containing `expect`, quickly.
void check_refused(const char* fault, const Outcome& o, const std::string& expect) {
  report(fault, o);
  INFO(fault << " on rank " << rank_in() << ": " << o.what);
  CHECK(everywhere(o.kfac_error));
  CHECK(same_everywhere(o.what));
  CHECK(has(o.what, expect));
  CHECK(everywhere(o.seconds < kTimeout));
}

/// A run of `steps` steps on data `seed`, saved.
std::string run(unsigned seed, long steps) {
  Pre pre(options(), Host{}, watched());
  const auto layers = net();
  register_net(pre, layers);
  for (long s = 0; s < steps; ++s) step_once(pre, layers, seed, s, rank_in());
  return saved(pre);
}

}  // namespace

TEST_CASE("a rank that loads another run's checkpoint is refused on every rank, naming it", "[mpi][load]") {
  if (size_of() == 1) return;
  const std::string mine = run(1, 3), other = run(2, 3);  // same layers, same step, other data
  const int odd = size_of() - 1;
  Pre pre(options(), Host{}, watched());
  const auto layers = net();
  register_net(pre, layers);
  step_once(pre, layers, 3, 0, rank_in());
  const std::string before = saved(pre);
  const Outcome o = attempt([&] { loaded(pre, rank_in() == odd ? other : mine); });
  check_refused("one rank loads another run's checkpoint", o, "loaded checkpoints of different content");
  CHECK(has(o.what, "rank " + std::to_string(odd) + " loaded"));
  CHECK(everywhere(saved(pre) == before && pre.step_count() == 1));
  // The same checkpoint everywhere loads.
  CHECK(everywhere(!attempt([&] { loaded(pre, mine); }).threw));
  CHECK(everywhere(pre.step_count() == 3));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a parameter average reached on one rank only times out there, naming the call and the absent ranks",
          "[mpi][watchdog]") {
  if (size_of() == 1) return;
  std::vector<double> p(8, double(rank_in()));
  kfac::ParameterAverager<kfac::MpiComm> avg(watched(), 10);
  avg.add(Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(p.data(), p.size()));
  // Step 9 on rank 0 (averages: 9 + 1 is a multiple of 10), step 8 elsewhere (does not).
  const Outcome o = attempt([&] { avg.maybe_average(rank_in() == 0 ? 9 : 8); });
  check_timed_out("maybe_average at different steps", o, rank_in() == 0, "ParameterAverager::average, average 1");
  // The communicator is unusable afterwards: the next call refuses at once, naming why.
  if (rank_in() == 0) {
    const Outcome again = attempt([&] { avg.average(); });
    CHECK(again.kfac_error);
    CHECK(has(again.what, "an earlier collective timed out"));
    CHECK(again.seconds < 0.5);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("ranks that arrived are told apart from the one that did not", "[mpi][watchdog]") {
  if (size_of() < 3) return;
  const kfac::MpiComm comm = watched();
  const int absent = size_of() - 1;
  const Outcome o = attempt([&] {
    if (rank_in() != absent) comm.allreduce_max(1L);
  });
  report("one rank absent from an allreduce", o, 0);
  INFO("rank " << rank_in() << ": " << o.what);
  if (rank_in() == absent) {
    CHECK_FALSE(o.threw);
  } else {
    CHECK(o.kfac_error);
    CHECK(has(o.what, "MPI_Allreduce"));
    CHECK(has(o.what, "rank(s) that did not arrive: " + std::to_string(absent) + " (no answer"));
    std::string others;
    for (int r = 0; r < absent; ++r)
      if (r != rank_in()) others += (others.empty() ? "" : ", ") + std::to_string(r);
    CHECK(has(o.what, "waiting in it too: rank(s) " + others));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("save() with reduce_to_owner on one rank only times out there, naming save", "[mpi][watchdog]") {
  if (size_of() == 1) return;
  Pre pre(options(), Host{}, watched(), kfac::Kaisa{}.with_reduce_to_owner(true));
  const auto layers = net();
  register_net(pre, layers);
  for (long s = 0; s < 2; ++s) step_once(pre, layers, 5, s, rank_in());
  std::ostringstream out;
  const Outcome o = attempt([&] {
    if (rank_in() == 0) pre.save(out);
  });
  check_timed_out("save on one rank only", o, rank_in() == 0, "Preconditioner::save at step 2");
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("KFAC_COMM_TIMEOUT sets the default, and MPI_COMM_NULL on one rank is an error on every rank",
          "[mpi][watchdog]") {
  ::setenv("KFAC_COMM_TIMEOUT", "2", 1);
  {
    kfac::MpiComm c(MPI_COMM_WORLD);
    CHECK(c.timeout() == 2.0);
  }
  if (size_of() > 1) {
    // On a communicator of its own: the others' duplication of it stays pending for ever.
    MPI_Comm scratch;
    MPI_Comm_dup(MPI_COMM_WORLD, &scratch);
    const int bad = size_of() - 1;
    const Outcome o = attempt([&] { kfac::MpiComm c(rank_in() == bad ? MPI_COMM_NULL : scratch); });
    report("MPI_COMM_NULL on one rank", o, 0);
    INFO("rank " << rank_in() << ": " << o.what);
    CHECK(o.kfac_error);
    if (rank_in() == bad) {
      CHECK(has(o.what, "MpiComm: the communicator is MPI_COMM_NULL"));
      CHECK(o.seconds < 0.5);
    } else {
      CHECK(has(o.what, "MPI_Comm_idup (MpiComm's constructor)"));
      CHECK(has(o.what, "did not complete within"));
      CHECK(o.seconds < kTimeout + 3.0);
    }
  }
  ::setenv("KFAC_COMM_TIMEOUT", "soon", 1);
  const Outcome bad_env = attempt([&] { kfac::MpiComm c(MPI_COMM_WORLD); });
  CHECK(bad_env.kfac_error);
  CHECK(has(bad_env.what, "KFAC_COMM_TIMEOUT='soon'"));
  ::unsetenv("KFAC_COMM_TIMEOUT");
  CHECK(kfac::MpiComm(MPI_COMM_WORLD).timeout() == 600.0);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("GradientAverager with different view sizes per rank is the same error on every rank", "[mpi][watchdog]") {
  if (size_of() == 1) return;
  std::vector<double> g(rank_in() == 0 ? 6 : 7, 1.0), before = g;
  kfac::GradientAverager<kfac::MpiComm> avg(watched());
  avg.add(Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(g.data(), g.size()));
  const Outcome o = attempt([&] { avg.average(); });
  report("GradientAverager sizes", o, 0);
  INFO("rank " << rank_in() << ": " << o.what);
  CHECK(everywhere(o.kfac_error));
  CHECK(has(o.what, "GradientAverager: ranks registered different gradient views"));
  CHECK(everywhere(o.seconds < kTimeout));
  CHECK(g == before);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("hyperparameters that differ by rank are the same error on every rank", "[mpi][watchdog]") {
  if (size_of() == 1) return;
  const int bad = size_of() - 1;
  const bool me = rank_in() == bad;
  struct Case {
    const char* what;
    kfac::Options mine;
    bool override_damping;
  };
  const std::vector<Case> cases = {
      {"damping", me ? options().with_damping(2e-2) : options(), false},
      {"lr", me ? options().with_lr(0.2) : options(), false},
      {"kl_clip", me ? options().with_kl_clip(2e-3) : options(), false},
      {"damping schedule from step 1", me ? options().with_damping([](long s) { return s < 1 ? 1e-2 : 3e-2; }) : options(), false},
      {"a layer's damping override", options(), me},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    Pre pre(c.mine, Host{}, watched());
    const auto layers = net();
    pre.register_layer("fc1", kfac::Dense(5, 4), kfac::KFAC<>{}.with_damping(c.override_damping ? 5e-2 : 1e-2));
    pre.register_layer("fc2", kfac::Dense(4, 3), kfac::KFAC<>{});
    const bool from_step_1 = std::string(c.what).find("from step 1") != std::string::npos;
    if (from_step_1) REQUIRE(everywhere(attempt([&] { step_once(pre, layers, 7, 0, rank_in()); }).threw == false));
    const std::string before = saved(pre);
    const long at = pre.step_count();
    const Grads kept = feed(pre, layers, 7, at, rank_in());  // the gradients must live until step() returns
    const Outcome o = attempt([&] { pre.step(); });
    check_refused(c.what, o, "ranks disagree on this step's hyperparameter values");
    const std::string what = c.what;
    const std::string named = has(what, "override") ? "fc1.damping" : what.substr(0, what.find(' '));
    CHECK(has(o.what, named + " (rank 0: "));  // the setting that differs, by name
    CHECK(everywhere(saved(pre) == before && pre.step_count() == at));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("settings that change the result, differing by rank, are the same error on every rank, naming the setting",
          "[mpi][watchdog]") {
  if (size_of() == 1) return;
  const bool me = rank_in() == size_of() - 1;
  using Randomized = kfac::RandomizedEigen<>;
  struct Case {
    const char* what;  // also the setting the error must name
    kfac::Options mine;
    std::function<void(Pre&)> fc1;  // registers fc1
  };
  const auto plain = [](Pre& p) { p.register_layer("fc1", kfac::Dense(5, 4), kfac::KFAC<>{}); };
  const std::vector<Case> cases = {
      {"Options::precompute_reciprocal", options().with_precompute_reciprocal(me), plain},
      {"Options::loss_reduction", me ? options().with_loss_reduction(kfac::LossReduction::mean) : options(), plain},
      {"Options::max_damping_retries", options().with_max_damping_retries(me ? 1 : 3), plain},
      {"fc1.rank",
       options(),
       [me](Pre& p) {
         p.register_layer("fc1", kfac::Dense(5, 4), kfac::KFAC<kfac::Symmetric, Randomized>(Randomized{}.with_rank(me ? 2 : 3)));
       }},
      {"fc1.oversampling",
       options(),
       [me](Pre& p) {
         p.register_layer("fc1", kfac::Dense(5, 4),
                          kfac::KFAC<kfac::Symmetric, Randomized>(Randomized{}.with_rank(2).with_oversampling(me ? 1 : 2)));
       }},
      {"fc1.pi_damping",
       options(),
       [me](Pre& p) {
         p.register_layer("fc1", kfac::Dense(5, 4),
                          kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>>(kfac::Cholesky<>{}.with_pi_damping(!me)));
       }},
      {"fc1.inv_update_steps",
       options(),
       [me](Pre& p) { p.register_layer("fc1", kfac::Dense(5, 4), kfac::KFAC<>{}.with_inv_update_steps(me ? 3 : 2)); }},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    Pre pre(c.mine, Host{}, watched());
    const auto layers = net();
    c.fc1(pre);
    pre.register_layer("fc2", kfac::Dense(4, 3), kfac::KFAC<>{});
    const std::string before = saved(pre);
    const Grads kept = feed(pre, layers, 7, 0, rank_in());
    const Outcome o = attempt([&] { pre.step(); });
    check_refused(c.what, o, c.what);
    CHECK(has(o.what, "the step was refused on every rank"));
    CHECK(everywhere(saved(pre) == before && pre.step_count() == 0));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("two preconditioners on one MpiComm stepped in different orders are the same error on every rank",
          "[mpi][watchdog]") {
  if (size_of() == 1) return;
  const kfac::MpiComm comm = watched();
  Pre first(options(), Host{}, comm), second(options(), Host{}, comm);
  const auto layers = net();
  register_net(first, layers);
  register_net(second, layers);
  // Both in the same order: fine.
  step_once(first, layers, 9, 0, rank_in());
  step_once(second, layers, 9, 0, rank_in());
  // Rank 0 steps `first`, the others `second`.
  Pre& mine = rank_in() == 0 ? first : second;
  const std::string before = saved(mine);
  const Grads kept = feed(mine, layers, 9, 1, rank_in());
  const Outcome o = attempt([&] { mine.step(); });
  report("preconditioners stepped in different orders", o);
  INFO("rank " << rank_in() << ": " << o.what);
  CHECK(everywhere(o.kfac_error));
  CHECK(has(o.what, "two preconditioners that share one communicator were stepped in different orders"));
  CHECK(everywhere(o.seconds < kTimeout));
  CHECK(everywhere(saved(mine) == before));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a slow rank within the deadline is no error", "[mpi][watchdog]") {
  if (size_of() == 1) return;
  const kfac::MpiComm comm = kfac::MpiComm(MPI_COMM_WORLD).with_timeout(3.0);
  if (rank_in() == 0) {
    const double t0 = MPI_Wtime();
    while (MPI_Wtime() - t0 < 0.5) {
    }
  }
  const Outcome o = attempt([&] { CHECK(comm.allreduce_max(long(rank_in())) == long(size_of() - 1)); });
  CHECK_FALSE(o.threw);
  MPI_Barrier(MPI_COMM_WORLD);
}
