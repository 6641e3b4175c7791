// ParameterAverager under mpiexec at 1-4 ranks: after averaging every rank holds the same bits,
// equal to the (weighted) mean of every rank's values; one rank is the identity; mismatched
// registrations and bad weights fail on every rank alike, changing nothing; and an NG-SGD
// preconditioner under kfac::Independent sends nothing per step.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/distributed/parameter_averager.hpp>
#include <kfac/kfac.hpp>
#include <kfac/methods/ngsgd/ngsgd.hpp>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "reference.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;
template <class T>
using V1 = Kokkos::View<T*, Kokkos::HostSpace>;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;

namespace {

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

/// Rank r's parameters: a double vector of 37, a float vector of 11 and a double vector of 5,
/// from a seed of its own (so any rank can rebuild any other's).
struct Params {
  V1<double> a{"a", 37}, c{"c", 5};
  V1<float> b{"b", 11};
  explicit Params(int rank) {
    Rng rng(100 + rank);
    for (std::size_t i = 0; i < a.extent(0); ++i) a(i) = rng.uniform() * (rank + 1);
    for (std::size_t i = 0; i < b.extent(0); ++i) b(i) = float(rng.uniform());
    for (std::size_t i = 0; i < c.extent(0); ++i) c(i) = rng.uniform() - rank;
  }
  template <class Comm>
  void add_to(kfac::ParameterAverager<Comm>& avg) const {
    avg.add(a);
    avg.add(b);
    avg.add(c);
  }
  std::size_t bytes() const { return (a.extent(0) + c.extent(0)) * 8 + b.extent(0) * 4; }
};

/// True on every rank when every rank's `bytes` equal rank 0's.
bool same_on_every_rank(const void* data, std::size_t bytes) {
  std::vector<char> root(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
  MPI_Bcast(root.data(), int(bytes), MPI_BYTE, 0, MPI_COMM_WORLD);
  int ok = std::memcmp(root.data(), data, bytes) == 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}
template <class V>
bool same_on_every_rank(const V& v) {
  return same_on_every_rank(v.data(), v.span() * sizeof(typename V::value_type));
}

/// The weighted mean over all ranks of one parameter, in double.
template <class Get>
std::vector<double> expected_mean(std::size_t n, const std::vector<double>& weights, Get get) {
  std::vector<double> m(n, 0.0);
  double total = 0;
  for (int r = 0; r < int(weights.size()); ++r) {
    Params p(r);
    for (std::size_t i = 0; i < n; ++i) m[i] += weights[r] * get(p, i);
    total += weights[r];
  }
  for (auto& v : m) v /= total;
  return m;
}

void check_mean(const Params& mine, const std::vector<double>& weights, double tol_double, double tol_float) {
  const auto ea = expected_mean(37, weights, [](const Params& p, std::size_t i) { return p.a(i); });
  const auto eb = expected_mean(11, weights, [](const Params& p, std::size_t i) { return double(p.b(i)); });
  const auto ec = expected_mean(5, weights, [](const Params& p, std::size_t i) { return p.c(i); });
  for (std::size_t i = 0; i < 37; ++i) CHECK(std::abs(mine.a(i) - ea[i]) <= tol_double * (1 + std::abs(ea[i])));
  for (std::size_t i = 0; i < 11; ++i) CHECK(std::abs(mine.b(i) - eb[i]) <= tol_float * (1 + std::abs(eb[i])));
  for (std::size_t i = 0; i < 5; ++i) CHECK(std::abs(mine.c(i) - ec[i]) <= tol_double * (1 + std::abs(ec[i])));
}

}  // namespace

TEST_CASE("ParameterAverager: bit-identical mean on every rank, bucketed", "[mpi][averaging]") {
  const int p = world_size();
  for (std::size_t bucket : {std::size_t(16), std::size_t(64), std::size_t(1) << 20}) {
    INFO("bucket bytes " << bucket);
    kfac::MpiComm comm;
    Params mine(world_rank());
    const Params original(world_rank());
    kfac::ParameterAverager<kfac::MpiComm> avg(comm, 1, bucket);
    mine.add_to(avg);
    comm.reset_bytes();
    avg.average();
    CHECK(same_on_every_rank(mine.a));
    CHECK(same_on_every_rank(mine.b));
    CHECK(same_on_every_rank(mine.c));
    if (p == 1) {  // the identity, bit for bit, and nothing sent
      CHECK(std::memcmp(mine.a.data(), original.a.data(), 37 * 8) == 0);
      CHECK(std::memcmp(mine.b.data(), original.b.data(), 11 * 4) == 0);
      CHECK(avg.bytes_sent() == 0);
      CHECK(avg.collectives() == 0);
    } else {
      check_mean(mine, std::vector<double>(p, 1.0), 1e-14, 1e-6);
      // reduce + broadcast of the weights (16 bytes) and of every parameter, counted twice
      CHECK(avg.bytes_sent() == 2 * (16 + mine.bytes()));
      CHECK(avg.bytes_sent() == comm.bytes_sent());
      // 1 view check + 1 weights + the buckets of each type
      const std::size_t floats = (11 * 4 + bucket - 1) / bucket, doubles = (42 * 8 + bucket - 1) / bucket;
      CHECK(avg.collectives() == 2 + floats + doubles);
    }
    // a second average is a fixed point up to rounding and still identical everywhere
    avg.average();
    CHECK(same_on_every_rank(mine.a));
    CHECK(same_on_every_rank(mine.b));
  }
}

TEST_CASE("ParameterAverager on the default execution space equals the host averager bit for bit",
          "[mpi][averaging][device]") {
  // Kokkos::DefaultExecutionSpace: Serial or OpenMP (host memory, given to MPI directly) or CUDA
  // (device views; packed by kernels in device memory, staged through the host for MPI).
  using Exec = Kokkos::DefaultExecutionSpace;
  const int r = world_rank();
  kfac::MpiComm comm;
  Params host(r);
  kfac::ParameterAverager<kfac::MpiComm> ref(comm, 1, 40);
  host.add_to(ref);
  ref.average(1.0 + r);
  const Params original(r);
  auto on_device = [](const auto& h) {
    Kokkos::View<typename std::decay_t<decltype(h)>::non_const_value_type*, Exec::memory_space> d("d", h.extent(0));
    Kokkos::deep_copy(d, h);
    return d;
  };
  auto a = on_device(original.a), c = on_device(original.c);
  auto b = on_device(original.b);
  kfac::ParameterAverager<kfac::MpiComm, Exec> avg(comm, 1, 40);
  avg.add(a);
  avg.add(b);
  avg.add(c);
  avg.average(1.0 + r);
  CHECK(avg.bytes_sent() == ref.bytes_sent());
  CHECK(avg.collectives() == ref.collectives());
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, a);
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, b);
  auto hc = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, c);
  CHECK(std::memcmp(ha.data(), host.a.data(), 37 * 8) == 0);
  CHECK(std::memcmp(hb.data(), host.b.data(), 11 * 4) == 0);
  CHECK(std::memcmp(hc.data(), host.c.data(), 5 * 8) == 0);
  if (world_size() > 1) CHECK(std::memcmp(ha.data(), original.a.data(), 37 * 8) != 0);  // it did average
}

