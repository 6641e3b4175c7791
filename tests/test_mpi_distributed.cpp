// Distributed K-FAC equals the single-process result on the concatenated batch, on every rank,
// for every assignment strategy; ranks agree bit for bit.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <type_traits>
#include <utility>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>

#include "reference.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V4 = Kokkos::View<double****, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;

namespace {

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

constexpr int kBatch = 6;  // per rank

/// The global problem: data for `ranks` shards of kBatch samples, identical on every rank.
struct Problem {
  int ranks;
  V2 x1, g1, x2, g2;  // dense layers: (ranks * kBatch, features)
  V4 xc, gc, xb, gb;  // conv and batch norm, NCHW
  V2 w1, w2; V1 b1, b2; V4 wc; V1 bc, gamma, beta;
  explicit Problem(int r, int step) : ranks(r) {
    Rng rng(1000 + step);
    const int n = r * kBatch;
    x1 = random_view<double>(n, 5, rng); g1 = random_view<double>(n, 4, rng);
    x2 = random_view<double>(n, 4, rng); g2 = random_view<double>(n, 3, rng);
    xc = random_view4<double>(n, 2, 5, 5, rng); gc = random_view4<double>(n, 3, 5, 5, rng);
    xb = random_view4<double>(n, 3, 2, 2, rng); gb = random_view4<double>(n, 3, 2, 2, rng);
    w1 = random_view<double>(4, 5, rng); b1 = random_vector<double>(4, rng);
    w2 = random_view<double>(3, 4, rng); b2 = random_vector<double>(3, rng);
    wc = random_view4<double>(3, 2, 3, 3, rng); bc = random_vector<double>(3, rng);
    gamma = random_vector<double>(3, rng); beta = random_vector<double>(3, rng);
  }
};

template <class V>
V shard(const V& v, int rank, int ranks) {
  if (ranks == 1) return v;
  auto s = Kokkos::subview(v, std::make_pair(rank * kBatch, (rank + 1) * kBatch), Kokkos::ALL);
  V out("shard", kBatch, v.extent(1));
  Kokkos::deep_copy(out, s);
  return out;
}
V4 shard4(const V4& v, int rank, int ranks) {
  if (ranks == 1) return v;
  auto s = Kokkos::subview(v, std::make_pair(rank * kBatch, (rank + 1) * kBatch), Kokkos::ALL,
                           Kokkos::ALL, Kokkos::ALL);
  V4 out("shard", kBatch, v.extent(1), v.extent(2), v.extent(3));
  Kokkos::deep_copy(out, s);
  return out;
}

/// RandomizedEigen at rank 2 with oversampling 2, as a type (register_all default-constructs its
/// policy): the A factors (6, 5 and conv's 19) go through the range finder, warm-started after
/// the first decomposition; the G factors (4, 3, 3: 2 + 2 >= n) are decomposed exactly, keeping 2.
struct LowRank : kfac::RandomizedEigen<> {
  LowRank() { with_rank(2).with_oversampling(2); }
};

template <class Factor, class Inverse = kfac::Eigendecomposition<>, class P>
void register_all(P& pre) {
  pre.template register_layer<kfac::Dense, Factor, Inverse>("fc1", kfac::Dense(5, 4));
  pre.template register_layer<kfac::Dense, Factor, Inverse>("fc2", kfac::Dense(4, 3));
  pre.template register_layer<kfac::Conv2d, Factor, Inverse>(
      "conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1));
  pre.template register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(3));
}

/// Runs `steps` steps from data step `first`; observations are shard `rank` of `ranks`; returns
/// all gradients, flattened.
template <class P>
std::vector<double> run(P& pre, int rank, int ranks, int steps, int first = 0) {
  std::vector<double> out;
  for (int s = first; s < first + steps; ++s) {
    Problem p(world_size(), s);  // same global data for every world size
    const int total = world_size();
    // Single process: ranks == 1 sees the whole batch of `total` shards.
    auto pick2 = [&](const V2& v) { return ranks == 1 ? v : shard(v, rank, total); };
    auto pick4 = [&](const V4& v) { return ranks == 1 ? v : shard4(v, rank, total); };
    if (pre.wants_observations()) {
      pre.observe_input("fc1", pick2(p.x1)); pre.observe_output_grad("fc1", pick2(p.g1));
      pre.observe_input("fc2", pick2(p.x2)); pre.observe_output_grad("fc2", pick2(p.g2));
      pre.observe_input("conv", pick4(p.xc)); pre.observe_output_grad("conv", pick4(p.gc));
      pre.observe_input("bn", pick4(p.xb)); pre.observe_output_grad("bn", pick4(p.gb));
    }
    pre.set_gradient("fc1", p.w1, p.b1);
    pre.set_gradient("fc2", p.w2, p.b2);
    pre.set_gradient("conv", p.wc, p.bc);
    pre.set_gradient("bn", p.gamma, p.beta);
    pre.step();
    for (auto* v : {&p.w1, &p.w2})
      for (std::size_t i = 0; i < v->span(); ++i) out.push_back(v->data()[i]);
    for (auto* v : {&p.b1, &p.b2, &p.bc, &p.gamma, &p.beta})
      for (std::size_t i = 0; i < v->span(); ++i) out.push_back(v->data()[i]);
    for (std::size_t i = 0; i < p.wc.span(); ++i) out.push_back(p.wc.data()[i]);
  }
  return out;
}

kfac::Options options() {
  return kfac::Options{}
      .with_loss_reduction(kfac::LossReduction::sum)
      .with_damping(1e-2)
      .with_kl_clip(1e-2)
      .with_lr(0.5)
      .with_factor_update_steps(1)
      .with_inv_update_steps(2);
}
/// KAISA at gradient-worker fraction `fraction`, with small buckets: several collectives per update.
kfac::Kaisa kaisa(double fraction) { return kfac::Kaisa{}.with_grad_worker_fraction(fraction).with_bucket_bytes(256); }

/// The upper triangles of the Kronecker factors (A, then G) of fc1, fc2 and conv.
template <class P>
std::vector<double> factors_of(const P& pre) {
  std::vector<double> out;
  auto add = [&](const auto& layer) {
    for (const auto* f : {&layer.factor_a(), &layer.factor_g()})
      for (std::size_t j = 0; j < f->extent(1); ++j)
        for (std::size_t i = 0; i <= j; ++i) out.push_back((*f)(i, j));
  };
  using Fc = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::DoublePrecision, double, Host>;
  using Conv = kfac::KroneckerBlock<kfac::Conv2d, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::DoublePrecision, double, Host>;
  add(pre.template layer_as<Fc>("fc1"));
  add(pre.template layer_as<Fc>("fc2"));
  add(pre.template layer_as<Conv>("conv"));
  return out;
}

bool identical_on_all_ranks(const std::vector<double>& v) {
  const std::uint64_t h = kfac::impl::fnv1a(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double)));
  unsigned long long a[2] = {h, ~h}, r[2];
  MPI_Allreduce(a, r, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  return r[0] == ~r[1];
}

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) { num += (a[i] - b[i]) * (a[i] - b[i]); den += b[i] * b[i]; }
  return std::sqrt(num / den);
}

