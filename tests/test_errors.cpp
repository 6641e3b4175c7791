// Misuse is refused with a kfac::Error that names the layer and the problem, and leaves the
// preconditioner as it was: afterwards it gives bit for bit what a twin that never saw the bad
// call gives.
#include <functional>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

using LL2 = Kokkos::View<double**, Kokkos::LayoutLeft, Kokkos::HostSpace>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

kfac::Options twin_options() {
  return kfac::Options{}.with_damping(1e-2).with_inv_update_steps(1).with_factor_decay(0.9).with_kl_clip(1e-3);
}

/// Three layers: "fc" Dense(3, 2) with bias, "conv" Conv2d(2, 2, 2x2) without bias on 3x3
/// images, "bn" BatchNorm2d(2) on (N, C) inputs.
void register_all(Pre& pre) {
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  pre.register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 2, 2, 2).with_bias(false));
  pre.register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(2));
}

/// One step's data of the three layers; the same seed gives the same values in new buffers.
struct StepData {
  V2<double> fc_x, fc_g, fc_w;
  V1<double> fc_b;
  V4<double> conv_x, conv_g, conv_w;
  V2<double> bn_x, bn_g;
  V1<double> dgamma, dbeta;

  explicit StepData(unsigned seed) {
    Rng rng(seed + 100);
    fc_x = random_view<double>(4, 3, rng);
    fc_g = random_view<double>(4, 2, rng);
    fc_w = random_view<double>(2, 3, rng);
    fc_b = random_vector<double>(2, rng);
    conv_x = random_view4<double>(2, 2, 3, 3, rng);
    conv_g = random_view4<double>(2, 2, 2, 2, rng);
    conv_w = random_view4<double>(2, 2, 2, 2, rng);
    bn_x = random_view<double>(3, 2, rng);
    bn_g = random_view<double>(3, 2, rng);
    dgamma = random_vector<double>(2, rng);
    dbeta = random_vector<double>(2, rng);
  }
  void observe_inputs(Pre& pre) const {
    pre.observe_input("fc", fc_x);
    pre.observe_input("conv", conv_x);
    pre.observe_input("bn", bn_x);
  }
  void observe_grads(Pre& pre) const {
    pre.observe_output_grad("fc", fc_g);
    pre.observe_output_grad("conv", conv_g);
    pre.observe_output_grad("bn", bn_g);
  }
  void set_gradients(Pre& pre) const {
    pre.set_gradient("fc", fc_w, fc_b);
    pre.set_gradient("conv", conv_w);
    pre.set_gradient("bn", dgamma, dbeta);
  }
  void feed(Pre& pre) const {
    observe_inputs(pre);
    observe_grads(pre);
    set_gradients(pre);
  }
};

/// Counters, KL scale, preconditioned gradients and running factors agree bit for bit.
void check_same_state(const Pre& p, const Pre& t, const StepData& dp, const StepData& dt) {
  CHECK(p.step_count() == t.step_count());
  CHECK(p.last_factor_step() == t.last_factor_step());
  CHECK(p.last_decomposition_step() == t.last_decomposition_step());
  CHECK(p.last_kl_scale() == t.last_kl_scale());
  CHECK(same_bits(dp.fc_w, dt.fc_w));
  CHECK(same_bits(dp.fc_b, dt.fc_b));
  CHECK(same_bits(dp.conv_w, dt.conv_w));
  CHECK(same_bits(dp.dgamma, dt.dgamma));
  CHECK(same_bits(dp.dbeta, dt.dbeta));
  const auto& pf = p.layer_as<KLayer<kfac::Dense>>("fc");
  const auto& tf = t.layer_as<KLayer<kfac::Dense>>("fc");
  CHECK(same_bits(pf.factor_a(), tf.factor_a()));
  CHECK(same_bits(pf.factor_g(), tf.factor_g()));
  const auto& pc = p.layer_as<KLayer<kfac::Conv2d>>("conv");
  const auto& tc = t.layer_as<KLayer<kfac::Conv2d>>("conv");
  CHECK(same_bits(pc.factor_a(), tc.factor_a()));
  CHECK(same_bits(pc.factor_g(), tc.factor_g()));
  CHECK(same_bits(p.layer_as<BnLayer<>>("bn").fisher(), t.layer_as<BnLayer<>>("bn").fisher()));
}

enum Where { kMid = 1, kLate = 2, kBoth = 3 };

struct BadCall {
  const char* what;
  int where;  // mid-step (after the inputs) and/or late (after set_gradient, before step)
  std::string layer;
  std::vector<std::string> parts;
  std::function<void(Pre&)> call;
};

