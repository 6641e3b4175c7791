// kfac::RandomizedEigen (randomized_eigen.hpp): exact layers equal Eigendecomposition; low-rank
// layers equal a dense double solve with the operator built from the returned U, Lambda, c;
// factors of known spectrum are recovered within stated bounds; warm starts keep an exact basis
// and follow a rotated one; long runs are finite, repeatable and resume from checkpoints bit for bit.
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <Eigen/QR>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

using RE = kfac::RandomizedEigen<>;
using Fact = RE::Factorization<double, Host>;
using DMat = kfac::impl::Matrix<double, Host>;
template <class Inverse = RE>
using RLayer = KLayer<kfac::Dense, kfac::Symmetric, Inverse>;

DMat to_view(const MatrixXd& m) {
  DMat v("m", m.rows(), m.cols());
  for (int i = 0; i < int(m.rows()); ++i)
    for (int j = 0; j < int(m.cols()); ++j) v(i, j) = m(i, j);
  return v;
}

/// \f$U \Lambda U^T + c (I - U U^T)\f$, the factor a factorization stands for.
template <class F>
MatrixXd approximation(const F& f) {
  const MatrixXd u = to_eigen(f.u);
  Eigen::VectorXd l(u.cols());
  for (int i = 0; i < l.size(); ++i) l(i) = double(f.lambda(i));
  const MatrixXd id = MatrixXd::Identity(u.rows(), u.rows());
  return u * l.asDiagonal() * u.transpose() + double(f.complement(0)) * (id - u * u.transpose());
}

double orthonormality_error(const Fact& f) {
  const MatrixXd u = to_eigen(f.u);
  return (u.transpose() * u - MatrixXd::Identity(u.cols(), u.cols())).norm();
}

MatrixXd random_orthogonal(int n, Rng& rng) {
  MatrixXd m(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) m(i, j) = rng.uniform();
  return Eigen::HouseholderQR<MatrixXd>(m).householderQ();
}

/// Q diag(lambda) Q^T.
MatrixXd with_spectrum(const MatrixXd& q, const Eigen::VectorXd& lambda) {
  return q * lambda.asDiagonal() * q.transpose();
}

/// \f$\|(I - U U^T) E\|_F\f$: how far the exact top-k eigenvectors E stick out of span(U)
/// (bounds the sine of the largest principal angle).
double subspace_gap(const MatrixXd& u, const MatrixXd& e) { return (e - u * (u.transpose() * e)).norm(); }

double spectral_norm(const MatrixXd& m) {
  Eigen::SelfAdjointEigenSolver<MatrixXd> es(MatrixXd((m + m.transpose()) / 2));
  return es.eigenvalues().cwiseAbs().maxCoeff();
}

/// mat((G kron A + damping I)^{-1} vec(X)) through Eigen's eigendecompositions of A and G: the
/// dense reference for factors too large for dense_kronecker_solve's (g a)^2 matrix.
MatrixXd eigen_kronecker_solve(const MatrixXd& a, const MatrixXd& g, const MatrixXd& x, double damping) {
  Eigen::SelfAdjointEigenSolver<MatrixXd> ea(a), eg(g);
  const MatrixXd qa = ea.eigenvectors(), qg = eg.eigenvectors();
  MatrixXd m = qg.transpose() * x * qa;
  for (int i = 0; i < m.rows(); ++i)
    for (int j = 0; j < m.cols(); ++j) m(i, j) /= eg.eigenvalues()(i) * ea.eigenvalues()(j) + damping;
  return qg * m * qa.transpose();
}

/// n = 120 with k = 8 leading eigenvalues in [1, 2] (ascending), then a tail of 112 values in
/// [0.9, 1.1] x 1e-3: a gap of 1e-3 after the k-th.
Eigen::VectorXd gapped_spectrum(int n, int k) {
  Eigen::VectorXd l(n);
  for (int i = 0; i < n - k; ++i) l(i) = 1e-3 * (0.9 + 0.2 * double(i) / double(n - k - 1));
  for (int i = 0; i < k; ++i) l(n - k + i) = 1.0 + double(i) / double(k - 1);
  return l;
}