/// `delay` > 0: Options::decomposition_delay on both sides, over more steps (swaps at 3, 5, 7
/// or 4, 6, 8); the single-process result with the same delay is the reference.
template <class Factor, class Inverse = kfac::Eigendecomposition<>>
void check_strategy(double fraction, bool to_owner = false, bool colocate = true, long delay = 0) {
  const int rank = world_rank(), size = world_size();
  const int steps = delay > 0 ? 9 : 5;
  kfac::Preconditioner<double, Host> single(options().with_decomposition_delay(delay));
  register_all<Factor, Inverse>(single);
  const auto expect = run(single, 0, 1, steps);

  kfac::Preconditioner<double, Host, kfac::MpiComm> dist(
      options().with_decomposition_delay(delay), Host(), kfac::MpiComm(MPI_COMM_WORLD),
      kaisa(fraction).with_reduce_to_owner(to_owner).with_colocate_factors(colocate));
  register_all<Factor, Inverse>(dist);
  const auto got = run(dist, rank, size, steps);
  REQUIRE(got.size() == expect.size());
  INFO("rank " << rank << " of " << size << ", fraction " << fraction << ", relative difference " << rel_diff(got, expect));
  CHECK(rel_diff(got, expect) < 1e-10);
  CHECK(identical_on_all_ranks(got));
}

/// Kaisa::split_preconditioning: the same comparison, and the divided applies really run:
/// where a layer has more than one gradient worker, its all-gathers add to the bytes a rank sends
/// (the same run without the option is the baseline), and nowhere else. `small_messages`: MPI
/// calls of at most 16 bytes, so the all-gathers go as broadcasts in pieces.
template <class Factor, class Inverse = kfac::Eigendecomposition<>>
void check_split(double fraction, bool to_owner = false, bool reciprocal = false, bool small_messages = false) {
  const int rank = world_rank(), size = world_size();
  const auto opts = options().with_precompute_reciprocal(reciprocal);
  const auto k = kaisa(fraction).with_reduce_to_owner(to_owner);
  kfac::Preconditioner<double, Host> single(opts);
  register_all<Factor, Inverse>(single);
  const auto expect = run(single, 0, 1, 5);

  kfac::MpiComm plain_comm(MPI_COMM_WORLD), split_comm(MPI_COMM_WORLD);
  if (small_messages) {
    plain_comm.with_max_message_bytes(16);
    split_comm.with_max_message_bytes(16);
  }
  kfac::Preconditioner<double, Host, kfac::MpiComm> plain(opts, Host(), plain_comm, k);
  kfac::Preconditioner<double, Host, kfac::MpiComm> split(opts, Host(), split_comm,
                                                          kfac::Kaisa(k).with_split_preconditioning(true));
  register_all<Factor, Inverse>(plain);
  register_all<Factor, Inverse>(split);
  run(plain, rank, size, 5);
  const auto got = run(split, rank, size, 5);
  REQUIRE(got.size() == expect.size());
  const bool divided = size > 1 && std::lround(fraction * size) > 1;
  INFO("rank " << rank << " of " << size << ", fraction " << fraction << ", relative difference "
               << rel_diff(got, expect) << ", bytes " << split_comm.bytes_sent() << " vs " << plain_comm.bytes_sent());
  CHECK(rel_diff(got, expect) < 1e-10);
  CHECK(identical_on_all_ranks(got));
  CHECK((split_comm.bytes_sent() > plain_comm.bytes_sent()) == divided);
  if (!divided) CHECK(split_comm.bytes_sent() == plain_comm.bytes_sent());
}

/// Runs `total` steps on a preconditioner from `make`, and again on another one saved after
/// `split` steps and resumed from that checkpoint on a third; returns {uninterrupted, resumed}.
template <class Make>
std::pair<std::vector<double>, std::vector<double>> with_restart(const Make& make, int split, int total) {
  const int rank = world_rank(), size = world_size();
  auto full = make();
  const auto expect = run(*full, rank, size, total);
  auto first = make();
  auto got = run(*first, rank, size, split);
  std::ostringstream os(std::ios::binary);
  first->save(os);
  auto resumed = make();
  std::istringstream is(os.str(), std::ios::binary);
  CHECK(resumed->load(is));
  const auto more = run(*resumed, rank, size, total - split, split);
  got.insert(got.end(), more.begin(), more.end());
  return {expect, got};
}

}  // namespace

TEST_CASE("distributed K-FAC equals the single-process result", "[mpi][distributed]") {
  const int size = world_size();
  SECTION("COMM-OPT, symmetric") { check_strategy<kfac::Symmetric>(1.0); }
  SECTION("COMM-OPT, full") { check_strategy<kfac::Full>(1.0); }
  SECTION("MEM-OPT, symmetric") { check_strategy<kfac::Symmetric>(1.0 / size); }
  SECTION("MEM-OPT, full") { check_strategy<kfac::Full>(1.0 / size); }
  SECTION("COMM-OPT, Cholesky") { check_strategy<kfac::Symmetric, kfac::Cholesky<>>(1.0); }
  SECTION("MEM-OPT, Cholesky") { check_strategy<kfac::Symmetric, kfac::Cholesky<>>(1.0 / size); }
  SECTION("COMM-OPT, Newton-Schulz") { check_strategy<kfac::Symmetric, kfac::NewtonSchulz>(1.0); }
  SECTION("COMM-OPT, randomized low-rank") { check_strategy<kfac::Symmetric, LowRank>(1.0); }
  SECTION("MEM-OPT, randomized low-rank") { check_strategy<kfac::Symmetric, LowRank>(1.0 / size); }
  SECTION("COMM-OPT, Cholesky, split preconditioning") { check_split<kfac::Symmetric, kfac::Cholesky<>>(1.0); }
  SECTION("COMM-OPT, Cholesky, split preconditioning, 16-byte messages") {
    check_split<kfac::Symmetric, kfac::Cholesky<>>(1.0, false, false, true);
  }
  SECTION("COMM-OPT, Newton-Schulz, split preconditioning") { check_split<kfac::Symmetric, kfac::NewtonSchulz>(1.0); }
  SECTION("COMM-OPT, eigen, split preconditioning") { check_split<kfac::Symmetric>(1.0); }
  SECTION("COMM-OPT, eigen, full, precomputed reciprocal, split preconditioning") { check_split<kfac::Full>(1.0, false, true); }
  SECTION("MEM-OPT, Cholesky, split preconditioning") { check_split<kfac::Symmetric, kfac::Cholesky<>>(1.0 / size); }
  SECTION("MEM-OPT, eigen, split preconditioning") { check_split<kfac::Symmetric>(1.0 / size); }
  if (size % 2 == 0 && size > 2) {
    SECTION("HYBRID 0.5") { check_strategy<kfac::Symmetric>(0.5); }
    SECTION("HYBRID 0.5, eigen, split preconditioning") { check_split<kfac::Symmetric>(0.5); }
    SECTION("HYBRID 0.5, Cholesky, split preconditioning") { check_split<kfac::Symmetric, kfac::Cholesky<>>(0.5); }
  }
}

