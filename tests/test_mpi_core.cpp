// The redesigned core under MPI: preconditioners sharing one MpiComm behave as if each had its
// own (and outlive each other), a method defined in the tests distributes its averaged state and
// keeps its private state, a decomposition failure on one rank is atomic on all, and the
// Independent distribution is a SerialComm run per rank.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>

#include "reference.hpp"
#include "toy_method.hpp"

using namespace kfac_test;

namespace {

using Host = Kokkos::DefaultHostExecutionSpace;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;
using MPre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
using SPre = kfac::Preconditioner<double, Host>;
using IPre = kfac::Preconditioner<double, Host, kfac::MpiComm, kfac::Independent>;

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

/// True on every rank when `v` holds the same bytes on every rank.
bool same_on_all_ranks(const std::vector<double>& v) {
  std::vector<double> root = v;
  long n = long(v.size()), nmax = 0;
  MPI_Allreduce(&n, &nmax, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
  root.resize(std::size_t(nmax));
  MPI_Bcast(root.data(), int(nmax), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  int ok = n == nmax && std::memcmp(root.data(), v.data(), v.size() * sizeof(double)) == 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}
bool all_ranks(bool b) {
  int v = b, r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return r == 1;
}
bool bit_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

/// A Dense layer of a test network: its name, shape and whether it uses the toy method.
struct Spec {
  std::string name;
  int in, out;
  bool toy;
};

template <class P>
void register_specs(P& pre, const std::vector<Spec>& specs) {
  for (const auto& s : specs) {
    if (s.toy) pre.register_layer(s.name, kfac::Dense(s.in, s.out), ScaledIdentity{}.with_damping(0.5));
    else pre.register_layer(s.name, kfac::Dense(s.in, s.out), kfac::KFAC<>{});
  }
}

/// The gradients handed to one step (they must live until step() returns).
struct Fed {
  std::vector<V2> ws;
  std::vector<V1> bs;
  /// The preconditioned gradients after step(), flattened.
  std::vector<double> result() const {
    std::vector<double> out;
    for (std::size_t l = 0; l < ws.size(); ++l) {
      out.insert(out.end(), ws[l].data(), ws[l].data() + ws[l].span());
      out.insert(out.end(), bs[l].data(), bs[l].data() + bs[l].span());
    }
    return out;
  }
};

/// Feeds one step: each layer observes `micro` micro-batches of `batch` samples drawn from
/// (seed, step, data_rank), and gets a gradient drawn from (seed, step) only, the same on every
/// rank as after a data-parallel allreduce.
template <class P>
Fed feed(P& pre, const std::vector<Spec>& specs, unsigned seed, long step, int data_rank,
         int batch = 6, int micro = 1) {
  Fed fed;
  for (std::size_t l = 0; l < specs.size(); ++l) {
    const auto& s = specs[l];
    Rng data(seed * 100003u + unsigned(step) * 1009u + unsigned(data_rank) * 17u + unsigned(l));
    const auto x = random_view<double>(batch, s.in, data);
    const auto g = random_view<double>(batch, s.out, data);
    const int per = batch / micro;
    for (int k = 0; k < micro; ++k) {
      const auto rows = std::make_pair(k * per, (k + 1) * per);
      V2 xs("x", per, s.in), gs("g", per, s.out);
      Kokkos::deep_copy(xs, Kokkos::subview(x, rows, Kokkos::ALL));
      Kokkos::deep_copy(gs, Kokkos::subview(g, rows, Kokkos::ALL));
      pre.observe_input(s.name, xs);
      pre.observe_output_grad(s.name, gs);
    }
    Rng grad(seed * 7919u + unsigned(step) * 31u + unsigned(l));
    fed.ws.push_back(random_view<double>(s.out, s.in, grad));
    fed.bs.push_back(random_vector<double>(s.out, grad));
    pre.set_gradient(s.name, fed.ws.back(), fed.bs.back());
  }
  return fed;
}

/// feed() and step(); returns the preconditioned gradients.
template <class P>
std::vector<double> step_once(P& pre, const std::vector<Spec>& specs, unsigned seed, long step,
                              int data_rank, int batch = 6, int micro = 1) {
  const Fed fed = feed(pre, specs, seed, step, data_rank, batch, micro);
  pre.step();
  return fed.result();
}

template <class P>
std::string saved(const P& pre) {
  std::ostringstream os;
  pre.save(os);
  return os.str();
}

kfac::Options mpi_options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-3).with_factor_decay(0.9)
      .with_inv_update_steps(2).with_loss_reduction(kfac::LossReduction::sum);
}
kfac::Kaisa kaisa(double fraction) { return kfac::Kaisa{}.with_grad_worker_fraction(fraction); }

std::vector<double> fractions() {
  const int w = world_size();
  std::vector<double> f = {1.0};
  if (w > 1) f.push_back(1.0 / w);
  if (w == 4) f.push_back(0.5);
  return f;
}

const std::vector<std::vector<Spec>> kNets = {
    {{"fc", 3, 2, false}, {"toy", 4, 3, true}, {"fc2", 5, 4, false}},
    {{"a", 5, 4, false}, {"b", 4, 3, false}},
    {{"fc", 3, 2, false}, {"t1", 2, 2, true}, {"t2", 3, 3, true}},
};

}  // namespace

