// The large-batch schedules and recipe (kfac/recipes/): each schedule against its closed form,
// the schedules across a checkpoint/restore, and the recipe on a small problem against the same
// run with its schedules written out by hand.
#include <cmath>
#include <limits>
#include <set>
#include <sstream>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;
namespace sch = kfac::schedules;

TEST_CASE("EpochClock converts epochs and steps", "[large_batch][schedule]") {
  const sch::EpochClock c(14);
  CHECK(c.steps_per_epoch() == 14);
  CHECK(c.step_at(0) == 0);
  CHECK(c.step_at(1) == 14);
  CHECK(c.step_at(0.25) == 4);  // 3.5 rounds away from zero
  CHECK(c.step_at(2.5) == 35);
  CHECK(c.epoch_of(21) == 1.5);
  CHECK_THROWS_AS(sch::EpochClock(0), kfac::Error);
  CHECK_THROWS_AS(c.step_at(-1), kfac::Error);
  CHECK_THROWS_AS(c.step_at(std::nan("")), kfac::Error);
}

TEST_CASE("linear scaling, warm-up, polynomial decay and ramps match their closed forms", "[large_batch][schedule]") {
  CHECK(sch::linear_scaling(0.1, 256, 4096) == 0.1 * 4096.0 / 256.0);
  CHECK_THROWS_AS(sch::linear_scaling(0.1, 0, 4096), kfac::Error);
  CHECK_THROWS_AS(sch::linear_scaling(-1, 256, 4096), kfac::Error);

  // polynomial_decay(2, 5, 15, 3, 0.5): 2 before step 5, 0.5 from 15, the power-3 curve between.
  const auto poly = sch::polynomial_decay(2.0, 5, 15, 3.0, 0.5);
  for (long s = 0; s < 25; ++s) {
    INFO("step " << s);
    const double expect = s < 5 ? 2.0 : s >= 15 ? 0.5 : 0.5 + 1.5 * std::pow(1.0 - (s - 5) / 10.0, 3.0);
    CHECK(poly(s) == Approx(expect).epsilon(1e-15));
  }
  CHECK(poly(14) > 0.5);
  CHECK_THROWS_AS(sch::polynomial_decay(1, 5, 5, 2), kfac::Error);
  CHECK_THROWS_AS(sch::polynomial_decay(1, 0, 5, 0), kfac::Error);

  // Warm-up from 0.1 over 4 steps into the decay above: 0.1, 0.575, 1.05, 1.525, then poly.
  const auto warm = sch::linear_warmup(0.1, 4, poly);
  const std::vector<double> head{0.1, 0.575, 1.05, 1.525};
  for (long s = 0; s < 4; ++s) CHECK(warm(s) == Approx(head[s]).epsilon(1e-15));
  for (long s = 4; s < 25; ++s) CHECK(warm(s) == poly(s));
  const auto none = sch::linear_warmup(0.1, 0, poly);
  for (long s = 0; s < 25; ++s) CHECK(none(s) == poly(s));
  CHECK_THROWS_AS(sch::linear_warmup(0.1, -1, poly), kfac::Error);
  CHECK_THROWS_AS(sch::linear_warmup(0.1, 3, nullptr), kfac::Error);

  // Damping ramp 1 -> 0.01 between steps 2 and 6: 1, 1, 1, 10^(-1/2), 0.1, 10^(-3/2), 0.01, 0.01.
  const auto ramp = sch::geometric_ramp(1.0, 0.01, 2, 6);
  const std::vector<double> r{1, 1, 1, std::pow(10.0, -0.5), 0.1, std::pow(10.0, -1.5), 0.01, 0.01};
  for (long s = 0; s < long(r.size()); ++s) CHECK(ramp(s) == Approx(r[s]).epsilon(1e-14));
  CHECK(sch::geometric_ramp(1.0, 0.5, 3, 3)(3) == 0.5);
  CHECK_THROWS_AS(sch::geometric_ramp(0.0, 0.5, 0, 3), kfac::Error);
  CHECK_THROWS_AS(sch::geometric_ramp(1.0, 0.5, 4, 3), kfac::Error);

  CHECK(sch::kl_clip_for_batch(0.01, 256, 4096) == Approx(0.16).epsilon(1e-15));
  CHECK(sch::kl_clip_for_batch(0.01, 256, 4096, 2.0) == Approx(2.56).epsilon(1e-15));
  CHECK(sch::kl_clip_for_batch(0.0, 256, 4096) == 0.0);
  CHECK_THROWS_AS(sch::kl_clip_for_batch(0.01, 256, 0), kfac::Error);
}

