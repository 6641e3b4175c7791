// kfac::Parameter under kfac::DiagonalFisher (the generic fallback): the running diagonal and the
// preconditioned step against a float64 reference built from per-sample gradients, under both loss
// reductions; refused input named with the state unchanged; checkpoints; the cost model.
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/planning/cost_model.hpp>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

using Block = kfac::DiagonalFisherBlock<kfac::DoublePrecision, double, Host>;
constexpr int kRows = 5, kCols = 3;

/// One step's data: N per-sample gradients (rows x cols each) and the batch gradient of the
/// reduced loss: their mean (LossReduction::mean) or their sum (sum).
struct Samples {
  std::vector<MatrixXd> per_sample;
  MatrixXd batch_gradient(bool mean) const {
    MatrixXd s = MatrixXd::Zero(kRows, kCols);
    for (const auto& g : per_sample) s += g;
    return mean ? MatrixXd(s / double(per_sample.size())) : s;
  }
  /// The reference statistic: (sum_n g_n)^2 / N, element-wise.
  MatrixXd fisher() const {
    const MatrixXd s = batch_gradient(false);
    return s.cwiseProduct(s) / double(per_sample.size());
  }
};

Samples make_samples(int n, Rng& rng) {
  Samples s;
  for (int k = 0; k < n; ++k) {
    MatrixXd g(kRows, kCols);
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kCols; ++j) g(i, j) = rng.uniform();
    s.per_sample.push_back(g);
  }
  return s;
}

V2<double> as_view(const MatrixXd& m) {
  V2<double> v("w", m.rows(), m.cols());
  for (int i = 0; i < m.rows(); ++i)
    for (int j = 0; j < m.cols(); ++j) v(i, j) = m(i, j);
  return v;
}

/// The sample count as the layer observes it: any tensor of batch n (here (n, 2)), split in
/// `parts` micro-batches.
void observe_samples(Pre& pre, const std::string& name, int n, int parts = 1) {
  for (int p = 0; p < parts; ++p) pre.observe_output_grad(name, V2<double>("count", n / parts, 2));
}

}  // namespace

TEST_CASE("DiagonalFisher: the diagonal and the step against per-sample gradients in double",
          "[generic_diagonal]") {
  for (const bool mean : {true, false})
    for (const int parts : {1, 2}) {
      INFO("loss reduction " << (mean ? "mean" : "sum") << ", micro-batches " << parts);
      const double damping = 0.03, decay = 0.8;
      Pre pre(kfac::Options{}.with_damping(damping).with_kl_clip(0.0).with_factor_decay(decay).with_loss_reduction(
          mean ? kfac::LossReduction::mean : kfac::LossReduction::sum));
      pre.register_layer("p", kfac::Parameter(kRows, kCols));  // DiagonalFisher<> by default
      Rng rng(7);
      MatrixXd f;
      for (int step = 0; step < 4; ++step) {
        const Samples s = make_samples(6, rng);
        const MatrixXd fhat = s.fisher();
        f = step == 0 ? fhat : MatrixXd(decay * f + (1 - decay) * fhat);
        const MatrixXd x = s.batch_gradient(mean);
        const MatrixXd expect = x.array() / (f.array() + damping);
        observe_samples(pre, "p", 6, parts);
        auto w = as_view(x);
        pre.set_gradient("p", w);
        pre.step();
        const auto& block = pre.layer_as<Block>("p");
        double worst = 0, worst_f = 0;
        for (int i = 0; i < kRows; ++i)
          for (int j = 0; j < kCols; ++j) {
            worst = std::max(worst, std::abs(w(i, j) - expect(i, j)) / std::abs(expect(i, j)));
            worst_f = std::max(worst_f, std::abs(block.diagonal()(i * kCols + j) - f(i, j)) / f(i, j));
          }
        CHECK(worst < 1e-13);
        CHECK(worst_f < 1e-13);
      }
    }
}

TEST_CASE("DiagonalFisher: refused input is named and leaves the state unchanged", "[generic_diagonal][errors]") {
  Pre pre(plain_options());
  pre.register_layer("p", kfac::Parameter(kRows, kCols));
  Rng rng(3);
  const Samples s = make_samples(4, rng);
  observe_samples(pre, "p", 4);
  auto w = as_view(s.batch_gradient(false));
  pre.set_gradient("p", w);
  pre.step();
  const auto& block = pre.layer_as<Block>("p");
  const auto before = clone(block.diagonal());

  // a statistics step without the sample count
  auto w2 = as_view(s.batch_gradient(false));
  pre.set_gradient("p", w2);
  expect_error([&] { pre.step(); }, "p", {"no observations were given", "first extent is the batch"});
  // a gradient of the wrong shape
  V2<double> wrong("wrong", kCols, kRows);
  expect_error([&] { pre.set_gradient("p", wrong); }, "p", {"weight gradient has shape", "expected 5 x 3"});
  // a non-finite gradient (NonFinitePolicy::raise)
  w2(1, 2) = std::nan("");
  observe_samples(pre, "p", 4);
  pre.set_gradient("p", w2);
  expect_error([&] { pre.step(); }, "p", {"NaN/Inf"});
  // an input and a sample count that disagree on the batch
  pre.observe_input("p", V1<double>("in", 4));
  expect_error([&] { pre.observe_output_grad("p", V1<double>("count", 3)); }, "p", {"differs from the batch"});
  CHECK(pre.step_count() == 1);
  CHECK(same_bits(before, block.diagonal()));
  CHECK_THROWS_AS(kfac::Parameter(0, 3), kfac::Error);
}