namespace {
using V3 = Kokkos::View<double***, Kokkos::LayoutRight, Kokkos::HostSpace>;

/// An Embedding(9, 5) with padding index 0 (G's eigendecomposition, unit G) and one with a
/// diagonal G (no unit).
template <class P>
void register_embeddings(P& pre) {
  pre.register_layer("emb", kfac::Embedding(9, 5).with_padding_index(0));
  pre.register_layer("emb_diag", kfac::Embedding(9, 5), kfac::EmbeddingFisher<kfac::Diagonal>{});
}

/// As run(), for register_embeddings: (ranks * kBatch, 4) token ids and (ranks * kBatch, 4, 5)
/// output gradients, identical on every rank, shard `rank` observed; returns the gradients.
template <class P>
std::vector<double> run_embeddings(P& pre, int rank, int ranks, int steps) {
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) {
    const int total = world_size(), n = total * kBatch;
    Rng rng(2000 + s);
    V2 ids("ids", n, 4);
    for (std::size_t i = 0; i < ids.span(); ++i) ids.data()[i] = double(int(4.5 * (rng.uniform() + 1.0)) % 9);
    V3 g("g", n, 4, 5);
    for (std::size_t i = 0; i < g.span(); ++i) g.data()[i] = rng.uniform();
    V2 w = random_view<double>(9, 5, rng), wd = random_view<double>(9, 5, rng);
    if (pre.wants_observations()) {
      V2 my_ids = ranks == 1 ? ids : shard(ids, rank, total);
      V3 my_g = g;
      if (ranks > 1) {
        my_g = V3("shard", kBatch, 4, 5);
        Kokkos::deep_copy(my_g, Kokkos::subview(g, std::make_pair(rank * kBatch, (rank + 1) * kBatch), Kokkos::ALL,
                                                Kokkos::ALL));
      }
      for (const char* name : {"emb", "emb_diag"}) {
        pre.observe_input(name, my_ids);
        pre.observe_output_grad(name, my_g);
      }
    }
    pre.set_gradient("emb", w);
    pre.set_gradient("emb_diag", wd);
    pre.step();
    for (const auto* v : {&w, &wd}) out.insert(out.end(), v->data(), v->data() + v->span());
  }
  return out;
}
}  // namespace

TEST_CASE("distributed Embedding equals the single-process result", "[mpi][distributed][embedding]") {
  const int rank = world_rank(), size = world_size();
  for (const double fraction : {1.0, 1.0 / size})
    for (const bool to_owner : {false, true}) {
      kfac::Preconditioner<double, Host> single(options());
      register_embeddings(single);
      const auto expect = run_embeddings(single, 0, 1, 5);
      kfac::Preconditioner<double, Host, kfac::MpiComm> dist(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                             kaisa(fraction).with_reduce_to_owner(to_owner));
      register_embeddings(dist);
      const auto got = run_embeddings(dist, rank, size, 5);
      REQUIRE(got.size() == expect.size());
      INFO("rank " << rank << " of " << size << ", fraction " << fraction << ", reduce-to-owner " << to_owner
                   << ", relative difference " << rel_diff(got, expect));
      CHECK(rel_diff(got, expect) < 1e-10);
      CHECK(identical_on_all_ranks(got));
    }
}

namespace {
/// Three parameters under the diagonal Fisher (kfac::Parameter, DiagonalFisher<>), and a Dense
/// layer beside them so that the assignment places more than closed forms.
template <class P>
void register_parameters(P& pre) {
  pre.register_layer("p0", kfac::Parameter(7, 3));
  pre.register_layer("p1", kfac::Parameter(11));
  pre.register_layer("fc", kfac::Dense(3, 2));
  pre.register_layer("p2", kfac::Parameter(2, 5), kfac::DiagonalFisher<kfac::MixedPrecision>{});
}

/// `steps` steps: every rank hands the same (already averaged) gradients and counts the global
/// batch of ranks * kBatch samples, as a Parameter's contract asks; fc observes shard `rank`.
template <class P>
std::vector<double> run_parameters(P& pre, int rank, int ranks, int steps) {
  std::vector<double> out;
  const int total = world_size(), n = total * kBatch;
  for (int s = 0; s < steps; ++s) {
    Rng rng(3000 + s);
    V2 w0 = random_view<double>(7, 3, rng), w2 = random_view<double>(2, 5, rng);
    V1 w1("w1", 11);
    for (std::size_t i = 0; i < w1.span(); ++i) w1.data()[i] = rng.uniform();
    V2 x = random_view<double>(n, 3, rng), g = random_view<double>(n, 2, rng);
    V2 fw = random_view<double>(2, 3, rng);
    V1 fb("fb", 2);
    if (pre.wants_observations()) {
      for (const char* name : {"p0", "p1", "p2"}) pre.observe_output_grad(name, V1("count", n));
      pre.observe_input("fc", ranks == 1 ? x : shard(x, rank, total));
      pre.observe_output_grad("fc", ranks == 1 ? g : shard(g, rank, total));
    }
    pre.set_gradient("p0", w0);
    pre.set_gradient("p1", w1);
    pre.set_gradient("p2", w2);
    pre.set_gradient("fc", fw, fb);
    pre.step();
    for (const auto* v : {&w0, &w2, &fw}) out.insert(out.end(), v->data(), v->data() + v->span());
    out.insert(out.end(), w1.data(), w1.data() + w1.span());
  }
  return out;
}
}  // namespace

TEST_CASE("distributed diagonal Fisher (Parameter) equals the single-process result",
          "[mpi][distributed][generic_diagonal]") {
  const int rank = world_rank(), size = world_size();
  kfac::Preconditioner<double, Host> single(options());
  register_parameters(single);
  const auto expect = run_parameters(single, 0, 1, 5);
  std::vector<double> fractions{1.0, 1.0 / size};
  if (size == 4) fractions.push_back(0.5);  // HYBRID
  for (const double fraction : fractions)
    for (const bool to_owner : {false, true}) {
      kfac::Preconditioner<double, Host, kfac::MpiComm> dist(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                             kaisa(fraction).with_reduce_to_owner(to_owner));
      register_parameters(dist);
      const auto got = run_parameters(dist, rank, size, 5);
      REQUIRE(got.size() == expect.size());
      INFO("rank " << rank << " of " << size << ", fraction " << fraction << ", reduce-to-owner " << to_owner
                   << ", relative difference " << rel_diff(got, expect));
      // p2 keeps float statistics: the replica average of 3 equal floats rounds (2e-8 seen)
      CHECK(rel_diff(got, expect) < 1e-6);
      CHECK(identical_on_all_ranks(got));
    }
  // Independent: every rank a single-process run of its own (here the whole batch on each).
  kfac::Preconditioner<double, Host, kfac::MpiComm, kfac::Independent> alone(
      kfac::Options{}.with_loss_reduction(kfac::LossReduction::sum).with_damping(1e-2).with_kl_clip(1e-2).with_lr(0.5)
          .with_inv_update_steps(2),
      Host(), kfac::MpiComm(MPI_COMM_WORLD));
  register_parameters(alone);
  const auto own = run_parameters(alone, 0, 1, 5);
  CHECK(rel_diff(own, expect) < 1e-12);
}

