// Deferred decompositions (Options::decomposition_delay = d): the decomposition a step uses is
// the one computed from the factors of the documented step, checked against dense solves in
// double over hundreds of steps; a checkpoint taken with a decomposition in flight resumes bit
// for bit; a delay longer than the decomposition interval is refused.
#include "helpers.hpp"

using namespace kfac_test;

namespace {

constexpr int kIn = 6, kOut = 4, kBatch = 8;
constexpr double kDamping = 1e-2, kDecay = 0.9;

enum class Form { kronecker, pi };  // eigen: (G kron A + gamma)^-1; inverses: pi-damped

/// The preconditioned gradient from the factors (a, g) by the dense formula.
MatrixXd dense_solve(Form form, const MatrixXd& a, const MatrixXd& g, const MatrixXd& x) {
  if (form == Form::kronecker) return dense_kronecker_solve(a, g, x, kDamping);
  const double pi = std::sqrt((a.trace() / double(a.rows())) / (g.trace() / double(g.rows())));
  const double s = std::sqrt(kDamping);
  const MatrixXd ia = (a + pi * s * MatrixXd::Identity(a.rows(), a.cols())).inverse();
  const MatrixXd ig = (g + s / pi * MatrixXd::Identity(g.rows(), g.cols())).inverse();
  return ig * x * ia;
}

/// The step whose factors the decomposition in use at step t comes from: decompositions at
/// steps 0, k, 2k, ...; the first is used at once, the others from s + d on.
long decomposition_of(long t, long k, long d) {
  long s = (t / k) * k;
  if (s > 0 && s + d > t) s -= k;
  return s;
}

kfac::Options options(long k, long d) {
  return plain_options(kDamping).with_factor_decay(kDecay).with_inv_update_steps(k).with_decomposition_delay(d);
}

/// Runs `steps` steps of one Dense layer under `method` and compares every preconditioned
/// gradient with the dense solve on the factors of the documented step; returns the largest
/// relative difference to what d = 0 would have given (to show the delay is visible).
template <class Method>
double check_schedule(const Method& method, Form form, long k, long d, int steps, double tol) {
  Pre pre(options(k, d));
  pre.register_layer("fc", kfac::Dense(kIn, kOut), method);
  std::vector<MatrixXd> fa, fg;  // the factors after each step's update, in double
  double worst = 0, off = 0;
  for (int t = 0; t < steps; ++t) {
    Rng rng(100 + t);
    DenseBatch batch(kIn, kOut, true, kBatch, rng);
    const MatrixXd x = batch.gradient();
    fa.push_back(t == 0 ? batch.factor_a() : kDecay * fa.back() + (1 - kDecay) * batch.factor_a());
    fg.push_back(t == 0 ? batch.factor_g() : kDecay * fg.back() + (1 - kDecay) * batch.factor_g());
    batch.feed(pre, "fc");
    pre.step();
    const long s = decomposition_of(t, k, d);
    const MatrixXd expect = dense_solve(form, fa[std::size_t(s)], fg[std::size_t(s)], x);
    const MatrixXd got = batch.gradient();
    worst = std::max(worst, rel_err(got, expect));
    const long now = (t / k) * k;  // what d = 0 uses
    off = std::max(off, rel_err(got, dense_solve(form, fa[std::size_t(now)], fg[std::size_t(now)], x)));
  }
  INFO("k = " << k << ", d = " << d << ": worst relative error " << worst);
  CHECK(worst < tol);
  return off;
}

/// Feeds step t's data (seeded by t) to layer `name` and returns the preconditioned gradient.
MatrixXd step_once(Pre& pre, int t, const std::vector<std::string>& names) {
  MatrixXd out;
  std::vector<DenseBatch> batches;
  for (std::size_t n = 0; n < names.size(); ++n) {
    Rng rng(100 + t + 1000 * std::uint64_t(n));
    batches.emplace_back(kIn, kOut, true, kBatch, rng);
    batches.back().feed(pre, names[n]);
  }
  pre.step();
  for (const auto& b : batches) {
    const MatrixXd g = b.gradient();
    MatrixXd joined(g.rows(), out.cols() + g.cols());
    if (out.size()) joined << out, g; else joined = g;
    out = joined;
  }
  return out;
}

bool same(const MatrixXd& a, const MatrixXd& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(double) * std::size_t(a.size())) == 0;
}

}  // namespace

