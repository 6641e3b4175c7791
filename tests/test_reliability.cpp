// Checkpoints resume bit-identically and refuse bad files; non-finite values are skipped or
// reported; failed decompositions retry with more damping.
#include <catch2/catch.hpp>
#include <kfac/kfac.hpp>
#include <cstring>
#include <limits>
#include <sstream>

#include "reference.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;
using Pre = kfac::Preconditioner<double, Host>;

namespace {

kfac::Options options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-2).with_lr(0.3)
      .with_factor_update_steps(1).with_inv_update_steps(3).with_factor_decay(0.9);
}

void register_all(Pre& pre) {
  pre.register_layer<kfac::Dense>("fc1", kfac::Dense(6, 5));
  pre.register_layer<kfac::Dense, kfac::Full, kfac::Cholesky<>>("fc2", kfac::Dense(5, 3, false));
  pre.register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 2, 3, 3).with_padding(1, 1));
  pre.register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(2));
}

/// One training-like step with data drawn from `step`; returns the preconditioned gradients.
std::vector<double> run_step(Pre& pre, long step, double poison = 0.0) {
  Rng rng(500 + std::uint64_t(step));
  auto x1 = random_view<double>(8, 6, rng), g1 = random_view<double>(8, 5, rng);
  auto x2 = random_view<double>(8, 5, rng), g2 = random_view<double>(8, 3, rng);
  auto xc = random_view4<double>(8, 2, 4, 4, rng), gc = random_view4<double>(8, 2, 4, 4, rng);
  auto xb = random_view4<double>(8, 2, 3, 3, rng), gb = random_view4<double>(8, 2, 3, 3, rng);
  auto w1 = random_view<double>(5, 6, rng); auto b1 = random_vector<double>(5, rng);
  auto w2 = random_view<double>(3, 5, rng);
  auto wc = random_view4<double>(2, 2, 3, 3, rng); auto bc = random_vector<double>(2, rng);
  auto gm = random_vector<double>(2, rng), bt = random_vector<double>(2, rng);
  if (poison != 0.0) x1(0, 0) = poison;
  if (pre.wants_observations()) {
    pre.observe_input("fc1", x1); pre.observe_output_grad("fc1", g1);
    pre.observe_input("fc2", x2); pre.observe_output_grad("fc2", g2);
    pre.observe_input("conv", xc); pre.observe_output_grad("conv", gc);
    pre.observe_input("bn", xb); pre.observe_output_grad("bn", gb);
  }
  pre.set_gradient("fc1", w1, b1);
  pre.set_gradient("fc2", w2);
  pre.set_gradient("conv", wc, bc);
  pre.set_gradient("bn", gm, bt);
  pre.step();
  std::vector<double> out;
  for (const double* p : {w1.data(), b1.data(), w2.data(), wc.data(), bc.data(), gm.data(), bt.data()}) out.push_back(*p);
  for (std::size_t i = 0; i < w1.span(); ++i) out.push_back(w1.data()[i]);
  for (std::size_t i = 0; i < wc.span(); ++i) out.push_back(wc.data()[i]);
  return out;
}

std::string saved(const Pre& pre, bool with_dec = true) {
  std::ostringstream os(std::ios::binary);
  pre.save(os, with_dec);
  return os.str();
}

}  // namespace

TEST_CASE("a restored run continues bit-identically", "[checkpoint]") {
  Pre uninterrupted(options());
  register_all(uninterrupted);
  std::vector<std::vector<double>> expect;
  for (long s = 0; s < 10; ++s) expect.push_back(run_step(uninterrupted, s));

  Pre first(options());
  register_all(first);
  for (long s = 0; s < 5; ++s) run_step(first, s);  // step 5 is not a decomposition step
  const std::string bytes = saved(first);

  Pre resumed(options());
  register_all(resumed);
  std::istringstream is(bytes, std::ios::binary);
  CHECK(resumed.load(is));
  CHECK(resumed.step_count() == 5);
  for (long s = 5; s < 10; ++s) {
    INFO("step " << s);
    CHECK(run_step(resumed, s) == expect[std::size_t(s)]);  // exact equality, not a tolerance
  }
}