TEST_CASE("reduce-to-owner equals the single-process result", "[mpi][distributed][owner]") {
  const int size = world_size();
  SECTION("COMM-OPT, symmetric") { check_strategy<kfac::Symmetric>(1.0, true); }
  SECTION("COMM-OPT, full, factors apart") { check_strategy<kfac::Full>(1.0, true, false); }
  SECTION("MEM-OPT, symmetric") { check_strategy<kfac::Symmetric>(1.0 / size, true); }
  SECTION("MEM-OPT, Cholesky") { check_strategy<kfac::Symmetric, kfac::Cholesky<>>(1.0 / size, true); }
  SECTION("COMM-OPT, Newton-Schulz") { check_strategy<kfac::Symmetric, kfac::NewtonSchulz>(1.0, true); }
  if (size % 2 == 0 && size > 2) {
    SECTION("HYBRID 0.5") { check_strategy<kfac::Symmetric>(0.5, true); }
    SECTION("HYBRID 0.5, factors apart") { check_strategy<kfac::Symmetric>(0.5, true, false); }
    SECTION("HYBRID 0.5, eigen, split preconditioning") { check_split<kfac::Symmetric>(0.5, true); }
  }
  SECTION("COMM-OPT, Cholesky, split preconditioning") { check_split<kfac::Symmetric, kfac::Cholesky<>>(1.0, true); }
  SECTION("COMM-OPT, eigen, split preconditioning") { check_split<kfac::Symmetric>(1.0, true); }
  SECTION("MEM-OPT, Cholesky, split preconditioning") { check_split<kfac::Symmetric, kfac::Cholesky<>>(1.0 / size, true); }
}

TEST_CASE("overlapped collectives give the bits, bytes and messages of blocking ones", "[mpi][distributed][overlap]") {
  // Kaisa::overlap_communication (the default) against the blocking collectives, over 24
  // steps (factors every step, decompositions every 3: two of three factor updates are summed
  // while the step preconditions), for each strategy with reduce-to-owner, split
  // preconditioning, reduced-precision payloads and 16-byte messages: every rank ends with
  // the same gradients and factors (bit for bit at 2 ranks, within rounding from 3 on), and
  // sends the same bytes in as many MPI calls.
  const int rank = world_rank(), size = world_size();
  struct Case {
    double fraction;
    bool owner, split;
    kfac::CommPrecision payload;
    std::size_t max_message;
  };
  std::vector<Case> cases{{1.0, false, false, kfac::CommPrecision::native, 1 << 30},
                          {1.0 / size, false, false, kfac::CommPrecision::native, 1 << 30},
                          {1.0, true, true, kfac::CommPrecision::native, 1 << 30},
                          {1.0 / size, true, false, kfac::CommPrecision::bfloat16, 1 << 30},
                          {1.0, false, true, kfac::CommPrecision::float32, 16},
                          {1.0 / size, false, true, kfac::CommPrecision::native, 16}};
  if (size >= 4) cases.push_back({0.5, true, true, kfac::CommPrecision::native, 1 << 30});
  for (const auto& c : cases) {
    std::vector<double> got[2], factors[2];
    std::size_t bytes[2], messages[2], started[2];
    for (int overlap : {0, 1}) {
      kfac::MpiComm comm(MPI_COMM_WORLD);
      comm.with_max_message_bytes(c.max_message);
      kfac::Preconditioner<double, Host, kfac::MpiComm> pre(
          options().with_inv_update_steps(3), Host(), comm,
          kaisa(c.fraction).with_reduce_to_owner(c.owner).with_split_preconditioning(c.split)
              .with_comm_precision(c.payload).with_overlap_communication(overlap == 1));
      register_all<kfac::Symmetric>(pre);
      got[overlap] = run(pre, rank, size, 24);
      factors[overlap] = factors_of(pre);
      bytes[overlap] = comm.bytes_sent();
      messages[overlap] = comm.messages();
      started[overlap] = comm.nonblocking_started();
    }
    INFO("rank " << rank << " of " << size << ", fraction " << c.fraction << ", owner " << c.owner << ", split " << c.split
                 << ", payload " << int(c.payload) << ", max message " << c.max_message << ", nonblocking "
                 << started[1]);
    // Two ranks add once: the same bits. From three on, MPI's nonblocking reduce may add in
    // another order than its blocking one: the same result within rounding (still identical
    // on every rank: every rank gets rank 0's sum).
    const double tol = c.payload == kfac::CommPrecision::native ? 1e-12 : c.payload == kfac::CommPrecision::float32 ? 1e-5 : 5e-2;
    INFO("relative difference to the blocking run " << rel_diff(got[1], got[0]));
    if (size <= 2) {
      CHECK(got[1] == got[0]);
      CHECK(factors[1] == factors[0]);
    } else {
      CHECK(rel_diff(got[1], got[0]) < tol);
      CHECK(rel_diff(factors[1], factors[0]) < tol);
    }
    CHECK(identical_on_all_ranks(factors[1]) == (size == 1 || !c.owner));
    CHECK(bytes[1] == bytes[0]);
    CHECK(messages[1] == messages[0]);
    CHECK(identical_on_all_ranks(got[1]));
    CHECK(started[0] == 0);
    // 16 overlapped factor updates (steps not divisible by 3), at least one sum each.
    if (size > 1) CHECK(started[1] >= 16);
    if (c.payload == kfac::CommPrecision::native) {
      kfac::Preconditioner<double, Host> single(options().with_inv_update_steps(3));
      register_all<kfac::Symmetric>(single);
      CHECK(rel_diff(got[1], run(single, 0, 1, 24)) < 1e-10);
    }
  }
}

