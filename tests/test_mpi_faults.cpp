// A fault on one rank (or on a subset) never hangs the job: every rank gets a kfac::Error with
// the same message, nothing changed, and once the fault is repaired the next step equals a twin
// preconditioner that never saw it, bit for bit. Run at 2, 3 and 4 ranks under a ctest timeout,
// so a hang fails the test. KFAC_PRINT_FAULTS=1 prints each message (docs/reliability.md).
#include "mpi_harness.hpp"

using namespace kfac_test;
using namespace kfac_test::mpi;

namespace {

kfac::Options fault_options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-3).with_factor_decay(0.9)
      .with_inv_update_steps(2).with_loss_reduction(kfac::LossReduction::sum);
}
kfac::Kaisa fault_kaisa() { return kfac::Kaisa{}.with_bucket_bytes(1024); }

/// Two K-FAC layers and world + 1 toy layers (so that every rank decomposes some toy unit).
std::vector<Layer> fault_net() {
  std::vector<Layer> net = {{"fc1", 5, 4, false}, {"fc2", 4, 3, false}};
  for (int k = 0; k <= size_of(); ++k) net.push_back({"toy" + std::to_string(k), 2 + k % 3, 2, true});
  return net;
}

constexpr unsigned kSeed = 3;
constexpr long kWarm = 3;  // good steps before the fault (step 3 is not a decomposition step)

/// The checks every fault shares: every rank threw a kfac::Error, the same message everywhere,
/// quickly, and it contains `expect`.
void check_refused(const char* fault, const Outcome& o, const std::string& expect) {
  report(fault, o);
  INFO(fault << " on rank " << rank_in() << ": " << o.what);
  CHECK(everywhere(o.kfac_error));
  CHECK(same_everywhere(o.what));
  CHECK(o.what.find(expect) != std::string::npos);
  CHECK(everywhere(o.seconds < 5.0));
}

/// A preconditioner and its twin after kWarm identical good steps.
struct Pair {
  Pre pre, twin;
  std::vector<Layer> net;
  Pair(const kfac::Options& mine, const kfac::Options& twins, std::vector<Layer> layers = fault_net(),
       const kfac::Kaisa& kaisa = fault_kaisa())
      : pre(mine, Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa),
        twin(twins, Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa),
        net(std::move(layers)) {
    register_net(pre, net);
    register_net(twin, net);
  }
  bool warm(long steps = kWarm) {
    bool equal = true;
    for (long s = 0; s < steps; ++s)
      equal = step_once(pre, net, kSeed, s, rank_in()) == step_once(twin, net, kSeed, s, rank_in()) && equal;
    return equal;
  }
  /// After the repaired step: the repaired gradients equal the twin's step, the states equal,
  /// and two more steps agree bit for bit.
  void check_recovered(const Grads& repaired, long s) {
    CHECK(everywhere(bytes_of(repaired.flat()) == bytes_of(step_once(twin, net, kSeed, s, rank_in()))));
    CHECK(everywhere(saved(pre) == saved(twin)));
    bool equal = true;
    for (long t = s + 1; t < s + 3; ++t)
      equal = bytes_of(step_once(pre, net, kSeed, t, rank_in())) == bytes_of(step_once(twin, net, kSeed, t, rank_in())) && equal;
    CHECK(everywhere(equal));
  }
};

}  // namespace

TEST_CASE("a missing set_gradient on one rank is the same error on every rank", "[mpi][faults]") {
  for (int bad : {size_of() - 1, 0}) {
    INFO("faulty rank " << bad);
    Pair p(fault_options(), fault_options());
    REQUIRE(everywhere(p.warm()));
    const std::string before = saved(p.pre);
    Grads g = feed(p.pre, p.net, kSeed, kWarm, rank_in(), rank_in() == bad ? "fc2" : "");
    const Outcome o = attempt([&] { p.pre.step(); });
    check_refused("missing set_gradient", o, "layer 'fc2': no gradient was set for step 3 (call set_gradient before step) (on rank " + std::to_string(bad) + "; the step was refused on every rank)");
    CHECK(everywhere(saved(p.pre) == before && p.pre.step_count() == kWarm));
    // Repair: hand the missing gradient over and call step() again (observations and the
    // other gradients of the refused step are still pending).
    if (rank_in() == bad) p.pre.set_gradient("fc2", g.w[1], g.b[1]);
    REQUIRE_NOTHROW(p.pre.step());
    p.check_recovered(g, kWarm);
  }
}