/// Two steps of a preconditioner and its twin on the same data; the preconditioner gets the
/// bad call in each step, which must throw and change nothing.
void check_rejected(const BadCall& bad) {
  for (int where : {kMid, kLate}) {
    if (!(bad.where & where)) continue;
    INFO(bad.what << (where == kMid ? ", mid-step" : ", before step()"));
    Pre pre(twin_options()), twin(twin_options());
    register_all(pre);
    register_all(twin);
    for (unsigned s = 0; s < 2; ++s) {
      INFO("step " << s);
      const StepData dp(s), dt(s);
      dp.observe_inputs(pre);
      dt.observe_inputs(twin);
      if (where == kMid) expect_error([&] { bad.call(pre); }, bad.layer, bad.parts);
      dp.observe_grads(pre);
      dp.set_gradients(pre);
      dt.observe_grads(twin);
      dt.set_gradients(twin);
      if (where == kLate) expect_error([&] { bad.call(pre); }, bad.layer, bad.parts);
      pre.step();
      twin.step();
      check_same_state(pre, twin, dp, dt);
    }
  }
}

template <class V>
V with_value(V v, std::size_t index, double value) {
  v.data()[index] = value;
  return v;
}

}  // namespace

TEST_CASE("bad observations are refused and change nothing", "[errors][observe]") {
  Rng rng(1);
  const BadCall calls[] = {
      {"Dense input of the wrong width", kBoth, "fc", {"input has shape (4, 5)", "expected (batch, 3)"},
       [](Pre& p) { p.observe_input("fc", V2<double>("x", 4, 5)); }},
      {"Conv2d input with the wrong channels", kBoth, "conv", {"input has shape (2, 3, 3, 3)", "expected (batch, 2, H, W)"},
       [](Pre& p) { p.observe_input("conv", V4<double>("x", 2, 3, 3, 3)); }},
      {"Conv2d input smaller than the kernel", kBoth, "conv", {"input has shape (2, 2, 1, 3)", "kernel fitting"},
       [](Pre& p) { p.observe_input("conv", V4<double>("x", 2, 2, 1, 3)); }},
      {"BatchNorm input with the wrong channels", kBoth, "bn", {"input has shape (3, 5)"},
       [](Pre& p) { p.observe_input("bn", V2<double>("x", 3, 5)); }},
      {"Dense output gradient of the wrong width", kBoth, "fc", {"output gradient has shape (4, 3)", "expected (batch, 2)"},
       [](Pre& p) { p.observe_output_grad("fc", V2<double>("g", 4, 3)); }},
      {"Conv2d output gradient of the wrong spatial size", kBoth, "conv",
       {"output gradient has shape (2, 2, 3, 3)", "expected (batch, 2, 2, 2)"},
       [](Pre& p) { p.observe_output_grad("conv", V4<double>("g", 2, 2, 3, 3)); }},
      {"Dense output gradient batch differs from its input", kMid, "fc", {"output gradient has batch 3", "has batch 4"},
       [](Pre& p) { p.observe_output_grad("fc", V2<double>("g", 3, 2)); }},
      {"Conv2d output gradient batch differs from its input", kMid, "conv", {"output gradient has batch 1", "has batch 2"},
       [](Pre& p) { p.observe_output_grad("conv", V4<double>("g", 1, 2, 2, 2)); }},
      {"BatchNorm output gradient batch differs from its input", kMid, "bn", {"output gradient has shape (2, 2)", "matching the input"},
       [](Pre& p) { p.observe_output_grad("bn", V2<double>("g", 2, 2)); }},
      {"BatchNorm output gradient without its input", kLate, "bn", {"without a matching input"},
       [](Pre& p) { p.observe_output_grad("bn", V2<double>("g", 3, 2)); }},
      {"NaN in an input", kBoth, "fc", {"input contains 1 NaN/Inf value(s)"},
       [&](Pre& p) { p.observe_input("fc", with_value(random_view<double>(4, 3, rng), 5, kNaN)); }},
      {"Inf in a Conv2d input", kBoth, "conv", {"input contains 1 NaN/Inf value(s)"},
       [&](Pre& p) { p.observe_input("conv", with_value(random_view4<double>(2, 2, 3, 3, rng), 17, kInf)); }},
      {"+-Inf in an output gradient", kBoth, "conv", {"output gradient contains 2 NaN/Inf value(s)"},
       [&](Pre& p) {
         p.observe_output_grad("conv", with_value(with_value(random_view4<double>(2, 2, 2, 2, rng), 0, kInf), 15, -kInf));
       }},
      {"NaN in a BatchNorm output gradient", kMid, "bn", {"output gradient contains 1 NaN/Inf value(s)"},
       [&](Pre& p) { p.observe_output_grad("bn", with_value(random_view<double>(3, 2, rng), 3, kNaN)); }},
      {"empty input batch", kBoth, "fc", {"input has an empty batch"}, [](Pre& p) { p.observe_input("fc", V2<double>("x", 0, 3)); }},
      {"empty output-gradient batch", kBoth, "conv", {"output gradient has an empty batch"},
       [](Pre& p) { p.observe_output_grad("conv", V4<double>("g", 0, 2, 2, 2)); }},
      {"LayoutLeft input", kBoth, "fc", {"input must be a contiguous row-major (LayoutRight) view"},
       [](Pre& p) { p.observe_input("fc", LL2("x", 4, 3)); }},
      {"LayoutLeft output gradient", kBoth, "bn", {"output gradient must be a contiguous row-major (LayoutRight) view"},
       [](Pre& p) { p.observe_output_grad("bn", LL2("g", 3, 2)); }},
      {"non-contiguous input", kBoth, "fc", {"contiguous row-major"},
       [](Pre& p) { p.observe_input("fc", Kokkos::subview(V2<double>("x", 4, 6), Kokkos::ALL, std::make_pair(0, 3))); }},
      {"input of an unknown layer", kBoth, "nope", {"no layer with this name is registered"},
       [](Pre& p) { p.observe_input("nope", V2<double>("x", 4, 3)); }},
      {"output gradient of an unknown layer", kBoth, "fc2", {"no layer with this name is registered"},
       [](Pre& p) { p.observe_output_grad("fc2", V2<double>("g", 4, 2)); }},
  };
  for (const auto& c : calls) check_rejected(c);
}