TEST_CASE("ParameterAverager: weighted by samples seen", "[mpi][averaging][weights]") {
  const int p = world_size(), r = world_rank();
  kfac::MpiComm comm;
  Params mine(r);
  kfac::ParameterAverager<kfac::MpiComm> avg(comm, 1, 40);
  mine.add_to(avg);
  const double weight = 10.0 * (r + 1);  // e.g. samples seen since the last average
  avg.average(weight);
  CHECK(same_on_every_rank(mine.a));
  CHECK(same_on_every_rank(mine.b));
  CHECK(same_on_every_rank(mine.c));
  std::vector<double> w(p);
  for (int k = 0; k < p; ++k) w[k] = 10.0 * (k + 1);
  if (p > 1) check_mean(mine, w, 1e-14, 1e-6);
}

TEST_CASE("ParameterAverager: maybe_average every N steps", "[mpi][averaging]") {
  kfac::MpiComm comm;
  Params mine(world_rank());
  kfac::ParameterAverager<kfac::MpiComm> avg(comm, 3);
  mine.add_to(avg);
  std::vector<long> averaged;
  for (long step = 0; step < 9; ++step)
    if (avg.maybe_average(step)) averaged.push_back(step);
  CHECK(averaged == std::vector<long>{2, 5, 8});
  CHECK(avg.averages() == 3);
  CHECK(same_on_every_rank(mine.a));
  CHECK_THROWS_AS(kfac::ParameterAverager<kfac::MpiComm>(comm, 0), kfac::Error);
}

