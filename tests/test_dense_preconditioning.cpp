// Preconditioned gradients of Dense layers against the dense Kronecker solve in double.
#include <catch2/catch.hpp>
#include <kfac/kfac.hpp>

#include "reference.hpp"

using namespace kfac_test;

namespace {

template <class Scalar>
using V2 = Kokkos::View<Scalar**, Kokkos::LayoutRight, Kokkos::HostSpace>;

/// Runs one K-FAC step on a random dense layer and returns (A, G, X, V) in double.
template <class Scalar, class Factor, class Inverse, class Prec>
void check_dense(int in, int out, bool bias, int batch, double damping, double tol, bool kron_damping) {
  Rng rng(42 + in * 7 + out);
  kfac::Preconditioner<Scalar, Kokkos::DefaultHostExecutionSpace> pre(
      kfac::Options{}.with_damping(damping).with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::sum));
  pre.template register_layer<kfac::Dense, Factor, Inverse, Prec>("fc", kfac::Dense(in, out, bias));
  auto x = random_view<Scalar>(batch, in, rng);
  auto g = random_view<Scalar>(batch, out, rng);
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
  if (kron_damping) {
    expect = dense_kronecker_solve(a, gg, grad, damping);
  } else {
    const double s = std::sqrt(damping);
    const MatrixXd ia = (a + s * MatrixXd::Identity(a.rows(), a.cols())).inverse();
    const MatrixXd ig = (gg + s * MatrixXd::Identity(gg.rows(), gg.cols())).inverse();
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
    check_dense<double, kfac::Symmetric, kfac::Eigendecomposition<>, P>(7, 5, true, 16, 1e-3, 1e-10, true);
    check_dense<double, kfac::Full, kfac::Eigendecomposition<>, P>(9, 4, false, 6, 1e-2, 1e-10, true);
  }
  SECTION("double, portable Jacobi") {
    check_dense<double, kfac::Symmetric, kfac::Eigendecomposition<kfac::PortableBackend>, P>(7, 5, true, 16, 1e-3, 1e-10, true);
  }
  SECTION("float") {
    check_dense<float, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, true);
    check_dense<float, kfac::Symmetric, kfac::Eigendecomposition<kfac::PortableBackend>, kfac::SinglePrecision>(6, 5, true, 32, 1e-2, 1e-4, true);
    check_dense<float, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::MixedPrecision>(7, 5, true, 32, 1e-3, 1e-4, true);
  }
}

TEST_CASE("Cholesky and Newton-Schulz equal the factored damped inverse", "[inverse][cholesky][newton_schulz]") {
  using P = kfac::DoublePrecision;
  check_dense<double, kfac::Symmetric, kfac::Cholesky<>, P>(7, 5, true, 16, 1e-3, 1e-10, false);
  check_dense<double, kfac::Symmetric, kfac::Cholesky<kfac::PortableBackend>, P>(7, 5, true, 16, 1e-3, 1e-10, false);
  check_dense<double, kfac::Full, kfac::NewtonSchulz, P>(7, 5, true, 16, 1e-3, 1e-10, false);
  check_dense<float, kfac::Symmetric, kfac::Cholesky<>, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, false);
  check_dense<float, kfac::Symmetric, kfac::NewtonSchulz, kfac::SinglePrecision>(7, 5, true, 32, 1e-2, 1e-4, false);
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
  using L = kfac::KroneckerLayer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
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