TEST_CASE("bad gradients and registrations are refused and change nothing", "[errors][gradient]") {
  const BadCall calls[] = {
      {"Dense weight gradient of the wrong shape", kBoth, "fc", {"weight gradient has shape (2, 4)", "expected 2 x 3 values"},
       [](Pre& p) { p.set_gradient("fc", V2<double>("w", 2, 4), V1<double>("b", 2)); }},
      {"Dense weight gradient with rows and columns swapped", kBoth, "fc", {"weight gradient has shape (3, 2)"},
       [](Pre& p) { p.set_gradient("fc", V2<double>("w", 3, 2), V1<double>("b", 2)); }},
      {"Conv2d weight gradient of the wrong kernel size", kBoth, "conv", {"weight gradient has shape (2, 2, 2, 3)", "expected 2 x 8 values"},
       [](Pre& p) { p.set_gradient("conv", V4<double>("w", 2, 2, 2, 3)); }},
      {"LayoutLeft weight gradient", kBoth, "fc", {"weight gradient must be a contiguous row-major (LayoutRight) view"},
       [](Pre& p) { p.set_gradient("fc", LL2("w", 2, 3), V1<double>("b", 2)); }},
      {"bias gradient of the wrong length", kBoth, "fc", {"bias gradient has length 3", "length 2"},
       [](Pre& p) { p.set_gradient("fc", V2<double>("w", 2, 3), V1<double>("b", 3)); }},
      {"missing bias gradient", kBoth, "fc", {"bias gradient has length 0"},
       [](Pre& p) { p.set_gradient("fc", V2<double>("w", 2, 3)); }},
      {"bias gradient for a layer without bias", kBoth, "conv", {"layer has no bias but a bias gradient was given"},
       [](Pre& p) { p.set_gradient("conv", V4<double>("w", 2, 2, 2, 2), V1<double>("b", 2)); }},
      {"BatchNorm dgamma of the wrong length", kBoth, "bn", {"weight gradient has shape (3)"},
       [](Pre& p) { p.set_gradient("bn", V1<double>("g", 3), V1<double>("b", 3)); }},
      {"gradient of an unknown layer", kBoth, "nope", {"no layer with this name is registered"},
       [](Pre& p) { p.set_gradient("nope", V2<double>("w", 2, 3), V1<double>("b", 2)); }},
      {"duplicate layer name", kBoth, "fc", {"a layer with this name is already registered"},
       [](Pre& p) { p.register_layer<kfac::Dense>("fc", kfac::Dense(5, 5)); }},
      {"duplicate name with another layer type", kBoth, "conv", {"already registered"},
       [](Pre& p) { p.register_layer<kfac::BatchNorm2d>("conv", kfac::BatchNorm2d(2)); }},
  };
  for (const auto& c : calls) check_rejected(c);
}