/// One preconditioner step of Dense(in, out) under `method` on random data; returns
/// {gradient in, preconditioned gradient}.
template <class Method>
std::pair<MatrixXd, MatrixXd> one_step(Pre& pre, int in, int out, int batch, unsigned seed, const Method& method,
                                       bool first = true) {
  if (first) pre.register_layer("fc", kfac::Dense(in, out), method);
  Rng rng(seed);
  DenseBatch b(in, out, true, batch, rng);
  const MatrixXd x = b.gradient();
  b.feed(pre, "fc");
  pre.step();
  return {x, b.gradient()};
}

/// The preconditioned gradient of a layer against the dense solve with its approximated factors.
template <class Inverse>
double against_own_operator(const Pre& pre, const MatrixXd& x, const MatrixXd& got, double damping) {
  const auto& layer = pre.layer_as<RLayer<Inverse>>("fc");
  const MatrixXd a = approximation(*layer.decomposition_a()), g = approximation(*layer.decomposition_g());
  return rel_err(got, dense_kronecker_solve(a, g, x, damping));
}

}  // namespace

TEST_CASE("settings, signatures and buffer counts", "[inverse][randomized]") {
  CHECK(RE{}.settings() == "r=64,p=16,q=1");
  CHECK(RE{}.with_rank(8).with_oversampling(4).with_power_iterations(2).with_warm_start(false).settings() ==
        "r=8,p=4,q=2,cold");
  CHECK(RE{}.with_seed(7).settings() == "r=64,p=16,q=1,seed=7");
  CHECK(RE{}.with_rank(8).settings(8, 5) == "exact");
  CHECK(RE{}.with_rank(8).settings(9, 5) == "r=8,p=16,q=1");
  CHECK(RE{}.with_rank(8).counts(20) == std::vector<std::size_t>{160, 8, 1});
  CHECK(RE{}.with_rank(8).counts(5) == std::vector<std::size_t>{25, 5, 1});
  CHECK(RE{}.with_rank(8).cost(5).flops == 125.0);
  CHECK(RE{}.with_rank(8).cost(1000).flops < 0.1 * 1e9);
  CHECK_THROWS_AS(RE{}.with_rank(0), kfac::Error);
  CHECK_THROWS_AS(RE{}.with_oversampling(-1), kfac::Error);
  CHECK_THROWS_AS(RE{}.with_power_iterations(-1), kfac::Error);
  CHECK(kfac::is_inversion_v<RE>);

  Pre small(plain_options()), large(plain_options());
  small.register_layer("fc", kfac::Dense(7, 5), kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(8)));
  large.register_layer("fc", kfac::Dense(30, 5), kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(8)));
  CHECK(small.layer_as<RLayer<>>("fc").signature().find("/randomized_eigen[exact]/") != std::string::npos);
  CHECK(large.layer_as<RLayer<>>("fc").signature().find("/randomized_eigen[r=8,p=16,q=1]/") != std::string::npos);
  CHECK(large.layer_as<RLayer<>>("fc").split_passes() == 0);  // split preconditioning leaves it whole
}

TEST_CASE("rank >= n: Eigendecomposition, bit for bit", "[inverse][randomized][exact]") {
  for (const bool precompute : {false, true}) {
    const auto opts = plain_options(1e-3).with_factor_decay(0.9).with_inv_update_steps(2).with_precompute_reciprocal(precompute);
    Pre exact(opts), eigen(opts);
    exact.register_layer("fc", kfac::Dense(7, 5), kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(8)));
    eigen.register_layer("fc", kfac::Dense(7, 5), kfac::KFAC<>{});
    for (int t = 0; t < 6; ++t) {
      Rng rng(70 + t);
      DenseBatch batch(7, 5, true, 16, rng);
      DenseBatch twin = batch.twin();
      const MatrixXd x = batch.gradient();
      batch.feed(exact, "fc");
      twin.feed(eigen, "fc");
      exact.step();
      eigen.step();
      INFO("precompute " << precompute << ", step " << t);
      CHECK(rel_err(batch.gradient(), twin.gradient()) < 1e-10);  // the requirement
      CHECK(same_bits(batch.w, twin.w));                           // and what the code gives
      CHECK(same_bits(batch.b, twin.b));
    }
    CHECK(exact.layer_as<RLayer<>>("fc").decomposition_a()->exact == 3);
  }
}