TEST_CASE("bytes per factor update follow the packed/full formula", "[mpi][bytes]") {
  const int size = world_size();
  if (size == 1) return;
  auto bytes_for = [&](auto factor_tag) {
    using Factor = decltype(factor_tag);
    kfac::MpiComm comm(MPI_COMM_WORLD);
    kfac::Preconditioner<double, Host, kfac::MpiComm> pre(options(), Host(), comm,
                                                          kaisa(1.0).with_bucket_bytes(1 << 20));
    register_all<Factor>(pre);
    run(pre, world_rank(), size, 1);  // step 0: factor update + decomposition
    comm.reset_bytes();
    run(pre, world_rank(), size, 1);  // step 1: factor update only (inv every 2); COMM-OPT: no V broadcast
    return comm.bytes_sent();
  };
  auto tri = [](std::size_t n) { return n * (n + 1) / 2; };
  // fc1: A 6, G 4; fc2: A 5, G 3; conv: A 19, G 3; bn: 9 values. Reduce + broadcast = 2 x payload.
  const std::size_t packed = 2 * 8 * (tri(6) + tri(4) + tri(5) + tri(3) + tri(19) + tri(3) + 9);
  const std::size_t full = 2 * 8 * (36 + 16 + 25 + 9 + 361 + 9 + 9);
  CHECK(bytes_for(kfac::Symmetric{}) == packed);
  CHECK(bytes_for(kfac::Full{}) == full);
  // Reduce-to-owner (COMM-OPT: no gradient broadcasts): one MPI_Reduce contribution per
  // decomposed factor; BatchNorm's closed form is still summed to every rank.
  kfac::MpiComm comm(MPI_COMM_WORLD);
  kfac::Preconditioner<double, Host, kfac::MpiComm> pre(
      options(), Host(), comm, kaisa(1.0).with_bucket_bytes(1 << 20).with_reduce_to_owner(true));
  register_all<kfac::Symmetric>(pre);
  run(pre, world_rank(), size, 1);
  comm.reset_bytes();
  run(pre, world_rank(), size, 1);
  const std::size_t owner = 8 * (tri(6) + tri(4) + tri(5) + tri(3) + tri(19) + tri(3)) + 2 * 8 * 9;
  CHECK(comm.bytes_sent() == owner);
  CHECK(owner < packed * 55 / 100);
}

TEST_CASE("MEM-OPT keeps one copy of each decomposition across ranks", "[mpi][memory]") {
  const int size = world_size();
  kfac::Preconditioner<double, Host, kfac::MpiComm> pre(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                        kaisa(1.0 / size));
  register_all<kfac::Symmetric>(pre);
  run(pre, world_rank(), size, 1);
  kfac::Preconditioner<double, Host> single(options());
  register_all<kfac::Symmetric>(single);
  run(single, 0, 1, 1);
  auto total = [](const std::vector<kfac::MemoryReport>& r) { std::size_t t = 0; for (auto& m : r) t += m.decomposition_bytes; return t; };
  double mine = double(total(pre.memory_report())), sum = 0;
  MPI_Allreduce(&mine, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == double(total(single.memory_report())));
}

TEST_CASE("reduced-precision factor averaging stays within its documented tolerance", "[mpi][precision]") {
  const int rank = world_rank(), size = world_size();
  kfac::Preconditioner<double, Host> single(options());
  register_all<kfac::Symmetric>(single);
  const auto expect = run(single, 0, 1, 3);
  for (auto [p, tol] : {std::pair<kfac::CommPrecision, double>{kfac::CommPrecision::float32, 1e-5},
                        {kfac::CommPrecision::bfloat16, 5e-2}}) {
    kfac::Preconditioner<double, Host, kfac::MpiComm> dist(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                           kaisa(1.0).with_comm_precision(p));
    register_all<kfac::Symmetric>(dist);
    const auto got = run(dist, rank, size, 3);
    INFO("payload " << int(p) << " relative difference " << rel_diff(got, expect));
    CHECK(rel_diff(got, expect) < tol);
    CHECK(identical_on_all_ranks(got));
  }
}

TEST_CASE("mismatched registration raises the same error on every rank", "[mpi][errors]") {
  const int rank = world_rank(), size = world_size();
  if (size == 1) return;
  kfac::Preconditioner<double, Host, kfac::MpiComm> pre(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD), kaisa(1.0));
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(5, rank == size - 1 ? 3 : 4));
  Rng rng(7);
  auto x = random_view<double>(kBatch, 5, rng);
  auto g = random_view<double>(kBatch, rank == size - 1 ? 3 : 4, rng);
  auto w = random_view<double>(rank == size - 1 ? 3 : 4, 5, rng);
  auto b = random_vector<double>(rank == size - 1 ? 3 : 4, rng);
  pre.observe_input("fc", x);
  pre.observe_output_grad("fc", g);
  pre.set_gradient("fc", w, b);
  const auto before = std::vector<double>(w.data(), w.data() + w.span());
  CHECK_THROWS_WITH(pre.step(), Catch::Contains("ranks registered different layers"));
  CHECK(std::vector<double>(w.data(), w.data() + w.span()) == before);
  CHECK(pre.step_count() == 0);
}

TEST_CASE("ranks that disagree on reduce_to_owner or split_preconditioning raise the same error and change nothing",
          "[mpi][errors][owner][split]") {
  // Both options change which collectives run; the registration check refuses them before any.
  const int rank = world_rank(), size = world_size();
  if (size == 1) return;
  const bool odd = rank == size - 1;
  for (const auto& k : {kaisa(1.0).with_reduce_to_owner(odd), kaisa(1.0).with_split_preconditioning(odd)}) {
    kfac::Preconditioner<double, Host, kfac::MpiComm> pre(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD), k);
    register_all<kfac::Symmetric>(pre);
    CHECK_THROWS_WITH(run(pre, rank, size, 1), Catch::Contains("ranks registered different layers"));
    CHECK(pre.step_count() == 0);
    CHECK_FALSE(pre.layer("fc1").has_factors());
  }
}

TEST_CASE("GradientAverager averages bucketed gradients bit-identically", "[mpi][data_parallel]") {
  const int rank = world_rank(), size = world_size();
  Rng rng(99 + rank);
  auto w = random_view<double>(7, 9, rng);  // 63 values
  auto b = random_vector<double>(5, rng);
  Kokkos::View<float*, Kokkos::HostSpace> f("f", 11);
  for (int i = 0; i < 11; ++i) f(i) = float(rank + i);
  // Expected means from every rank's generator, computed independently.
  std::vector<double> mean_w(63, 0.0), mean_b(5, 0.0);
  for (int r = 0; r < size; ++r) {
    Rng other(99 + r);
    auto ow = random_view<double>(7, 9, other);
    auto ob = random_vector<double>(5, other);
    for (int i = 0; i < 63; ++i) mean_w[i] += ow.data()[i] / size;
    for (int i = 0; i < 5; ++i) mean_b[i] += ob(i) / size;
  }
  kfac::GradientAverager<kfac::MpiComm> avg(kfac::MpiComm(MPI_COMM_WORLD), 10 * sizeof(double));
  avg.add(w);
  avg.add(b);
  avg.add(f);
  avg.average();
  for (int i = 0; i < 63; ++i) CHECK(w.data()[i] == Approx(mean_w[i]).epsilon(1e-12));
  for (int i = 0; i < 5; ++i) CHECK(b(i) == Approx(mean_b[i]).epsilon(1e-12));
  for (int i = 0; i < 11; ++i) CHECK(f(i) == Approx(float(i) + float(size - 1) / 2).epsilon(1e-6));
  if (size > 1) {
    // the first average checks the views (1); 68 doubles in buckets of 10 -> 7; 11 floats fit one bucket of 20
    CHECK(avg.collectives() == 1 + 7 + 1);
  }
  std::vector<double> all(w.data(), w.data() + 63);
  all.insert(all.end(), b.data(), b.data() + 5);
  CHECK(identical_on_all_ranks(all));
}