TEST_CASE("a deferred decomposition is used from step s + d on", "[deferred][eigen][cholesky][newton_schulz]") {
  const auto eigen = kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>>{};
  const auto cholesky = kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>>{};
  const auto newton = kfac::KFAC<kfac::Symmetric, kfac::NewtonSchulz>{};
  SECTION("every step, d = 1, 300 steps (eigen)") { CHECK(check_schedule(eigen, Form::kronecker, 1, 1, 300, 1e-9) > 1e-4); }
  SECTION("every 3, d = 1 and d = 3 (eigen)") {
    CHECK(check_schedule(eigen, Form::kronecker, 3, 1, 60, 1e-9) > 1e-4);
    CHECK(check_schedule(eigen, Form::kronecker, 3, 3, 60, 1e-9) > 1e-4);
  }
  SECTION("every step and every 4, d = 2 (Cholesky, pi-damped)") {
    CHECK(check_schedule(cholesky, Form::pi, 1, 1, 200, 1e-9) > 1e-4);
    CHECK(check_schedule(cholesky, Form::pi, 4, 2, 60, 1e-9) > 1e-4);
  }
  SECTION("Newton-Schulz (computed when swapped in, on the calling thread)") {
    CHECK(check_schedule(newton, Form::pi, 2, 2, 40, 1e-8) > 1e-4);
  }
  SECTION("d = 0 is today's schedule") { CHECK(check_schedule(eigen, Form::kronecker, 3, 0, 20, 1e-9) < 1e-9); }
}

TEST_CASE("which decompositions run on a second host thread", "[deferred]") {
  Pre pre(options(1, 1));
  pre.register_layer("eigen", kfac::Dense(kIn, kOut), kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>>{});
  pre.register_layer("ns", kfac::Dense(kIn, kOut), kfac::KFAC<kfac::Symmetric, kfac::NewtonSchulz>{});
  pre.register_layer("jacobi", kfac::Dense(kIn, kOut), kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<kfac::PortableBackend>>{});
#if defined(KOKKOS_ENABLE_SERIAL) && defined(KFAC_HAVE_LAPACK)
  const bool serial = std::is_same<Host, Kokkos::Serial>::value;
#else
  const bool serial = false;
#endif
  CHECK(pre.layer("eigen").decomposes_off_thread() == serial);
  CHECK_FALSE(pre.layer("ns").decomposes_off_thread());
  CHECK_FALSE(pre.layer("jacobi").decomposes_off_thread());
}

TEST_CASE("a checkpoint with a decomposition in flight resumes bit for bit", "[deferred][checkpoint]") {
  const std::vector<std::string> names = {"eigen", "chol", "refresh"};
  long delay = 2;
  auto make = [&] {
    auto p = std::make_unique<Pre>(options(3, delay));
    p->register_layer("eigen", kfac::Dense(kIn, kOut), kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>>{});
    p->register_layer("chol", kfac::Dense(kIn, kOut), kfac::KFAC<kfac::Full, kfac::Cholesky<>>{});
    // Refreshes start from the decomposition in use, which the checkpoint holds.
    p->register_layer("refresh", kfac::Dense(kIn, kOut),
                      kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<>>(kfac::Eigendecomposition<>{}.with_refresh_tolerance(0.3)));
    return p;
  };
  for (int at : {7, 9, -7}) {  // 7: launched at 6, swapped in at 8; 9: nothing in flight; -7: d = 0
    if (at < 0) delay = 0, at = -at;
    auto a = make();
    for (int t = 0; t < at; ++t) step_once(*a, t, names);
    std::stringstream ckpt;
    a->save(ckpt);
    std::vector<MatrixXd> expect;
    for (int t = at; t < at + 8; ++t) expect.push_back(step_once(*a, t, names));
    auto b = make();
    REQUIRE(b->load(ckpt));
    INFO("saved after " << at << " steps, d = " << delay);
    for (int t = at; t < at + 8; ++t) CHECK(same(step_once(*b, t, names), expect[std::size_t(t - at)]));
    // With d = 0 the layer's own counts show that the resumed run refreshed (d > 0: its shadow did).
    if (delay == 0) CHECK(b->layer_as<KLayer<kfac::Dense>>("refresh").decomposition_a()->refreshed > 0);
  }
}

