// kfac::CostModel against closed forms, against WorkAssignment, and against memory_report() of a
// real single-process Preconditioner. Bytes against MpiComm::bytes_sent() at 1-4 ranks are in
// test_mpi_cost_model.cpp.
#include <catch2/catch.hpp>
#include <cmath>
#include <kfac/planning/calibration.hpp>
#include <kfac/planning/cost_model.hpp>
#include <kfac/kfac.hpp>

#include "cost_model_net.hpp"
#include "toy_method.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;

namespace {

std::size_t tri(std::size_t n) { return n * (n + 1) / 2; }

/// The layers of test_mpi_distributed: fc1 A 6 G 4, fc2 A 5 G 3, conv A 19 G 3, bn 3 channels.
template <class Factor = kfac::Symmetric>
std::vector<kfac::LayerShape> small_net() {
  return {kfac::LayerShape::of<kfac::Dense, Factor>("fc1", kfac::Dense(5, 4)),
          kfac::LayerShape::of<kfac::Dense, Factor>("fc2", kfac::Dense(4, 3)),
          kfac::LayerShape::of<kfac::Conv2d, Factor>("conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1)),
          kfac::LayerShape::of("bn", kfac::BatchNorm2d(3))};
}

std::vector<kfac::LayerShape> mlp() {
  return {kfac::LayerShape::of("fc1", kfac::Dense(784, 1024)), kfac::LayerShape::of("fc2", kfac::Dense(1024, 1024)),
          kfac::LayerShape::of("fc3", kfac::Dense(1024, 10))};
}

double cube(double n) { return n * n * n; }

template <class F>
std::size_t sum_ranks(const kfac::CostPrediction& p, F field) {
  std::size_t t = 0;
  for (const auto& r : p.ranks) t += field(r);
  return t;
}

}  // namespace

TEST_CASE("LayerShape mirrors register_layer's policies", "[cost_model][shape]") {
  const auto d = kfac::LayerShape::of("fc", kfac::Dense(5, 4));
  CHECK(d.a_dim == 6);
  CHECK(d.g_dim == 4);
  CHECK(d.packed);
  CHECK(d.decomposed_factors() == 2);
  CHECK(d.unit_costs[0].work.eigh_n3 == cube(6));  // the eigendecomposition states its own work
  CHECK(d.unit_costs[1].work.eigh_n3 == cube(4));
  CHECK(d.plan.apply.gemm_flops == 4.0 * 4 * 6 * (4 + 6));
  const auto c = kfac::LayerShape::of<kfac::Conv2d, kfac::Full, kfac::Cholesky<>, kfac::MixedPrecision>(
      "conv", kfac::Conv2d(2, 3, 3, 3).with_bias(false));
  CHECK(c.a_dim == 18);
  CHECK(c.g_dim == 3);
  CHECK_FALSE(c.packed);
  CHECK(c.unit_costs[0].work.factorization_n3 == cube(18));
  CHECK(c.unit_costs[0].work.eigh_n3 == 0);
  CHECK(c.plan.apply.gemm_flops == 2.0 * 3 * 18 * (3 + 18));
  CHECK(c.factor_scalar == 4);
  CHECK(c.decomposition_scalar == 8);
  const auto g = kfac::LayerShape::of<kfac::Dense, kfac::Diagonal>("diag", kfac::Dense(5, 4));
  CHECK(g.decomposed_factors() == 0);
  CHECK(g.plan.apply.gemm_flops == 0);
  CHECK_FALSE(g.packed);
  const auto b = kfac::LayerShape::of("bn", kfac::BatchNorm2d(7));
  CHECK_FALSE(b.kronecker);
  CHECK(b.channels == 7);
  CHECK(b.factor_payload_counts() == std::vector<std::size_t>{21});
  for (const bool shift : {true, false}) {  // LayerNorm: 3 averaged values per feature, nothing to decompose
    const auto n = kfac::LayerShape::of("ln", kfac::LayerNorm(9, shift));
    CHECK(n.kind == "layer_norm");
    CHECK_FALSE(n.kronecker);
    CHECK(n.channels == 9);
    CHECK(n.factor_payload_counts() == std::vector<std::size_t>{27});
    CHECK(n.decomposed_factors() == 0);
  }
  const auto r = kfac::LayerShape::of("seq", kfac::Dense(5, 4).with_tokens(kfac::Dense::Tokens::reduce));
  CHECK(r.a_dim == 6);  // a sequence layer's factors have the shapes of its samples' layer
  CHECK(r.unit_costs[0].work.eigh_n3 == cube(6));
}

TEST_CASE("bytes per factor update follow the packed/full formula", "[cost_model][bytes]") {
  const std::size_t packed = 2 * 8 * (tri(6) + tri(4) + tri(5) + tri(3) + tri(19) + tri(3) + 9);
  const std::size_t full = 2 * 8 * (36 + 16 + 25 + 9 + 361 + 9 + 9);
  for (int world : {2, 3, 4}) {
    for (double f : {1.0, 1.0 / world}) {
      const auto p = kfac::CostModel(small_net()).predict(world, f);
      const auto q = kfac::CostModel(small_net<kfac::Full>()).predict(world, f);
      for (int r = 0; r < world; ++r) {
        CHECK(p.ranks[std::size_t(r)].factor_bytes_sent == packed);
        CHECK(q.ranks[std::size_t(r)].factor_bytes_sent == full);
      }
    }
  }
  SECTION("one rank communicates nothing") {
    const auto p = kfac::CostModel(small_net()).predict(1, 1.0);
    CHECK(p.ranks[0].factor_bytes_sent == 0);
    CHECK(p.ranks[0].decomposition_bytes_sent == 0);
    CHECK(p.ranks[0].gradient_bytes_sent == 0);
    CHECK(p.factor_collectives == 0);
    CHECK(p.ranks[0].staging_bytes == 0);
  }
  SECTION("reduced-precision payloads") {
    const kfac::CostModel m(small_net());
    CHECK(m.predict(2, kfac::Kaisa{}.with_comm_precision(kfac::CommPrecision::float32)).ranks[0].factor_bytes_sent ==
          packed / 2);
    CHECK(m.predict(2, kfac::Kaisa{}.with_comm_precision(kfac::CommPrecision::bfloat16)).ranks[0].factor_bytes_sent ==
          packed / 4);
    // float factors already travel as float
    std::vector<kfac::LayerShape> f{kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
                                                         kfac::SinglePrecision>("fc", kfac::Dense(5, 4))};
    CHECK(kfac::CostModel(f).predict(2, kfac::Kaisa{}.with_comm_precision(kfac::CommPrecision::float32))
              .ranks[0].factor_bytes_sent == 2 * 4 * (tri(6) + tri(4)));
  }
  SECTION("reduce-to-owner: one reduce contribution per decomposed factor") {
    // BatchNorm's 9 values still go to every rank (reduce + broadcast).
    const std::size_t owner = 8 * (tri(6) + tri(4) + tri(5) + tri(3) + tri(19) + tri(3)) + 2 * 8 * 9;
    for (int world : {2, 3, 4})
      for (double f : {1.0, 1.0 / world}) {
        const auto p = kfac::CostModel(small_net())
                           .predict(world, kfac::Kaisa{}.with_grad_worker_fraction(f).with_reduce_to_owner(true));
        for (int r = 0; r < world; ++r) CHECK(p.ranks[std::size_t(r)].factor_bytes_sent == owner);
      }
    // Buckets per owner (world 2, COMM-OPT, colocated): the closed form alone, then one bucket
    // per owner of the Kronecker factors.
    const auto p = kfac::CostModel(small_net()).predict(2, kfac::Kaisa{}.with_reduce_to_owner(true));
    CHECK(p.factor_collectives == 3);
    // The issue-16 MLP at 4 ranks: factor bytes 0.5x those of the allreduce.
    std::vector<kfac::LayerShape> mlp{kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::SinglePrecision>("fc1", kfac::Dense(784, 256)),
                                      kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::SinglePrecision>("fc2", kfac::Dense(256, 256)),
                                      kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::SinglePrecision>("fc3", kfac::Dense(256, 10))};
    for (double f : {1.0, 0.5, 0.25}) {
      const auto all = kfac::CostModel(mlp).predict(4, f);
      const auto own =
          kfac::CostModel(mlp).predict(4, kfac::Kaisa{}.with_grad_worker_fraction(f).with_reduce_to_owner(true));
      CHECK(2 * own.ranks[0].factor_bytes_sent == all.ranks[0].factor_bytes_sent);
    }
  }
  SECTION("buckets") {
    // Payloads 21, 10, 15, 6, 190, 6, 9 values in buckets of 32: [21 10] [15 6] [190] [6 9].
    const auto p = kfac::CostModel(small_net()).predict(2, kfac::Kaisa{}.with_bucket_bytes(256));
    CHECK(p.factor_collectives == 4);
    CHECK(p.ranks[1].staging_bytes == 190 * 8);
    CHECK(p.ranks[1].factor_bytes_sent == packed);
    CHECK(kfac::CostModel(small_net()).predict(2, 1.0).factor_collectives == 1);
  }
}

TEST_CASE("decomposition and gradient bytes follow the strategy", "[cost_model][bytes]") {
  const kfac::CostModel m(small_net());
  // Eigen buffers Q (n x n) and lambda (n) of every factor; the gradient g x a of every layer.
  const std::size_t eigen = 8 * ((36 + 6 + 16 + 4) + (25 + 5 + 9 + 3) + (361 + 19 + 9 + 3));
  const std::size_t grads = 8 * (4 * 6 + 3 * 5 + 3 * 19);
  auto dec = [](const kfac::RankCost& r) { return r.decomposition_bytes_sent; };
  auto grad = [](const kfac::RankCost& r) { return r.gradient_bytes_sent; };

  SECTION("COMM-OPT: decompositions broadcast to all, no gradients") {
    for (int world : {2, 4}) {
      const auto p = m.predict(world, 1.0);
      CHECK(sum_ranks(p, dec) == eigen);
      CHECK(sum_ranks(p, grad) == 0);
      for (const auto& r : p.ranks) {  // colocated: the decomposer of a layer sends both factors
        std::size_t mine = 0;
        for (std::size_t l = 0; l < 3; ++l)
          if (p.assignment.decomposer(l, 0) == r.rank) {
            const auto& s = m.layers()[l];
            const std::size_t a = std::size_t(s.a_dim), g = std::size_t(s.g_dim);
            mine += 8 * (a * a + a + g * g + g);
          }
        CHECK(r.decomposition_bytes_sent == mine);
      }
    }
  }
  SECTION("MEM-OPT: no decomposition traffic, each gradient sent once by its owner") {
    for (int world : {2, 3, 4}) {
      const auto p = m.predict(world, 1.0 / world);
      CHECK(sum_ranks(p, dec) == 0);
      CHECK(sum_ranks(p, grad) == grads);
    }
  }
  SECTION("HYBRID f = 1/2 at 4 ranks: each factor once within its group, each gradient twice") {
    const auto p = m.predict(4, 0.5);
    CHECK(p.assignment.grad_workers() == 2);
    CHECK(sum_ranks(p, dec) == eigen);
    CHECK(sum_ranks(p, grad) == 2 * grads);
  }
  SECTION("explicit inverses send one n x n buffer per factor") {
    std::vector<kfac::LayerShape> v{
        kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>>("fc", kfac::Dense(5, 4))};
    CHECK(sum_ranks(kfac::CostModel(v).predict(2, 1.0), dec) == 8 * (36 + 16));
  }
  SECTION("skipped and closed-form layers communicate no decompositions or gradients") {
    auto opts = kfac::Options{}.with_skip_layers({"fc2", "conv2d"});
    const auto p = m.predict(2, opts, kfac::Kaisa{}.with_grad_worker_fraction(0.5));
    CHECK(sum_ranks(p, grad) == 8 * 4 * 6);
    CHECK(p.ranks[0].factor_bytes_sent == 2 * 8 * (tri(6) + tri(4) + 9));
  }
}

TEST_CASE("the assignment is the library's WorkAssignment", "[cost_model][assignment]") {
  const auto net = mlp();
  std::vector<std::pair<double, double>> costs;
  for (const auto& s : net) costs.push_back({cube(s.a_dim), cube(s.g_dim)});
  for (int world : {1, 2, 4, 8}) {
    for (double f : {1.0, 1.0 / world}) {
      for (bool colocate : {true, false}) {
        const kfac::WorkAssignment w(world, f, costs, colocate);
        const auto p = kfac::CostModel(net).predict(
            world, kfac::Kaisa{}.with_grad_worker_fraction(f).with_colocate_factors(colocate));
        for (std::size_t l = 0; l < net.size(); ++l)
          for (int which = 0; which < 2; ++which) CHECK(p.assignment.decomposer(l, which) == w.decomposer(l, which));
        for (int r = 0; r < world; ++r)
          CHECK(p.ranks[std::size_t(r)].decomposition_n3 == Approx(w.rank_load()[std::size_t(r)]).epsilon(1e-15));
      }
    }
  }
}

TEST_CASE("times follow the library's schedule", "[cost_model][time]") {
  const double c = 1e-9, flops = 1e9;
  auto figures = kfac::MachineFigures{}.with_eigen_seconds_per_n3(c).with_gemm_flops(flops).with_latency(0).with_bandwidth(1e300);
  const kfac::CostModel m(mlp(), figures);
  const double fc1 = cube(785) + cube(1024), fc2 = cube(1025) + cube(1024), fc3 = cube(1025) + cube(10);
  auto gemm = [&](double g, double a) { return 4 * g * a * (g + a) / flops; };
  const double apply = gemm(1024, 785) + gemm(1024, 1025) + gemm(10, 1025);

  const auto one = m.predict(1, 1.0);
  CHECK(one.decomposition_phase_seconds == Approx(c * (fc1 + fc2 + fc3)));
  CHECK(one.preconditioning_phase_seconds == Approx(apply));

  SECTION("MEM-OPT, 2 ranks: greedy puts fc2 alone, so the phase is fc1 + fc3") {
    const auto p = m.predict(2, 0.5);
    CHECK(p.ranks[0].decomposition_seconds == Approx(c * fc2));
    CHECK(p.ranks[1].decomposition_seconds == Approx(c * (fc1 + fc3)));
    CHECK(p.decomposition_phase_seconds == Approx(c * (fc1 + fc3)));
    // Each rank preconditions its own layers at once; the broadcasts follow (free here).
    CHECK(p.preconditioning_phase_seconds == Approx(gemm(1024, 1025)));
    CHECK(p.ranks[1].preconditioning_seconds == Approx(gemm(1024, 785) + gemm(10, 1025)));
    CHECK(p.ranks[0].preconditioning_seconds == Approx(gemm(1024, 1025)));
  }
  SECTION("COMM-OPT, 2 ranks: decompositions run at once, the broadcasts follow") {
    const auto p = m.predict(2, 1.0);
    CHECK(p.decomposition_phase_seconds == Approx(c * (fc1 + fc3)));
    CHECK(p.max_decomposition_seconds() == Approx(p.decomposition_phase_seconds));
    CHECK(p.preconditioning_phase_seconds == Approx(apply));
  }
  SECTION("COMM-OPT, 2 ranks, A and G apart: the larger factor first, on the least-loaded rank") {
    // fc2: A (1025) -> 0, G (1024) -> 1; fc1: G (1024) -> 1, A (785) -> 0; fc3: A -> 0, G -> 1
    const auto p = m.predict(2, kfac::Kaisa{}.with_colocate_factors(false));
    CHECK(p.ranks[0].decomposition_seconds == Approx(c * (2 * cube(1025) + cube(785))));
    CHECK(p.decomposition_phase_seconds == Approx(c * (2 * cube(1025) + cube(785))));
  }
  SECTION("latency and bandwidth: a failure vote, then one broadcast per buffer") {
    const double alpha = 1e-3, beta = 1e9;
    const kfac::CostModel n(mlp(), kfac::MachineFigures(figures).with_latency(alpha).with_bandwidth(beta));
    const auto p = n.predict(2, 1.0);
    double bcast = 0;
    for (double d : {785.0, 1024.0, 1025.0, 1024.0, 1025.0, 10.0}) bcast += 2 * alpha + 8 * (d * d + d) / beta;
    const double vote = 2 * (alpha + 8 / beta);
    CHECK(p.decomposition_phase_seconds == Approx(c * (fc1 + fc3) + vote + bcast));
    CHECK(n.predict(2, 0.5).decomposition_phase_seconds == Approx(c * (fc1 + fc3) + vote));
    // factor averaging: reduce + broadcast of every packed factor; 2,409,810 values do not fit
    // one 16 MiB bucket (2,097,152 doubles), so two collectives
    double values = 0;
    for (double d : {785.0, 1024.0, 1025.0, 1024.0, 1025.0, 10.0}) values += d * (d + 1) / 2;
    CHECK(p.factor_collectives == 2);
    CHECK(p.factor_comm_seconds == Approx(2 * (2 * alpha) + 2 * 8 * values / beta));
    // MEM-OPT: the gradient broadcasts (g x a doubles, 2 ranks) follow the busier rank's GEMMs
    const auto q = n.predict(2, 0.5);
    double grads = 0;
    for (auto ga : {1024.0 * 785, 1024.0 * 1025, 10.0 * 1025}) grads += alpha + 8 * ga / beta;
    CHECK(q.preconditioning_phase_seconds == Approx(gemm(1024, 1025) + grads));
  }
  SECTION("collective time: log2 p latency hops, at most two bandwidth terms") {
    const auto f = kfac::MachineFigures{}.with_latency(1.0).with_bandwidth(1.0);
    CHECK(f.collective_seconds(10, 1) == 0.0);
    CHECK(f.collective_seconds(10, 2) == Approx(1 + 10));
    CHECK(f.collective_seconds(10, 3) == Approx(2 + 20));
    CHECK(f.collective_seconds(10, 1024) == Approx(10 + 20));
  }
}

TEST_CASE("memory equals memory_report() of a real Preconditioner", "[cost_model][memory]") {
  const auto base = kfac::Options{}.with_inv_update_steps(1);
  for (const auto& opts : {base, kfac::Options(base).with_precompute_reciprocal(true),
                           kfac::Options(base).with_skip_layers({"fc2", "batch_norm"})}) {
    const bool reciprocal = opts.precompute_reciprocal, skips = !opts.skip_layers.empty();
    INFO("precompute_reciprocal " << reciprocal << ", skipped layers " << skips);
    kfac::Preconditioner<double, Host> pre(opts);
    register_cost_model_net(pre);
    Rng rng(5);
    for (int step = 0; step < 2; ++step) {
      const CostModelBatch batch(rng);
      batch.feed(pre);
      pre.step();
    }
    const auto got = pre.memory_report();
    const auto model = kfac::CostModel(cost_model_net_shapes()).predict(1, opts);
    const auto& mem = model.ranks[0].memory;
    REQUIRE(got.size() == mem.size());
    for (std::size_t l = 0; l < got.size(); ++l) {
      INFO("layer " << got[l].name);
      CHECK(mem[l].name == got[l].name);
      CHECK(mem[l].kind == got[l].kind);
      CHECK(mem[l].factor_bytes == got[l].factor_bytes);
      CHECK(mem[l].decomposition_bytes == got[l].decomposition_bytes);
      CHECK(mem[l].workspace_bytes == got[l].workspace_bytes);
    }
    // Closed forms: eigen dense (A 6, G 4), float-factor conv (A 19, G 3), Diagonal (A 7, G 2),
    // BatchNorm (3 channels), skipped layers. Workspace includes the pending Gram matrices, the
    // factors' size in the arithmetic type, kept between steps.
    CHECK(mem[0].factor_bytes == (36 + 16) * 8);
    CHECK(mem[0].decomposition_bytes == (36 + 6 + 16 + 4 + (reciprocal ? 24 : 0)) * 8);
    CHECK(mem[0].workspace_bytes == 3 * 24 * 8 + (36 + 16) * 8);
    CHECK(mem[3].factor_bytes == (361 + 9) * 4);
    CHECK(mem[3].workspace_bytes == 3 * 57 * 8 + (361 + 9) * 4);
    CHECK(mem[4].factor_bytes == (7 + 2) * 8);
    CHECK(mem[4].decomposition_bytes == 0);
    CHECK(mem[4].workspace_bytes == 2 * 14 * 8 + (7 + 2) * 8);
    CHECK(mem[5].workspace_bytes == (skips ? 9 * 8 : 9 * 8 + 12 * 8));
    CHECK(mem[1].total() == (skips ? 0 : (16 + 9) * 8 * 3 + 3 * 12 * 8));
  }
}

namespace {
/// Registers each layer on a Preconditioner and describes it on a CostModel: one registration.
template <class Pre>
struct Both {
  Pre& pre;
  kfac::CostModel& model;
  template <class L, class M>
  void register_layer(const std::string& name, const L& layer, const M& method) {
    pre.register_layer(name, layer, method);
    model.add<typename Pre::scalar_type>(name, layer, method);
  }
};
}  // namespace

TEST_CASE("CostModel::add describes what register_layer registers, for any method", "[cost_model][shape]") {
  // A float preconditioner (ScalarPrecision resolves to float), methods with non-default
  // settings, NG-SGD and the toy method of toy_method.hpp, which the library does not know.
  kfac::Preconditioner<float, Host> pre(kfac::Options{}.with_inv_update_steps(1));
  kfac::CostModel model;
  Both<decltype(pre)> both{pre, model};
  both.register_layer("fc1", kfac::Dense(5, 4), kfac::KFAC<>{});
  both.register_layer("fc2", kfac::Dense(4, 3), kfac::KFAC<kfac::Full, kfac::NewtonSchulz>(kfac::NewtonSchulz{}.with_max_iterations(40)));
  both.register_layer("fc3", kfac::Dense(3, 6), kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>, kfac::MixedPrecision>{});
  both.register_layer("ng", kfac::Dense(6, 5), kfac::NGSGD{}.with_rank(2));
  both.register_layer("toy", kfac::Dense(5, 2), ScaledIdentity{});
  both.register_layer("bn", kfac::BatchNorm2d(2), kfac::UnitWiseFisher<>{});
  CHECK_THROWS_WITH(model.add("fc1", kfac::Dense(5, 4), kfac::KFAC<>{}), Catch::Contains("already added"));
  CHECK_THROWS_WITH(model.layer("nope"), Catch::Contains("no layer of this name"));
  REQUIRE(model.layers().size() == 6);

  const auto& fc1 = model.layer("fc1");
  CHECK(fc1.factor_scalar == 4);         // float, from the block
  CHECK(fc1.decomposition_scalar == 4);
  CHECK(fc1.unit_costs[0].work.scalar == 4);
  const auto& fc2 = model.layer("fc2");
  CHECK(fc2.unit_costs[1].work.iteration_flops == 4 * cube(3));
  CHECK_FALSE(fc2.packed);
  const auto& fc3 = model.layer("fc3");
  CHECK(fc3.factor_scalar == 4);
  CHECK(fc3.decomposition_scalar == 8);
  CHECK(model.layer("toy").decomposed_factors() == 1);
  CHECK(model.layer("toy").unit_costs[0].flops == 1.0);
  CHECK(model.layer("ng").decomposed_factors() == 0);
  CHECK_FALSE(model.layer("bn").kronecker);
  // The same description as the policy-list form, where one exists.
  const auto listed = kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::MixedPrecision>("fc3", kfac::Dense(3, 6));
  CHECK(listed.payload_counts == fc3.payload_counts);
  CHECK(listed.unit_counts == fc3.unit_counts);
  CHECK(listed.plan.apply.gemm_flops == fc3.plan.apply.gemm_flops);
  CHECK(listed.planned[1][0][0].total() == fc3.planned[1][0][0].total());

  // Times come from each unit's own work: the toy unit's work is zero, Newton-Schulz's is
  // iteration flops times the assumed iterations.
  const kfac::MachineFigures m;
  CHECK(m.decomposition_seconds(model.layer("toy"), 0) == 0.0);
  CHECK(m.decomposition_seconds(fc2, 0) == Approx(m.newton_schulz_iterations * 4 * cube(5) / m.gemm_flops / m.float_speedup));
  CHECK(m.decomposition_seconds(fc1, 0) == Approx(m.eigen_seconds_per_n3 * cube(6) / m.float_speedup));
  // NG-SGD (a = 7 with the bias column, g = 5, ranks 2 and 2) states the GEMMs of its apply,
  // which every rank runs for its own gradient.
  const double ng = m.preconditioning_seconds(model.layer("ng"));
  CHECK(ng == Approx((4.0 * 7 * 5 * (2 + 2) + 2.0 * 2 * 2 * (7 + 5)) / m.gemm_flops / m.float_speedup));
  for (int world : {1, 3}) {
    const auto q = model.predict(world);
    double kronecker = 0;  // whole layers on one gradient worker each (COMM-OPT: every rank)
    for (const char* l : {"fc1", "fc2", "fc3"}) kronecker += m.preconditioning_seconds(model.layer(l));
    for (const auto& r : q.ranks) CHECK(r.preconditioning_seconds == Approx(kronecker + ng));
  }
  const auto p = model.predict(1, kfac::Options{}.with_inv_update_steps(1));
  CHECK(p.ranks[0].decomposition_n3 == Approx(cube(6) + cube(4) + cube(5) + cube(3) + cube(4) + cube(6) + 1.0));

  // Memory: what the preconditioner reports after two steps, layer by layer.
  Rng rng(9);
  for (int step = 0; step < 2; ++step) {
    auto x1 = random_view<float>(8, 5, rng), g1 = random_view<float>(8, 4, rng), w1 = random_view<float>(4, 5, rng);
    auto x2 = random_view<float>(8, 4, rng), g2 = random_view<float>(8, 3, rng), w2 = random_view<float>(3, 4, rng);
    auto x3 = random_view<float>(8, 3, rng), g3 = random_view<float>(8, 6, rng), w3 = random_view<float>(6, 3, rng);
    auto x4 = random_view<float>(8, 6, rng), g4 = random_view<float>(8, 5, rng), w4 = random_view<float>(5, 6, rng);
    auto x5 = random_view<float>(8, 5, rng), g5 = random_view<float>(8, 2, rng), w5 = random_view<float>(2, 5, rng);
    auto xb = random_view4<float>(8, 2, 2, 2, rng), gb = random_view4<float>(8, 2, 2, 2, rng);
    auto b1 = random_vector<float>(4, rng), b2 = random_vector<float>(3, rng), b3 = random_vector<float>(6, rng);
    auto b4 = random_vector<float>(5, rng), b5 = random_vector<float>(2, rng);
    auto gamma = random_vector<float>(2, rng), beta = random_vector<float>(2, rng);
    pre.observe_input("fc1", x1); pre.observe_output_grad("fc1", g1); pre.set_gradient("fc1", w1, b1);
    pre.observe_input("fc2", x2); pre.observe_output_grad("fc2", g2); pre.set_gradient("fc2", w2, b2);
    pre.observe_input("fc3", x3); pre.observe_output_grad("fc3", g3); pre.set_gradient("fc3", w3, b3);
    pre.observe_input("ng", x4); pre.observe_output_grad("ng", g4); pre.set_gradient("ng", w4, b4);
    pre.observe_input("toy", x5); pre.observe_output_grad("toy", g5); pre.set_gradient("toy", w5, b5);
    pre.observe_input("bn", xb); pre.observe_output_grad("bn", gb); pre.set_gradient("bn", gamma, beta);
    pre.step();
  }
  const auto got = pre.memory_report();
  REQUIRE(got.size() == p.ranks[0].memory.size());
  for (std::size_t l = 0; l < got.size(); ++l) {
    INFO("layer " << got[l].name);
    CHECK(p.ranks[0].memory[l].name == got[l].name);
    CHECK(p.ranks[0].memory[l].factor_bytes == got[l].factor_bytes);
    CHECK(p.ranks[0].memory[l].decomposition_bytes == got[l].decomposition_bytes);
    CHECK(p.ranks[0].memory[l].workspace_bytes == got[l].workspace_bytes);
  }
}

TEST_CASE("MEM-OPT holds one copy of each decomposition and of each intermediate product", "[cost_model][memory]") {
  const kfac::CostModel m(small_net());
  const auto one = m.predict(1, 1.0);
  // The g x a intermediate product of fc1 (4 x 6), fc2 (3 x 5) and conv (3 x 19), in double:
  // only the rank that preconditions a layer holds it; gradient in and out are on every rank.
  const std::size_t work = (4 * 6 + 3 * 5 + 3 * 19) * 8;
  for (int world : {2, 3, 4}) {
    const auto p = m.predict(world, 1.0 / world);
    const auto comm = m.predict(world, 1.0);
    std::size_t dec = 0, workspace = 0;
    for (const auto& r : p.ranks) {
      dec += r.decomposition_memory();
      workspace += r.workspace_memory();
      CHECK(r.factor_memory() == one.ranks[0].factor_memory());
      CHECK(r.workspace_memory() <= one.ranks[0].workspace_memory());
    }
    CHECK(dec == one.ranks[0].decomposition_memory());
    CHECK(workspace == std::size_t(world) * (one.ranks[0].workspace_memory() - work) + work);
    for (const auto& r : comm.ranks) CHECK(r.memory_bytes() == one.ranks[0].memory_bytes());
  }
}

TEST_CASE("ResNet-50 shapes", "[cost_model][resnet50]") {
  const auto net = kfac::shapes::resnet50();
  std::size_t convs = 0, bns = 0, params = 0;
  kfac::index_t largest = 0;
  for (const auto& s : net) {
    if (s.kronecker) {
      params += std::size_t(s.a_dim) * std::size_t(s.g_dim);
      largest = std::max({largest, s.a_dim, s.g_dim});
      convs += s.kind == std::string("conv2d");
    } else {
      params += 2 * std::size_t(s.channels);
      ++bns;
    }
  }
  CHECK(convs == 53);
  CHECK(bns == 53);
  CHECK(net.size() == 107);
  CHECK(params == 25557032);  // torchvision's resnet50 parameter count
  CHECK(largest == 4608);     // layer4 3x3 convs: 512 * 3 * 3
  CHECK(kfac::shapes::resnet50(false).size() == 54);
  // 1024 ranks: 54 layers cannot keep them busy; the largest layer bounds MEM-OPT.
  const auto p = kfac::CostModel(net).predict(1024, 1.0 / 1024);
  CHECK(p.decomposition_phase_seconds ==
        Approx(kfac::MachineFigures{}.eigen_seconds_per_n3 * (cube(4608) + cube(512))));
}

TEST_CASE("factor computation: a syrk per factor over this rank's share of the rows", "[cost_model][time]") {
  const double flops = 1e9;
  const auto figures =
      kfac::MachineFigures{}.with_gemm_flops(flops).with_latency(0).with_bandwidth(1e300).with_memory_bandwidth(1e300);
  auto syrk = [](double n) { return n * (n + 1); };  // flops per row
  const double per_row = syrk(785) + syrk(1024) + syrk(1025) + syrk(1024) + syrk(1025) + syrk(10);
  auto net = mlp();
  const kfac::CostModel plain(net, figures);
  for (auto& l : net) l.with_observation_rows(256);
  const kfac::CostModel m(net, figures);

  CHECK(plain.predict(1, 1.0).factor_compute_seconds == 0.0);
  CHECK(m.predict(1, 1.0).factor_compute_seconds == Approx(256 * per_row / flops));
  // the global batch split over the ranks, rounded up: 128 rows each on 2 ranks, 86 on 3
  for (int world : {2, 3, 4}) {
    const auto p = m.predict(world, 1.0);
    const double rows = double((256 + world - 1) / world);
    CHECK(p.factor_compute_seconds == Approx(rows * per_row / flops));
    for (const auto& r : p.ranks) CHECK(r.factor_seconds == Approx(rows * per_row / flops));
  }
  SECTION("step_seconds: factors and their averaging per factor update, decompositions per decomposition step") {
    const auto o = kfac::Options{}.with_factor_update_steps(2L).with_inv_update_steps(10L);
    const auto p = m.predict(2, o), q = plain.predict(2, o);
    CHECK(p.step_seconds() == Approx((p.factor_compute_seconds + p.factor_comm_seconds) / 2 +
                                     p.decomposition_phase_seconds / 10 + p.preconditioning_phase_seconds +
                                     p.gradient_pass_seconds));
    CHECK(p.step_seconds() - q.step_seconds() == Approx(p.factor_compute_seconds / 2));
    CHECK(p.decomposition_phase_seconds == q.decomposition_phase_seconds);
  }
  SECTION("diagonal factors, float factors, BatchNorm and skipped layers") {
    std::vector<kfac::LayerShape> v{
        kfac::LayerShape::of<kfac::Dense, kfac::Diagonal>("diag", kfac::Dense(5, 4)).with_observation_rows(10),
        kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::Precision<float>>(
            "single", kfac::Dense(5, 4))
            .with_observation_rows(10),
        kfac::LayerShape::of("bn", kfac::BatchNorm2d(3)).with_observation_rows(10),
        kfac::LayerShape::of("skipped", kfac::Dense(5, 4)).with_observation_rows(10)};
    const auto f = kfac::MachineFigures(figures).with_float_speedup(2.0);  // memory: free
    const auto p = kfac::CostModel(v, f).predict(1, kfac::Options{}.with_skip_layers({"skipped"}));
    CHECK(p.factor_compute_seconds == Approx(10 * (2.0 * (6 + 4) + (syrk(6) + syrk(4)) / 2) / flops));
  }
  SECTION("forming the rows: a + g values per row, read and written once") {
    const double bw = 1e8;
    const auto p = kfac::CostModel(net, kfac::MachineFigures(figures).with_memory_bandwidth(bw)).predict(2, 1.0);
    const double values = 785 + 1024 + 1025 + 1024 + 1025 + 10;
    CHECK(p.factor_compute_seconds == Approx(128 * (per_row / flops + 2 * 8 * values / bw)));
  }
  CHECK_THROWS_WITH(kfac::LayerShape::of("fc", kfac::Dense(5, 4)).with_observation_rows(-1), Catch::Contains("fc"));
}

TEST_CASE("gradient passes: every rank loads, clips and writes back every layer's whole gradient", "[cost_model][time]") {
  // 6 passes over g x a values with KL clipping (load: read + write; inner product: 2 reads;
  // write-back: read + write), 4 without, in the decomposition's scalar, on every rank at every
  // world size and strategy; skipped layers and closed forms (BatchNorm) add nothing.
  const double bw = 1e10;
  const auto figures = kfac::MachineFigures{}.with_memory_bandwidth(bw);
  auto net = mlp();
  net.push_back(kfac::LayerShape::of("bn", kfac::BatchNorm2d(64)));
  const double values = 1024.0 * 785 + 1024.0 * 1025 + 10.0 * 1025;
  const kfac::CostModel m(net, figures);
  for (int world : {1, 2, 4})
    for (double f : {1.0, 1.0 / world}) {
      CHECK(m.predict(world, f).gradient_pass_seconds ==
            Approx(6 * values * 8 / bw));
      CHECK(m.predict(world, kfac::Options{}.with_kl_clip(0.0), kfac::Kaisa{}.with_grad_worker_fraction(f))
                .gradient_pass_seconds ==
            Approx(4 * values * 8 / bw));
    }
  const auto p = m.predict(2, kfac::Options{}.with_skip_layers({"fc2"}));
  CHECK(p.gradient_pass_seconds == Approx(6 * (values - 1024.0 * 1025) * 8 / bw));
  const auto single = kfac::CostModel({kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::Precision<float>>(
                                          "fc", kfac::Dense(784, 256))},
                                      figures)
                          .predict(1, kfac::Options{});
  CHECK(single.gradient_pass_seconds == Approx(6 * 256.0 * 785 * 4 / bw));
  CHECK(single.step_seconds() == Approx(single.decomposition_phase_seconds / double(single.inv_interval) +
                                        single.preconditioning_phase_seconds + single.gradient_pass_seconds));
}

TEST_CASE("measure_machine_figures times the library's own calls", "[cost_model][calibration]") {
  // One process: compute and memory figures measured (positive, finite, plausible against a
  // timed GEMM of another size), communication figures left at their defaults.
  const auto f = kfac::measure_machine_figures(Host(), kfac::SerialComm(), 128, 2);
  for (double v : {f.eigen_seconds_per_n3, f.cholesky_seconds_per_n3, f.gemm_flops, f.float_speedup, f.memory_bandwidth}) {
    CHECK(std::isfinite(v));
    CHECK(v > 0);
  }
  CHECK(f.latency == kfac::MachineFigures{}.latency);
  CHECK(f.bandwidth == kfac::MachineFigures{}.bandwidth);
  CHECK_THROWS_WITH(kfac::measure_machine_figures(Host(), kfac::SerialComm(), 8), Catch::Contains("n >= 64"));
}

TEST_CASE("bad inputs raise kfac::Error", "[cost_model][errors]") {
  const kfac::CostModel m(small_net());
  CHECK_THROWS_AS(m.predict(0, 1.0), kfac::Error);
  CHECK_THROWS_WITH(m.predict(4, 0.75), Catch::Contains("does not divide"));
  CHECK_THROWS_WITH(m.predict(4, 0.1), Catch::Contains("grad_worker_fraction"));
  kfac::LayerShape bad = kfac::LayerShape::of("fc", kfac::Dense(5, 4));
  bad.a_dim = 0;
  CHECK_THROWS_WITH(kfac::CostModel({bad}), Catch::Contains("fc"));
}

TEST_CASE("group layouts: every receiver group holds one member of every worker group", "[cost_model][assignment]") {
  const auto net = mlp();
  for (auto layout : {kfac::GroupLayout::contiguous_receivers, kfac::GroupLayout::contiguous_workers}) {
    const kfac::WorkAssignment w(8, 0.5, std::vector<std::vector<double>>(net.size(), {1.0, 2.0}), false, layout);
    REQUIRE(w.grad_workers() == 4);
    REQUIRE(w.worker_groups() == 2);
    std::vector<int> seen(8, 0);
    for (int k = 0; k < 2; ++k)
      for (int j = 0; j < 4; ++j) {
        const int r = w.rank_of(k, j);
        ++seen[std::size_t(r)];
        CHECK(w.worker_group_of(r) == k);
        CHECK(w.receiver_group_of(r) == j);
      }
    for (int c : seen) CHECK(c == 1);
    // contiguous_receivers: a receiver group is consecutive ranks; contiguous_workers: a worker group is.
    if (layout == kfac::GroupLayout::contiguous_receivers) {
      CHECK(w.rank_of(1, 0) == w.rank_of(0, 0) + 1);
    } else {
      CHECK(w.rank_of(0, 1) == w.rank_of(0, 0) + 1);
    }
    for (std::size_t l = 0; l < net.size(); ++l)
      for (int u = 0; u < 2; ++u) CHECK(w.is_grad_worker(l, w.decomposer(l, u)));
  }
}

TEST_CASE("the randomized low-rank decomposition states its own work", "[cost_model][shape]") {
  using R = kfac::RandomizedEigen<>;
  kfac::CostModel model;
  model.add("big", kfac::Dense(255, 300), kfac::KFAC<kfac::Symmetric, R>(R{}.with_rank(32).with_oversampling(8)));
  model.add("small", kfac::Dense(15, 10), kfac::KFAC<kfac::Symmetric, R>(R{}.with_rank(32)));
  const auto& big = model.layer("big");  // (add() may move the earlier descriptions)
  const auto& small = model.layer("small");
  // A = 256 (bias column), G = 300: l = 40 < n, GEMMs plus 2q + 4 = 6 small eighs of 40.
  CHECK(big.unit_costs[0].work.eigh_n3 == 6 * cube(40));
  CHECK(big.unit_costs[0].work.gemm_flops > 0);
  CHECK(big.unit_costs[0].flops < cube(256));  // about 0.7 n^3 at n = 256, r = 32
  CHECK(big.decomposition_buffer_counts(0) == std::vector<std::size_t>{256 * 32, 32, 1});
  CHECK(big.plan.apply.gemm_flops == 2.0 * (2.0 * 300 * 256 * 64 + 2.0 * 256 * 32 * 32));
  // Both factors smaller than the rank: Eigendecomposition's work.
  CHECK(small.unit_costs[0].work.eigh_n3 == cube(16));
  CHECK(small.plan.apply.gemm_flops == 4.0 * 10 * 16 * 26);
  const kfac::MachineFigures m;
  CHECK(m.decomposition_seconds(big, 0) < m.eigen_seconds_per_n3 * cube(256));
}

TEST_CASE("kfac::Independent states its cost: every rank computes everything, sends nothing", "[cost_model][policy]") {
  auto net = cost_model_net_shapes();
  for (auto& l : net) l.with_observation_rows(64);
  const kfac::CostModel m(net);
  for (const auto& opts : {kfac::Options{}, kfac::Options{}.with_skip_layers({"fc2", "batch_norm"})}) {
    const auto one = m.predict(1, opts);  // KAISA on one rank: every unit there
    for (int world : {1, 2, 3, 8}) {
      INFO("world " << world);
      const auto p = m.predict(world, opts, kfac::Independent{});
      CHECK(p.factor_collectives == 0);
      CHECK(p.factor_comm_seconds == 0);
      REQUIRE(p.ranks.size() == std::size_t(world));
      for (const auto& r : p.ranks) {
        CHECK(r.factor_bytes_sent + r.decomposition_bytes_sent + r.gradient_bytes_sent + r.staging_bytes == 0);
        CHECK(r.decomposition_seconds == one.ranks[0].decomposition_seconds);
        CHECK(r.decomposition_n3 == one.ranks[0].decomposition_n3);
        CHECK(r.preconditioning_seconds == Approx(one.ranks[0].preconditioning_seconds).epsilon(1e-12));
        CHECK(r.memory_bytes() == one.ranks[0].memory_bytes());
      }
      CHECK(p.decomposition_phase_seconds == one.ranks[0].decomposition_seconds);
      CHECK(p.gradient_pass_seconds == one.gradient_pass_seconds);
      CHECK(p.factor_compute_seconds > 0);
    }
  }
  CHECK(m.predict(2, kfac::Independent{}).max_bytes_per_step() == 0);
}

namespace {

/// A strategy of a test's own: rank 0 decomposes every unit and broadcasts it to every rank,
/// and every rank applies every layer; factors are not averaged.
struct RootDecomposes {
  using distribution_tag = void;
  int root = 0;
  template <class Sheet>
  void state_cost(Sheet& sheet) const {
    std::vector<int> all;
    for (int r = 0; r < sheet.world(); ++r) all.push_back(r);
    for (std::size_t l = 0; l < sheet.layers(); ++l)
      for (int u = 0; u < sheet.layer(l).decomposed_factors(); ++u) sheet.decompose(root, l, u);
    sheet.agree();
    for (std::size_t l = 0; l < sheet.layers(); ++l)
      for (int u = 0; u < sheet.layer(l).decomposed_factors(); ++u)
        for (std::size_t count : sheet.layer(l).decomposition_buffer_counts(u))
          sheet.share_decomposition(all, root, count * sheet.layer(l).decomposition_scalar);
    for (int r = 0; r < sheet.world(); ++r)
      for (std::size_t l = 0; l < sheet.layers(); ++l) sheet.precondition(r, l);
  }
};

}  // namespace

TEST_CASE("a policy states its own step; the model prices it on the machine", "[cost_model][policy]") {
  const kfac::MachineFigures figures;
  const kfac::CostModel m(mlp(), figures);
  const int world = 4;
  const auto p = m.predict(world, kfac::Options{}, RootDecomposes{});
  double decompose = 0, broadcasts = 0;
  std::size_t bytes = 0;
  for (const auto& l : m.layers())
    for (int u = 0; u < l.decomposed_factors(); ++u) {
      decompose += figures.decomposition_seconds(l, u);
      for (std::size_t count : l.decomposition_buffer_counts(u)) {
        bytes += count * l.decomposition_scalar;
        broadcasts += figures.collective_seconds(count * l.decomposition_scalar, world);
      }
    }
  CHECK(p.ranks[0].decomposition_seconds == Approx(decompose));
  CHECK(p.ranks[1].decomposition_seconds == 0);
  CHECK(p.ranks[0].decomposition_bytes_sent == bytes);
  CHECK(p.ranks[1].decomposition_bytes_sent == 0);
  // The others wait for rank 0 at the agreement; then the broadcasts follow one another.
  CHECK(p.decomposition_phase_seconds ==
        Approx(decompose + figures.allreduce_seconds(sizeof(long), world) + broadcasts).epsilon(1e-12));
  CHECK(p.factor_collectives == 0);
  // Every rank holds every layer unless the policy says otherwise: COMM-OPT's memory.
  CHECK(p.ranks[3].memory_bytes() == m.predict(world, 1.0).ranks[3].memory_bytes());
  // The sheet refuses events it cannot price.
  CHECK_THROWS_WITH(m.predict(world, kfac::Options{}, RootDecomposes{world}), Catch::Contains("outside the world"));
}
