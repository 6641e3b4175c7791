// Preconditioned gradients of Dense layers against the dense Kronecker solve in double.
#include <catch2/catch.hpp>
#include <kfac/kfac.hpp>

#include "helpers.hpp"

using namespace kfac_test;

namespace {


/// The damping form of the reference: \f$(G \otimes A + \gamma I)^{-1}\f$, or factored,
/// \f$(G + \sqrt{\gamma}/\pi)^{-1} X (A + \pi\sqrt{\gamma})^{-1}\f$ with \f$\pi = 1\f$ or
/// \f$\pi\f$ from the traces (Martens & Grosse 2015, §6.3).
enum class Damping { kronecker, factored, pi };

/// Runs one K-FAC step on a random dense layer (output gradients times `g_scale`) and compares
/// the preconditioned gradient with the dense formula in double.
template <class Scalar, class Factor, class Inverse, class Prec>
void check_dense(int in, int out, bool bias, int batch, double damping, double tol, Damping form,
                 const Inverse& inverse = Inverse{}, double g_scale = 1.0) {
  Rng rng(42 + in * 7 + out);
  kfac::Preconditioner<Scalar, Kokkos::DefaultHostExecutionSpace> pre(
      kfac::Options{}.with_damping(damping).with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::sum));
  pre.register_layer("fc", kfac::Dense(in, out, bias), kfac::KFAC<Factor, Inverse, Prec>(inverse));
  auto x = random_view<Scalar>(batch, in, rng);
  auto g = random_view<Scalar>(batch, out, rng);
  for (int r = 0; r < batch; ++r)
    for (int c = 0; c < out; ++c) g(r, c) = Scalar(g_scale * double(g(r, c)));
  auto w = random_view<Scalar>(out, in, rng);
  auto b = random_vector<Scalar>(out, rng);
  // Reference factors from the definition.
  MatrixXd xa(batch, in + (bias ? 1 : 0));
  xa.leftCols(in) = to_eigen(x);
  if (bias) xa.col(in).setOnes();
  const MatrixXd a = xa.transpose() * xa / batch;
  const MatrixXd gm = to_eigen(g);
  const MatrixXd gg = gm.transpose() * gm / batch;
  MatrixXd grad(out, in + (bias ? 1 : 0));
  grad.leftCols(in) = to_eigen(w);
  if (bias) for (int i = 0; i < out; ++i) grad(i, in) = b(i);

  pre.observe_input("fc", x);
  pre.observe_output_grad("fc", g);
  if (bias) pre.set_gradient("fc", w, b); else pre.set_gradient("fc", w);
  pre.step();

  MatrixXd expect;
  if (form == Damping::kronecker) {
    expect = dense_kronecker_solve(a, gg, grad, damping);
  } else {
    const double pi = form == Damping::pi ? std::sqrt((a.trace() / double(a.rows())) / (gg.trace() / double(gg.rows()))) : 1.0;
    const double s = std::sqrt(damping);
    const MatrixXd ia = (a + pi * s * MatrixXd::Identity(a.rows(), a.cols())).inverse();
    const MatrixXd ig = (gg + s / pi * MatrixXd::Identity(gg.rows(), gg.cols())).inverse();
    expect = ig * grad * ia;
  }
  MatrixXd got(out, in + (bias ? 1 : 0));
  got.leftCols(in) = to_eigen(w);
  if (bias) for (int i = 0; i < out; ++i) got(i, in) = b(i);
  INFO("relative error " << rel_err(got, expect));
  CHECK(rel_err(got, expect) < tol);
}

}  // namespace

TEST_CASE("eigen method equals the dense Kronecker solve", "[inverse][eigen]") {
  using P = kfac::DoublePrecision;
  SECTION("double, LAPACK") {
    check_dense<double, kfac::Symmetric, kfac::Eigendecomposition<>, P>(7, 5, true, 16, 1e-3, 1e-10, Damping::kronecker);
    check_dense<double, kfac::Full, kfac::Eigendecomposition<>, P>(9, 4, false, 6, 1e-2, 1e-10, Damping::kronecker);
  }
  SECTION("double, portable Jacobi") {
    check_dense<double, kfac::Symmetric, kfac::Eigendecomposition<kfac::PortableBackend>, P>(7, 5, true, 16, 1e-3, 1e-10, Damping::kronecker);
  }
  SECTION("float") {
    check_dense<float, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, Damping::kronecker);
    check_dense<float, kfac::Symmetric, kfac::Eigendecomposition<kfac::PortableBackend>, kfac::SinglePrecision>(6, 5, true, 32, 1e-2, 1e-4, Damping::kronecker);
    check_dense<float, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::MixedPrecision>(7, 5, true, 32, 1e-3, 1e-4, Damping::kronecker);
  }
}