TEST_CASE("rank < n: the dense solve with the returned low-rank-plus-identity factors", "[inverse][randomized][reference]") {
  const double damping = 1e-3;
  struct Case {
    const char* what;
    int in, out, batch;
    RE policy;
  };
  const Case cases[] = {
      {"both factors low-rank (range finder)", 30, 14, 64, RE{}.with_rank(4).with_oversampling(3)},
      {"no power iteration", 30, 14, 64, RE{}.with_rank(4).with_oversampling(3).with_power_iterations(0)},
      {"two power iterations", 30, 14, 64, RE{}.with_rank(5).with_oversampling(2).with_power_iterations(2)},
      {"G exact (rank >= g), A low-rank", 30, 6, 64, RE{}.with_rank(6).with_oversampling(3)},
      {"A low-rank exactly (rank + p >= n), G exact", 9, 4, 32, RE{}.with_rank(5).with_oversampling(8)},
      {"rank-deficient factors (batch 3 < rank)", 30, 14, 3, RE{}.with_rank(6).with_oversampling(4)},
  };
  SECTION("the range finder, exact and rank-deficient factors") {
    for (const auto& c : cases) {
      for (const bool precompute : {false, true}) {
        Pre pre(plain_options(damping).with_precompute_reciprocal(precompute));
        const auto [x, got] = one_step(pre, c.in, c.out, c.batch, 11, kfac::KFAC<kfac::Symmetric, RE>(c.policy));
        const auto& layer = pre.layer_as<RLayer<>>("fc");
        INFO(c.what << ", precompute " << precompute);
        CHECK(against_own_operator<RE>(pre, x, got, damping) < 1e-10);
        for (const Fact* f : {layer.decomposition_a(), layer.decomposition_g()}) {
          CHECK(orthonormality_error(*f) < 1e-12);
          CHECK(f->complement(0) >= 0.0);
        }
        // c is the mean eigenvalue of the complement: the approximation keeps the factor's trace.
        const MatrixXd a = symmetric_from_upper(layer.factor_a());
        CHECK(std::abs(approximation(*layer.decomposition_a()).trace() - a.trace()) < 1e-12 * a.trace());
      }
    }
  }
  SECTION("a damping schedule: precomputed coefficients keep their decomposition's damping") {
    // Decompositions at steps 0 and 2; the damping is 1e-2 at step 0 and 1e-3 from step 1 on.
    for (const bool precompute : {false, true}) {
      Pre pre(plain_options(damping).with_precompute_reciprocal(precompute).with_inv_update_steps(2));
      const auto method = kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(4).with_oversampling(3))
                              .with_damping([](long step) { return step == 0 ? 1e-2 : 1e-3; });
      one_step(pre, 30, 14, 64, 11, method);
      const auto [x, got] = one_step(pre, 30, 14, 64, 12, method, false);  // step 1, no decomposition
      INFO("precompute " << precompute);
      CHECK(against_own_operator<RE>(pre, x, got, precompute ? 1e-2 : 1e-3) < 1e-10);
      CHECK(against_own_operator<RE>(pre, x, got, precompute ? 1e-3 : 1e-2) > 1e-3);
    }
  }
  SECTION("portable small eigh (Jacobi), and its agreement with LAPACK's") {
    using Portable = kfac::RandomizedEigen<kfac::PortableBackend>;
    Pre lapack(plain_options(damping)), portable(plain_options(damping));
    const auto policy = RE{}.with_rank(4).with_oversampling(3);
    const auto [x, got] = one_step(portable, 30, 14, 64, 11,
                                   kfac::KFAC<kfac::Symmetric, Portable>(Portable{}.with_rank(4).with_oversampling(3)));
    const auto expect = one_step(lapack, 30, 14, 64, 11, kfac::KFAC<kfac::Symmetric, RE>(policy)).second;
    CHECK(against_own_operator<Portable>(portable, x, got, damping) < 1e-10);
    CHECK(rel_err(got, expect) < 1e-8);
  }
  SECTION("float decompositions, against their own operator in double") {
    kfac::Preconditioner<float, Host> pre(plain_options(1e-2));
    pre.register_layer("fc", kfac::Dense(30, 14), kfac::KFAC<kfac::Symmetric, RE, kfac::SinglePrecision>(RE{}.with_rank(4)));
    Rng rng(5);
    auto xin = random_view<float>(64, 30, rng);
    auto g = random_view<float>(64, 14, rng);
    auto w = random_view<float>(14, 30, rng);
    auto b = random_vector<float>(14, rng);
    MatrixXd x(14, 31);
    x.leftCols(30) = to_eigen(w);
    for (int i = 0; i < 14; ++i) x(i, 30) = b(i);
    pre.observe_input("fc", xin);
    pre.observe_output_grad("fc", g);
    pre.set_gradient("fc", w, b);
    pre.step();
    MatrixXd got(14, 31);
    got.leftCols(30) = to_eigen(w);
    for (int i = 0; i < 14; ++i) got(i, 30) = b(i);
    using FLayer = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, RE, kfac::SinglePrecision, float, Host>;
    const auto& layer = pre.layer_as<FLayer>("fc");
    const MatrixXd fa = approximation(*layer.decomposition_a()), fg = approximation(*layer.decomposition_g());
    CHECK(rel_err(got, dense_kronecker_solve(fa, fg, x, 1e-2)) < 1e-4);
  }
  SECTION("binary16 factors, float decompositions: finite, near the float result") {
    kfac::Preconditioner<float, Host> half(plain_options(1e-2)), single(plain_options(1e-2));
    half.register_layer("fc", kfac::Dense(30, 14, false), kfac::KFAC<kfac::Symmetric, RE, kfac::HalfPrecision>(RE{}.with_rank(4)));
    single.register_layer("fc", kfac::Dense(30, 14, false), kfac::KFAC<kfac::Symmetric, RE, kfac::SinglePrecision>(RE{}.with_rank(4)));
    Rng rng(6);
    auto xin = random_view<float>(64, 30, rng);
    auto g = random_view<float>(64, 14, rng);
    auto w = random_view<float>(14, 30, rng);
    auto w2 = clone(w);
    for (auto* p : {&half, &single}) {
      p->observe_input("fc", xin);
      p->observe_output_grad("fc", g);
    }
    half.set_gradient("fc", w);
    single.set_gradient("fc", w2);
    half.step();
    single.step();
    const MatrixXd a = to_eigen(w), b = to_eigen(w2);
    CHECK(a.allFinite());
    CHECK(rel_err(a, b) < 2e-2);  // binary16 factors: 3 decimal digits
  }
}

