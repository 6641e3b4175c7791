// The per-step schedule of the Preconditioner: when factors and decompositions are updated,
// running averages, KL clipping, hyperparameters as functions of the step, skip_layers and the
// memory report.
#include <cmath>
#include <set>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

using DenseLayer = KLayer<kfac::Dense>;

/// Steps s_0 = 0, s_{k+1} = s_k + interval(s_k) below `end`, as documented on Preconditioner.
std::set<long> update_steps(const std::function<long(long)>& interval, long end) {
  std::set<long> s;
  for (long k = 0; k < end; k += interval(k)) s.insert(k);
  return s;
}

/// The last element <= step of a set of update steps.
long last_at(const std::set<long>& steps, long step) { return *std::prev(steps.upper_bound(step)); }

/// Runs `steps` steps of a Dense(3, 2) layer "fc" with the given schedule and checks, at every
/// step, the schedule queries, the running factors (formula in double, decay evaluated at the
/// factor step) and the preconditioned gradient (the solve with the factors of the last
/// decomposition step and the damping of the current step).
void check_schedule(kfac::Options options, const std::function<long(long)>& factor_interval,
                    const std::function<long(long)>& inv_interval,
                    const std::function<double(long)>& decay, long steps) {
  const double damping = 0.02;
  const auto factor_steps = update_steps(factor_interval, steps);
  const auto inv_steps = update_steps(inv_interval, steps);
  Pre pre(options.with_damping(damping).with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::sum)
              .with_factor_update_steps(factor_interval).with_inv_update_steps(inv_interval)
              .with_factor_decay(decay));
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  Rng rng(17);
  MatrixXd a, g, a_dec, g_dec;  // running factors; factors at the last decomposition
  for (long s = 0; s < steps; ++s) {
    INFO("step " << s);
    CHECK(pre.step_count() == s);
    CHECK(pre.wants_observations() == bool(factor_steps.count(s)));
    CHECK(pre.will_decompose() == bool(inv_steps.count(s)));
    DenseBatch d(3, 2, true, 4, rng);
    d.feed(pre, "fc");  // observations on other steps must be ignored
    if (factor_steps.count(s)) {
      a = s == 0 ? d.factor_a() : MatrixXd(decay(s) * a + (1 - decay(s)) * d.factor_a());
      g = s == 0 ? d.factor_g() : MatrixXd(decay(s) * g + (1 - decay(s)) * d.factor_g());
    }
    if (inv_steps.count(s)) {
      a_dec = a;
      g_dec = g;
    }
    const MatrixXd expect = dense_kronecker_solve(a_dec, g_dec, d.gradient(), damping);
    pre.step();
    CHECK(pre.last_factor_step() == last_at(factor_steps, s));
    CHECK(pre.last_decomposition_step() == last_at(inv_steps, s));
    const auto& layer = pre.layer_as<DenseLayer>("fc");
    CHECK(rel_err(symmetric_from_upper(layer.factor_a()), a) < 1e-13);
    CHECK(rel_err(symmetric_from_upper(layer.factor_g()), g) < 1e-13);
    CHECK(rel_err(d.gradient(), expect) < 1e-10);
  }
}

}  // namespace

TEST_CASE("constant intervals: factors every 2 steps, decompositions every 3", "[schedule]") {
  // Factor steps 0, 2, 4, 6, 8; decomposition steps 0, 3, 6, 9.
  const auto two = [](long) { return 2L; };
  const auto three = [](long) { return 3L; };
  CHECK(update_steps(two, 10) == std::set<long>{0, 2, 4, 6, 8});
  CHECK(update_steps(three, 10) == std::set<long>{0, 3, 6, 9});
  check_schedule(kfac::Options{}, two, three, [](long) { return 0.6; }, 10);
}

TEST_CASE("constant intervals given as constants", "[schedule]") {
  Pre pre(plain_options().with_factor_update_steps(2).with_inv_update_steps(3));
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(2, 2, false));
  Rng rng(3);
  const std::vector<bool> factor{true, false, true, false, true, false, true};
  const std::vector<bool> inv{true, false, false, true, false, false, true};
  for (int s = 0; s < 7; ++s) {
    INFO("step " << s);
    CHECK(pre.wants_observations() == factor[s]);
    CHECK(pre.will_decompose() == inv[s]);
    const DenseBatch d(2, 2, false, 3, rng);  // set_gradient's views must outlive step()
    d.feed(pre, "fc");
    pre.step();
  }
  CHECK(pre.last_factor_step() == 6);
  CHECK(pre.last_decomposition_step() == 6);
}