TEST_CASE("Cholesky and Newton-Schulz equal the pi-damped inverse", "[inverse][cholesky][newton_schulz][pi]") {
  using P = kfac::DoublePrecision;
  using Chol = kfac::Cholesky<>;
  using Portable = kfac::Cholesky<kfac::PortableBackend>;
  const Damping pi = Damping::pi;
  SECTION("pi-damping (the default)") {
    check_dense<double, kfac::Symmetric, Chol, P>(7, 5, true, 16, 1e-3, 1e-10, pi);
    check_dense<double, kfac::Symmetric, Portable, P>(7, 5, true, 16, 1e-3, 1e-10, pi);
    check_dense<double, kfac::Full, kfac::NewtonSchulz, P>(7, 5, true, 16, 1e-3, 1e-10, pi);
    check_dense<float, kfac::Symmetric, Chol, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, pi);
    check_dense<float, kfac::Symmetric, kfac::NewtonSchulz, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, pi);
  }
  SECTION("pi far from 1: output gradients 100x smaller than the inputs") {
    // pi ~ 100 here, so a damping with pi = 1 misses the reference by far more than the tolerance.
    check_dense<double, kfac::Symmetric, Chol, P>(7, 5, true, 16, 1e-2, 1e-10, pi, Chol{}, 1e-2);
    check_dense<double, kfac::Full, kfac::NewtonSchulz, P>(7, 5, true, 16, 1e-2, 1e-10, pi, kfac::NewtonSchulz{}, 1e-2);
    check_dense<float, kfac::Symmetric, Chol, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, pi, Chol{}, 1e-2);
  }
  SECTION("with_pi_damping(false): kfac 0.1's pi = 1") {
    const Damping one = Damping::factored;
    check_dense<double, kfac::Symmetric, Chol, P>(7, 5, true, 16, 1e-2, 1e-10, one, Chol{}.with_pi_damping(false), 1e-2);
    check_dense<double, kfac::Symmetric, Portable, P>(7, 5, true, 16, 1e-3, 1e-10, one, Portable{}.with_pi_damping(false));
    check_dense<double, kfac::Full, kfac::NewtonSchulz, P>(7, 5, true, 16, 1e-2, 1e-10, one,
                                                           kfac::NewtonSchulz{}.with_pi_damping(false), 1e-2);
    check_dense<float, kfac::Symmetric, Chol, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, one,
                                                                     Chol{}.with_pi_damping(false));
  }
}

TEST_CASE("pi-damping: pi from the traces, 1 for a zero or non-finite ratio", "[inverse][pi]") {
  CHECK(kfac::impl::pi_from_traces(8.0, 2, 1.0, 2) == Approx(std::sqrt(8.0)));
  CHECK(kfac::impl::pi_from_traces(6.0, 3, 8.0, 4) == 1.0);
  CHECK(kfac::impl::pi_from_traces(0.0, 3, 8.0, 4) == 1.0);
  CHECK(kfac::impl::pi_from_traces(1.0, 3, 0.0, 4) == 1.0);
  CHECK(kfac::Cholesky<>{}.settings() == "pi");
  CHECK(kfac::Cholesky<>{}.with_pi_damping(false).settings().empty());
  CHECK(kfac::NewtonSchulz{}.settings() == "pi");
  CHECK(kfac::NewtonSchulz{}.with_pi_damping(false).settings().empty());
  CHECK(kfac::NewtonSchulz{}.with_max_iterations(50).settings() == "it=50,tol=0.000000,pi");
}

TEST_CASE("symmetric factors expose their packed upper triangle", "[factor][symmetric]") {
  using Host = Kokkos::DefaultHostExecutionSpace;
  kfac::Preconditioner<double, Host> pre(kfac::Options{}.with_kl_clip(0.0));
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(4, 3));
  Rng rng(3);
  auto x = random_view<double>(5, 4, rng);
  auto g = random_view<double>(5, 3, rng);
  auto w = random_view<double>(3, 4, rng);
  auto b = random_vector<double>(3, rng);
  pre.observe_input("fc", x);
  pre.observe_output_grad("fc", g);
  pre.set_gradient("fc", w, b);
  pre.step();
  using L = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
                                 kfac::DoublePrecision, double, Host>;
  const auto& layer = pre.layer_as<L>("fc");
  const auto packed = layer.packed_factor(0);
  REQUIRE(packed.extent(0) == 5u * 6u / 2u);  // a_dim = 5 with the bias column
  // A = [x 1]^T [x 1] / 5 (loss reduction mean scales G only), packed column by column
  MatrixXd xa(5, 5);
  xa.leftCols(4) = to_eigen(x);
  xa.col(4).setOnes();
  const MatrixXd a = xa.transpose() * xa / 5.0;
  std::size_t k = 0;
  for (int j = 0; j < 5; ++j)
    for (int i = 0; i <= j; ++i, ++k) CHECK(packed(k) == Approx(a(i, j)).epsilon(1e-14));
}