TEST_CASE("a bad-shape set_gradient on one rank, caught there, is the same error on every rank at step()", "[mpi][faults]") {
  const int bad = size_of() - 1;
  Pair p(fault_options(), fault_options());
  REQUIRE(everywhere(p.warm()));
  const std::string before = saved(p.pre);
  Grads g = feed(p.pre, p.net, kSeed, kWarm, rank_in(), rank_in() == bad ? "fc2" : "");
  if (rank_in() == bad) {
    V2 wrong("wrong", 4, 3);  // fc2's weight is 3 x 4
    const Outcome local = attempt([&] { p.pre.set_gradient("fc2", wrong, g.b[1]); });
    CHECK(local.kfac_error);
    CHECK(local.what == "kfac: layer 'fc2': weight gradient has shape (4, 3), expected 3 x 4 values");
  }
  const Outcome o = attempt([&] { p.pre.step(); });
  check_refused("bad-shape set_gradient, caught", o, "layer 'fc2': no gradient was set for step 3 (call set_gradient before step) (on rank " + std::to_string(bad) + "; the step was refused on every rank)");
  CHECK(everywhere(saved(p.pre) == before));
  if (rank_in() == bad) p.pre.set_gradient("fc2", g.w[1], g.b[1]);
  REQUIRE_NOTHROW(p.pre.step());
  p.check_recovered(g, kWarm);
}

TEST_CASE("a NaN gradient under the raise policy on one rank is the same error on every rank", "[mpi][faults]") {
  const int bad = size_of() - 1;
  Pair p(fault_options(), fault_options());
  REQUIRE(everywhere(p.warm()));
  const std::string before = saved(p.pre);
  Grads g = feed(p.pre, p.net, kSeed, kWarm, rank_in());
  V2 nan("nan", 4, 5);
  Kokkos::deep_copy(nan, g.w[0]);
  nan(1, 2) = std::numeric_limits<double>::quiet_NaN();
  if (rank_in() == bad) p.pre.set_gradient("fc1", nan, g.b[0]);
  const Outcome o = attempt([&] { p.pre.step(); });
  check_refused("NaN gradient (raise)", o, "layer 'fc1': gradient contains 1 NaN/Inf value(s) at step 3 (on rank " + std::to_string(bad) + "; the step was refused on every rank)");
  CHECK(everywhere(saved(p.pre) == before));
  CHECK(everywhere(std::isnan(nan(1, 2))));  // the refused gradient was not touched
  if (rank_in() == bad) p.pre.set_gradient("fc1", g.w[0], g.b[0]);
  REQUIRE_NOTHROW(p.pre.step());
  p.check_recovered(g, kWarm);
}

TEST_CASE("a layer registered late on a subset of ranks is the same error on every rank", "[mpi][faults]") {
  // Odd ranks register "late" after step kWarm - 1 and feed it; the even ranks do not. Then the
  // even ranks register it too and feed it, and step() is called again. The twin registers it at
  // the same step on every rank.
  const bool subset = rank_in() % 2 == 1;
  Pair p(fault_options(), fault_options());
  REQUIRE(everywhere(p.warm()));
  const Layer late{"late", 3, 2, false};
  const std::string before = saved(p.pre);
  if (subset) p.pre.register_layer(late.name, kfac::Dense(late.in, late.out), kfac::KFAC<>{});
  Grads g = feed(p.pre, p.net, kSeed, kWarm, rank_in());
  auto feed_late = [&](Pre& pre, Grads& gr) {
    const auto o = observations(late, 99, kSeed, kWarm, rank_in());
    pre.observe_input(late.name, o.first);
    pre.observe_output_grad(late.name, o.second);
    const auto w = gradient(late, 99, kSeed, kWarm);
    gr.w.push_back(w.first);
    gr.b.push_back(w.second);
    pre.set_gradient(late.name, w.first, w.second);
  };
  if (subset) feed_late(p.pre, g);
  const Outcome o = attempt([&] { p.pre.step(); });
  check_refused("late registration on a subset", o, "kfac: ranks registered different layers, shapes, methods or distribution options: ");
  // The layer that differs is named first (issue 46), then its consequences.
  CHECK(o.what.find("options: late.method (rank 0: (none), rank 1: dense(in=3,out=2,bias=1)") != std::string::npos);
  CHECK(o.what.find("; the step was refused on every rank") != std::string::npos);
  CHECK(everywhere(p.pre.step_count() == kWarm));
  if (!subset) CHECK(saved(p.pre) == before);
  // Repair: the other ranks register the layer too (same position: last) and feed it.
  if (!subset) {
    p.pre.register_layer(late.name, kfac::Dense(late.in, late.out), kfac::KFAC<>{});
    feed_late(p.pre, g);
  }
  REQUIRE_NOTHROW(p.pre.step());
  p.twin.register_layer(late.name, kfac::Dense(late.in, late.out), kfac::KFAC<>{});
  Grads t = feed(p.twin, p.net, kSeed, kWarm, rank_in());
  feed_late(p.twin, t);
  p.twin.step();
  CHECK(everywhere(bytes_of(g.flat()) == bytes_of(t.flat())));
  CHECK(everywhere(saved(p.pre) == saved(p.twin)));
  p.net.push_back(late);  // (the gradient seeds of "late" differ from here on: same on both)
  bool equal = true;
  for (long s = kWarm + 1; s < kWarm + 3; ++s)
    equal = bytes_of(step_once(p.pre, p.net, kSeed, s, rank_in())) == bytes_of(step_once(p.twin, p.net, kSeed, s, rank_in())) && equal;
  CHECK(everywhere(equal));
}