TEST_CASE("ParameterAverager: mismatched views fail on every rank, changing nothing", "[mpi][averaging][errors]") {
  const int p = world_size(), r = world_rank();
  if (p == 1) return;  // one rank cannot disagree with itself
  auto expect_refusal = [&](auto&& register_views, const std::string& what) {
    kfac::MpiComm comm;
    Params mine(r);
    const Params original(r);
    kfac::ParameterAverager<kfac::MpiComm> avg(comm, 1, 64);
    register_views(avg, mine);
    int threw = 0;
    try {
      avg.average();
    } catch (const kfac::Error& e) {
      threw = std::string(e.what()).find(what) != std::string::npos;
      INFO(e.what());
    }
    int all = 0;
    MPI_Allreduce(&threw, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    CHECK(all == 1);
    CHECK(std::memcmp(mine.a.data(), original.a.data(), 37 * 8) == 0);
    CHECK(std::memcmp(mine.b.data(), original.b.data(), 11 * 4) == 0);
  };
  using Avg = kfac::ParameterAverager<kfac::MpiComm>;
  // the last rank registers one view fewer
  expect_refusal([&](Avg& avg, Params& m) { avg.add(m.a); avg.add(m.b); if (r != p - 1) avg.add(m.c); },
                 "ranks registered different parameter views");
  // rank 0 registers a shorter view
  V1<double> shorter("shorter", 4);
  expect_refusal([&](Avg& avg, Params& m) { avg.add(m.a); avg.add(m.b); if (r == 0) avg.add(shorter); else avg.add(m.c); },
                 "ranks registered different parameter views");
  // same sizes, another type on rank 1
  V1<float> as_float("as_float", 5);
  expect_refusal([&](Avg& avg, Params& m) { avg.add(m.a); avg.add(m.b); if (r == 1) avg.add(as_float); else avg.add(m.c); },
                 "ranks registered different parameter views");
  // a bad weight on one rank
  {
    kfac::MpiComm comm;
    Params mine(r);
    const Params original(r);
    Avg avg(comm);
    mine.add_to(avg);
    int threw = 0;
    try {
      avg.average(r == p - 1 ? -1.0 : 1.0);
    } catch (const kfac::Error& e) {
      threw = std::string(e.what()).find("negative or non-finite weight") != std::string::npos;
    }
    int all = 0;
    MPI_Allreduce(&threw, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    CHECK(all == 1);
    CHECK(std::memcmp(mine.a.data(), original.a.data(), 37 * 8) == 0);
  }
}

TEST_CASE("NG-SGD under Independent sends nothing per step", "[mpi][ngsgd][independent]") {
  kfac::MpiComm comm;
  using Pre = kfac::Preconditioner<double, Host, kfac::MpiComm, kfac::Independent>;
  Pre pre(kfac::Options{}.with_kl_clip(0.0), Host{}, comm);
  pre.register_layer("fc1", kfac::Dense(6, 5), kfac::NGSGD{}.with_update_period(2));
  pre.register_layer("fc2", kfac::Dense(5, 3), kfac::NGSGD{}.with_update_period(1));
  Rng rng(50 + world_rank());  // every rank its own data
  comm.reset_bytes();
  for (int step = 0; step < 6; ++step) {
    V2 x1 = random_view<double>(8, 6, rng), g1 = random_view<double>(8, 5, rng), w1 = random_view<double>(5, 6, rng);
    V2 x2 = random_view<double>(8, 5, rng), g2 = random_view<double>(8, 3, rng), w2 = random_view<double>(3, 5, rng);
    auto b1 = random_vector<double>(5, rng), b2 = random_vector<double>(3, rng);
    if (pre.wants_observations("fc1")) { pre.observe_input("fc1", x1); pre.observe_output_grad("fc1", g1); }
    pre.observe_input("fc2", x2);
    pre.observe_output_grad("fc2", g2);
    pre.set_gradient("fc1", w1, b1);
    pre.set_gradient("fc2", w2, b2);
    pre.step();
    CHECK(comm.bytes_sent() == 0);
  }
  // and the parameters are then averaged every few steps by the averager, which does send
  Params mine(world_rank());
  kfac::ParameterAverager<kfac::MpiComm> avg(comm, 2);
  mine.add_to(avg);
  avg.maybe_average(1);
  CHECK(comm.bytes_sent() == (world_size() > 1 ? 2 * (16 + mine.bytes()) : 0));
}

// Kaldi's parallel recipe: fresh jobs read the averaged model, so each job's NG-SGD estimates
// start again after every average, and every job trains with P times the learning rate. With
// with_after_average building a new Preconditioner, the job's gradients after an average are
// bit for bit those of a preconditioner that saw only the data since; by default (nothing
// runs) the estimates carry over and the gradients differ.
TEST_CASE("ParameterAverager: Kaldi's restart of NG-SGD after each average, and its learning rate",
          "[mpi][ngsgd][restart]") {
  kfac::MpiComm comm;
  using Pre = kfac::Preconditioner<double, Host, kfac::MpiComm, kfac::Independent>;
  const auto make = [&] {
    auto pre = std::make_unique<Pre>(kfac::Options{}.with_kl_clip(0.0), Host{}, comm);
    pre->register_layer("fc", kfac::Dense(6, 5), kfac::NGSGD{}.with_rank(2));
    return pre;
  };
  const Params mine(world_rank());
  for (bool restart : {false, true}) {
    INFO((restart ? "restart" : "keep") << " at " << world_size() << " ranks");
    std::unique_ptr<Pre> pre = make(), fresh;  // fresh: sees only the data since the average
    kfac::ParameterAverager<kfac::MpiComm> avg(comm, 4);
    mine.add_to(avg);
    long restarts = 0;
    if (restart) avg.with_after_average([&] { pre = make(); ++restarts; });
    Rng rng(70 + world_rank());
    int same = 0;
    for (int step = 0; step < 8; ++step) {  // averages after steps 3 and 7
      if (step == 4) fresh = make();
      V2 x = random_view<double>(8, 6, rng), g = random_view<double>(8, 5, rng), w = random_view<double>(5, 6, rng);
      auto b = random_vector<double>(5, rng);
      V2 w2("w2", 5, 6);
      V1<double> b2("b2", 5);
      Kokkos::deep_copy(w2, w);
      Kokkos::deep_copy(b2, b);
      for (Pre* q : {pre.get(), fresh.get()}) {
        if (!q) continue;
        if (q->wants_observations("fc")) { q->observe_input("fc", x); q->observe_output_grad("fc", g); }
        q == pre.get() ? q->set_gradient("fc", w, b) : q->set_gradient("fc", w2, b2);
        q->step();
      }
      if (fresh) same += std::memcmp(w.data(), w2.data(), 30 * 8) == 0 && std::memcmp(b.data(), b2.data(), 5 * 8) == 0;
      avg.maybe_average(step);
    }
    CHECK(restarts == (restart ? 2 : 0));
    CHECK(same == (restart ? 4 : 0));
    // a failed average runs nothing
    CHECK_THROWS_AS(avg.average(-1.0), kfac::Error);
    CHECK(restarts == (restart ? 2 : 0));
  }
  kfac::ParameterAverager<kfac::MpiComm> avg(comm, 4);
  CHECK(avg.learning_rate(0.05) == 0.05);  // the default: each job as one
  avg.with_lr_times_jobs(true);
  CHECK(avg.learning_rate(0.05) == 0.05 * world_size());
}