TEST_CASE("step() refuses missing observations and gradients and changes nothing", "[errors][step]") {
  // The preconditioner gets `partial`, a refused step(), then `rest`; its twin gets `partial`
  // and `rest` only.
  using Feed = std::function<void(Pre&, const StepData&)>;
  struct Case {
    const char* what;
    std::string layer;
    std::vector<std::string> parts;
    Feed partial, rest;
  };
  const Feed inputs = [](Pre& p, const StepData& d) { d.observe_inputs(p); };
  const Feed grads = [](Pre& p, const StepData& d) { d.observe_grads(p); };
  const Feed gradients = [](Pre& p, const StepData& d) { d.set_gradients(p); };
  const Case cases[] = {
      {"no observations at all", "fc", {"no observations were given before the factor update at step"}, gradients,
       [&](Pre& p, const StepData& d) {
         inputs(p, d);
         grads(p, d);
       }},
      {"no output gradient", "fc", {"no output gradient was observed before the factor update"},
       [&](Pre& p, const StepData& d) {
         inputs(p, d);
         gradients(p, d);
       },
       grads},
      {"no input", "conv", {"no input was observed"},
       [](Pre& p, const StepData& d) {
         p.observe_input("fc", d.fc_x);
         p.observe_output_grad("fc", d.fc_g);
         p.observe_output_grad("conv", d.conv_g);
         d.set_gradients(p);
       },
       [](Pre& p, const StepData& d) {
         p.observe_input("conv", d.conv_x);
         p.observe_input("bn", d.bn_x);
         p.observe_output_grad("bn", d.bn_g);
       }},
      {"BatchNorm input without its output gradient", "bn", {"observed 1 inputs but 0 output gradients"},
       [](Pre& p, const StepData& d) {
         d.observe_inputs(p);
         p.observe_output_grad("fc", d.fc_g);
         p.observe_output_grad("conv", d.conv_g);
         d.set_gradients(p);
       },
       [](Pre& p, const StepData& d) { p.observe_output_grad("bn", d.bn_g); }},
      {"no gradient", "conv", {"no gradient was set for step", "call set_gradient before step"},
       [](Pre& p, const StepData& d) {
         d.observe_inputs(p);
         d.observe_grads(p);
         p.set_gradient("fc", d.fc_w, d.fc_b);
       },
       [](Pre& p, const StepData& d) {
         p.set_gradient("conv", d.conv_w);
         p.set_gradient("bn", d.dgamma, d.dbeta);
       }},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    for (unsigned s = 0; s < 2; ++s) {  // before the first factor update, and after one
      INFO("refused at step " << s);
      Pre pre(twin_options()), twin(twin_options());
      register_all(pre);
      register_all(twin);
      if (s == 1) {
        const StepData d0p(7), d0t(7);
        d0p.feed(pre);
        d0t.feed(twin);
        pre.step();
        twin.step();
      }
      const StepData dp(s), dt(s), untouched(s);
      c.partial(pre, dp);
      expect_error([&] { pre.step(); }, c.layer, c.parts);
      CHECK(pre.step_count() == s);
      CHECK(same_bits(dp.fc_w, untouched.fc_w));  // nothing was written back
      c.rest(pre, dp);
      c.partial(twin, dt);
      c.rest(twin, dt);
      pre.step();
      twin.step();
      check_same_state(pre, twin, dp, dt);
    }
  }
}

TEST_CASE("input and output-gradient sample counts that differ at step() can be completed", "[errors][step]") {
  // Micro-batches x(4), g(4), x(3): step() refuses the 7 vs 4 samples; the missing g(3) makes
  // the step equal to a twin's that got all four observations before its first step().
  Rng rng(3);
  const auto x1 = random_view<double>(4, 3, rng), g1 = random_view<double>(4, 2, rng);
  const auto x2 = random_view<double>(3, 3, rng), g2 = random_view<double>(3, 2, rng);
  const DenseBatch dp(3, 2, true, 1, rng);
  const DenseBatch dt = dp.twin();
  Pre pre(twin_options()), twin(twin_options());
  for (Pre* p : {&pre, &twin}) {
    p->register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
    p->observe_input("fc", x1);
    p->observe_output_grad("fc", g1);
    p->observe_input("fc", x2);
  }
  pre.set_gradient("fc", dp.w, dp.b);
  expect_error([&] { pre.step(); }, "fc", {"observed 7 input samples but 4 output-gradient samples"});
  for (Pre* p : {&pre, &twin}) p->observe_output_grad("fc", g2);
  pre.set_gradient("fc", dp.w, dp.b);
  twin.set_gradient("fc", dt.w, dt.b);
  pre.step();
  twin.step();
  CHECK(same_bits(dp.w, dt.w));
  CHECK(same_bits(dp.b, dt.b));
  CHECK(same_bits(pre.layer_as<KLayer<kfac::Dense>>("fc").factor_a(), twin.layer_as<KLayer<kfac::Dense>>("fc").factor_a()));
}

