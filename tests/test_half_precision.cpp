// Half-precision factor storage (kfac::Half, Precision<Half, float>): the binary16 conversions
// against their definition, the stored running average against a double recurrence over
// hundreds of updates, preconditioning against the dense solve on the stored factors,
// overflow refusal, memory, checkpoints.
#include <catch2/catch.hpp>
#include <kfac/kfac.hpp>
#include <kfac/planning/cost_model.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "helpers.hpp"
#include "reference.hpp"

using namespace kfac_test;

namespace {

using Host = Kokkos::DefaultHostExecutionSpace;
using HalfPre = kfac::Preconditioner<float, Host>;

/// The value of binary16 bits from the definition: (-1)^s 2^(e-15) (1 + m/1024), subnormals
/// 2^-14 (m/1024).
double half_value(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL;
  return s ? -v : v;
}

std::uint16_t bits_of(float f) { return kfac::impl::to_half_bits(f); }

}  // namespace

TEST_CASE("binary16 conversions follow the IEEE definition", "[half][conversion]") {
  SECTION("every bit pattern converts to float exactly and back") {
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const auto h = std::uint16_t(b);
      const float f = kfac::impl::from_half_bits(h);
      const double want = half_value(h);
      INFO("bits " << b);
      if (std::isnan(want)) {
        CHECK(std::isnan(f));
        CHECK((bits_of(f) & 0x7C00u) == 0x7C00u);
        CHECK((bits_of(f) & 0x3FFu) != 0);  // still a NaN
      } else {
        CHECK(double(f) == want);
        CHECK(bits_of(f) == h);
      }
    }
  }
  SECTION("floats round to the nearest half, ties to even") {
    long checked = 0;
    for (std::uint16_t h = 0; h < 0x7BFF; ++h) {  // neighbours h, h + 1, both finite, positive
      const float lo = kfac::impl::from_half_bits(h), hi = kfac::impl::from_half_bits(std::uint16_t(h + 1));
      const float mid = float((double(lo) + double(hi)) / 2);  // exact: 12 significant bits
      const std::uint16_t even = (h & 1) ? std::uint16_t(h + 1) : h;
      INFO("between bits " << h << " and " << h + 1);
      CHECK(bits_of(mid) == even);
      CHECK(bits_of(std::nextafter(mid, 0.0f)) == h);
      CHECK(bits_of(std::nextafter(mid, 1e30f)) == h + 1);
      CHECK(bits_of(-mid) == (even | 0x8000u));
      checked += 4;
    }
    CHECK(checked > 100000);
  }
  SECTION("range ends") {
    CHECK(bits_of(65504.0f) == 0x7BFFu);
    CHECK(bits_of(std::nextafter(65520.0f, 0.0f)) == 0x7BFFu);  // below the tie: the largest finite
    CHECK(bits_of(65520.0f) == 0x7C00u);                        // the tie rounds to even: infinity
    CHECK(bits_of(1e30f) == 0x7C00u);
    CHECK(bits_of(-HUGE_VALF) == 0xFC00u);
    CHECK(bits_of(std::ldexp(1.0f, -25)) == 0);  // half the smallest subnormal: tie to even zero
    CHECK(bits_of(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 1);
    CHECK(bits_of(std::ldexp(1.0f, -26)) == 0);
    CHECK(bits_of(-0.0f) == 0x8000u);
    CHECK(bits_of(std::ldexp(1.0f, -14)) == 0x0400u);  // the smallest normal
    CHECK(kfac::Half(3.0f) == 3.0f);
  }
  SECTION("the checkpoint check knows binary16 infinities and NaN") {
    const std::uint16_t ok[3] = {0x7BFF, 0x0001, 0x8000}, inf[2] = {0x3C00, 0x7C00}, nan[2] = {0xFE00, 0x0000};
    CHECK(kfac::impl::all_finite(reinterpret_cast<const char*>(ok), 3, 2));
    CHECK(!kfac::impl::all_finite(reinterpret_cast<const char*>(inf), 2, 2));
    CHECK(!kfac::impl::all_finite(reinterpret_cast<const char*>(nan), 2, 2));
  }
}

namespace {

using HalfLayer = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::HalfPrecision,
                                       float, Host>;
using FloatLayer = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
                                        kfac::SinglePrecision, float, Host>;

template <class Prec, class Inverse = kfac::Eigendecomposition<>>
void register_fc(HalfPre& pre, int in, int out) {
  pre.register_layer<kfac::Dense, kfac::Symmetric, Inverse, Prec>("fc", kfac::Dense(in, out, true));
}

/// One step of fc with the given batch; returns the preconditioned [W b] in double.
MatrixXd step_fc(HalfPre& pre, const V2<float>& x, const V2<float>& g, const V2<float>& w0, const V1<float>& b0) {
  auto w = clone(w0);
  auto b = clone(b0);
  pre.observe_input("fc", x);
  pre.observe_output_grad("fc", g);
  pre.set_gradient("fc", w, b);
  pre.step();
  MatrixXd m(w.extent(0), w.extent(1) + 1);
  for (int i = 0; i < int(w.extent(0)); ++i) {
    for (int j = 0; j < int(w.extent(1)); ++j) m(i, j) = w(i, j);
    m(i, w.extent(1)) = b(i);
  }
  return m;
}

/// [x 1]^T [x 1] / n and g^T g / n in double (the new statistics of one step, loss sum).
MatrixXd gram_a(const V2<float>& x) {
  const int n = int(x.extent(0)), c = int(x.extent(1));
  MatrixXd xa(n, c + 1);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < c; ++j) xa(i, j) = x(i, j);
    xa(i, c) = 1;
  }
  return xa.transpose() * xa / n;
}
MatrixXd gram_g(const V2<float>& g) {
  MatrixXd m = to_eigen(g);
  return m.transpose() * m / double(g.extent(0));
}

}  // namespace