TEST_CASE("preconditioners sharing one MpiComm equal ones with their own, and outlive each other", "[mpi][core]") {
  const int rank = world_rank();
  for (double f : fractions()) {
    INFO("grad_worker_fraction " << f << " at " << world_size() << " ranks");
    const kfac::Options o = mpi_options();
    kfac::MpiComm comm(MPI_COMM_WORLD);
    std::vector<std::unique_ptr<MPre>> shared, own;
    for (std::size_t p = 0; p < kNets.size(); ++p) {
      shared.push_back(std::make_unique<MPre>(o, Host{}, comm, kaisa(f)));
      own.push_back(std::make_unique<MPre>(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa(f)));
      register_specs(*shared[p], kNets[p]);
      register_specs(*own[p], kNets[p]);
    }
    bool equal = true, ranks_agree = true;
    for (long s = 0; s < 24; ++s) {
      if (s == 9) {  // destroy the middle one (and, to keep the pairs in step, its twin)
        shared[1].reset();
        own[1].reset();
      }
      if (s == 16) {  // and a preconditioner made late on the same comm
        shared[1] = std::make_unique<MPre>(o, Host{}, comm, kaisa(f));
        own[1] = std::make_unique<MPre>(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa(f));
        register_specs(*shared[1], kNets[1]);
        register_specs(*own[1], kNets[1]);
      }
      for (std::size_t p = 0; p < kNets.size(); ++p) {
        if (!shared[p]) continue;
        const auto a = step_once(*shared[p], kNets[p], unsigned(p + 1), s, rank);
        const auto b = step_once(*own[p], kNets[p], unsigned(p + 1), s, rank);
        equal = equal && bit_equal(a, b);
        ranks_agree = same_on_all_ranks(a) && ranks_agree;
      }
    }
    CHECK(all_ranks(equal));
    CHECK(ranks_agree);
    for (std::size_t p = 0; p < kNets.size(); ++p) CHECK(saved(*shared[p]) == saved(*own[p]));
  }
}

TEST_CASE("the toy method's statistic is averaged over the ranks and its counter is not", "[mpi][core][toy]") {
  const int rank = world_rank(), world = world_size();
  const std::vector<Spec> net = {{"fc", 3, 2, false}, {"toy", 4, 3, true}};
  const int micro = std::vector<int>{1, 2, 3, 6}[std::size_t(rank % 4)];
  for (double f : fractions()) {
    INFO("grad_worker_fraction " << f);
    MPre pre(mpi_options().with_kl_clip(0.0), Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa(f));
    register_specs(pre, net);
    const long steps = 6;
    // The statistic of a single process on the concatenated data of all ranks.
    struct {
      std::vector<double> s;
    } ref;
    for (long st = 0; st < steps; ++st) {
      const auto got = step_once(pre, net, 5, st, rank, 6, micro);
      double m = 0;
      for (int r = 0; r < world; ++r) {
        Rng data(5u * 100003u + unsigned(st) * 1009u + unsigned(r) * 17u + 1u);
        const auto x = random_view<double>(6, 4, data);
        m += to_eigen(x).squaredNorm();
      }
      m /= double(world * 6 * 4);
      ref.s.push_back(st == 0 ? m : 0.9 * ref.s.back() + 0.1 * m);
      const auto& blk = pre.layer_as<ToyBlock<Host>>("toy");
      INFO("step " << st);
      CHECK(std::abs(blk.statistic() - ref.s.back()) <= 1e-14 * ref.s.back());
      CHECK(blk.counter() == double((st + 1) * micro));  // this rank's own micro-batches
      // The toy's gradient: X / (s + 0.5) with s of its last decomposition (every 2 steps).
      const double s_dec = ref.s[std::size_t(st - st % 2)];
      Rng grad(5u * 7919u + unsigned(st) * 31u + 1u);
      const auto w = random_view<double>(3, 4, grad);
      const auto b = random_vector<double>(3, grad);
      const std::size_t off = 3 * 2 + 2;  // after fc's weight and bias
      double err = 0;
      for (int i = 0; i < 12; ++i) err = std::max(err, std::abs(got[off + i] - w.data()[i] / (s_dec + 0.5)));
      for (int i = 0; i < 3; ++i) err = std::max(err, std::abs(got[off + 12 + i] - b(i) / (s_dec + 0.5)));
      CHECK(err <= 1e-14);
      CHECK(same_on_all_ranks(got));
    }
    // The counter differs per rank: it is in the checkpoint, which resumes it unaveraged.
    MPre resumed(mpi_options().with_kl_clip(0.0), Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa(f));
    register_specs(resumed, net);
    std::stringstream ckpt;
    pre.save(ckpt);
    resumed.load(ckpt);
    CHECK(resumed.layer_as<ToyBlock<Host>>("toy").counter() == double(steps * micro));
  }
}