TEST_CASE("a checkpoint without decompositions recomputes them", "[checkpoint]") {
  Pre a(options());
  register_all(a);
  for (long s = 0; s < 3; ++s) run_step(a, s);  // step 3 is a decomposition step
  Pre b(options());
  register_all(b);
  std::istringstream is(saved(a, false), std::ios::binary);
  CHECK(b.load(is));
  // At a decomposition step both recompute from the same factors: identical results.
  CHECK(run_step(b, 3) == run_step(a, 3));
}

TEST_CASE("bad checkpoints are refused and change nothing", "[checkpoint][errors]") {
  Pre src(options());
  register_all(src);
  for (long s = 0; s < 4; ++s) run_step(src, s);
  const std::string good = saved(src);

  auto expect_refused = [&](const std::string& bytes, const std::string& what) {
    Pre target(options()), twin(options());
    register_all(target);
    register_all(twin);
    for (long s = 0; s < 2; ++s) { run_step(target, s); run_step(twin, s); }
    std::istringstream is(bytes, std::ios::binary);
    CHECK_THROWS_WITH(target.load(is), Catch::Contains(what));
    CHECK(target.step_count() == 2);
    CHECK(run_step(target, 2) == run_step(twin, 2));
  };
  SECTION("truncated") {
    for (std::size_t cut : {std::size_t(0), std::size_t(5), std::size_t(12), std::size_t(30), good.size() / 2, good.size() - 1})
      expect_refused(good.substr(0, cut), cut < 8 ? "bad magic" : "truncated");
  }
  SECTION("corrupted byte") {
    std::string bad = good;
    bad[good.size() / 2] ^= 0x40;
    expect_refused(bad, "checksum mismatch");
  }
  SECTION("foreign file") { expect_refused("P6\n640 480\n255\n" + std::string(100, 'x'), "not a kfac checkpoint"); }
  SECTION("future version") {
    std::string bad = good;
    bad[8] = 9;
    expect_refused(bad, "version 9 is not supported");
  }
  SECTION("different layers") {
    Pre other(options());
    other.register_layer<kfac::Dense>("fc1", kfac::Dense(6, 5));
    other.register_layer<kfac::Dense>("fc2", kfac::Dense(5, 3, false));  // Symmetric/eigen, not Full/Cholesky
    other.register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 2, 3, 3).with_padding(1, 1));
    other.register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(2));
    for (long s = 0; s < 2; ++s) run_step(other, s);
    expect_refused(saved(other), "layer 'fc2': checkpoint was written for dense(in=5,out=3,bias=0)/symmetric/eigen");
    Pre renamed(options());
    renamed.register_layer<kfac::Dense>("dense1", kfac::Dense(6, 5));
    expect_refused(saved(renamed), "checkpoint has 1 layers");
  }
}

TEST_CASE("NaN/Inf under the skip policy skips the step and keeps the last good state", "[nonfinite]") {
  auto opts = options().with_nonfinite_policy(kfac::NonFinitePolicy::skip);
  Pre pre(opts), twin(opts);
  register_all(pre);
  register_all(twin);
  for (long s = 0; s < 2; ++s) { run_step(pre, s); run_step(twin, s); }
  const std::string before = saved(pre);
  const auto skipped = run_step(pre, 2, std::numeric_limits<double>::quiet_NaN());
  CHECK(pre.skipped_steps() == 1);
  // gradients untouched: equal to the raw random values drawn for step 2
  Rng rng(502);
  for (int k = 0; k < 4; ++k) random_view<double>(8, k == 0 ? 6 : k == 1 ? 5 : k == 2 ? 5 : 3, rng);
  random_view4<double>(8, 2, 4, 4, rng); random_view4<double>(8, 2, 4, 4, rng);
  random_view4<double>(8, 2, 3, 3, rng); random_view4<double>(8, 2, 3, 3, rng);
  auto w1 = random_view<double>(5, 6, rng);
  CHECK(skipped[0] == w1(0, 0));
  CHECK(pre.step_count() == 3);
  // factors unchanged: the next factor update starts from the same state as a twin that skipped too
  run_step(twin, 2, std::numeric_limits<double>::infinity());
  CHECK(twin.skipped_steps() == 1);
  CHECK(run_step(pre, 3) == run_step(twin, 3));
  CHECK(saved(pre).size() == before.size());
}