TEST_CASE("deferred decompositions equal the single-process result with the same delay", "[mpi][distributed][deferred]") {
  const int size = world_size();
  SECTION("COMM-OPT, d = 1") { check_strategy<kfac::Symmetric>(1.0, false, true, 1); }
  SECTION("MEM-OPT, d = 2") { check_strategy<kfac::Symmetric>(1.0 / size, false, true, 2); }
  SECTION("MEM-OPT, Cholesky, reduce-to-owner, d = 1") { check_strategy<kfac::Symmetric, kfac::Cholesky<>>(1.0 / size, true, true, 1); }
  SECTION("COMM-OPT, full, factors apart, reduce-to-owner, d = 2") { check_strategy<kfac::Full>(1.0, true, false, 2); }
  SECTION("COMM-OPT, Newton-Schulz, d = 1") { check_strategy<kfac::Symmetric, kfac::NewtonSchulz>(1.0, false, true, 1); }
  SECTION("MEM-OPT, randomized low-rank, d = 1") { check_strategy<kfac::Symmetric, LowRank>(1.0 / size, false, true, 1); }
  if (size % 2 == 0 && size > 2) {
    SECTION("HYBRID 0.5, d = 1") { check_strategy<kfac::Symmetric>(0.5, false, true, 1); }
  }
  // The delay is visible: d = 1 differs from d = 0 once a deferred decomposition is in use.
  kfac::Preconditioner<double, Host> now(options()), later(options().with_decomposition_delay(1));
  register_all<kfac::Symmetric>(now);
  register_all<kfac::Symmetric>(later);
  CHECK(rel_diff(run(later, 0, 1, 4), run(now, 0, 1, 4)) > 1e-6);
}

TEST_CASE("decompositions shared in the background: the same result and bytes as at the swap step", "[mpi][distributed][deferred][background]") {
  // Kaisa::background_sharing (the default; this main asks MPI for MPI_THREAD_MULTIPLE): on
  // Serial + LAPACK the thread that computes a deferred decomposition also broadcasts it, and
  // every holder that computes none of the layer's units receives it into a shadow of its own,
  // which memory_report() shows while the decomposition is in flight.
  const int rank = world_rank(), size = world_size();
  using DPre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  const bool threads = kfac::MpiComm(MPI_COMM_WORLD).thread_multiple();
  const bool off_thread = std::is_same<Host, Kokkos::Serial>::value;
  for (double fraction : {1.0, 1.0 / size}) {
    std::vector<double> got[2];
    std::size_t bytes[2] = {0, 0}, pending[2] = {0, 0};
    for (int bg : {0, 1}) {
      kfac::MpiComm comm(MPI_COMM_WORLD);
      DPre pre(options().with_decomposition_delay(1), Host(), comm, kaisa(fraction).with_background_sharing(bg == 1));
      register_all<kfac::Symmetric>(pre);
      got[bg] = run(pre, rank, size, 3);  // step 2 launches a decomposition, swapped in at step 3
      for (const auto& m : pre.memory_report()) pending[bg] += m.workspace_bytes;
      const auto more = run(pre, rank, size, 4, 3);
      got[bg].insert(got[bg].end(), more.begin(), more.end());
      bytes[bg] = comm.bytes_sent();
    }
    INFO("rank " << rank << " of " << size << ", fraction " << fraction << ", MPI_THREAD_MULTIPLE " << threads);
    CHECK(got[1] == got[0]);  // the same broadcasts, from another thread
    CHECK(bytes[1] == bytes[0]);
    CHECK(identical_on_all_ranks(got[1]));
    kfac::Preconditioner<double, Host> single(options().with_decomposition_delay(1));
    register_all<kfac::Symmetric>(single);
    CHECK(rel_diff(got[1], run(single, 0, 1, 7)) < 1e-10);
    // Under COMM-OPT every rank holds every layer and at least one layer's units are computed
    // elsewhere (3 Kronecker layers, each on one rank): its receiving shadow is in flight.
    if (fraction == 1.0 && size > 1) {
      if (threads && off_thread) CHECK(pending[1] > pending[0]);
      else CHECK(pending[1] == pending[0]);
    }
  }
}

TEST_CASE("a decomposition shared in the background that a damping retry mends is shared again", "[mpi][errors][deferred][background]") {
  // Cholesky without pi of A = 2^56 (1 1; 1 1) + sqrt(damping) I. With damping 1 the shift is
  // below half the spacing of doubles near 2^56 (16), so A + I == A, singular: potrf fails on
  // the rank that computes it, in flight, and that failed attempt is what its thread
  // broadcast. At the swap step the retry (damping 1000, shift 31.6) succeeds there; the other
  // ranks must get the mended inverse, not keep what arrived in the background. With no retry
  // allowed, every rank throws the same error.
  const int rank = world_rank(), size = world_size();
  const double big = std::ldexp(1.0, 28);
  auto options_for = [](int retries) {
    return kfac::Options{}.with_kl_clip(0.0).with_damping(1.0).with_factor_decay(0.0).with_inv_update_steps(1)
        .with_decomposition_delay(1).with_max_damping_retries(retries).with_damping_retry_factor(1000.0);
  };
  auto run_steps = [&](auto& pre) {
    pre.register_layer("c", kfac::Dense(2, 1, false), kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>>(
                                                           kfac::Cholesky<>{}.with_pi_damping(false)));
    V2 x("x", 1, 2), g("g", 1, 1), w("w", 1, 2);
    std::vector<double> out;
    for (int s = 0; s < 4; ++s) {
      x(0, 0) = s == 1 ? big : 1.0;
      x(0, 1) = s == 1 ? big : 0.5;
      g(0, 0) = 1.0;
      w(0, 0) = 1.0;
      w(0, 1) = -2.0;
      pre.observe_input("c", x);
      pre.observe_output_grad("c", g);
      pre.set_gradient("c", w);
      pre.step();  // step 1 launches the decomposition of the singular A, step 2 swaps it in
      out.push_back(w(0, 0));
      out.push_back(w(0, 1));
    }
    return out;
  };
  kfac::Preconditioner<double, Host> single(options_for(1));
  const auto expect = run_steps(single);
  for (bool bg : {true, false}) {
    INFO("rank " << rank << " of " << size << ", background sharing " << bg);
    kfac::Preconditioner<double, Host, kfac::MpiComm> pre(options_for(1), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                          kfac::Kaisa{}.with_background_sharing(bg));
    const auto got = run_steps(pre);
    CHECK(rel_diff(got, expect) < 1e-12);
    CHECK(identical_on_all_ranks(got));
    kfac::Preconditioner<double, Host, kfac::MpiComm> strict(options_for(0), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                             kfac::Kaisa{}.with_background_sharing(bg));
    CHECK_THROWS_WITH(run_steps(strict), Catch::Contains("layer 'c'") && Catch::Contains("failed after 0 damping increase(s)"));
    CHECK(strict.step_count() == 2);
  }
}

