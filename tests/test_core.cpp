// The redesigned core, single process: a method defined outside the library (toy_method.hpp)
// plugs in next to K-FAC and gives its closed form, checkpoints and resumes bit for bit; a
// failing decomposition leaves the preconditioner exactly as it was; per-layer overrides
// behave like global Options; inversion settings travel with the method; type traits.
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "toy_method.hpp"

using namespace kfac_test;

namespace {

using ToyB = ToyBlock<Host>;

kfac::Options core_options() {
  return plain_options(1e-2).with_inv_update_steps(1).with_factor_decay(0.9);
}

/// One step's data: "fc" Dense(3, 2) under K-FAC and "toy" Dense(4, 3) under ScaledIdentity.
struct CoreData {
  Rng rng_fc, rng_toy;
  DenseBatch fc, toy;
  explicit CoreData(unsigned step, int batch = 5)
      : rng_fc(step + 300), rng_toy(step + 8077), fc(3, 2, true, batch, rng_fc), toy(4, 3, true, batch, rng_toy) {}
  void feed(Pre& pre) const {
    fc.feed(pre, "fc");
    toy.feed(pre, "toy");
  }
  /// The gradients after step(), flattened (fc then toy).
  std::vector<double> result() const {
    std::vector<double> v;
    for (const auto* b : {&fc, &toy}) {
      v.insert(v.end(), b->w.data(), b->w.data() + b->w.span());
      v.insert(v.end(), b->b.data(), b->b.data() + b->b.span());
    }
    return v;
  }
};

void register_core(Pre& pre) {
  pre.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{});
  pre.register_layer("toy", kfac::Dense(4, 3), ScaledIdentity{}.with_damping(0.5));
}

std::string saved(const Pre& pre) {
  std::ostringstream os;
  pre.save(os);
  return os.str();
}

bool bit_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

/// Steps `pre` through steps [from, to) with CoreData(step); returns every step's result.
std::vector<std::vector<double>> run(Pre& pre, long from, long to) {
  std::vector<std::vector<double>> out;
  for (long s = from; s < to; ++s) {
    CoreData d{unsigned(s)};
    d.feed(pre);
    pre.step();
    out.push_back(d.result());
  }
  return out;
}

}  // namespace

TEST_CASE("a method defined outside the library gives its closed form next to K-FAC", "[core][toy]") {
  Pre pre(core_options());
  register_core(pre);
  const double decay = 0.9, damping = 0.5;
  double s = 0;
  for (int step = 0; step < 25; ++step) {
    CoreData d{unsigned(step)};
    const MatrixXd x = to_eigen(d.toy.x), grad = d.toy.gradient();
    d.feed(pre);
    pre.step();
    const double m = x.squaredNorm() / double(x.size());
    s = step == 0 ? m : decay * s + (1 - decay) * m;
    const MatrixXd expected = grad / (s + damping);
    const MatrixXd got = grad_with_bias(d.toy.w, d.toy.b);
    INFO("step " << step);
    CHECK((got - expected).cwiseAbs().maxCoeff() <= 1e-14 * expected.cwiseAbs().maxCoeff());
    const auto& blk = pre.layer_as<ToyB>("toy");
    CHECK(std::abs(blk.statistic() - s) <= 1e-15 * s);
    CHECK(blk.counter() == double(step + 1));  // one micro-batch per step
    CHECK(std::abs(blk.inverse() - 1 / (s + damping)) <= 1e-15);
  }
  CHECK(pre.layer("toy").kind() == std::string("toy"));
}

TEST_CASE("a toy-method run resumed from a checkpoint equals an uninterrupted one bit for bit", "[core][toy][checkpoint]") {
  Pre whole(core_options());
  register_core(whole);
  const auto expected = run(whole, 0, 14);

  for (bool with_decompositions : {true, false}) {
    INFO("with decompositions: " << with_decompositions);
    Pre first(core_options());
    register_core(first);
    run(first, 0, 7);
    std::stringstream ckpt;
    first.save(ckpt, with_decompositions);

    Pre resumed(core_options());
    register_core(resumed);
    CHECK(resumed.load(ckpt));  // false only when saved decompositions could not be restored
    CHECK(resumed.step_count() == 7);
    CHECK(resumed.layer_as<ToyB>("toy").counter() == first.layer_as<ToyB>("toy").counter());
    CHECK(resumed.layer_as<ToyB>("toy").statistic() == first.layer_as<ToyB>("toy").statistic());
    const auto rest = run(resumed, 7, 14);
    for (std::size_t k = 0; k < rest.size(); ++k) {
      INFO("step " << 7 + k);
      CHECK(bit_equal(rest[k], expected[7 + k]));
    }
    CHECK(saved(resumed) == saved(whole));
  }
}