TEST_CASE("set_step_count moves the counter, and every layer is due at the next step", "[schedule][set_step]") {
  const auto damping = [](long s) { return s >= 100 ? 0.5 : 0.01; };
  Pre pre(plain_options().with_factor_update_steps(5).with_inv_update_steps(7).with_damping(damping)
              .with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::sum));
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  Rng rng(41);
  for (int s = 0; s < 3; ++s) {
    const DenseBatch d(3, 2, true, 4, rng);
    d.feed(pre, "fc");
    pre.step();
  }
  CHECK_FALSE(pre.wants_observations());
  CHECK_FALSE(pre.will_decompose());
  CHECK_THROWS_AS(pre.set_step_count(-1), kfac::Error);
  CHECK(pre.step_count() == 3);
  pre.set_step_count(100);
  CHECK(pre.step_count() == 100);
  CHECK(pre.wants_observations());
  CHECK(pre.will_decompose());
  const DenseBatch d(3, 2, true, 4, rng);
  const MatrixXd gradient = d.gradient();
  d.feed(pre, "fc");
  pre.step();
  CHECK(pre.last_factor_step() == 100);
  CHECK(pre.last_decomposition_step() == 100);
  const auto& layer = pre.layer_as<DenseLayer>("fc");
  // The solve with the factors just updated and the damping of step 100, not step 3's.
  const MatrixXd expect = dense_kronecker_solve(symmetric_from_upper(layer.factor_a()),
                                                symmetric_from_upper(layer.factor_g()), gradient, 0.5);
  CHECK(rel_err(d.gradient(), expect) < 1e-10);
  CHECK(pre.step_count() == 101);
  CHECK_FALSE(pre.wants_observations());  // the next statistics at 100 + 5
}

TEST_CASE("intervals as functions of the step, incl. stale_fisher", "[schedule][stale_fisher]") {
  const auto stale = kfac::schedules::stale_fisher(1, 8, 4);
  for (long s = 0; s < 30; ++s) {
    INFO("step " << s);
    CHECK(stale(s) == (s < 4 ? 1 : s < 8 ? 2 : s < 12 ? 4 : 8));
  }
  const auto capped = kfac::schedules::stale_fisher(2, 3, 5);
  CHECK(capped(4) == 2);
  CHECK(capped(5) == 3);
  CHECK(capped(100) == 3);
  CHECK_THROWS_AS(kfac::schedules::stale_fisher(0, 4, 2), kfac::Error);
  CHECK_THROWS_AS(kfac::schedules::stale_fisher(4, 2, 2), kfac::Error);
  CHECK_THROWS_AS(kfac::schedules::stale_fisher(1, 4, 0), kfac::Error);

  const auto factor_interval = [](long s) { return s < 3 ? 1L : 3L; };
  CHECK(update_steps(factor_interval, 30) == std::set<long>{0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27});
  CHECK(update_steps(stale, 30) == std::set<long>{0, 1, 2, 3, 4, 6, 8, 12, 20, 28});
  // The decay changes with the step too: each update must use the value of its own step.
  check_schedule(kfac::Options{}, factor_interval, stale, [](long s) { return 0.5 + 0.01 * s; }, 30);
}

TEST_CASE("KL clipping scales by min(1, sqrt(kl_clip / (lr^2 sum <V, grad>)))", "[schedule][kl_clip]") {
  // Two layers; the learning rate and the bound change with the step. The reference V comes
  // from a twin that does not clip (kl_clip = 0) and sees the same data.
  const auto lr = [](long s) { return 0.1 * double(s + 1); };
  const auto kl = [](long s) { return s == 0 ? 1e-4 : 1e6; };  // clips at step 0, not at step 1
  Pre clipped(plain_options().with_lr(lr).with_kl_clip(kl));
  Pre twin(plain_options().with_lr(lr));
  for (Pre* p : {&clipped, &twin}) {
    p->register_layer<kfac::Dense>("fc1", kfac::Dense(4, 3));
    p->register_layer<kfac::Dense>("fc2", kfac::Dense(3, 2, false));
  }
  Rng rng(5);
  for (long s = 0; s < 2; ++s) {
    INFO("step " << s);
    DenseBatch d1(4, 3, true, 5, rng), d2(3, 2, false, 5, rng);
    const MatrixXd x1 = d1.gradient(), x2 = d2.gradient();
    const DenseBatch e1 = d1.twin(), e2 = d2.twin();
    d1.feed(clipped, "fc1");
    d2.feed(clipped, "fc2");
    e1.feed(twin, "fc1");
    e2.feed(twin, "fc2");
    clipped.step();
    twin.step();
    CHECK(twin.last_kl_scale() == 1.0);
    const MatrixXd v1 = e1.gradient(), v2 = e2.gradient();
    const double vg = (v1.array() * x1.array()).sum() + (v2.array() * x2.array()).sum();
    const double nu = std::min(1.0, std::sqrt(kl(s) / (lr(s) * lr(s) * vg)));
    if (s == 0) CHECK(nu < 0.5);  // the test exercises a real clip
    if (s == 1) CHECK(nu == 1.0);
    CHECK(clipped.last_kl_scale() == Approx(nu).epsilon(1e-13));
    CHECK(rel_err(d1.gradient(), nu * v1) < 1e-13);
    CHECK(rel_err(d2.gradient(), nu * v2) < 1e-13);
  }
}