TEST_CASE("a checkpoint with decompositions in flight resumes bit-identically at every rank", "[mpi][checkpoint][deferred]") {
  const int rank = world_rank(), size = world_size();
  using DPre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  // MEM-OPT with and without reduce-to-owner; COMM-OPT, whose holders share the decompositions in
  // the background (Kaisa::background_sharing) in the uninterrupted run and at the swap step
  // after the restart (a decomposition restarted by load() has no sharer).
  for (auto [fraction, owner] : {std::pair{1.0 / size, false}, std::pair{1.0 / size, true}, std::pair{1.0, false}}) {
    auto make = [&, fraction = fraction, owner = owner] {
      auto p = std::make_unique<DPre>(options().with_decomposition_delay(2), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                      kaisa(fraction).with_reduce_to_owner(owner));
      register_all<kfac::Symmetric, kfac::Cholesky<>>(*p);
      return p;
    };
    const auto [expect, got] = with_restart(make, 5, 9);  // saved with a decomposition launched at 4, due at 6
    INFO("fraction " << fraction << ", reduce-to-owner " << owner << ", rank " << rank);
    CHECK(got == expect);
    CHECK(identical_on_all_ranks(got));
  }
}

TEST_CASE("distributed checkpoints resume bit-identically; factors restore at any world size", "[mpi][checkpoint]") {
  const int size = world_size();
  using DPre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  auto make = [&] {
    auto p = std::make_unique<DPre>(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD), kaisa(1.0 / size));
    register_all<kfac::Symmetric>(*p);
    return p;
  };
  const auto [expect, got] = with_restart(make, 3, 6);  // step 3 is not a decomposition step (every 2: 0, 2, 4)
  CHECK(got == expect);  // bit-identical to the uninterrupted run

  // A single-process checkpoint restores its (global) factors on every rank of any world size;
  // its decompositions are per-rank state and are recomputed (load returns false) when W > 1.
  kfac::Preconditioner<double, Host> single(options());
  register_all<kfac::Symmetric>(single);
  run(single, 0, 1, 3);
  std::ostringstream os1(std::ios::binary);
  single.save(os1);
  auto fresh = make();
  std::istringstream is1(os1.str(), std::ios::binary);
  CHECK(fresh->load(is1) == (size == 1));
  CHECK(fresh->step_count() == 3);
  CHECK(fresh->layer("fc1").has_factors());
}

TEST_CASE("reduce-to-owner checkpoints hold the global factors", "[mpi][checkpoint][owner]") {
  const int rank = world_rank(), size = world_size();
  using DPre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  auto make = [&](double f) {
    auto p = std::make_unique<DPre>(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                    kaisa(f).with_reduce_to_owner(true));
    register_all<kfac::Symmetric>(*p);
    return p;
  };
  kfac::Preconditioner<double, Host> single(options()), single3(options());
  register_all<kfac::Symmetric>(single);
  register_all<kfac::Symmetric>(single3);
  auto expect = run(single, 0, 1, 6);
  run(single3, 0, 1, 3);
  for (double f : {1.0, 1.0 / size}) {
    INFO("fraction " << f);
    // Same world size: resumes bit-identically with the uninterrupted run.
    auto full = make(f);
    const auto all = run(*full, rank, size, 6);
    auto first = make(f);
    auto got = run(*first, rank, size, 3);
    std::ostringstream os(std::ios::binary);
    first->save(os);  // collective: the owners share their factors
    auto resumed = make(f);
    std::istringstream is(os.str(), std::ios::binary);
    CHECK(resumed->load(is));
    const auto tail = run(*resumed, rank, size, 3, 3);
    got.insert(got.end(), tail.begin(), tail.end());
    CHECK(got == all);
    CHECK(rel_diff(got, expect) < 1e-10);
    CHECK(identical_on_all_ranks(got));
    // Another world size: every rank's checkpoint holds the global factors, which restore in
    // one process (decompositions are per-rank state, recomputed when W > 1).
    kfac::Preconditioner<double, Host> one(options());
    register_all<kfac::Symmetric>(one);
    std::istringstream is1(os.str(), std::ios::binary);
    CHECK(one.load(is1) == (size == 1));
    CHECK(rel_diff(factors_of(one), factors_of(single3)) < 1e-10);
  }
  // And a single-process checkpoint restores into a reduce-to-owner job as into an allreduce
  // one (both recompute the decompositions when W > 1).
  std::ostringstream os(std::ios::binary);
  single3.save(os);
  auto job = make(1.0 / size);
  DPre plain(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD), kaisa(1.0 / size));
  register_all<kfac::Symmetric>(plain);
  std::istringstream is(os.str(), std::ios::binary), is2(os.str(), std::ios::binary);
  CHECK(job->load(is) == plain.load(is2));
  const auto got = run(*job, rank, size, 3, 3);
  CHECK(rel_diff(got, run(plain, rank, size, 3, 3)) < 1e-10);
  CHECK(identical_on_all_ranks(got));
}

TEST_CASE("every rank may load rank 0's checkpoint", "[mpi][checkpoint]") {
  // Decompositions are restored on every rank or on none; a per-rank decision would leave the
  // ranks disagreeing about which layers to decompose, and the next step would hang.
  const int rank = world_rank(), size = world_size();
  using DPre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  DPre first(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD), kaisa(1.0));
  register_all<kfac::Symmetric>(first);
  run(first, rank, size, 3);
  std::ostringstream os(std::ios::binary);
  first.save(os);
  std::string bytes = os.str();
  unsigned long n = bytes.size();
  MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG, 0, MPI_COMM_WORLD);
  bytes.resize(n);
  MPI_Bcast(&bytes[0], int(n), MPI_CHAR, 0, MPI_COMM_WORLD);
  DPre resumed(options(), Host(), kfac::MpiComm(MPI_COMM_WORLD), kaisa(1.0));
  register_all<kfac::Symmetric>(resumed);
  std::istringstream is(bytes, std::ios::binary);
  CHECK(resumed.load(is) == (size == 1));
  CHECK(identical_on_all_ranks(run(resumed, rank, size, 2)));
}

