#pragma once
// NonFinitePolicy::skip for every layer type and call order, written once for test_skip (single
// process) and test_mpi_skip (2 ranks, NaN on one rank only). A Dense, a Conv2d and a
// BatchNorm2d layer observe two micro-batches of unequal size (3 and 5 samples) per step, either
// grouped (input 1, input 2, grad 1, grad 2) or interleaved (input 1, grad 1, input 2, grad 2);
// one observation holds a NaN. The step must be skipped on every rank without an exception,
// leave the state as it was and the gradients as given, and the next good step must equal a
// twin's that never saw the NaN.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

#include "reference.hpp"

namespace kfac_test {
namespace skip {

using Host = Kokkos::DefaultHostExecutionSpace;
using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V4 = Kokkos::View<double****, Kokkos::LayoutRight, Kokkos::HostSpace>;

constexpr int kMicro[2] = {3, 5};  // unequal micro-batches; 8 samples per step and rank

/// Where the NaN goes: layer ("fc", "conv", "bn"), input or output gradient, which micro-batch,
/// and the call order.
struct Case {
  std::string layer;
  bool in_output_grad;
  int micro;
  bool interleaved;
};
inline std::vector<Case> all_cases() {
  std::vector<Case> c;
  for (const char* l : {"fc", "conv", "bn"})
    for (bool g : {false, true})
      for (int m : {0, 1})
        for (bool il : {false, true}) c.push_back({l, g, m, il});
  return c;
}

inline kfac::Options skip_options() {
  return kfac::Options{}.with_nonfinite_policy(kfac::NonFinitePolicy::skip).with_damping(1e-2)
      .with_factor_decay(0.9).with_kl_clip(1e-2).with_inv_update_steps(2);
}
template <class P>
void register_layers(P& pre) {
  pre.register_layer("fc", kfac::Dense(5, 4));
  pre.register_layer("conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1));
  pre.register_layer("bn", kfac::BatchNorm2d(3));
}

/// Rows [first, first + n) of a rank-2 or rank-4 view, as a new contiguous view.
inline V2 rows(const V2& v, int first, int n) {
  V2 out("rows", n, v.extent(1));
  Kokkos::deep_copy(out, Kokkos::subview(v, std::make_pair(first, first + n), Kokkos::ALL));
  return out;
}
inline V4 rows(const V4& v, int first, int n) {
  V4 out("rows", n, v.extent(1), v.extent(2), v.extent(3));
  Kokkos::deep_copy(out, Kokkos::subview(v, std::make_pair(first, first + n), Kokkos::ALL, Kokkos::ALL, Kokkos::ALL));
  return out;
}

/// One step's data on one shard, and its gradients (the same on every shard).
struct Batch {
  V2 xf, gf;
  V4 xc, gc, xb, gb;
  V2 wf;
  V1 bf, bc, gamma, beta;
  V4 wc;
  Batch(long step, int shard) {
    Rng d(4242u + unsigned(step) * 131u + unsigned(shard) * 7u);
    xf = random_view<double>(8, 5, d); gf = random_view<double>(8, 4, d);
    xc = random_view4<double>(8, 2, 5, 5, d); gc = random_view4<double>(8, 3, 5, 5, d);
    xb = random_view4<double>(8, 3, 2, 2, d); gb = random_view4<double>(8, 3, 2, 2, d);
    Rng g(977u + unsigned(step) * 13u);
    wf = random_view<double>(4, 5, g); bf = random_vector<double>(4, g);
    wc = random_view4<double>(3, 2, 3, 3, g); bc = random_vector<double>(3, g);
    gamma = random_vector<double>(3, g); beta = random_vector<double>(3, g);
  }
  std::vector<double> gradients() const {
    std::vector<double> out;
    auto add = [&](const double* p, std::size_t n) { out.insert(out.end(), p, p + n); };
    add(wf.data(), wf.span()); add(bf.data(), bf.span()); add(wc.data(), wc.span());
    add(bc.data(), bc.span()); add(gamma.data(), gamma.span()); add(beta.data(), beta.span());
    return out;
  }
};

/// Observes `b` in micro-batches (with a NaN where `c` says, if `nan`), sets the gradients.
template <class P>
void feed(P& pre, const Batch& b, const Case& c, bool nan) {
  auto observe = [&](const std::string& name, const auto& x, const auto& g) {
    auto one = [&](bool grad, int m) {
      const int first = m == 0 ? 0 : kMicro[0];
      auto v = rows(grad ? g : x, first, kMicro[m]);
      if (nan && name == c.layer && grad == c.in_output_grad && m == c.micro)
        v.data()[v.span() / 2] = std::numeric_limits<double>::quiet_NaN();
      if (grad) pre.observe_output_grad(name, v);
      else pre.observe_input(name, v);
    };
    if (c.interleaved) { one(false, 0); one(true, 0); one(false, 1); one(true, 1); }
    else { one(false, 0); one(false, 1); one(true, 0); one(true, 1); }
  };
  observe("fc", b.xf, b.gf);
  observe("conv", b.xc, b.gc);
  observe("bn", b.xb, b.gb);
  pre.set_gradient("fc", b.wf, b.bf);
  pre.set_gradient("conv", b.wc, b.bc);
  pre.set_gradient("bn", b.gamma, b.beta);
}

template <class P>
std::string saved(const P& pre) {
  std::ostringstream os(std::ios::binary);
  pre.save(os);
  return os.str();
}
/// A checkpoint without what a skipped step changes: the step counter (body offset 0, file
/// offset 20) and the checksum (the last 8 bytes).
inline std::string state_of(const std::string& file) {
  return file.substr(0, 20) + file.substr(28, file.size() - 36);
}

/// Runs case `c`: `nan` says whether this rank sees the NaN, `all` is true on every rank when
/// its argument holds on every rank, `shard` selects this rank's data.
template <class P, class All>
void run_case(P& pre, P& twin, const Case& c, bool nan, int shard, All all) {
  INFO("NaN in " << c.layer << (c.in_output_grad ? " output gradient" : " input") << ", micro-batch "
                 << c.micro + 1 << (c.interleaved ? ", interleaved" : ", grouped"));
  const Case clean{"", false, 0, false};
  bool equal = true;
  for (long s = 0; s < 2; ++s) {
    Batch a(s, shard), t(s, shard);
    feed(pre, a, clean, false);
    feed(twin, t, clean, false);
    pre.step();
    twin.step();
    equal = equal && a.gradients() == t.gradients();
  }
  REQUIRE(all(equal));
  const std::string good = saved(pre);
  // Step 2 (a decomposition step) with the NaN.
  Batch bad(2, shard);
  const std::vector<double> given = bad.gradients();
  bool threw = false;
  try {
    feed(pre, bad, c, nan);
    pre.step();
  } catch (const std::exception& e) {
    threw = true;
    FAIL_CHECK(e.what());
  }
  CHECK(all(!threw));
  CHECK(all(pre.skipped_steps() == 1 && pre.step_count() == 3));
  CHECK(all(state_of(saved(pre)) == state_of(good)));
  CHECK(all(std::memcmp(bad.gradients().data(), given.data(), given.size() * sizeof(double)) == 0));
  // The next good step (the same data the twin gets at its step 2) equals the twin's.
  Batch again(2, shard), t(2, shard);
  feed(pre, again, clean, false);
  feed(twin, t, clean, false);
  REQUIRE_NOTHROW(pre.step());
  twin.step();
  CHECK(all(std::memcmp(again.gradients().data(), t.gradients().data(), given.size() * sizeof(double)) == 0));
  CHECK(all(pre.skipped_steps() == 1 && twin.skipped_steps() == 0));
}

}  // namespace skip
}  // namespace kfac_test