TEST_CASE("a layer registered after step 0 must be observed at the next step", "[errors][step]") {
  // Registering late makes the next step a factor-update and decomposition step; stepping without
  // observing the new layer is refused (it has no factors yet) and changes nothing.
  Pre pre(twin_options().with_factor_update_steps(2)), twin(twin_options().with_factor_update_steps(2));
  for (Pre* p : {&pre, &twin}) p->register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  Rng rng(4);
  const DenseBatch dp(3, 2, true, 4, rng);
  const DenseBatch dt = dp.twin();
  dp.feed(pre, "fc");
  dt.feed(twin, "fc");
  pre.step();
  twin.step();
  REQUIRE_FALSE(pre.wants_observations());  // step 1 is not a factor step ...
  pre.register_layer<kfac::Dense>("late", kfac::Dense(2, 2, false));
  CHECK(pre.wants_observations());  // ... until a layer arrives late
  CHECK(pre.will_decompose());
  const DenseBatch d1(3, 2, true, 4, rng), late(2, 2, false, 4, rng);
  const auto w1 = clone(d1.w);
  const auto late_w = clone(late.w);
  d1.feed(pre, "fc");
  pre.set_gradient("late", late.w);  // gradient but no observations
  expect_error([&] { pre.step(); }, "late", {"no observations were given", "factor update at step 1"});
  CHECK(pre.step_count() == 1);
  CHECK(pre.last_factor_step() == 0);
  CHECK(pre.last_decomposition_step() == 0);
  CHECK(same_bits(d1.w, w1));
  CHECK(same_bits(late.w, late_w));
  const auto& fc = pre.layer_as<KLayer<kfac::Dense>>("fc");
  const auto& fc_twin = twin.layer_as<KLayer<kfac::Dense>>("fc");
  CHECK(same_bits(fc.factor_a(), fc_twin.factor_a()));
  CHECK(same_bits(fc.factor_g(), fc_twin.factor_g()));
  late.feed(pre, "late");  // now complete: the step goes through
  pre.step();
  CHECK(pre.layer("late").has_factors());
  CHECK(pre.last_factor_step() == 1);
}

TEST_CASE("non-positive damping is refused", "[errors][damping]") {
  SECTION("constants at construction") {
    for (double d : {0.0, -1e-3, kNaN, kInf}) {
      INFO("damping " << d);
      expect_error([&] { Pre pre(kfac::Options{}.with_damping(d)); }, "", {"damping", "at step 0", "expected a finite value > 0"});
    }
    expect_error([] { Pre pre(kfac::Options{}.with_lr(0.0)); }, "", {"lr = "});
    expect_error([] { Pre pre(kfac::Options{}.with_factor_decay(1.0)); }, "", {"factor_decay", "[0, 1)"});
    expect_error([] { Pre pre(kfac::Options{}.with_kl_clip(-1.0)); }, "", {"kl_clip"});
    expect_error([] { Pre pre(kfac::Options{}.with_inv_update_steps(0)); }, "", {"inv_update_steps", ">= 1"});
    expect_error([] { Pre pre(kfac::Options{}.with_damping([](long s) { return s == 0 ? 0.0 : 1.0; })); }, "",
                 {"damping = 0", "at step 0"});
  }
  SECTION("a schedule that reaches 0 at step 2") {
    const auto bad = [](long s) { return s == 2 ? 0.0 : 1e-2; };
    Pre pre(twin_options().with_damping(bad)), twin(twin_options());
    register_all(pre);
    register_all(twin);
    for (unsigned s = 0; s < 2; ++s) {
      const StepData dp(s), dt(s);
      dp.feed(pre);
      dt.feed(twin);
      pre.step();
      twin.step();
      check_same_state(pre, twin, dp, dt);
    }
    const StepData dp(2), dt(2), untouched(2);
    dp.feed(pre);
    expect_error([&] { pre.step(); }, "", {"damping = 0", "at step 2", "expected a finite value > 0"});
    // Nothing changed: the state is the twin's after step 1, the gradients are as handed over.
    check_same_state(pre, twin, dp, untouched);
    expect_error([&] { pre.step(); }, "", {"at step 2"});  // and it stays refused
  }
}