/// A Newton-Schulz layer that fails by construction, not by rounding. With every input 2^60 and
/// every output gradient 1 in a one-row batch (statistics replacing the factors: factor decay
/// 0), A = a J (3 x 3) and G = b J (2 x 2), J all ones, a = 2^120 and b = 1 (to an ulp after the
/// average over ranks), every entry the same bits on every kernel: one product of powers of two,
/// then the same operations. pi ~ 2^60, so the shifts pi sqrt(damping) and sqrt(damping) / pi
/// stay below half an ulp of a and of b while sqrt(damping) < 2^7 (damping up to 1.6e4, retries
/// included): A + shift I == A and G + shift I == G, singular, bit for bit. Then for any X, M X
/// has rank 1 and ||I - M X||_F >= sqrt(n - 1) >= 1, never below the convergence test's 1e-2;
/// the GEMMs' rounding is about n eps 2^k of M X's scale after k iterations (X doubles on J's
/// null space), 4e-7 at the 30 allowed.
constexpr double singular_input = 1152921504606846976.0;  // 2^60
template <class Pre>
void register_singular_newton_schulz(Pre& pre) {
  pre.register_layer("ns", kfac::Dense(3, 2, false),
                     kfac::KFAC<kfac::Symmetric, kfac::NewtonSchulz>(kfac::NewtonSchulz{}.with_max_iterations(30)));
}

TEST_CASE("a decomposition failing on one rank is an error on every rank", "[mpi][errors]") {
  kfac::Preconditioner<double, Host, kfac::MpiComm> pre(
      kfac::Options{}.with_kl_clip(0.0).with_damping(1e-2).with_factor_decay(0.0), Host(),
      kfac::MpiComm(MPI_COMM_WORLD));
  register_singular_newton_schulz(pre);
  V2 x("x", 1, 3), g("g", 1, 2), w("w", 2, 3);
  Kokkos::deep_copy(x, singular_input);  // A + shift I singular: fails even after 3 damping raises
  Kokkos::deep_copy(g, 1.0);
  Kokkos::deep_copy(w, 1.0);
  pre.observe_input("ns", x);
  pre.observe_output_grad("ns", g);
  pre.set_gradient("ns", w);
  CHECK_THROWS_WITH(pre.step(), Catch::Contains("layer 'ns'") && Catch::Contains("decomposition"));
  CHECK(pre.step_count() == 0);
}

TEST_CASE("a deferred decomposition failing on the rank that computes it is an error on every rank", "[mpi][errors][deferred]") {
  // d = 1, a decomposition every step: step 0 decomposes at once (benign data: J + 0.1 I), step
  // 1 launches one from singular factors (register_singular_newton_schulz: Newton-Schulz fails
  // even after 3 damping raises), step 2 swaps it in: one rank computed it, every rank must
  // throw the same error.
  kfac::Preconditioner<double, Host, kfac::MpiComm> pre(kfac::Options{}
                                                            .with_kl_clip(0.0)
                                                            .with_damping(1e-2)
                                                            .with_factor_decay(0.0)
                                                            .with_inv_update_steps(1)
                                                            .with_decomposition_delay(1),
                                                        Host(), kfac::MpiComm(MPI_COMM_WORLD));
  register_singular_newton_schulz(pre);
  V2 x("x", 1, 3), g("g", 1, 2), w("w", 2, 3);
  auto feed = [&](double scale) {
    Kokkos::deep_copy(x, scale);
    Kokkos::deep_copy(g, 1.0);
    Kokkos::deep_copy(w, 1.0);
    pre.observe_input("ns", x);
    pre.observe_output_grad("ns", g);
    pre.set_gradient("ns", w);
  };
  feed(1.0);
  pre.step();
  feed(singular_input);
  pre.step();  // launched: the decomposition in use is still step 0's
  feed(1.0);
  const int size = world_size();
  INFO("rank " << world_rank() << " of " << size);
  CHECK_THROWS_WITH(pre.step(), Catch::Contains("layer 'ns'") && Catch::Contains("decomposition") &&
                                    Catch::Contains(size > 1 ? "every rank restored its state" : "failed after 3"));
  CHECK(pre.step_count() == 2);
  CHECK(identical_on_all_ranks({double(pre.step_count()), double(pre.last_decomposition_step())}));
}

TEST_CASE("kfac::Kaisa holds the distribution's settings, the only place they are read", "[mpi][distributed][policy]") {
  const int rank = world_rank(), size = world_size();
  const double fraction = size == 4 ? 0.5 : 1.0 / size;  // HYBRID at 4 ranks, else MEM-OPT
  const auto policy = kfac::Kaisa{}
                          .with_grad_worker_fraction(fraction)
                          .with_reduce_to_owner(true)
                          .with_split_preconditioning(true)
                          .with_bucket_bytes(256);
  kfac::MpiComm comm(MPI_COMM_WORLD), plain_comm(MPI_COMM_WORLD);
  kfac::Preconditioner<double, Host, kfac::MpiComm> pre(options(), Host(), comm, policy);
  CHECK(pre.distribution().grad_worker_fraction == fraction);
  CHECK(pre.distribution().bucket_bytes == 256);
  CHECK(pre.distribution().reduce_to_owner);
  // Without a policy object: kfac::Kaisa{}, COMM-OPT with every default.
  kfac::Preconditioner<double, Host, kfac::MpiComm> plain(options(), Host(), plain_comm);
  CHECK(plain.distribution().grad_worker_fraction == 1.0);
  CHECK_FALSE(plain.distribution().reduce_to_owner);
  CHECK(plain.distribution().bucket_bytes == kfac::Kaisa{}.bucket_bytes);
  register_all<kfac::Symmetric>(pre);
  register_all<kfac::Symmetric>(plain);
  kfac::Preconditioner<double, Host> single(options());
  register_all<kfac::Symmetric>(single);
  const auto expect = run(single, 0, 1, 5);
  const auto got = run(pre, rank, size, 5), got_plain = run(plain, rank, size, 5);
  CHECK(rel_diff(got, expect) < 1e-10);
  CHECK(rel_diff(got_plain, expect) < 1e-10);
  CHECK(identical_on_all_ranks(got));
  // The policy's settings take effect: other collectives, other bytes than the defaults'.
  if (size > 1) CHECK(comm.bytes_sent() != plain_comm.bytes_sent());
}

TEST_CASE("ranks whose distribution policies differ refuse the first step together",
          "[mpi][distributed][policy][errors]") {
  kfac::MpiComm comm(MPI_COMM_WORLD);
  using P = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  // Ranks whose policies differ refuse the first step together (the registration signature).
  P q(options(), Host(), comm, kfac::Kaisa{}.with_bucket_bytes(world_rank() == 0 ? 1024 : 2048));
  register_all<kfac::Symmetric>(q);
  if (world_size() > 1) CHECK_THROWS_WITH(run(q, world_rank(), world_size(), 1), Catch::Contains("ranks registered different"));
}