TEST_CASE("a delay longer than the decomposition interval is refused", "[deferred][errors]") {
  Pre pre(options(1, 2));
  pre.register_layer("fc", kfac::Dense(kIn, kOut), kfac::KFAC<>{});
  step_once(pre, 0, {"fc"});  // synchronous: the first decomposition
  step_once(pre, 1, {"fc"});  // launched, swapped in at step 3
  Rng rng(7);
  DenseBatch batch(kIn, kOut, true, kBatch, rng);
  batch.feed(pre, "fc");
  const V2<double> before = clone(batch.w);
  expect_error([&] { pre.step(); }, "fc", {"due at step 2", "of step 1", "only at step 3", "must not exceed inv_update_steps"});
  CHECK(pre.step_count() == 2);
  CHECK(same_bits(batch.w, before));
  CHECK_THROWS_AS(kfac::Options{}.with_decomposition_delay(-1), kfac::Error);
}

TEST_CASE("registering a layer drops the decompositions in flight", "[deferred]") {
  Pre pre(options(2, 2));
  pre.register_layer("fc", kfac::Dense(kIn, kOut), kfac::KFAC<>{});
  std::vector<MatrixXd> fa, fg;
  for (int t = 0; t < 4; ++t) {  // launched at 2, due at 4
    Rng rng(100 + t);
    DenseBatch b(kIn, kOut, true, kBatch, rng);
    fa.push_back(t == 0 ? b.factor_a() : kDecay * fa.back() + (1 - kDecay) * b.factor_a());
    fg.push_back(t == 0 ? b.factor_g() : kDecay * fg.back() + (1 - kDecay) * b.factor_g());
    b.feed(pre, "fc");
    pre.step();
  }
  const auto with_shadow = pre.memory_report()[0];
  pre.register_layer("late", kfac::Dense(kIn, kOut), kfac::KFAC<>{});
  // Step 4 decomposes every layer at once, from the factors of step 4.
  Rng rng(104);
  DenseBatch b(kIn, kOut, true, kBatch, rng);
  Rng rng2(5);
  DenseBatch late(kIn, kOut, true, kBatch, rng2);
  const MatrixXd x = b.gradient();
  b.feed(pre, "fc");
  late.feed(pre, "late");
  pre.step();
  const MatrixXd a4 = kDecay * fa.back() + (1 - kDecay) * b.factor_a();
  const MatrixXd g4 = kDecay * fg.back() + (1 - kDecay) * b.factor_g();
  CHECK(rel_err(b.gradient(), dense_kronecker_solve(a4, g4, x, kDamping)) < 1e-9);
  // The shadow's memory is reported with the layer's workspace.
  Pre plain(options(2, 0));
  plain.register_layer("fc", kfac::Dense(kIn, kOut), kfac::KFAC<>{});
  step_once(plain, 0, {"fc"});
  const auto m = plain.memory_report()[0];
  CHECK(with_shadow.workspace_bytes == m.workspace_bytes + m.factor_bytes + m.decomposition_bytes);
}