TEST_CASE("eigenvalue refreshes stay within their tolerance of the factor, else decompose exactly", "[inverse][eigen][refresh]") {
  using Layer = KLayer<kfac::Dense>;
  auto make = [](double tau) {
    auto pre = std::make_unique<Pre>(plain_options(1e-2).with_factor_decay(0.9).with_inv_update_steps(1));
    pre->register_layer("fc", kfac::Dense(6, 4),
                        kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>>(kfac::Eigendecomposition<>{}.with_refresh_tolerance(tau)));
    return pre;
  };
  // The preconditioner a decomposition defines: Q diag(lambda) Q^T for each factor.
  auto reconstruct = [](const auto& f) {
    const MatrixXd q = to_eigen(f.q);
    Eigen::VectorXd l(q.cols());
    for (int i = 0; i < l.size(); ++i) l(i) = f.lambda(i);
    return MatrixXd(q * l.asDiagonal() * q.transpose());
  };
  for (double tau : {0.05, 0.3}) {
    auto pre = make(tau);
    double worst_bound = 0, worst_solve = 0;
    for (int t = 0; t < 80; ++t) {
      Rng rng(500 + t);
      DenseBatch batch(6, 4, true, 8, rng);
      const MatrixXd x = batch.gradient();
      batch.feed(*pre, "fc");
      pre->step();
      const auto& layer = pre->layer_as<Layer>("fc");
      const MatrixXd a = symmetric_from_upper(layer.factor_a()), g = symmetric_from_upper(layer.factor_g());
      const MatrixXd ra = reconstruct(*layer.decomposition_a()), rg = reconstruct(*layer.decomposition_g());
      worst_bound = std::max({worst_bound, (a - ra).norm() / (tau * a.norm()), (g - rg).norm() / (tau * g.norm())});
      worst_solve = std::max(worst_solve, rel_err(batch.gradient(), dense_kronecker_solve(ra, rg, x, 1e-2)));
    }
    const auto& layer = pre->layer_as<Layer>("fc");
    INFO("tau " << tau << ": worst ||F - Q diag(l) Q^T|| / (tau ||F||) " << worst_bound << ", A refreshed "
                << layer.decomposition_a()->refreshed << " of 80, G " << layer.decomposition_g()->refreshed);
    CHECK(worst_bound <= 1 + 1e-9);  // the stated bound
    CHECK(worst_solve < 1e-9);       // and it is what preconditions
    CHECK(layer.decomposition_a()->refreshed > 0);
    CHECK(layer.decomposition_a()->exact > 1);  // fell back when the basis had drifted
  }
  SECTION("a tolerance never met decomposes exactly, bit for bit") {
    auto pre = make(1e-12);
    Pre exact(plain_options(1e-2).with_factor_decay(0.9).with_inv_update_steps(1));
    exact.register_layer("fc", kfac::Dense(6, 4), kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>>{});
    for (int t = 0; t < 20; ++t) {
      Rng rng(500 + t);
      DenseBatch batch(6, 4, true, 8, rng);
      DenseBatch twin = batch.twin();
      batch.feed(*pre, "fc");
      twin.feed(exact, "fc");
      pre->step();
      exact.step();
      CHECK(same_bits(batch.w, twin.w));
    }
    CHECK(pre->layer_as<Layer>("fc").decomposition_a()->refreshed == 0);
    CHECK_THROWS_AS(kfac::Eigendecomposition<>{}.with_refresh_tolerance(1.0), kfac::Error);
  }
}