TEST_CASE("damping as a function of the step is used at the right step", "[schedule][damping]") {
  // Factors every step, decompositions every 2 steps. The eigen method applies the damping
  // of the current step; with a precomputed reciprocal, and for Cholesky, the damping is the
  // one of the decomposition step; the closed-form Diagonal uses the current factors and damping.
  const auto damping = [](long s) { return 0.01 * double(s + 1); };
  auto options = [&](bool precompute) {
    return plain_options().with_damping(damping).with_inv_update_steps(2).with_factor_decay(0.5).with_precompute_reciprocal(precompute);
  };
  Pre eig(options(false)), pre_rec(options(true)), chol(options(false)), diag(options(false));
  eig.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  pre_rec.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  // pi = 1 (kfac 0.1's damping), the form the reference below spells out.
  chol.register_layer("fc", kfac::Dense(3, 2),
                      kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>, kfac::Precision<double>>(
                          kfac::Cholesky<>{}.with_pi_damping(false)));
  diag.register_layer<kfac::Dense, kfac::Diagonal>("fc", kfac::Dense(3, 2));
  Rng rng(23);
  MatrixXd a, g, a_dec, g_dec;
  long dec_step = 0;
  for (long s = 0; s < 4; ++s) {
    INFO("step " << s);
    DenseBatch d(3, 2, true, 5, rng);
    a = s == 0 ? d.factor_a() : MatrixXd(0.5 * a + 0.5 * d.factor_a());
    g = s == 0 ? d.factor_g() : MatrixXd(0.5 * g + 0.5 * d.factor_g());
    if (s % 2 == 0) {
      a_dec = a;
      g_dec = g;
      dec_step = s;
    }
    const MatrixXd x = d.gradient();
    const MatrixXd expect_eig = dense_kronecker_solve(a_dec, g_dec, x, damping(s));
    const MatrixXd expect_rec = dense_kronecker_solve(a_dec, g_dec, x, damping(dec_step));
    const double sd = std::sqrt(damping(dec_step));
    const MatrixXd expect_chol = (g_dec + sd * MatrixXd::Identity(2, 2)).inverse() * x *
                                 (a_dec + sd * MatrixXd::Identity(4, 4)).inverse();
    MatrixXd expect_diag(2, 4);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 4; ++j) expect_diag(i, j) = x(i, j) / (g(i, i) * a(j, j) + damping(s));
    const std::pair<Pre*, const MatrixXd*> runs[] = {
        {&eig, &expect_eig}, {&pre_rec, &expect_rec}, {&chol, &expect_chol}, {&diag, &expect_diag}};
    int which = 0;
    for (const auto& run : runs) {
      INFO("preconditioner " << which++);
      const DenseBatch mine = d.twin();
      mine.feed(*run.first, "fc");
      run.first->step();
      CHECK(rel_err(mine.gradient(), *run.second) < 1e-10);
    }
    if (s % 2 == 1) CHECK(rel_err(expect_eig, expect_rec) > 1e-6);  // the cases do differ
  }
}