TEST_CASE("a different bucket_bytes on one rank is the same error on every rank", "[mpi][faults]") {
  // bucket_bytes belongs to the distribution policy, so it is part of the registration
  // signature (since kfac 0.3): the first collective call after registration (here load(),
  // before any step) is refused on every rank, and nothing is loaded. Each rank's message names
  // its own signature, so the messages differ by that part only. The repair is a preconditioner
  // built with the right options, which loads the same checkpoint and continues like the twin.
  const int bad = size_of() - 1;
  Pair p(fault_options(), fault_options(), {{"fc1", 5, 4, false}, {"fc2", 4, 3, false}, {"fc3", 3, 6, false}});
  REQUIRE(everywhere(p.warm()));
  const std::string good = saved(p.pre);
  Pre faulty(fault_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD),
             rank_in() == bad ? fault_kaisa().with_bucket_bytes(64) : fault_kaisa());
  register_net(faulty, p.net);
  const Outcome o = attempt([&] { loaded(faulty, good); });
  report("different bucket_bytes", o);
  INFO("rank " << rank_in() << ": " << o.what);
  CHECK(everywhere(o.kfac_error));
  CHECK(o.what.find("kfac: ranks registered different layers, shapes, policies or distribution options (rank " +
                    std::to_string(rank_in()) + " has: ") != std::string::npos);
  CHECK(o.what.find(rank_in() == bad ? ";b=64;" : ";b=1024;") != std::string::npos);
  CHECK(everywhere(o.seconds < 5.0));
  CHECK(everywhere(faulty.step_count() == 0));
  Pre fixed(fault_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), fault_kaisa());
  register_net(fixed, p.net);
  CHECK(everywhere(loaded(fixed, good)));
  Grads f = feed(fixed, p.net, kSeed, kWarm, rank_in());
  REQUIRE_NOTHROW(fixed.step());
  CHECK(everywhere(bytes_of(f.flat()) == bytes_of(step_once(p.twin, p.net, kSeed, kWarm, rank_in()))));
  CHECK(everywhere(saved(fixed) == saved(p.twin)));
}

TEST_CASE("a different schedule on one rank is the same error on every rank", "[mpi][faults]") {
  // inv_update_steps 3 on one rank, 2 elsewhere: the hyperparameter values enter every step's
  // agreement, so step 0 is refused everywhere (before kfac 0.2.0 only step 2, the first whose
  // collectives differ). Repair: every rank builds the preconditioner again, correctly.
  const int bad = size_of() - 1;
  Pair p(rank_in() == bad ? fault_options().with_inv_update_steps(3) : fault_options(), fault_options());
  const std::string before = saved(p.pre);
  const Grads kept = feed(p.pre, p.net, kSeed, 0, rank_in());  // alive until step() returns
  const Outcome o = attempt([&] { p.pre.step(); });
  check_refused("different inv_update_steps", o, "kfac: ranks disagree on this step's hyperparameter values");
  CHECK(everywhere(saved(p.pre) == before && p.pre.step_count() == 0));
  Pre fixed(fault_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), fault_kaisa());
  register_net(fixed, p.net);
  bool equal = true;
  for (long s = 0; s < 4; ++s)
    equal = bytes_of(step_once(fixed, p.net, kSeed, s, rank_in())) == bytes_of(step_once(p.twin, p.net, kSeed, s, rank_in())) && equal;
  CHECK(everywhere(equal));
}