TEST_CASE("a decomposition failure on one rank is atomic on every rank", "[mpi][core][atomic]") {
  const int rank = world_rank(), world = world_size();
  std::vector<Spec> net = {{"fc", 3, 2, false}, {"fc2", 4, 3, false}};
  for (int k = 0; k < world + 1; ++k) net.push_back({"toy" + std::to_string(k), 2 + k % 3, 2, true});
  for (double f : fractions())
    for (ToyFailure how : {ToyFailure::error, ToyFailure::bad_alloc}) {
      INFO("grad_worker_fraction " << f << ", failure " << int(how));
      const auto o = mpi_options().with_inv_update_steps(1);
      MPre pre(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa(f));
      MPre twin(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD), kaisa(f));
      register_specs(pre, net);
      register_specs(twin, net);
      for (long s = 0; s < 3; ++s) {
        step_once(pre, net, 9, s, rank);
        step_once(twin, net, 9, s, rank);
      }
      // Rank P-1 decomposes some toy layer (else the injection would not fire).
      bool last_decomposes = false;
      for (std::size_t l = 2; l < net.size(); ++l)
        last_decomposes = last_decomposes || pre.assignment().decomposer(l, 0) == world - 1;
      REQUIRE(all_ranks(last_decomposes || rank != world - 1));

      // Step 3 fails on rank P-1 only.
      const Fed fed = feed(pre, net, 9, 3, rank);
      const std::string before = saved(pre);
      const std::vector<double> grads_before = fed.result();
      const long steps = pre.step_count(), li = pre.last_decomposition_step();
      std::string message;
      bool threw = false;
      {
        ToyFailScope fail(rank == world - 1 ? how : ToyFailure::none);
        try {
          pre.step();
        } catch (const kfac::Error& e) {
          threw = true;
          message = e.what();
        }
      }
      CHECK(all_ranks(threw));
      INFO("rank " << rank << ": " << message);
      // Every rank throws the failing rank's error, naming that rank.
      CHECK(message.find(how == ToyFailure::error ? "toy decomposition refused" : "bad_alloc") != std::string::npos);
      if (world > 1) CHECK(message.find("(on rank " + std::to_string(world - 1)) != std::string::npos);
      CHECK(all_ranks(saved(pre) == before));
      CHECK(all_ranks(pre.step_count() == steps && pre.last_decomposition_step() == li));

      CHECK(all_ranks(bit_equal(fed.result(), grads_before)));  // gradients untouched
      // The retry uses the failed call's pending observations and gradients.
      pre.step();
      CHECK(all_ranks(bit_equal(fed.result(), step_once(twin, net, 9, 3, rank))));
      CHECK(all_ranks(saved(pre) == saved(twin)));
      bool equal = true;
      for (long s = 4; s < 7; ++s) equal = bit_equal(step_once(pre, net, 9, s, rank), step_once(twin, net, 9, s, rank)) && equal;
      CHECK(all_ranks(equal));
    }
}

TEST_CASE("Independent: each rank is a SerialComm run on its own data and layers", "[mpi][core][independent]") {
  const int rank = world_rank();
  // Ranks register different layers (a rank-dependent shape, and a toy layer on odd ranks).
  std::vector<Spec> net = {{"fc", 3 + rank, 2, false}};
  if (rank % 2 == 1) net.push_back({"toy", 4, 3, true});
  net.push_back({"last", 2, 2 + rank % 3, false});
  const auto o = mpi_options().with_inv_update_steps(3);
  IPre pre(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD));
  SPre ref(o);
  REQUIRE_NOTHROW(register_specs(pre, net));
  register_specs(ref, net);
  bool equal = true;
  for (long s = 0; s < 8; ++s) {
    std::vector<double> a, b;
    REQUIRE_NOTHROW(a = step_once(pre, net, 11, s, rank));
    b = step_once(ref, net, 11, s, rank);
    equal = equal && bit_equal(a, b);
  }
  CHECK(equal);  // (save() bytes differ: a checkpoint records world size and rank)
}