TEST_CASE("stale_fisher_after: first until hold, then doubling up to the cap", "[large_batch][stale_fisher]") {
  const auto f = sch::stale_fisher_after(6, 1, 8, 3);
  for (long s = 0; s < 40; ++s) {
    INFO("step " << s);
    CHECK(f(s) == (s < 6 ? 1 : s < 9 ? 2 : s < 12 ? 4 : 8));
  }
  const auto g = sch::stale_fisher_after(0, 3, 10, 2);  // 6 at once, 10 (capped) from step 2
  CHECK(g(0) == 6);
  CHECK(g(1) == 6);
  CHECK(g(2) == 10);
  CHECK(g(1000000) == 10);
  const long huge = std::numeric_limits<long>::max();
  CHECK(sch::stale_fisher_after(0, 1, huge, 1)(1000) == huge);  // capped, not overflowed
  CHECK_THROWS_AS(sch::stale_fisher_after(-1, 1, 2, 1), kfac::Error);
  CHECK_THROWS_AS(sch::stale_fisher_after(0, 2, 1, 1), kfac::Error);
  CHECK_THROWS_AS(sch::stale_fisher_after(0, 1, 2, 0), kfac::Error);
}

namespace {

// The small problem's recipe: batch 100 of 300 samples (3 steps per epoch), 6 epochs, tuned
// at batch 25 (scale 4); warm-up and damping ramp over 1 epoch (3 steps), damping from 4 x
// 0.01 (the scale); stale-Fisher cap 2 epochs = 6 steps, so the intervals go 1, 2, 4, 6.
kfac::recipes::LargeBatch small_recipe() {
  return kfac::recipes::large_batch(100, 3, 6)
      .with_reference_batch(25)
      .with_warmup_epochs(1)
      .with_lr(0.1)
      .with_damping(0.01)
      .with_kl_clip(0.01)
      .with_stale_fisher(1, 1, 2);
}

// The same schedules written out from the documented formulas.
double hand_decay(long s) {
  const double peak = 0.1 * 100.0 / 25.0, final_lr = 0.01 * peak;
  if (s >= 18) return final_lr;
  return final_lr + (peak - final_lr) * std::pow(1.0 - double(s - 3) / double(18 - 3), 2.0);
}
double hand_lr(long s) { return s >= 3 ? hand_decay(s) : 0.1 + (hand_decay(3) - 0.1) * (double(s) / 3.0); }
double hand_damping(long s) { return s == 0 ? 0.04 : s >= 3 ? 0.01 : 0.04 * std::pow(0.01 / 0.04, double(s) / 3.0); }
long hand_interval(long s) { return s < 3 ? 1 : s < 6 ? 2 : s < 9 ? 4 : 6; }
const double hand_kl = 0.01 * std::pow(100.0 / 25.0, 1.0);

kfac::Options hand_options() {
  return kfac::Options{}.with_lr(hand_lr).with_damping(hand_damping).with_kl_clip(hand_kl)
      .with_factor_update_steps(hand_interval).with_inv_update_steps(hand_interval);
}

}  // namespace