TEST_CASE("skip_layers leaves a layer's gradient untouched", "[schedule][skip_layers]") {
  // "fc" is skipped by name, every batch_norm by kind; "conv" is preconditioned exactly as if
  // it were alone, KL clipping included.
  const auto options = plain_options().with_kl_clip(1e-4);
  Pre pre(kfac::Options(options).with_skip_layers({"fc", "batch_norm"}));
  Pre alone(options);
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  pre.register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(2));
  pre.register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 2, 2, 2));
  alone.register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 2, 2, 2));
  CHECK(pre.is_skipped("fc"));
  CHECK(pre.is_skipped("bn"));
  CHECK_FALSE(pre.is_skipped("conv"));
  Rng rng(29);
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s);
    const auto x = random_view4<double>(2, 2, 3, 3, rng), dy = random_view4<double>(2, 2, 2, 2, rng);
    auto w = random_view4<double>(2, 2, 2, 2, rng);
    auto b = random_vector<double>(2, rng);
    auto w_alone = clone(w);
    auto b_alone = clone(b);
    for (Pre* p : {&pre, &alone}) {
      p->observe_input("conv", x);
      p->observe_output_grad("conv", dy);
    }
    pre.set_gradient("conv", w, b);
    alone.set_gradient("conv", w_alone, b_alone);
    // Skipped layers need no observations; a gradient handed over stays as it is.
    DenseBatch fc(3, 2, true, 4, rng);
    const auto fc_w = clone(fc.w);
    const auto fc_b = clone(fc.b);
    if (s == 1) fc.feed(pre, "fc");  // observing a skipped layer is allowed and ignored
    pre.set_gradient("fc", fc.w, fc.b);
    auto dgamma = random_vector<double>(2, rng), dbeta = random_vector<double>(2, rng);
    const auto dgamma0 = clone(dgamma), dbeta0 = clone(dbeta);
    if (s == 0) pre.set_gradient("bn", dgamma, dbeta);
    pre.step();
    alone.step();
    CHECK(same_bits(fc.w, fc_w));
    CHECK(same_bits(fc.b, fc_b));
    CHECK(same_bits(dgamma, dgamma0));
    CHECK(same_bits(dbeta, dbeta0));
    CHECK(same_bits(w, w_alone));
    CHECK(same_bits(b, b_alone));
    CHECK(pre.last_kl_scale() == alone.last_kl_scale());
  }
  CHECK(pre.memory_report()[0].total() == 0);  // nothing was allocated for the skipped layer
}

TEST_CASE("memory_report of one Dense layer matches the documented formula", "[schedule][memory]") {
  // KroneckerBlock::memory(): factors (a^2 + g^2) * sizeof(Factor) (a + g for Diagonal);
  // eigendecomposition (a^2 + a + g^2 + g) * sizeof(Decomposition), plus g * a for a
  // precomputed reciprocal; workspace 3 g a * sizeof(Decomposition) (2 g a for Diagonal) plus,
  // from the first observation on, the pending Gram matrices, the size of the factors whatever
  // the batch and the number of observations (issue 15: no longer batch * (a + g) rows), kept
  // after the step (issue 27: no step allocates them again).
  const int in = 5, out = 3, a = in + 1, g = out, batch = 4;
  const std::size_t d8 = sizeof(double), f4 = sizeof(float);
  auto run = [&](auto tag, auto prec, bool precompute, std::size_t factors,
                 std::size_t decomposition, std::size_t workspace) {
    using Factor = decltype(tag);
    using Prec = decltype(prec);
    Pre pre(plain_options().with_precompute_reciprocal(precompute));
    pre.register_layer<kfac::Dense, Factor, kfac::Eigendecomposition<>, Prec>("fc", kfac::Dense(in, out));
    auto r = pre.memory_report();
    REQUIRE(r.size() == 1);
    CHECK(r[0].name == "fc");
    CHECK(r[0].kind == "dense");
    CHECK(r[0].total() == 0);
    Rng rng(1);
    DenseBatch d(in, out, true, batch, rng);
    d.feed(pre, "fc");
    r = pre.memory_report();
    CHECK(r[0].factor_bytes == 0);
    CHECK(r[0].workspace_bytes == factors);  // the pending Gram matrices
    const DenseBatch more(in, out, true, 3 * batch, rng);  // a second, larger micro-batch
    pre.observe_input("fc", more.x);
    pre.observe_output_grad("fc", more.g);
    CHECK(pre.memory_report()[0].workspace_bytes == factors);
    pre.step();
    r = pre.memory_report();
    CHECK(r[0].factor_bytes == factors);
    CHECK(r[0].decomposition_bytes == decomposition);
    CHECK(r[0].workspace_bytes == workspace + factors);  // the Gram matrices are kept
    CHECK(r[0].total() == factors + decomposition + workspace + factors);
    const DenseBatch next(in, out, true, batch, rng);  // the next step reuses them
    next.feed(pre, "fc");
    CHECK(pre.memory_report()[0].workspace_bytes == workspace + factors);
  };
  const std::size_t eig = std::size_t(a * a + a + g * g + g);
  SECTION("Symmetric, double") {
    run(kfac::Symmetric{}, kfac::DoublePrecision{}, false, (a * a + g * g) * d8, eig * d8, 3 * g * a * d8);
  }
  SECTION("precomputed reciprocal") {
    run(kfac::Symmetric{}, kfac::DoublePrecision{}, true, (a * a + g * g) * d8, (eig + g * a) * d8, 3 * g * a * d8);
  }
  SECTION("mixed precision") {
    run(kfac::Full{}, kfac::MixedPrecision{}, false, (a * a + g * g) * f4, eig * d8, 3 * g * a * d8);
  }
  SECTION("Diagonal") {
    run(kfac::Diagonal{}, kfac::DoublePrecision{}, false, (a + g) * d8, 0, 2 * g * a * d8);
  }
}