TEST_CASE("factored damping: (G~ + sqrt(damping) I)^-1 X (A~ + sqrt(damping) I)^-1", "[inverse][randomized][factored]") {
  const double damping = 0.3;  // large enough that the two forms differ visibly
  CHECK(RE{}.with_factored_damping(true).settings() == "r=64,p=16,q=1,factored");
  CHECK(RE{}.with_rank(8).with_factored_damping(true).settings(8, 5) == "exact,factored");

  SECTION("rank >= n: Cholesky's damped inverses (pi = 1), to round-off") {
    for (const bool precompute : {false, true}) {
      const auto opts = plain_options(damping).with_factor_decay(0.9).with_inv_update_steps(2).with_precompute_reciprocal(precompute);
      Pre low(opts), chol(opts);
      low.register_layer("fc", kfac::Dense(7, 5), kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(8).with_factored_damping(true)));
      chol.register_layer("fc", kfac::Dense(7, 5),
                          kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>>(kfac::Cholesky<>{}.with_pi_damping(false)));
      for (int t = 0; t < 6; ++t) {
        Rng rng(170 + t);
        DenseBatch batch(7, 5, true, 16, rng);
        DenseBatch twin = batch.twin();
        batch.feed(low, "fc");
        twin.feed(chol, "fc");
        low.step();
        chol.step();
        INFO("precompute " << precompute << ", step " << t);
        CHECK(rel_err(batch.gradient(), twin.gradient()) < 1e-10);
      }
    }
  }
  SECTION("rank < n: the dense solve with the returned factors, each damped") {
    const RE policies[] = {RE{}.with_rank(4).with_oversampling(3), RE{}.with_rank(6).with_oversampling(3),
                           RE{}.with_rank(6).with_oversampling(3)};
    // both factors low-rank; G exact (rank >= g), A low-rank; A exact (4 inputs and the bias), G low-rank
    const int ins[] = {30, 30, 4}, outs[] = {14, 6, 14};
    for (int c = 0; c < 3; ++c) {
      for (const bool precompute : {false, true}) {
        Pre pre(plain_options(damping).with_precompute_reciprocal(precompute));
        const auto method = kfac::KFAC<kfac::Symmetric, RE>(RE(policies[c]).with_factored_damping(true));
        const auto [x, got] = one_step(pre, ins[c], outs[c], 64, 11, method);
        const auto& layer = pre.layer_as<RLayer<>>("fc");
        const double s = std::sqrt(damping);
        const MatrixXd a = approximation(*layer.decomposition_a()), g = approximation(*layer.decomposition_g());
        const MatrixXd ia = (a + s * MatrixXd::Identity(a.rows(), a.cols())).inverse();
        const MatrixXd ig = (g + s * MatrixXd::Identity(g.rows(), g.cols())).inverse();
        INFO("case " << c << ", precompute " << precompute);
        CHECK(rel_err(got, MatrixXd(ig * x * ia)) < 1e-10);
        CHECK(rel_err(got, dense_kronecker_solve(a, g, x, damping)) > 1e-3);  // not the Kronecker-sum form
      }
    }
  }
}