TEST_CASE("half factors track the running average within one rounding per update", "[half][factors][long]") {
  // 400 updates with decay 0.95 and inputs whose scale drifts: each stored entry is rounded once
  // per update, so |stored - exact| <= sum_k decay^(t-k) (2^-11 |stored_k| + float error_k); the
  // bound is replayed entry by entry next to the double recurrence.
  const int in = 10, out = 6, batch = 16, steps = 400;
  const double decay = 0.95, u = std::ldexp(1.0, -11), float_rel = 4e-6;
  HalfPre pre(plain_options(1e-2).with_factor_decay(decay).with_inv_update_steps(50));
  register_fc<kfac::HalfPrecision>(pre, in, out);
  Rng rng(7);
  MatrixXd ref_a, ref_g, bound_a, bound_g;
  double max_rel_a = 0;
  for (int t = 0; t < steps; ++t) {
    auto x = random_view<float>(batch, in, rng);
    auto g = random_view<float>(batch, out, rng);
    const float scale = 1.0f + 0.5f * float(std::sin(0.05 * t));
    for (std::size_t i = 0; i < x.span(); ++i) x.data()[i] *= scale;
    auto w = random_view<float>(out, in, rng);
    auto b = random_vector<float>(out, rng);
    step_fc(pre, x, g, w, b);
    const MatrixXd na = gram_a(x), ng = gram_g(g);
    const MatrixXd abs_a = na.cwiseAbs(), abs_g = ng.cwiseAbs();  // bounds |R|^T|R| for the float error
    const auto& layer = pre.layer_as<HalfLayer>("fc");
    const MatrixXd got_a = symmetric_from_upper(layer.factor_a()), got_g = symmetric_from_upper(layer.factor_g());
    if (t == 0) {
      ref_a = na;
      ref_g = ng;
      bound_a = u * got_a.cwiseAbs() + float_rel * in * abs_a;
      bound_g = u * got_g.cwiseAbs() + float_rel * out * abs_g;
    } else {
      ref_a = decay * ref_a + (1 - decay) * na;
      ref_g = decay * ref_g + (1 - decay) * ng;
      bound_a = decay * bound_a + u * got_a.cwiseAbs() + float_rel * (in * (1 - decay) * abs_a + ref_a.cwiseAbs());
      bound_g = decay * bound_g + u * got_g.cwiseAbs() + float_rel * (out * (1 - decay) * abs_g + ref_g.cwiseAbs());
    }
    const MatrixXd err_a = (got_a - ref_a).cwiseAbs(), err_g = (got_g - ref_g).cwiseAbs();
    INFO("update " << t);
    REQUIRE((err_a.array() <= bound_a.array()).all());
    REQUIRE((err_g.array() <= bound_g.array()).all());
    max_rel_a = std::max(max_rel_a, rel_err(got_a, ref_a));
  }
  // The storage really is binary16: errors far above float's, yet the average still tracks.
  CHECK(max_rel_a > 1e-4);
  CHECK(max_rel_a < 2e-2);
  const auto& layer = pre.layer_as<HalfLayer>("fc");
  CHECK(sizeof(*layer.factor_a().data()) == 2);
  const auto r = pre.memory_report()[0];
  CHECK(r.factor_bytes == ((in + 1) * (in + 1) + out * out) * 2);
}