TEST_CASE("observations that are their own rows are read in place, with the bits of copied rows", "[factor][dense]") {
  // Dense without bias, double factors: the double input is rows_a itself and, under the sum
  // reduction, the double output gradient is rows_g itself, so the syrk reads the caller's
  // memory. Float observations of the same values (exact in double) are converted into copied
  // rows first. Both must give the same factors, bit for bit, over several steps and with a
  // second micro-batch (the input of step 1 comes in two halves).
  using Prec = kfac::Precision<double, double>;
  using Method = kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>, Prec>;
  const auto opts = kfac::Options{}.with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::sum);
  kfac::Preconditioner<double, Host> in_place(opts);
  kfac::Preconditioner<float, Host> copied(opts);
  const int in = 7, out = 5, batch = 6;
  in_place.register_layer("fc", kfac::Dense(in, out, false), Method{});
  copied.register_layer("fc", kfac::Dense(in, out, false), Method{});
  Rng rng(27);
  for (int step = 0; step < 3; ++step) {
    const auto xf = random_view<float>(batch, in, rng), gf = random_view<float>(batch, out, rng);
    V2<double> xd("x", batch, in), gd("g", batch, out);
    for (int r = 0; r < batch; ++r) {
      for (int c = 0; c < in; ++c) xd(r, c) = xf(r, c);
      for (int c = 0; c < out; ++c) gd(r, c) = gf(r, c);
    }
    if (step == 1) {
      const std::pair<int, int> half[2] = {{0, batch / 2}, {batch / 2, batch}};
      for (const auto& h : half) {
        in_place.observe_input("fc", Kokkos::subview(xd, h, Kokkos::ALL));
        copied.observe_input("fc", Kokkos::subview(xf, h, Kokkos::ALL));
        in_place.observe_output_grad("fc", Kokkos::subview(gd, h, Kokkos::ALL));
        copied.observe_output_grad("fc", Kokkos::subview(gf, h, Kokkos::ALL));
      }
    } else {
      in_place.observe_input("fc", xd);
      copied.observe_input("fc", xf);
      in_place.observe_output_grad("fc", gd);
      copied.observe_output_grad("fc", gf);
    }
    auto wd = random_view<double>(out, in, rng);
    V2<float> wf("w", out, in);
    in_place.set_gradient("fc", wd);
    copied.set_gradient("fc", wf);
    in_place.step();
    copied.step();
    const auto& a = in_place.layer_as<Method::block_type<kfac::Dense, double, Host>>("fc");
    const auto& b = copied.layer_as<Method::block_type<kfac::Dense, float, Host>>("fc");
    INFO("step " << step);
    CHECK(same_bits(a.factor_a(), b.factor_a()));
    CHECK(same_bits(a.factor_g(), b.factor_g()));
  }
}

namespace {
template <class T>
using V3 = Kokkos::View<T***, Kokkos::LayoutRight, Kokkos::HostSpace>;

V3<double> random_view3(int n, int t, int f, Rng& rng) {
  V3<double> v("rand3", n, t, f);
  for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = rng.uniform() - 0.5;
  return v;
}

/// Eschenhagen et al. (2023) in double, written from the per-token definitions: expand sums a a^T
/// over every (sample, token) and divides by N T, and g g^T over the same pairs divided by N;
/// reduce takes a_n = the token mean of (x, 1) and g_n = the token sum of g, each divided by N.
/// `batches` are micro-batches of one step (their normalizers add up); g is scaled by `scale(n)`.
struct TokenFactors {
  MatrixXd a, g;
  double a_norm = 0, g_norm = 0;
  void add(const V3<double>& x, const V3<double>& dy, bool bias, bool reduce, double scale) {
    const int n = int(x.extent(0)), t = int(x.extent(1)), in = int(x.extent(2)), out = int(dy.extent(2));
    if (a.size() == 0) a = MatrixXd::Zero(in + bias, in + bias), g = MatrixXd::Zero(out, out);
    for (int s = 0; s < n; ++s) {
      Eigen::VectorXd am = Eigen::VectorXd::Zero(in + bias), gs = Eigen::VectorXd::Zero(out);
      for (int k = 0; k < t; ++k) {
        Eigen::VectorXd av(in + bias), gv(out);
        for (int i = 0; i < in; ++i) av(i) = x(s, k, i);
        if (bias) av(in) = 1.0;
        for (int o = 0; o < out; ++o) gv(o) = scale * dy(s, k, o);
        if (reduce) {
          am += av / t;
          gs += gv;
        } else {
          a += av * av.transpose();
          g += gv * gv.transpose();
        }
      }
      if (reduce) {
        a += am * am.transpose();
        g += gs * gs.transpose();
      }
    }
    a_norm += reduce ? n : double(n) * t;
    g_norm += n;
  }
};
}  // namespace