TEST_CASE("bad layer definitions and lookups", "[errors]") {
  expect_error([] { kfac::Dense(0, 2); }, "", {"Dense"});
  expect_error([] { kfac::Conv2d(1, 1, 0, 3); }, "", {"Conv2d"});
  expect_error([] { kfac::Conv2d(1, 1, 3, 3).with_stride(0, 1); }, "", {"stride"});
  expect_error([] { kfac::Conv2d(1, 1, 3, 3).with_padding(-1, 0); }, "", {"padding"});
  expect_error([] { kfac::Conv2d(1, 1, 3, 3).with_dilation(1, 0); }, "", {"dilation"});
  expect_error([] { kfac::BatchNorm2d(0); }, "", {"BatchNorm2d"});
  Pre pre(twin_options());
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
  expect_error([&] { pre.register_layer<kfac::Dense>("", kfac::Dense(3, 2)); }, "", {"must not be empty"});
  expect_error([&] { pre.layer("nope"); }, "nope", {"no layer with this name"});
  expect_error([&] { pre.layer_as<KLayer<kfac::Dense, kfac::Full>>("fc"); }, "fc", {"different policy combination"});
  CHECK(pre.layer_names() == std::vector<std::string>{"fc"});
}

TEST_CASE("Conv2d refuses a kernel that does not fit, at the edge of fitting", "[errors][conv2d]") {
  // (h + 2p - d (k - 1) - 1) / s + 1 with a negative span must give no output, not one row.
  const kfac::Conv2d conv = kfac::Conv2d(1, 1, 4, 4).with_stride(2, 2);
  CHECK(conv.out_h(3) == 0);
  CHECK(conv.out_h(4) == 1);
  CHECK(conv.out_w(5) == 1);
  CHECK(conv.out_w(6) == 2);
  CHECK(kfac::Conv2d(1, 1, 3, 3).with_dilation(2, 2).with_padding(1, 0).out_h(2) == 0);
  CHECK(kfac::Conv2d(1, 1, 3, 3).with_dilation(2, 2).with_padding(1, 0).out_h(3) == 1);
  Pre pre(twin_options());
  pre.register_layer<kfac::Conv2d>("c", conv);
  expect_error([&] { pre.observe_input("c", V4<double>("x", 1, 1, 3, 4)); }, "c", {"kernel fitting"});
  pre.observe_input("c", V4<double>("x", 1, 1, 4, 4));
}

TEST_CASE("misuse found by a user's campaign is refused by name, at registration where it can be",
          "[errors][registration]") {
  SECTION("an allocation that cannot succeed") {
#if defined(__SANITIZE_ADDRESS__)
    WARN("not under AddressSanitizer: its malloc aborts on a 137 GB request instead of failing");
    return;
#endif
    Pre pre(twin_options());
    pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
    pre.register_layer<kfac::Dense>("huge", kfac::Dense(131072, 2));  // memory comes with the first observation
    const V2<double> x("x", 2, 131072);
    expect_error([&] { pre.observe_input("huge", x); }, "huge", {"observe_input: cannot allocate the layer's memory"});
    CHECK(pre.memory_report()[1].workspace_bytes < (std::size_t(1) << 30));  // nothing pending was kept
  }
  SECTION("per-layer overrides are checked at registration, naming the layer") {
    Pre pre(twin_options());
    expect_error([&] { pre.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{}.with_damping(-1e-3)); }, "fc",
                 {"damping = -0.001", "expected a finite value > 0"});
    expect_error([&] { pre.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{}.with_inv_update_steps(0)); }, "fc",
                 {"inv_update_steps", "an interval >= 1"});
    expect_error([&] { pre.register_layer("bn", kfac::BatchNorm2d(2), kfac::UnitWiseFisher<>{}.with_factor_decay(1.0)); },
                 "bn", {"factor_decay"});
    CHECK(pre.layer_names().empty());
  }
  SECTION("a per-layer schedule that turns bad later names the layer at step()") {
    Pre pre(twin_options());
    pre.register_layer("fc", kfac::Dense(3, 2), kfac::KFAC<>{}.with_damping([](long s) { return s < 1 ? 1e-2 : -1.0; }));
    Rng rng(3);
    for (long s = 0; s < 2; ++s) {
      const auto x = random_view<double>(4, 3, rng), g = random_view<double>(4, 2, rng);
      auto w = random_view<double>(2, 3, rng);
      auto b = random_vector<double>(2, rng);
      pre.observe_input("fc", x);
      pre.observe_output_grad("fc", g);
      pre.set_gradient("fc", w, b);
      if (s == 0) pre.step();
      else expect_error([&] { pre.step(); }, "fc", {"damping = -1", "at step 1"});
    }
    CHECK(pre.step_count() == 1);
  }
  SECTION("a skip_layers entry that matches no layer name or kind") {
    Pre pre(twin_options().with_skip_layers({"fc_typo", "conv2d"}));
    register_all(pre);
    const StepData d(0);
    d.feed(pre);
    expect_error([&] { pre.step(); }, "", {"skip_layers entry 'fc_typo' matches no registered layer"});
    CHECK(pre.step_count() == 0);
  }
  SECTION("an output gradient of the wrong width on a step without a factor update") {
    Pre pre(twin_options().with_factor_update_steps(2));
    register_all(pre);
    const StepData d0(0), d1(1);
    d0.feed(pre);
    pre.step();
    REQUIRE_FALSE(pre.wants_observations("fc"));
    expect_error([&] { pre.observe_output_grad("fc", V2<double>("g", 4, 3)); }, "fc",
                 {"output gradient has shape (4, 3)", "expected (batch, 2)"});
    expect_error([&] { pre.observe_output_grad("conv", V4<double>("g", 2, 3, 2, 2)); }, "conv",
                 {"output gradient has shape (2, 3, 2, 2)", "expected (batch, 2, Ho, Wo)"});
    expect_error([&] { pre.observe_input("fc", V2<double>("x", 4, 5)); }, "fc", {"input has shape (4, 5)"});
  }
  SECTION("a Conv2d output gradient of the wrong spatial size observed before its input") {
    Pre pre(twin_options());
    register_all(pre);
    const StepData d(0);
    pre.observe_output_grad("conv", V4<double>("g", 2, 2, 3, 3));  // no input yet: the size is not known
    expect_error([&] { pre.observe_input("conv", d.conv_x); }, "conv",
                 {"input has shape (2, 2, 3, 3) but the output gradient observed before it", "(2, 2, 3, 3)",
                  "expected (batch, 2, 2, 2)"});
  }
  SECTION("schedules refuse what would crash them") {
    expect_error([] { kfac::schedules::step_decay(0.1, 0.5, 0); }, "", {"step_decay: every = 0"});
    expect_error([] { kfac::schedules::step_decay(0.1, -0.5, 10); }, "", {"step_decay"});
    CHECK(kfac::schedules::step_decay(0.1, 0.5, 10)(25) == Approx(0.025));
  }
}