TEST_CASE("preconditioning with half factors equals the dense solve on the stored factors", "[half][inverse]") {
  const int in = 9, out = 5, batch = 24;
  for (int method = 0; method < 2; ++method) {
    INFO((method == 0 ? "eigen" : "cholesky"));
    const double damping = 1e-2;
    HalfPre pre(plain_options(damping).with_inv_update_steps(1).with_factor_update_steps(1));
    if (method == 0) register_fc<kfac::HalfPrecision>(pre, in, out);
    else register_fc<kfac::HalfPrecision, kfac::Cholesky<>>(pre, in, out);
    Rng rng(11 + method);
    MatrixXd got, a, g, grad;
    for (int t = 0; t < 3; ++t) {
      auto x = random_view<float>(batch, in, rng);
      auto gy = random_view<float>(batch, out, rng);
      auto w = random_view<float>(out, in, rng);
      auto b = random_vector<float>(out, rng);
      got = step_fc(pre, x, gy, w, b);
      grad = MatrixXd(out, in + 1);
      for (int i = 0; i < out; ++i) {
        for (int j = 0; j < in; ++j) grad(i, j) = w(i, j);
        grad(i, in) = b(i);
      }
    }
    using L = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::HalfPrecision, float, Host>;
    const MatrixXd fa = method == 0 ? symmetric_from_upper(pre.layer_as<HalfLayer>("fc").factor_a())
                                    : symmetric_from_upper(pre.layer_as<L>("fc").factor_a());
    const MatrixXd fg = method == 0 ? symmetric_from_upper(pre.layer_as<HalfLayer>("fc").factor_g())
                                    : symmetric_from_upper(pre.layer_as<L>("fc").factor_g());
    MatrixXd expect;
    if (method == 0) {
      expect = dense_kronecker_solve(fa, fg, grad, damping);
    } else {
      // pi-damping (the default of Cholesky<>), pi from the stored factors' traces
      const double s = std::sqrt(damping);
      const double pi = std::sqrt((fa.trace() / double(in + 1)) / (fg.trace() / double(out)));
      expect = (fg + s / pi * MatrixXd::Identity(out, out)).inverse() * grad *
               (fa + pi * s * MatrixXd::Identity(in + 1, in + 1)).inverse();
    }
    INFO("relative error " << rel_err(got, expect));
    CHECK(rel_err(got, expect) < 1e-4);
  }
}

TEST_CASE("half factors that would overflow binary16 are refused with the layer's name", "[half][errors]") {
  const int in = 4, out = 3, batch = 8;
  HalfPre pre(plain_options(1e-2));
  register_fc<kfac::HalfPrecision>(pre, in, out);
  Rng rng(3);
  auto x = random_view<float>(batch, in, rng);
  auto g = random_view<float>(batch, out, rng);
  auto w = random_view<float>(out, in, rng);
  auto b = random_vector<float>(out, rng);
  step_fc(pre, x, g, w, b);
  const auto& layer = pre.layer_as<HalfLayer>("fc");
  const MatrixXd before = symmetric_from_upper(layer.factor_a());
  for (std::size_t i = 0; i < x.span(); ++i) x.data()[i] *= 400.0f;  // x^2 ~ 1e5 > 65504
  const std::string msg = expect_error([&] { step_fc(pre, x, g, w, b); }, "fc", {"overflow the factor type"});
  CHECK(msg.find("65504") != std::string::npos);
  CHECK(symmetric_from_upper(layer.factor_a()) == before);
}

TEST_CASE("a run with half factors resumes from a checkpoint bit for bit", "[half][checkpoint]") {
  const int in = 6, out = 4, batch = 12;
  auto run = [&](HalfPre& pre, int from, int to) {
    std::vector<MatrixXd> r;
    for (int t = from; t < to; ++t) {
      Rng rng(100 + t);
      auto x = random_view<float>(batch, in, rng);
      auto g = random_view<float>(batch, out, rng);
      auto w = random_view<float>(out, in, rng);
      auto b = random_vector<float>(out, rng);
      r.push_back(step_fc(pre, x, g, w, b));
    }
    return r;
  };
  auto options = [] { return plain_options(1e-2).with_factor_decay(0.9).with_inv_update_steps(3); };
  HalfPre whole(options());
  register_fc<kfac::HalfPrecision>(whole, in, out);
  const auto expected = run(whole, 0, 10);
  HalfPre first(options());
  register_fc<kfac::HalfPrecision>(first, in, out);
  run(first, 0, 5);
  std::stringstream ckpt;
  first.save(ckpt);
  HalfPre resumed(options());
  register_fc<kfac::HalfPrecision>(resumed, in, out);
  CHECK(resumed.load(ckpt));
  const auto rest = run(resumed, 5, 10);
  for (int k = 0; k < 5; ++k) CHECK(rest[k] == expected[5 + k]);
  CHECK(same_bits(resumed.layer_as<HalfLayer>("fc").factor_a(), whole.layer_as<HalfLayer>("fc").factor_a()));

  // A checkpoint of float factors is refused by a half layer (sizes differ), changing nothing.
  HalfPre single(options());
  register_fc<kfac::SinglePrecision>(single, in, out);
  run(single, 0, 2);
  std::stringstream other;
  single.save(other);
  HalfPre target(options());
  register_fc<kfac::HalfPrecision>(target, in, out);
  run(target, 0, 2);
  const MatrixXd before = symmetric_from_upper(target.layer_as<HalfLayer>("fc").factor_a());
  CHECK_THROWS_AS(target.load(other), kfac::Error);
  CHECK(symmetric_from_upper(target.layer_as<HalfLayer>("fc").factor_a()) == before);
}

TEST_CASE("the cost model counts half factors at two bytes", "[half][cost_model]") {
  const auto h = kfac::LayerShape::of<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::HalfPrecision>(
      "fc", kfac::Dense(9, 5, true));
  CHECK(h.factor_scalar == 2);
  CHECK(h.decomposition_scalar == 4);
  CHECK(h.planned[1][0][0].factor_bytes == (10 * 10 + 5 * 5) * 2);
}