TEST_CASE("DiagonalFisher: a checkpoint round trip resumes bit for bit", "[generic_diagonal][checkpoint]") {
  Rng rng(12);
  auto make = [] {
    auto p = std::make_unique<Pre>(kfac::Options{}.with_damping(0.01).with_factor_decay(0.9));
    p->register_layer("p", kfac::Parameter(kRows, kCols), kfac::DiagonalFisher<>{});
    p->register_layer("fc", kfac::Dense(kCols, kRows, false));
    return p;
  };
  auto feed = [](Pre& p, V2<double>& w, V2<double>& fc) {
    observe_samples(p, "p", 6);
    p.observe_input("fc", V2<double>("x", 6, kCols));
    p.observe_output_grad("fc", V2<double>("g", 6, kRows));
    p.set_gradient("p", w);
    p.set_gradient("fc", fc);
    p.step();
  };
  auto a = make();
  for (int step = 0; step < 3; ++step) {
    const Samples s = make_samples(6, rng);
    auto w = as_view(s.batch_gradient(true)), fc = as_view(s.batch_gradient(false));
    feed(*a, w, fc);
  }
  std::stringstream bytes;
  a->save(bytes);
  auto b = make();
  REQUIRE(b->load(bytes));
  CHECK(same_bits(a->layer_as<Block>("p").diagonal(), b->layer_as<Block>("p").diagonal()));
  const Samples s = make_samples(6, rng);
  auto wa = as_view(s.batch_gradient(true)), wb = clone(wa);
  auto fa = as_view(s.batch_gradient(false)), fb = clone(fa);
  feed(*a, wa, fa);
  feed(*b, wb, fb);
  CHECK(same_bits(wa, wb));
  CHECK(same_bits(a->layer_as<Block>("p").diagonal(), b->layer_as<Block>("p").diagonal()));
}

TEST_CASE("DiagonalFisher: the cost model prices the block from its description", "[generic_diagonal][cost_model]") {
  const kfac::index_t rows = 300, cols = 40;
  const auto s = kfac::LayerShape::of("p", kfac::Parameter(rows, cols));
  CHECK(s.kind == "parameter");
  CHECK_FALSE(s.kronecker);
  CHECK(s.g_dim == rows);
  CHECK(s.a_dim == cols);
  CHECK(s.factor_payload_counts() == std::vector<std::size_t>{std::size_t(rows * cols)});
  CHECK(s.decomposed_factors() == 0);
  CHECK(s.plan.apply.stream_bytes == double(rows * cols) * 24);
  const auto p = kfac::CostModel(std::vector<kfac::LayerShape>{s}).predict(2, 1.0);
  CHECK(p.ranks[0].factor_bytes_sent == 2 * 8 * std::size_t(rows * cols));  // the allreduce of f
  CHECK(p.gradient_pass_seconds > 0);
  CHECK(p.preconditioning_phase_seconds > 0);

  // Memory: what a real Preconditioner reports after two steps.
  const auto opts = plain_options();
  Pre pre(opts);
  pre.register_layer("p", kfac::Parameter(kRows, kCols));
  kfac::CostModel model;
  model.add("p", kfac::Parameter(kRows, kCols), kfac::DiagonalFisher<>{});
  Rng rng(9);
  for (int step = 0; step < 2; ++step) {
    auto w = random_view<double>(kRows, kCols, rng);
    observe_samples(pre, "p", 4);
    pre.set_gradient("p", w);
    pre.step();
  }
  const auto got = pre.memory_report();
  const auto& mem = model.predict(1, opts).ranks[0].memory;
  REQUIRE(got.size() == 1);
  CHECK(mem[0].factor_bytes == got[0].factor_bytes);
  CHECK(mem[0].decomposition_bytes == got[0].decomposition_bytes);
  CHECK(mem[0].workspace_bytes == got[0].workspace_bytes);
  CHECK(got[0].factor_bytes == kRows * kCols * 8);
}