TEST_CASE("issue 46: four bad inputs are refused by name and change nothing", "[errors][issue46]") {
  SECTION("a checkpoint cut short, read through a stream that throws") {
    Pre pre(twin_options()), twin(twin_options());
    register_all(pre);
    register_all(twin);
    const StepData d(0);
    d.feed(pre);
    pre.step();
    std::ostringstream os(std::ios::binary);
    pre.save(os);
    const std::string full = os.str();
    for (std::size_t cut : {std::size_t(4), std::size_t(14), full.size() / 2, full.size() - 3}) {
      INFO("cut at " << cut << " of " << full.size() << " bytes");
      std::istringstream in(full.substr(0, cut), std::ios::binary);
      in.exceptions(std::ios::failbit | std::ios::badbit);
      std::ostringstream before(std::ios::binary);
      twin.save(before);
      expect_error([&] { twin.load(in); }, "", {"checkpoint"});
      std::ostringstream after(std::ios::binary);
      twin.save(after);
      CHECK(after.str() == before.str());
    }
  }
  SECTION("the large-batch recipe's builders refuse bad arguments and keep the recipe") {
    const auto base = kfac::recipes::large_batch(4096, 14, 8);
    const std::vector<std::pair<std::string, std::function<void(kfac::recipes::LargeBatch&)>>> bad = {
        {"with_step_decay", [](auto& r) { r.with_step_decay(0.1, -1.0); }},
        {"with_step_decay", [](auto& r) { r.with_step_decay(0.1, 0.0); }},
        {"with_step_decay", [](auto& r) { r.with_step_decay(1.5, 2.0); }},
        {"with_polynomial_decay", [](auto& r) { r.with_polynomial_decay(-1.0); }},
        {"with_lr", [](auto& r) { r.with_lr(-0.1); }},
        {"with_warmup_epochs", [](auto& r) { r.with_warmup_epochs(std::nan("")); }},
        {"with_damping", [](auto& r) { r.with_damping(0.0); }},
        {"with_damping_ramp", [](auto& r) { r.with_damping_ramp(-1.0, 1.0); }},
        {"with_kl_clip", [](auto& r) { r.with_kl_clip(-1.0); }},
        {"with_stale_fisher", [](auto& r) { r.with_stale_fisher(1.0, 0.0, 1.0); }},
        {"with_inv_per_factor", [](auto& r) { r.with_inv_per_factor(0); }},
        {"with_reference_batch", [](auto& r) { r.with_reference_batch(0); }},
    };
    for (const auto& [name, call] : bad) {
      INFO(name);
      auto r = base;
      expect_error([&] { call(r); }, "", {"recipes::large_batch: " + name});
      CHECK(r.step_decay_epochs == base.step_decay_epochs);
      CHECK(r.lr_schedule()(500) == base.lr_schedule()(500));
    }
    CHECK(kfac::recipes::large_batch(4096, 14, 8).with_step_decay(0.1, 2.0).lr_schedule()(14 * 5) ==
          Approx(0.1 * 16 * 0.01));
  }
  SECTION("two layers handed the same or overlapping gradient buffers (tied weights)") {
    Pre pre(twin_options()), twin(twin_options());
    for (Pre* p : {&pre, &twin}) {
      p->register_layer<kfac::Dense>("enc", kfac::Dense(3, 2));
      p->register_layer<kfac::Dense>("dec", kfac::Dense(3, 2));
    }
    Rng rng(7);
    const auto x = random_view<double>(4, 3, rng), g = random_view<double>(4, 2, rng);
    auto w = random_view<double>(2, 3, rng), w2 = random_view<double>(2, 3, rng);
    auto b = random_vector<double>(2, rng), b2 = random_vector<double>(2, rng);
    V1<double> flat("flat", 9);
    const V2<double> first(flat.data(), 2, 3), shifted(flat.data() + 1, 2, 3);
    for (Pre* p : {&pre, &twin})
      for (const char* n : {"enc", "dec"}) {
        p->observe_input(n, x);
        p->observe_output_grad(n, g);
      }
    pre.set_gradient("enc", w, b);
    expect_error([&] { pre.set_gradient("dec", w, b2); }, "dec", {"shares memory", "layer 'enc'", "tied weights"});
    expect_error([&] { pre.set_gradient("dec", w2, b); }, "dec", {"shares memory", "layer 'enc'"});
    expect_error([&] { pre.set_gradient("enc", first, V1<double>(flat.data() + 5, 2)); }, "enc",
                 {"weight and bias gradients overlap"});
    pre.set_gradient("enc", first, V1<double>(flat.data() + 6, 2));  // replaces its own: fine
    expect_error([&] { pre.set_gradient("dec", shifted, b2); }, "dec", {"shares memory", "layer 'enc'"});
    // Nothing was taken: "dec" still has no gradient, and the same call with its own buffer works.
    expect_error([&] { pre.step(); }, "dec", {"no gradient was set"});
    pre.set_gradient("enc", w, b);
    pre.set_gradient("dec", w2, b2);
    auto tw = random_view<double>(2, 3, rng), tw2 = random_view<double>(2, 3, rng);
    auto tb = random_vector<double>(2, rng), tb2 = random_vector<double>(2, rng);
    Kokkos::deep_copy(tw, w);
    Kokkos::deep_copy(tw2, w2);
    Kokkos::deep_copy(tb, b);
    Kokkos::deep_copy(tb2, b2);
    twin.set_gradient("enc", tw, tb);
    twin.set_gradient("dec", tw2, tb2);
    pre.step();
    twin.step();
    CHECK(same_bits(w, tw));
    CHECK(same_bits(w2, tw2));
  }
  SECTION("Preconditioner<float> with finite gradients near float's range") {
    using FPre = kfac::Preconditioner<float, Host>;
    for (auto policy : {kfac::NonFinitePolicy::raise, kfac::NonFinitePolicy::skip}) {
      INFO((policy == kfac::NonFinitePolicy::raise ? "raise" : "skip"));
      FPre pre(kfac::Options{}.with_damping(1e-3).with_kl_clip(1e-3).with_nonfinite_policy(policy));
      pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2));
      Rng rng(11);
      Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> x("x", 4, 3), g("g", 4, 2), w("w", 2, 3);
      Kokkos::View<float*, Kokkos::HostSpace> b("b", 2);
      for (std::size_t i = 0; i < x.span(); ++i) x.data()[i] = float(rng.uniform());
      for (std::size_t i = 0; i < g.span(); ++i) g.data()[i] = float(rng.uniform());
      for (std::size_t i = 0; i < w.span(); ++i) w.data()[i] = (i % 2 ? -3e37f : 3e37f);
      Kokkos::deep_copy(b, 3e37f);
      const std::vector<float> given(w.data(), w.data() + w.span());
      pre.observe_input("fc", x);
      pre.observe_output_grad("fc", g);
      pre.set_gradient("fc", w, b);
      if (policy == kfac::NonFinitePolicy::raise) {
        expect_error([&] { pre.step(); }, "fc", {"magnitude above", "overflow"});
        CHECK(pre.step_count() == 0);
        CHECK_FALSE(pre.layer("fc").has_factors());
      } else {
        pre.step();
        CHECK(pre.skipped_steps() == 1);
      }
      for (std::size_t i = 0; i < w.span(); ++i) CHECK(std::isfinite(w.data()[i]));
      CHECK(std::vector<float>(w.data(), w.data() + w.span()) == given);
    }
  }
}