TEST_CASE("NaN/Inf under the raise policy is an error naming the layer", "[nonfinite][errors]") {
  Pre pre(options());
  register_all(pre);
  Rng rng(1);
  auto x = random_view<double>(4, 6, rng);
  x(2, 3) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(pre.observe_input("fc1", x), Catch::Contains("layer 'fc1'") && Catch::Contains("1 NaN/Inf"));
}

TEST_CASE("observations that would overflow the factor type are refused", "[nonfinite][errors]") {
  // (inputs, rows, value): 3 rows of 3e30, whose squares overflow float; and 8 rows of one input
  // of 1e19, whose squares (1e38) fit but whose sum (8e38) does not, while the trace over the
  // normalizer (1e38) is below float's largest value: the check reads the folded Gram matrix
  // itself, so it sees the overflow that a sum of squares in double would not.
  using FPre = kfac::Preconditioner<float, Host>;
  struct Case { int inputs, rows; float value; };
  for (const Case c : {Case{4, 3, 3e30f}, Case{1, 8, 1e19f}})
    for (auto policy : {kfac::NonFinitePolicy::raise, kfac::NonFinitePolicy::skip}) {
      INFO(c.rows << " rows of " << c.inputs << " inputs of " << c.value);
      FPre pre(kfac::Options{}.with_kl_clip(0.0).with_nonfinite_policy(policy));
      pre.register_layer<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>>("big", kfac::Dense(c.inputs, 2, false));
      Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> x("x", c.rows, c.inputs), g("g", c.rows, 2),
          w("w", 2, c.inputs);
      Kokkos::deep_copy(x, c.value);
      Kokkos::deep_copy(g, 1.0f);
      Kokkos::deep_copy(w, 1.0f);
      pre.observe_input("big", x);
      pre.observe_output_grad("big", g);
      pre.set_gradient("big", w);
      if (policy == kfac::NonFinitePolicy::raise) {
        CHECK_THROWS_WITH(pre.step(), Catch::Contains("layer 'big'") && Catch::Contains("overflow the factor type"));
        CHECK(pre.step_count() == 0);
      } else {
        pre.step();
        CHECK(pre.skipped_steps() == 1);
      }
      CHECK(w(0, 0) == 1.0f);
      CHECK_FALSE(pre.layer("big").has_factors());
    }
}

TEST_CASE("a decomposition that keeps failing is reported with the layer name", "[nonfinite][retry]") {
  // Newton-Schulz needs about log2(cond) iterations to converge; a factor of 1e30 with damping
  // 1e-30 has cond ~ 1e45 and needs ~150 > 100 iterations even after three 10x damping raises.
  // pi = 1, for which the iteration count above was worked out.
  Pre pre(kfac::Options{}.with_kl_clip(0.0).with_damping(1e-30));
  pre.register_layer("ns", kfac::Dense(3, 2, false),
                     kfac::KFAC<kfac::Symmetric, kfac::NewtonSchulz>(kfac::NewtonSchulz{}.with_pi_damping(false)));
  Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace> x("x", 1, 3), g("g", 1, 2), w("w", 2, 3);
  Kokkos::deep_copy(x, 1e15);
  Kokkos::deep_copy(g, 1.0);
  Kokkos::deep_copy(w, 1.0);
  pre.observe_input("ns", x);
  pre.observe_output_grad("ns", g);
  pre.set_gradient("ns", w);
  CHECK_THROWS_WITH(pre.step(), Catch::Contains("layer 'ns'") && Catch::Contains("after 3 damping increase(s)") &&
                                    Catch::Contains("Newton-Schulz"));
}