TEST_CASE("the recipe's schedules match their closed forms", "[large_batch][recipe]") {
  const auto r = small_recipe();
  const auto lr = r.lr_schedule(), damping = r.damping_schedule();
  const auto fi = r.factor_intervals(), ii = r.inv_intervals();
  for (long s = 0; s < 30; ++s) {
    INFO("step " << s);
    CHECK(lr(s) == hand_lr(s));
    CHECK(damping(s) == hand_damping(s));
    CHECK(fi(s) == hand_interval(s));
    CHECK(ii(s) == hand_interval(s));
  }
  CHECK(lr(0) == 0.1);  // the warm-up starts at the reference batch's rate
  CHECK(lr(3) == Approx(0.4).epsilon(1e-15));
  CHECK(r.scaled_kl_clip() == hand_kl);
  // The first-order counterpart: the same plan around another base rate.
  const auto sgd = r.lr_schedule(0.05);
  CHECK(sgd(0) == 0.05);
  CHECK(sgd(3) == Approx(0.2).epsilon(1e-15));
  CHECK(sgd(10) == Approx(lr(10) / 2).epsilon(1e-14));
  // Step decay instead: x0.5 every epoch after the warm-up.
  const auto step = kfac::recipes::large_batch(100, 3, 6).with_reference_batch(25).with_warmup_epochs(1)
      .with_step_decay(0.5, 1).lr_schedule();
  CHECK(step(3) == Approx(0.4).epsilon(1e-15));
  CHECK(step(6) == Approx(0.2).epsilon(1e-15));
  CHECK(step(17) == Approx(0.4 / 16).epsilon(1e-15));  // (17 - 3) / 3 = 4 halvings
  // inv_per_factor multiplies the factor interval.
  const auto twice = small_recipe().with_inv_per_factor(2).inv_intervals();
  CHECK(twice(0) == 2);
  CHECK(twice(10) == 12);
  // The default ramp: damping x min(10, scale), none at the reference batch; or as given.
  CHECK(kfac::recipes::large_batch(25, 12, 6).with_reference_batch(25).damping_schedule()(0) == 0.01);
  CHECK(kfac::recipes::large_batch(4096, 14, 6).damping_schedule()(0) == Approx(0.1).epsilon(1e-15));
  CHECK(small_recipe().with_damping_ramp(0.5, 2).damping_schedule()(0) == 0.5);
  CHECK(small_recipe().with_damping_ramp(0.5, 2).damping_schedule()(6) == 0.01);
  CHECK_THROWS_AS(kfac::recipes::large_batch(0, 3, 6), kfac::Error);
  CHECK_THROWS_AS(kfac::recipes::large_batch(100, 0, 6), kfac::Error);
  CHECK_THROWS_AS(small_recipe().with_warmup_epochs(7).lr_schedule(), kfac::Error);
  CHECK_THROWS_AS(small_recipe().with_polynomial_decay(2, 0).options(), kfac::Error);
}

TEST_CASE("the recipe's schedules continue across a checkpoint/restore", "[large_batch][checkpoint]") {
  const kfac::Options options = small_recipe().options();
  const long steps = 24;
  Rng rng(11);
  std::vector<DenseBatch> data;
  for (long s = 0; s < steps; ++s) data.emplace_back(4, 3, true, 6, rng);
  std::set<long> updates;  // the closed form's update steps
  for (long s = 0; s < steps; s += hand_interval(s)) updates.insert(s);
  CHECK(updates == std::set<long>{0, 1, 2, 3, 5, 7, 11, 17, 23});

  for (long k : {8L, 11L}) {  // saved between updates, and on an update step
    DYNAMIC_SECTION("saved at step " << k) {
      Pre whole(options), first(options);
      for (Pre* p : {&whole, &first}) p->register_layer<kfac::Dense>("fc", kfac::Dense(4, 3));
      for (long s = 0; s < k; ++s) {
        const DenseBatch a = data[s].twin(), b = data[s].twin();
        a.feed(whole, "fc");
        b.feed(first, "fc");
        whole.step();
        first.step();
      }
      std::stringstream checkpoint;
      first.save(checkpoint);
      Pre resumed(options);  // a fresh preconditioner, built from the same recipe
      resumed.register_layer<kfac::Dense>("fc", kfac::Dense(4, 3));
      CHECK(resumed.load(checkpoint));
      CHECK(resumed.step_count() == k);
      long last_update = -1;
      for (long s = k; s < steps; ++s) {
        INFO("step " << s);
        CHECK(resumed.step_count() == s);
        const auto& o = resumed.options();
        CHECK(o.lr(s) == hand_lr(s));
        CHECK(o.damping(s) == hand_damping(s));
        CHECK(o.factor_update_steps(s) == hand_interval(s));
        CHECK(resumed.wants_observations() == bool(updates.count(s)));
        CHECK(resumed.will_decompose() == bool(updates.count(s)));
        CHECK(whole.wants_observations() == bool(updates.count(s)));
        const DenseBatch a = data[s].twin(), b = data[s].twin();
        a.feed(whole, "fc");
        b.feed(resumed, "fc");
        whole.step();
        resumed.step();
        if (updates.count(s)) last_update = s;
        CHECK(same_bits(a.w, b.w));
        CHECK(same_bits(a.b, b.b));
        CHECK(whole.last_kl_scale() == resumed.last_kl_scale());
        if (last_update >= 0) CHECK(resumed.last_factor_step() == last_update);
      }
    }
  }
}