TEST_CASE("a corrupt toy-method checkpoint is refused and changes nothing", "[core][toy][checkpoint]") {
  Pre a(core_options());
  register_core(a);
  run(a, 0, 3);
  const std::string good = saved(a);

  Pre b(core_options());
  register_core(b);
  run(b, 0, 5);
  const std::string before = saved(b);
  // The toy's counter is the last 8 bytes of its state: flip a bit in the checksummed body.
  for (std::size_t pos : {good.size() / 2, good.size() - 20, std::size_t(12)}) {
    std::string bad = good;
    bad[pos] = char(bad[pos] ^ 0x10);
    std::istringstream is(bad);
    INFO("flipped byte " << pos);
    CHECK_THROWS_AS(b.load(is), kfac::Error);
    CHECK(saved(b) == before);
  }
  std::istringstream cut(good.substr(0, good.size() - 9));
  CHECK_THROWS_AS(b.load(cut), kfac::Error);
  CHECK(saved(b) == before);
  // The untouched bytes still load.
  std::istringstream ok(good);
  CHECK_NOTHROW(b.load(ok));
  CHECK(saved(b) == good);
}

TEST_CASE("a failing decomposition leaves the preconditioner exactly as before the step", "[core][atomic]") {
  struct Case {
    ToyFailure how;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {ToyFailure::error, {"toy decomposition refused", "failed after 3 damping increase(s)"}},
      {ToyFailure::bad_alloc, {"decomposition failed", "bad_alloc"}},
      {ToyFailure::nan, {"NaN/Inf", "failed after 3"}},
  };
  for (const auto& c : cases)
    for (long fail_at : {0L, 4L}) {  // at 4 the toy (and fc) hold decompositions from step 3
      INFO("failure " << int(c.how) << " at step " << fail_at);
      Pre pre(core_options()), twin(core_options());
      register_core(pre);
      register_core(twin);
      run(pre, 0, fail_at);
      run(twin, 0, fail_at);

      CoreData d{unsigned(fail_at)};
      d.feed(pre);
      const std::string before = saved(pre);
      const long steps = pre.step_count(), lf = pre.last_factor_step(), li = pre.last_decomposition_step();
      const double inv = pre.layer_as<ToyB>("toy").inverse();
      const auto fc_a = clone(pre.layer_as<KLayer<kfac::Dense>>("fc").factor_a());
      const bool had_stats = pre.layer("toy").has_statistics();
      const std::vector<double> grads_before = d.result();
      {
        ToyFailScope fail(c.how);
        const long calls = toy_decompose_calls;
        expect_error([&] { pre.step(); }, "toy", c.parts);
        CHECK(toy_decompose_calls > calls);
      }
      CHECK(saved(pre) == before);
      CHECK(pre.step_count() == steps);
      CHECK(pre.last_factor_step() == lf);
      CHECK(pre.last_decomposition_step() == li);
      CHECK(pre.layer("toy").has_statistics() == had_stats);
      // An earlier decomposition is put back (the failing call scribbled -1 or NaN on it); a
      // first one leaves a buffer that nothing reads (saved() above: not decomposed).
      if (fail_at > 0) CHECK(pre.layer_as<ToyB>("toy").inverse() == inv);
      if (fail_at > 0) CHECK(same_bits(pre.layer_as<KLayer<kfac::Dense>>("fc").factor_a(), fc_a));
      CHECK(bit_equal(d.result(), grads_before));  // gradients untouched

      // The retry uses the pending observations and gradients of the failed call.
      pre.step();
      CoreData e{unsigned(fail_at)};
      e.feed(twin);
      twin.step();
      CHECK(bit_equal(d.result(), e.result()));
      CHECK(saved(pre) == saved(twin));
      const auto after = run(pre, fail_at + 1, fail_at + 3), twin_after = run(twin, fail_at + 1, fail_at + 3);
      for (std::size_t k = 0; k < after.size(); ++k) CHECK(bit_equal(after[k], twin_after[k]));
    }
}