TEST_CASE("Dense over tokens: expand and reduce factors and steps against per-token loops in double",
          "[dense][tokens]") {
  const int in = 3, out = 2, t = 4;
  for (const bool bias : {true, false})
    for (const bool reduce : {false, true})
      for (const auto reduction : {kfac::LossReduction::sum, kfac::LossReduction::mean}) {
        INFO("bias " << bias << " reduce " << reduce << " mean " << (reduction == kfac::LossReduction::mean));
        Rng rng(17 + 2 * bias + reduce);
        const double damping = 0.05;
        Pre pre(plain_options(damping).with_loss_reduction(reduction));
        const auto tokens = reduce ? kfac::Dense::Tokens::reduce : kfac::Dense::Tokens::expand;
        pre.register_layer("fc", kfac::Dense(in, out, bias).with_tokens(tokens));
        TokenFactors ref;
        for (const int n : {5, 3}) {  // two micro-batches in one step
          const auto x = random_view3(n, t, in, rng), dy = random_view3(n, t, out, rng);
          pre.observe_input("fc", x);
          pre.observe_output_grad("fc", dy);
          ref.add(x, dy, bias, reduce, reduction == kfac::LossReduction::mean ? double(n) : 1.0);
        }
        DenseBatch d(in, out, bias, 1, rng);
        pre.set_gradient("fc", d.w, d.b);
        const MatrixXd grad = d.gradient();
        pre.step();
        const auto& layer = pre.layer_as<KLayer<kfac::Dense>>("fc");
        const MatrixXd a = ref.a / ref.a_norm, g = ref.g / ref.g_norm;
        CHECK(rel_err(symmetric_from_upper(layer.factor_a()), a) < 1e-13);
        CHECK(rel_err(symmetric_from_upper(layer.factor_g()), g) < 1e-13);
        CHECK(rel_err(grad_with_bias(d.w, d.b), dense_kronecker_solve(a, g, grad, damping)) < 1e-10);
      }
}

TEST_CASE("Dense over one token equals Dense over samples, bit for bit", "[dense][tokens]") {
  for (const auto tokens : {kfac::Dense::Tokens::expand, kfac::Dense::Tokens::reduce}) {
    Rng rng(5);
    const auto x = random_view3(6, 1, 4, rng), dy = random_view3(6, 1, 3, rng);
    V2<double> x2(x.data(), 6, 4), dy2(dy.data(), 6, 3);
    DenseBatch d(4, 3, true, 1, rng);
    DenseBatch twin = d.twin();
    Pre seq(plain_options()), flat(plain_options());
    seq.register_layer("fc", kfac::Dense(4, 3).with_tokens(tokens));
    flat.register_layer("fc", kfac::Dense(4, 3));
    for (int step = 0; step < 3; ++step) {
      seq.observe_input("fc", x);
      seq.observe_output_grad("fc", dy);
      seq.set_gradient("fc", d.w, d.b);
      flat.observe_input("fc", x2);
      flat.observe_output_grad("fc", dy2);
      flat.set_gradient("fc", twin.w, twin.b);
      seq.step();
      flat.step();
    }
    CHECK(same_bits(d.w, twin.w));
    CHECK(same_bits(d.b, twin.b));
  }
}

TEST_CASE("Dense over tokens refuses mismatched token counts and widths by name", "[dense][tokens][errors]") {
  Rng rng(9);
  Pre pre(plain_options());
  pre.register_layer("fc", kfac::Dense(3, 2).with_tokens(kfac::Dense::Tokens::reduce));
  const auto x = random_view3(2, 4, 3, rng);
  pre.observe_input("fc", x);
  expect_error([&] { pre.observe_output_grad("fc", random_view3(2, 5, 2, rng)); }, "fc",
               {"(2, 5, 2)", "5 tokens per sample", "has 4"});
  expect_error([&] { pre.observe_input("fc", random_view3(2, 4, 2, rng)); }, "fc",
               {"(2, 4, 2)", "(batch, tokens, 3)"});
  // A (batch, 3, 1) sequence of one-feature tokens is not a (batch, 3) matrix.
  expect_error([&] { pre.observe_input("fc", random_view3(2, 3, 1, rng)); }, "fc", {"(2, 3, 1)"});
  Pre conv(plain_options());
  conv.register_layer("conv", kfac::Conv2d(3, 2, 1, 1));
  expect_error([&] { conv.observe_input("conv", random_view3(2, 3, 4, rng)); }, "conv", {"(2, 3, 4)"});
  // The refused observations changed nothing: the step uses the one good pair.
  pre.observe_output_grad("fc", random_view3(2, 4, 2, rng));
  DenseBatch d(3, 2, true, 1, rng);
  pre.set_gradient("fc", d.w, d.b);
  pre.step();
  CHECK(pre.layer_as<KLayer<kfac::Dense>>("fc").factor_a()(3, 3) == 1.0);
}