namespace {

/// Softmax regression (Dense(6, 3) + cross-entropy, mean over the batch) on 300 fixed samples,
/// batches of 100 in order, K-FAC preconditioned SGD with the learning rate lr(step). Returns
/// the final weights (3 x 7, bias last) and the losses of the first and last epochs.
struct SmallRun {
  MatrixXd w;
  double first_loss = 0, last_loss = 0;
};

SmallRun train_small(const kfac::Options& options, const std::function<double(long)>& lr, int epochs) {
  const int n = 300, batch = 100, in = 6, out = 3;
  Rng rng(23);
  MatrixXd x(n, in), w(out, in + 1);
  std::vector<int> y(n);
  MatrixXd centers(out, in);
  for (int c = 0; c < out; ++c)
    for (int j = 0; j < in; ++j) centers(c, j) = 1.5 * rng.uniform();
  for (int i = 0; i < n; ++i) {
    y[i] = i % out;
    for (int j = 0; j < in; ++j) x(i, j) = centers(y[i], j) + rng.uniform();
  }
  w.setZero();
  Pre pre(options);
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(in, out));
  SmallRun run;
  for (int e = 0; e < epochs; ++e) {
    double loss = 0;
    for (int b0 = 0; b0 < n; b0 += batch) {
      V2<double> xv("x", batch, in), gv("g", batch, out), wg("wg", out, in);
      V1<double> bg("bg", out);
      for (int i = 0; i < batch; ++i) {
        double logit[3], m = -1e300, z = 0;
        for (int c = 0; c < out; ++c) {
          logit[c] = w(c, in);
          for (int j = 0; j < in; ++j) logit[c] += w(c, j) * x(b0 + i, j);
          m = std::max(m, logit[c]);
        }
        for (int c = 0; c < out; ++c) z += std::exp(logit[c] - m);
        loss += (m + std::log(z) - logit[y[b0 + i]]) / n;
        for (int j = 0; j < in; ++j) xv(i, j) = x(b0 + i, j);
        for (int c = 0; c < out; ++c) gv(i, c) = (std::exp(logit[c] - m) / z - (c == y[b0 + i])) / batch;
      }
      for (int c = 0; c < out; ++c) {
        bg(c) = 0;
        for (int i = 0; i < batch; ++i) bg(c) += gv(i, c);
        for (int j = 0; j < in; ++j) {
          wg(c, j) = 0;
          for (int i = 0; i < batch; ++i) wg(c, j) += gv(i, c) * xv(i, j);
        }
      }
      if (pre.wants_observations()) {
        pre.observe_input("fc", xv);
        pre.observe_output_grad("fc", gv);
      }
      pre.set_gradient("fc", wg, bg);
      const double eta = lr(pre.step_count());
      pre.step();
      for (int c = 0; c < out; ++c) {
        for (int j = 0; j < in; ++j) w(c, j) -= eta * wg(c, j);
        w(c, in) -= eta * bg(c);
      }
    }
    if (e == 0) run.first_loss = loss;
    run.last_loss = loss;
  }
  run.w = w;
  return run;
}

}  // namespace

TEST_CASE("the recipe on a small problem equals the run with its schedules written by hand", "[large_batch][recipe]") {
  const auto recipe = small_recipe();
  const SmallRun a = train_small(recipe.options(), recipe.lr_schedule(), 6);
  const SmallRun b = train_small(hand_options(), hand_lr, 6);
  CHECK(a.w == b.w);  // bit for bit
  CHECK(a.last_loss == b.last_loss);
  CHECK(a.last_loss < 0.8 * a.first_loss);  // it learns
  // The comparison can fail: constant settings (no warm-up, decay, ramp or stale intervals) differ.
  const kfac::Options constant = kfac::Options{}.with_lr(0.4).with_damping(0.01).with_kl_clip(hand_kl)
      .with_factor_update_steps(1).with_inv_update_steps(1);
  const SmallRun c = train_small(constant, [](long) { return 0.4; }, 6);
  CHECK(!(c.w == a.w));
}