TEST_CASE("a failure on a decomposition step of a longer interval restores the old decomposition", "[core][atomic]") {
  // Decompositions at 0, 3, 6: the failure at 3 must put back the decomposition of step 0, and
  // the retry and the steps after it (4, 5 use step 3's decomposition) equal a twin's.
  auto opts = core_options().with_inv_update_steps(3);
  Pre pre(opts), twin(opts);
  register_core(pre);
  register_core(twin);
  run(pre, 0, 3);
  run(twin, 0, 3);
  const double inv0 = pre.layer_as<ToyB>("toy").inverse();
  CoreData d(3);
  d.feed(pre);
  {
    ToyFailScope fail(ToyFailure::bad_alloc);
    CHECK_THROWS_AS(pre.step(), kfac::Error);
  }
  CHECK(pre.layer_as<ToyB>("toy").inverse() == inv0);
  pre.step();
  CoreData e(3);
  e.feed(twin);
  twin.step();
  CHECK(bit_equal(d.result(), e.result()));
  const auto a = run(pre, 4, 7), b = run(twin, 4, 7);
  for (std::size_t k = 0; k < a.size(); ++k) CHECK(bit_equal(a[k], b[k]));
}

TEST_CASE("per-layer overrides act like global Options for that layer", "[core][overrides]") {
  // "slow": inv_update_steps 3 and damping 1e-2 as overrides; "fast": the Options (1, 1e-3).
  const auto global = plain_options(1e-3).with_inv_update_steps(1).with_factor_decay(0.9);
  Pre both(global);
  both.register_layer("slow", kfac::Dense(3, 2), kfac::KFAC<>{}.with_inv_update_steps(3).with_damping(1e-2));
  both.register_layer("fast", kfac::Dense(4, 3), kfac::KFAC<>{});
  Pre slow_ref(plain_options(1e-2).with_inv_update_steps(3).with_factor_decay(0.9));
  slow_ref.register_layer("slow", kfac::Dense(3, 2), kfac::KFAC<>{});
  Pre fast_ref(global);
  fast_ref.register_layer("fast", kfac::Dense(4, 3), kfac::KFAC<>{});
  // The same layer under Options (1, 1e-2): equal to "slow" only at its decomposition steps.
  Pre every(plain_options(1e-2).with_inv_update_steps(1).with_factor_decay(0.9));
  every.register_layer("slow", kfac::Dense(3, 2), kfac::KFAC<>{});

  std::vector<long> slow_decomposed;
  for (int step = 0; step < 10; ++step) {
    CoreData d{unsigned(step)}, r{unsigned(step)}, f{unsigned(step)}, ev{unsigned(step)};
    d.fc.feed(both, "slow");
    d.toy.feed(both, "fast");
    r.fc.feed(slow_ref, "slow");
    f.toy.feed(fast_ref, "fast");
    ev.fc.feed(every, "slow");
    CHECK(both.will_decompose());
    both.step();
    slow_ref.step();
    fast_ref.step();
    every.step();
    INFO("step " << step);
    CHECK(same_bits(d.fc.w, r.fc.w));
    CHECK(same_bits(d.fc.b, r.fc.b));
    CHECK(same_bits(d.toy.w, f.toy.w));
    CHECK(same_bits(d.toy.b, f.toy.b));
    CHECK(both.last_decomposition_step() == step);  // "fast" decomposes every step
    if (same_bits(d.fc.w, ev.fc.w)) slow_decomposed.push_back(step);
  }
  CHECK(slow_decomposed == std::vector<long>{0, 3, 6, 9});
}

TEST_CASE("inversion settings travel with the method object", "[core][inversion]") {
  using NS = kfac::KFAC<kfac::Symmetric, kfac::NewtonSchulz>;
  for (int retries : {0, 3}) {
    Pre pre(core_options().with_max_damping_retries(retries));
    pre.register_layer("ns", kfac::Dense(3, 2), NS(kfac::NewtonSchulz{}.with_max_iterations(1)));
    CoreData d(0);
    d.fc.feed(pre, "ns");
    const std::string before = saved(pre);
    expect_error([&] { pre.step(); }, "ns",
                 {"failed after " + std::to_string(retries) + " damping increase(s)"});
    CHECK(saved(pre) == before);
    CHECK(pre.step_count() == 0);
  }
  // The default iteration budget succeeds on the same data.
  Pre ok(core_options());
  ok.register_layer("ns", kfac::Dense(3, 2), NS{});
  CoreData d(0);
  d.fc.feed(ok, "ns");
  CHECK_NOTHROW(ok.step());
  CHECK_THROWS_AS(kfac::NewtonSchulz{}.with_max_iterations(0), kfac::Error);
}