TEST_CASE("known spectrum: the top eigenpairs, and the solve, within their bounds", "[inverse][randomized][spectrum]") {
  const int n = 120, k = 8;
  Rng rng(2024);
  const MatrixXd qa = random_orthogonal(n, rng), qg = random_orthogonal(n, rng);
  const Eigen::VectorXd spectrum = gapped_spectrum(n, k);
  const MatrixXd a = with_spectrum(qa, spectrum), g = with_spectrum(qg, spectrum);
  const MatrixXd top_a = qa.rightCols(k), top_g = qg.rightCols(k);
  const RE policy = RE{}.with_rank(k).with_oversampling(8).with_power_iterations(1);
  Fact fa(n, policy), fg(n, policy);
  fa.compute(Host(), to_view(a), 0.0, policy);
  fg.compute(Host(), to_view(g), 0.0, policy);
  // Subspace iteration: tan of the principal angles shrinks by (lambda_{l+1} / lambda_k)^(q+1)
  // = (1.1e-3)^2 ~ 1.2e-6 from that of the Gaussian start (O(sqrt(n)) here): stated 1e-4.
  // Eigenvalues then err by the squared angle times the spread: stated 1e-8 relative.
  for (const auto* f : {&fa, &fg}) {
    const MatrixXd& top = f == &fa ? top_a : top_g;
    INFO("subspace gap " << subspace_gap(to_eigen(f->u), top));
    CHECK(subspace_gap(to_eigen(f->u), top) < 1e-4);
    for (int i = 0; i < k; ++i) CHECK(std::abs(f->lambda(i) - spectrum(n - k + i)) < 1e-8 * spectrum(n - k + i));
    // c is the tail's mean, 1e-3 (to the subspace error).
    CHECK(std::abs(f->complement(0) - 1e-3) < 1e-8);
    CHECK(orthonormality_error(*f) < 1e-12);
  }
  CHECK(fa.cold == 1);
  // The solve: with K = G (x) A + gamma I and K~ its approximation, ||K~^-1 - K^-1|| <=
  // ||K - K~|| / gamma^2 and ||K - K~|| <= ||G - G~|| ||A|| + ||G~|| ||A - G~||, every norm the
  // spectral one, measured here from the dense matrices: the stated bound.
  const double damping = 1e-2;
  const MatrixXd ta = approximation(fa), tg = approximation(fg);
  const double dk = spectral_norm(g - tg) * spectral_norm(a) + spectral_norm(tg) * spectral_norm(a - ta);
  CHECK(spectral_norm(a - ta) <= 1.1e-4 + 1e-8);  // the tail's spread about its mean
  MatrixXd x(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) x(i, j) = rng.uniform();
  DMat xv = to_view(x), work("work", n, n), out("out", n, n);
  RE::apply(Host(), fa, fg, xv, damping, DMat(), work, out);
  const MatrixXd exact = eigen_kronecker_solve(a, g, x, damping), got = to_eigen(out);
  const double bound = dk / (damping * damping) * x.norm();
  INFO("error " << (got - exact).norm() << ", bound " << bound << ", relative error " << rel_err(got, exact));
  CHECK((got - exact).norm() <= bound);
  CHECK(rel_err(got, exact) < 1e-2);  // measured 2.4e-3: the tail's spread over the damping
  CHECK(rel_err(got, eigen_kronecker_solve(ta, tg, x, damping)) < 1e-10);
}