namespace {
/// An injected failure inside one rank's decomposition (the toy method); returns what each
/// rank saw. The pair recovers by calling step() again.
Outcome decomposition_fault(Pair& p, ToyFailure how, int bad) {
  REQUIRE(everywhere(p.warm()));
  bool decomposes_toy = false;
  for (std::size_t l = 2; l < p.net.size(); ++l) decomposes_toy = decomposes_toy || p.pre.assignment().decomposer(l, 0) == bad;
  REQUIRE(everywhere(decomposes_toy || rank_in() != bad));
  const std::string before = saved(p.pre);
  Grads g = feed(p.pre, p.net, kSeed, kWarm, rank_in());
  Outcome o;
  {
    ToyFailScope fail(rank_in() == bad ? how : ToyFailure::none);
    o = attempt([&] { p.pre.step(); });
  }
  CHECK(everywhere(o.kfac_error));
  CHECK(everywhere(o.seconds < 5.0));
  CHECK(everywhere(saved(p.pre) == before));
  REQUIRE_NOTHROW(p.pre.step());
  p.check_recovered(g, kWarm);
  return o;
}
}  // namespace

TEST_CASE("an allocation failure in one rank's decomposition is an error on every rank, then recovers", "[mpi][faults]") {
  const int bad = size_of() - 1;
  for (ToyFailure how : {ToyFailure::bad_alloc, ToyFailure::error}) {
    INFO("failure " << int(how));
    Pair p(fault_options().with_inv_update_steps(1), fault_options().with_inv_update_steps(1));
    const Outcome o = decomposition_fault(p, how, bad);
    for (int who : {0, bad}) report(how == ToyFailure::bad_alloc ? "std::bad_alloc in a decomposition" : "kfac::Error in a decomposition", o, who);
    INFO("rank " << rank_in() << ": " << o.what);
    if (rank_in() == bad) CHECK(o.what.find(how == ToyFailure::bad_alloc ? "std::bad_alloc" : "toy decomposition refused") != std::string::npos);
  }
}

// A decomposition failure is voted after the step's agreement (decompositions run after it);
// the lowest failing rank's error is shared, so every rank throws the same message.
TEST_CASE("a decomposition failure gives the same message on every rank", "[mpi][faults]") {
  const int bad = size_of() - 1;
  Pair p(fault_options().with_inv_update_steps(1), fault_options().with_inv_update_steps(1));
  const Outcome o = decomposition_fault(p, ToyFailure::bad_alloc, bad);
  INFO("rank " << rank_in() << ": " << o.what);
  CHECK(same_everywhere(o.what));
  CHECK(o.what.find("on rank " + std::to_string(bad)) != std::string::npos);
}

TEST_CASE("observations that would overflow a bfloat16 payload on one rank are the same error everywhere, or skip everywhere",
          "[mpi][faults][payload]") {
  if (size_of() == 1) return;  // one rank sends nothing: the payload does not apply
  const int bad = size_of() - 1;
  for (auto policy : {kfac::NonFinitePolicy::raise, kfac::NonFinitePolicy::skip}) {
    const kfac::Options o = fault_options().with_nonfinite_policy(policy);
    Pair p(o, o, fault_net(), fault_kaisa().with_comm_precision(kfac::CommPrecision::bfloat16));
    REQUIRE(everywhere(p.warm()));
    const std::string before = saved(p.pre);
    Grads g = feed(p.pre, p.net, kSeed, kWarm, rank_in());
    // Finite in double, but its A would hold about 5e40: beyond bfloat16's 3.4e38.
    V2 huge("huge", 4, 5), dy("dy", 4, 4);
    Kokkos::deep_copy(huge, 1e20);
    Kokkos::deep_copy(dy, 0.5);
    if (rank_in() == bad) {
      p.pre.observe_input("fc1", huge);
      p.pre.observe_output_grad("fc1", dy);
    }
    if (policy == kfac::NonFinitePolicy::raise) {
      const Outcome out = attempt([&] { p.pre.step(); });
      check_refused("payload overflow (raise)", out, "layer 'fc1': observations would overflow the reduced-precision communication payload");
      CHECK(everywhere(saved(p.pre) == before));
      // The pending observation cannot be taken back: restore the last good state and go on.
      REQUIRE(loaded(p.pre, before));
      Grads again = feed(p.pre, p.net, kSeed, kWarm, rank_in());
      REQUIRE_NOTHROW(p.pre.step());
      p.check_recovered(again, kWarm);
    } else {
      REQUIRE_NOTHROW(p.pre.step());
      CHECK(everywhere(p.pre.skipped_steps() == 1));
      CHECK(everywhere(p.pre.last_factor_step() == kWarm - 1));  // the update was not applied
    }
  }
}