TEST_CASE("a method object without per-layer overrides registers and follows Options", "[core][toy]") {
  static_assert(kfac::is_method_v<BareScaledIdentity>);
  auto opts = core_options();
  Pre bare(opts), based(opts);
  for (Pre* p : {&bare, &based}) p->register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{});
  bare.register_layer("toy", kfac::Dense(4, 3), BareScaledIdentity{});
  based.register_layer("toy", kfac::Dense(4, 3), ScaledIdentity{});
  const auto a = run(bare, 0, 6), b = run(based, 0, 6);
  for (std::size_t s = 0; s < a.size(); ++s) CHECK(bit_equal(a[s], b[s]));
  // ... and an override on the based one changes its results, so the comparison can fail.
  Pre damped(opts);
  damped.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{});
  damped.register_layer("toy", kfac::Dense(4, 3), ScaledIdentity{}.with_damping(0.5));
  CHECK_FALSE(bit_equal(run(damped, 0, 6).back(), a.back()));
}

TEST_CASE("type traits recognize the library's and the user's types", "[core][traits]") {
  static_assert(kfac::is_method_v<kfac::KFAC<>>);
  static_assert(kfac::is_method_v<kfac::UnitWiseFisher<>>);
  static_assert(kfac::is_method_v<ScaledIdentity>);
  static_assert(!kfac::is_method_v<int>);
  static_assert(!kfac::is_method_v<kfac::Dense>);
  static_assert(kfac::is_layer_type_v<kfac::Dense>);
  static_assert(kfac::is_layer_type_v<kfac::Conv2d>);
  static_assert(kfac::is_layer_type_v<kfac::BatchNorm2d>);
  static_assert(!kfac::is_layer_type_v<kfac::KFAC<>>);
  static_assert(kfac::is_inversion_v<kfac::NewtonSchulz>);
  static_assert(kfac::is_inversion_v<kfac::Eigendecomposition<>>);
  static_assert(kfac::is_inversion_v<kfac::Cholesky<>>);
  static_assert(!kfac::is_inversion_v<kfac::Dense>);
  static_assert(kfac::is_communicator_v<kfac::SerialComm>);
  static_assert(!kfac::is_communicator_v<int>);
  static_assert(kfac::is_distribution_v<kfac::Independent>);
  static_assert(kfac::is_distribution_v<kfac::Kaisa>);
  static_assert(!kfac::is_distribution_v<kfac::SerialComm>);
  static_assert(ScaledIdentity::accepts<kfac::Dense> && !ScaledIdentity::accepts<kfac::Conv2d>);
  SUCCEED();
}

template <class V>
std::vector<double> host_values(const V& v) {
  auto h = Kokkos::create_mirror_view(v);
  Kokkos::deep_copy(h, v);
  return std::vector<double>(h.data(), h.data() + h.span());
}

TEST_CASE("an eigendecomposition retry decomposes F + damping I, not F again", "[core][retry]") {
  // Block level: decompose(attempt >= 1) solves the shifted problem and takes the shift off
  // the eigenvalues again: the same decomposition to rounding, but another computation.
  Pre pre(core_options());
  pre.register_layer("fc", kfac::Dense(6, 5));
  Rng rng(77);
  DenseBatch d(6, 5, true, 40, rng);
  d.feed(pre, "fc");
  pre.step();
  const auto& block = pre.layer_as<KLayer<kfac::Dense>>("fc");
  auto& b = const_cast<KLayer<kfac::Dense>&>(block);
  const Host exec;
  b.decompose(exec, 0, 1e-2);
  const auto q0 = host_values(b.decomposition_a()->q);
  const auto l0 = host_values(b.decomposition_a()->lambda);
  b.decompose(exec, 0, 0.5, 1);
  const auto q1 = host_values(b.decomposition_a()->q);
  const auto l1 = host_values(b.decomposition_a()->lambda);
  REQUIRE(l0.size() == l1.size());
  bool any_bit_differs = false;
  for (std::size_t i = 0; i < l0.size(); ++i) {
    CHECK(l1[i] == Approx(l0[i]).margin(1e-12));
    any_bit_differs = any_bit_differs || l1[i] != l0[i];
  }
  CHECK(any_bit_differs);  // the shifted solve rounds differently: it did not repeat F
  // Eigenvectors agree up to sign: |q0^T q1| is the identity.
  const int n = int(l0.size());
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      double dot = 0;
      for (int k = 0; k < n; ++k) dot += q0[std::size_t(i * n + k)] * q1[std::size_t(j * n + k)];
      if (l0[std::size_t(i)] > 1e-8 && l0[std::size_t(j)] > 1e-8 && std::abs(l0[std::size_t(i)] - l0[std::size_t(j)]) > 1e-6)
        CHECK(std::abs(dot) == Approx(i == j ? 1.0 : 0.0).margin(1e-8));
    }
}