TEST_CASE("loading a checkpoint saved before any factor update drops the old factors", "[checkpoint]") {
  Pre empty(options()), trained(options()), fresh(options());
  for (Pre* p : {&empty, &trained, &fresh}) register_all(*p);
  for (long s = 0; s < 4; ++s) run_step(trained, s);
  std::istringstream is(saved(empty), std::ios::binary);
  trained.load(is);
  CHECK_FALSE(trained.layer("fc1").has_factors());
  CHECK(saved(trained) == saved(fresh));
  CHECK(run_step(trained, 0) == run_step(fresh, 0));
}

TEST_CASE("checkpoints with impossible counters or NaN values are refused", "[checkpoint][errors]") {
  Pre src(options());
  register_all(src);
  for (long s = 0; s < 4; ++s) run_step(src, s);
  const std::string good = saved(src);
  // Patches `value` in at `at` and recomputes the checksum, so that the body checks are reached.
  auto patched = [&](std::size_t at, auto value) {
    std::string b = good;
    std::memcpy(&b[at], &value, sizeof(value));
    const std::uint64_t sum = kfac::impl::fnv1a_bytes(b.data() + 20, b.size() - 28);
    std::memcpy(&b[b.size() - 8], &sum, 8);
    return b;
  };
  // First layer record (format version 2): name and signature strings, the layer's schedule
  // (4 x i64), the factor flag, the buffer count, then the first buffer's scalar size and value
  // count before its values.
  auto u32 = [&](std::size_t at) { std::uint32_t v; std::memcpy(&v, &good[at], 4); return std::size_t(v); };
  const std::size_t name = 20 + 56, sig = name + 4 + u32(name),
                    first_value = sig + 4 + u32(sig) + 32 + 1 + 4 + 1 + 8;
  const std::size_t after_factors = first_value + 8 * (6 + 1) * (6 + 1) + 1 + 8 + 8 * 5 * 5;  // A 7x7, G 5x5
  auto expect_refused = [&](const std::string& bytes, const std::string& what) {
    Pre target(options());
    register_all(target);
    std::istringstream is(bytes, std::ios::binary);
    CHECK_THROWS_WITH(target.load(is), Catch::Contains(what));
    CHECK(target.step_count() == 0);
    CHECK_FALSE(target.layer("fc1").has_factors());
  };
  expect_refused(patched(20, std::numeric_limits<std::int64_t>::max() - 1), "step counter");
  expect_refused(patched(20 + 24, std::int64_t(4)), "last-update step 4 at step 4");
  expect_refused(patched(first_value, std::numeric_limits<double>::quiet_NaN()), "layer 'fc1': checkpoint has NaN/Inf");
  expect_refused(patched(after_factors + 1, -1.0), "layer 'fc1': checkpoint has decomposition damping -1");
}

TEST_CASE("a NaN gradient under the raise policy is an error naming the layer", "[nonfinite][errors]") {
  Pre pre(options());
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(4, 3));
  Rng rng(9);
  auto x = random_view<double>(5, 4, rng), g = random_view<double>(5, 3, rng);
  auto w = random_view<double>(3, 4, rng);
  auto b = random_vector<double>(3, rng);
  b(1) = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> w_before(w.data(), w.data() + w.span());
  pre.observe_input("fc", x);
  pre.observe_output_grad("fc", g);
  pre.set_gradient("fc", w, b);
  CHECK_THROWS_WITH(pre.step(), Catch::Contains("layer 'fc'") && Catch::Contains("gradient contains 1 NaN/Inf"));
  CHECK(pre.step_count() == 0);
  CHECK_FALSE(pre.layer("fc").has_factors());
  CHECK(std::vector<double>(w.data(), w.data() + w.span()) == w_before);
  b(1) = 0.5;  // fixed: the same pending observations now go through
  pre.step();
  CHECK(pre.step_count() == 1);
}