TEST_CASE("warm starts: an exact basis stays exact, a rotated one is recovered", "[inverse][randomized][warm]") {
  const int n = 120, k = 8;
  Rng rng(77);
  const MatrixXd q1 = random_orthogonal(n, rng), q2 = random_orthogonal(n, rng);
  const Eigen::VectorXd spectrum = gapped_spectrum(n, k);
  SECTION("exact basis, no power iteration: one decomposition, then twenty, no drift") {
    const RE policy = RE{}.with_rank(k).with_oversampling(4).with_power_iterations(0);
    const DMat f = to_view(with_spectrum(q1, spectrum));
    Fact fact(n, policy);
    const MatrixXd top = q1.rightCols(k);
    Kokkos::deep_copy(fact.u, to_view(top));
    for (int i = 0; i < k; ++i) fact.lambda(i) = spectrum(n - k + i);
    for (int t = 1; t <= 20; ++t) {
      fact.compute(Host(), f, 0.0, policy);
      INFO("decomposition " << t << ": subspace gap " << subspace_gap(to_eigen(fact.u), top));
      CHECK(subspace_gap(to_eigen(fact.u), top) < 1e-13);
      for (int i = 0; i < k; ++i) CHECK(std::abs(fact.lambda(i) - spectrum(n - k + i)) < 1e-13);
      CHECK(orthonormality_error(fact) < 1e-13);
    }
    CHECK(fact.warm == 20);
    CHECK(fact.cold == 0);
  }
  SECTION("the eigenbasis rotated: two warm decompositions, q = 1") {
    // Each decomposition multiplies the tangents of the principal angles by
    // (lambda_{l+1} / lambda_k)^(q+1) ~ 1.2e-6, from O(1) for an unrelated old basis: stated
    // 1e-4 after the first, 1e-9 after the second.
    const RE policy = RE{}.with_rank(k).with_oversampling(8).with_power_iterations(1);
    Fact fact(n, policy);
    const DMat f1 = to_view(with_spectrum(q1, spectrum)), f2 = to_view(with_spectrum(q2, spectrum));
    fact.compute(Host(), f1, 0.0, policy);
    fact.compute(Host(), f1, 0.0, policy);
    CHECK(subspace_gap(to_eigen(fact.u), q1.rightCols(k)) < 1e-9);
    const double bounds[2] = {1e-4, 1e-9};
    for (int t = 0; t < 2; ++t) {
      fact.compute(Host(), f2, 0.0, policy);
      INFO("decomposition " << t + 1 << " after the rotation: gap " << subspace_gap(to_eigen(fact.u), q2.rightCols(k)));
      CHECK(subspace_gap(to_eigen(fact.u), q2.rightCols(k)) < bounds[t]);
    }
    CHECK(fact.warm == 3);
    CHECK(fact.cold == 1);
  }
}

namespace {

/// A small net: "fc1" Dense(40, 24) and "fc2" Dense(24, 12), low-rank (A, G of fc1 by the range
/// finder; fc2's G, 12 <= 8 + 4, exactly, keeping 8), KL clipping on.
std::unique_ptr<Pre> small_net() {
  auto pre = std::make_unique<Pre>(kfac::Options{}.with_damping(1e-3).with_inv_update_steps(3).with_kl_clip(1e-2));
  const auto method = kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(8).with_oversampling(4));
  pre->register_layer("fc1", kfac::Dense(40, 24), method);
  pre->register_layer("fc2", kfac::Dense(24, 12), method);
  return pre;
}

/// Steps [from, to) on fresh data per step; the preconditioned gradients, flattened.
std::vector<double> run_net(Pre& pre, int from, int to) {
  std::vector<double> out;
  for (int t = from; t < to; ++t) {
    Rng r1(9000 + t), r2(19000 + t);
    DenseBatch b1(40, 24, true, 16, r1), b2(24, 12, true, 16, r2);
    b1.feed(pre, "fc1");
    b2.feed(pre, "fc2");
    pre.step();
    for (const auto* b : {&b1, &b2}) {
      out.insert(out.end(), b->w.data(), b->w.data() + b->w.span());
      out.insert(out.end(), b->b.data(), b->b.data() + b->b.span());
    }
  }
  return out;
}

bool bit_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE("300 steps: finite, repeatable, and resumed from a checkpoint bit for bit", "[inverse][randomized][checkpoint]") {
  const int steps = 300, saved_at = 150;
  auto first = small_net();
  const auto expect = run_net(*first, 0, steps);
  CHECK(std::all_of(expect.begin(), expect.end(), [](double v) { return std::isfinite(v); }));
  CHECK(expect.size() == std::size_t(steps) * (24 * 41 + 12 * 25));
  const auto& fc1 = first->layer_as<RLayer<>>("fc1");
  CHECK(fc1.decomposition_a()->cold == 1);
  CHECK(fc1.decomposition_a()->warm == 99);
  CHECK(first->layer_as<RLayer<>>("fc2").decomposition_g()->exact == 100);

  auto again = small_net();
  CHECK(bit_equal(run_net(*again, 0, steps), expect));

  auto before = small_net();
  auto got = run_net(*before, 0, saved_at);
  std::stringstream ckpt;
  before->save(ckpt);
  auto resumed = small_net();
  REQUIRE(resumed->load(ckpt));
  const auto rest = run_net(*resumed, saved_at, steps);
  got.insert(got.end(), rest.begin(), rest.end());
  CHECK(bit_equal(got, expect));
  // A decomposition after the resume started warm, from the restored basis.
  CHECK(resumed->layer_as<RLayer<>>("fc1").decomposition_a()->cold == 0);

  SECTION("another rank is another signature: its checkpoint is refused") {
    Pre other(kfac::Options{}.with_damping(1e-3));
    other.register_layer("fc1", kfac::Dense(40, 24), kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(9).with_oversampling(4)));
    other.register_layer("fc2", kfac::Dense(24, 12), kfac::KFAC<kfac::Symmetric, RE>(RE{}.with_rank(9).with_oversampling(4)));
    std::stringstream again_ckpt;
    before->save(again_ckpt);
    CHECK_THROWS_AS(other.load(again_ckpt), kfac::Error);
  }
}
