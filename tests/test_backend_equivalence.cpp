// Backend equivalence (Ginkgo's "equivalent to reference"): the same problem, every policy
// combination, run on the reference backend (Kokkos::Serial) and on Kokkos::DefaultExecutionSpace
// in one binary, then compared. Written once and built per backend: on a Serial-only Kokkos both
// sides are Serial (the test still runs, trivially); with OpenMP (or Threads) the host kernels
// must agree bit for bit, on Kokkos 3.4 and 4.x alike and at any thread count; with CUDA (built
// in CI, run only on a machine with a GPU) cuSOLVER and cuBLAS replace LAPACK and OpenBLAS, so
// only the documented tolerances apply.
//
// Why bit-identical on every host backend (docs/backends.md): statistics (syrk through BLAS,
// elementwise kernels), LAPACK and portable decompositions (one-thread Jacobi, column-parallel
// Cholesky inverse) and the GEMMs of preconditioning fix the order of their arithmetic; and kfac
// has no Kokkos::parallel_reduce over floating point on a host backend: every sum (the factors'
// traces for pi-damping, Newton-Schulz's Frobenius norm and residual, the KL-clip's <V, X> per
// layer, NG-SGD's norms) goes through impl::ordered_sum, whose order depends on the number of
// terms only. Kokkos promises no order for parallel_reduce (Kokkos 4's OpenMP differs from Serial
// in the last bit even with one thread), so before ordered_sum these expectations failed there.
#include <catch2/catch.hpp>
#include <kfac/kfac.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "reference.hpp"

using namespace kfac_test;

namespace {

#if defined(KOKKOS_ENABLE_SERIAL)
using Reference = Kokkos::Serial;
#else
using Reference = Kokkos::DefaultHostExecutionSpace;
#endif
using Backend = Kokkos::DefaultExecutionSpace;
constexpr bool same_backend = std::is_same<Reference, Backend>::value;
constexpr bool host_backend =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, Backend::memory_space>::accessible;

template <class T, class Mem>
using V1 = Kokkos::View<T*, Kokkos::LayoutRight, Mem>;
template <class T, class Mem>
using V2 = Kokkos::View<T**, Kokkos::LayoutRight, Mem>;
template <class T, class Mem>
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Mem>;

/// One registered layer: its host inputs and gradient.
template <class T>
struct LayerData {
  std::string name;
  Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::HostSpace> x, g;  ///< as 4-D (Dense: (N, F, 1, 1))
  Kokkos::View<T*, Kokkos::LayoutRight, Kokkos::HostSpace> w, b;     ///< flat weight and bias gradient
  std::vector<int> x_shape, g_shape, w_shape;
};

/// The problem on one execution space: a preconditioner with every layer and device copies.
template <class T, class Exec>
struct Run {
  using Mem = typename Exec::memory_space;
  kfac::Preconditioner<T, Exec> pre;
  explicit Run(const kfac::Options& o) : pre(o) {}

  template <class Host>
  static auto to_exec(const Host& h) {
    return Kokkos::create_mirror_view_and_copy(Mem(), h);
  }

  /// Observes and sets the gradients of every layer, steps, and returns the preconditioned
  /// gradients (weight then bias, per layer) on the host.
  std::vector<std::vector<T>> step(const std::vector<LayerData<T>>& layers) {
    std::vector<V1<T, Mem>> ws, bs;
    for (const auto& l : layers) {
      const auto x = to_exec(l.x), g = to_exec(l.g);
      ws.push_back(V1<T, Mem>("w", l.w.extent(0)));
      bs.push_back(V1<T, Mem>("b", l.b.extent(0)));
      Kokkos::deep_copy(ws.back(), l.w);
      Kokkos::deep_copy(bs.back(), l.b);
      const auto& xs = l.x_shape;
      const auto& gs = l.g_shape;
      const auto& wsh = l.w_shape;
      if (xs.size() == 2) {  // Dense
        pre.observe_input(l.name, V2<T, Mem>(x.data(), xs[0], xs[1]));
        pre.observe_output_grad(l.name, V2<T, Mem>(g.data(), gs[0], gs[1]));
        pre.set_gradient(l.name, V2<T, Mem>(ws.back().data(), wsh[0], wsh[1]), bs.back());
      } else if (wsh.size() == 4) {  // Conv2d
        pre.observe_input(l.name, x);
        pre.observe_output_grad(l.name, g);
        pre.set_gradient(l.name, V4<T, Mem>(ws.back().data(), wsh[0], wsh[1], wsh[2], wsh[3]), bs.back());
      } else {  // BatchNorm2d: (dgamma, dbeta)
        pre.observe_input(l.name, x);
        pre.observe_output_grad(l.name, g);
        pre.set_gradient(l.name, ws.back(), bs.back());
      }
    }
    pre.step();
    Kokkos::fence();
    std::vector<std::vector<T>> out;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const auto hw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ws[i]);
      const auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), bs[i]);
      std::vector<T> v(hw.data(), hw.data() + hw.span());
      v.insert(v.end(), hb.data(), hb.data() + hb.span());
      out.push_back(std::move(v));
    }
    return out;
  }
};

template <class T>
LayerData<T> dense_data(const std::string& name, int in, int out, int batch, Rng& rng) {
  LayerData<T> l{name, random_view4<T>(batch, in, 1, 1, rng), random_view4<T>(batch, out, 1, 1, rng),
                 {}, {}, {batch, in}, {batch, out}, {out, in}};
  l.w = random_vector<T>(out * in, rng);
  l.b = random_vector<T>(out, rng);
  return l;
}

template <class T>
LayerData<T> conv_data(const std::string& name, int c, int o, int k, int hw, int batch, Rng& rng) {
  // stride 1, padding 1: output has the input's height and width
  LayerData<T> l{name, random_view4<T>(batch, c, hw, hw, rng), random_view4<T>(batch, o, hw, hw, rng),
                 {}, {}, {batch, c, hw, hw}, {batch, o, hw, hw}, {o, c, k, k}};
  l.w = random_vector<T>(o * c * k * k, rng);
  l.b = random_vector<T>(o, rng);
  return l;
}

template <class T>
LayerData<T> bn_data(const std::string& name, int c, int hw, int batch, Rng& rng) {
  LayerData<T> l{name, random_view4<T>(batch, c, hw, hw, rng), random_view4<T>(batch, c, hw, hw, rng),
                 {}, {}, {batch, c, hw, hw}, {batch, c, hw, hw}, {c}};
  l.w = random_vector<T>(c, rng);
  l.b = random_vector<T>(c, rng);
  return l;
}

/// max |a - b| / max(|b|, tiny) over two gradients.
template <class T>
double max_rel_diff(const std::vector<T>& a, const std::vector<T>& b) {
  double scale = 1e-300, diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(double(b[i])));
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
  }
  return diff / scale;
}

/// Runs `steps` steps on both backends and compares every layer's preconditioned gradient
/// after each step, then the checkpointed statistics.
template <class T, class Register>
void compare(const kfac::Options& o, const std::vector<LayerData<T>>& layers, int steps, double tol,
             bool checkpoints_bitwise, Register&& reg) {
  Run<T, Reference> ref(o);
  Run<T, Backend> dev(o);
  reg(ref.pre);
  reg(dev.pre);
  for (int s = 0; s < steps; ++s) {
    const auto a = ref.step(layers);
    const auto b = dev.step(layers);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      INFO("step " << s << ", layer " << layers[i].name);
      REQUIRE(a[i].size() == b[i].size());
      const bool bitwise = host_backend;  // every host backend: bit for bit (the header says why)
      const double d = max_rel_diff(b[i], a[i]);
      INFO("max relative difference " << d << (bitwise ? " (bitwise expected)" : ""));
      if (bitwise) CHECK(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(T)) == 0);
      else CHECK(d <= tol);
    }
  }
  // The checkpoint's statistics (no decompositions): the same bytes where statistics are exact.
  std::ostringstream sa, sb;
  ref.pre.save(sa, false);
  dev.pre.save(sb, false);
  if (host_backend && checkpoints_bitwise) CHECK(sa.str() == sb.str());
  else CHECK(sa.str().size() == sb.str().size());
}

kfac::Options options(double kl_clip) {
  return kfac::Options{}
      .with_damping(1e-2)
      .with_kl_clip(kl_clip)
      .with_factor_update_steps(1)
      .with_inv_update_steps(1)
      .with_loss_reduction(kfac::LossReduction::mean);
}

}  // namespace

TEST_CASE("every policy gives the reference backend's results, double", "[backend][equivalence]") {
  if (same_backend) WARN("only one Kokkos backend in this build: the reference is compared with itself");
  Rng rng(11);
  std::vector<LayerData<double>> layers;
  const char* factors[] = {"full", "sym"};
  const char* inversions[] = {"eigen", "chol", "ns", "eigen_portable", "chol_portable"};
  for (const char* f : factors)
    for (const char* v : inversions)
      layers.push_back(dense_data<double>(std::string("fc_") + f + "_" + v, 7, 5, 12, rng));
  layers.push_back(dense_data<double>("fc_diag", 7, 5, 12, rng));
  // (100 + 1) x 60 = 6060 gradient entries: the KL clip's inner product spans two chunks of
  // ordered_sum, so its chunked path is compared too.
  layers.push_back(dense_data<double>("fc_wide", 100, 60, 12, rng));
  layers.push_back(conv_data<double>("conv_sym_eigen", 2, 3, 3, 5, 4, rng));
  layers.push_back(conv_data<double>("conv_full_chol", 2, 3, 3, 5, 4, rng));
  layers.push_back(conv_data<double>("conv_diag", 2, 3, 3, 5, 4, rng));
  layers.push_back(bn_data<double>("bn_unit", 3, 4, 4, rng));
  layers.push_back(bn_data<double>("bn_diag", 3, 4, 4, rng));

  auto reg = [](auto& pre) {
    using P = kfac::DoublePrecision;
    using Portable = kfac::PortableBackend;
    auto dense = [&](auto factor, const char* name) {
      using Fa = decltype(factor);
      const std::string n(name);
      const kfac::Dense d(7, 5, true);
      pre.template register_layer<kfac::Dense, Fa, kfac::Eigendecomposition<>, P>("fc_" + n + "_eigen", d);
      pre.template register_layer<kfac::Dense, Fa, kfac::Cholesky<>, P>("fc_" + n + "_chol", d);
      pre.template register_layer<kfac::Dense, Fa, kfac::NewtonSchulz, P>("fc_" + n + "_ns", d);
      pre.template register_layer<kfac::Dense, Fa, kfac::Eigendecomposition<Portable>, P>("fc_" + n + "_eigen_portable", d);
      pre.template register_layer<kfac::Dense, Fa, kfac::Cholesky<Portable>, P>("fc_" + n + "_chol_portable", d);
    };
    dense(kfac::Full{}, "full");
    dense(kfac::Symmetric{}, "sym");
    pre.template register_layer<kfac::Dense, kfac::Diagonal>("fc_diag", kfac::Dense(7, 5, true));
    pre.template register_layer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, P>("fc_wide",
                                                                                          kfac::Dense(100, 60, true));
    const auto conv = kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1);
    pre.template register_layer<kfac::Conv2d, kfac::Symmetric, kfac::Eigendecomposition<>, P>("conv_sym_eigen", conv);
    pre.template register_layer<kfac::Conv2d, kfac::Full, kfac::Cholesky<>, P>("conv_full_chol", conv);
    pre.template register_layer<kfac::Conv2d, kfac::Diagonal>("conv_diag", conv);
    pre.template register_layer<kfac::BatchNorm2d, kfac::UnitWise>("bn_unit", kfac::BatchNorm2d(3));
    pre.template register_layer<kfac::BatchNorm2d, kfac::Diagonal>("bn_diag", kfac::BatchNorm2d(3));
  };
  SECTION("no KL clipping") { compare<double>(options(0.0), layers, 3, 1e-10, true, reg); }
  SECTION("KL clipping: the scale is a fixed-order sum over layers") {
    compare<double>(options(1e-3), layers, 3, 1e-10, true, reg);
  }
}

TEST_CASE("float and mixed precision give the reference backend's results", "[backend][equivalence][float]") {
  Rng rng(12);
  std::vector<LayerData<float>> layers;
  layers.push_back(dense_data<float>("fc_single", 7, 5, 16, rng));
  layers.push_back(dense_data<float>("fc_mixed", 7, 5, 16, rng));
  layers.push_back(dense_data<float>("fc_ns", 7, 5, 16, rng));
  layers.push_back(conv_data<float>("conv_single", 2, 3, 3, 5, 4, rng));
  layers.push_back(dense_data<float>("fc_half", 7, 5, 16, rng));  // binary16 factors
  auto reg = [](auto& pre) {
    const kfac::Dense d(7, 5, true);
    pre.template register_layer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::SinglePrecision>(
        "fc_single", d);
    pre.template register_layer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::MixedPrecision>(
        "fc_mixed", d);
    pre.template register_layer<kfac::Dense, kfac::Symmetric, kfac::NewtonSchulz, kfac::SinglePrecision>("fc_ns", d);
    pre.template register_layer<kfac::Conv2d, kfac::Symmetric, kfac::Cholesky<>, kfac::SinglePrecision>(
        "conv_single", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1));
    pre.template register_layer<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>, kfac::HalfPrecision>("fc_half", d);
  };
  compare<float>(options(0.0), layers, 3, 1e-4, true, reg);
}

namespace {

/// impl::ordered_sum over `x` viewed as (rows, cols) column-major, on execution space E.
template <class E>
double ordered_sum_on(const Kokkos::View<double*, Kokkos::HostSpace>& x, long rows, long cols) {
  const auto d = Kokkos::create_mirror_view_and_copy(typename E::memory_space(), x);
  return kfac::impl::ordered_sum(E(), "test::ordered_sum", rows, cols,
                                 KOKKOS_LAMBDA(long j, long i) { return d(i * rows + j); });
}

}  // namespace

TEST_CASE("fixed-order sums: the documented order, the same bits on every host backend",
          "[backend][equivalence][ordered_sum]") {
  // The order written out from docs/backends.md: chunks of 4096 terms (column-major), each summed
  // first to last, then the chunks' sums first to last; up to 4096 terms plain left to right.
  // The last four shapes take the path that sums two chunks side by side (columns of 256 terms
  // and more): an even and an odd number of chunks, with and without a partial last one.
  Rng rng(13);
  for (const auto& shape : std::vector<std::pair<long, long>>{
           {1, 1}, {7, 1}, {4096, 1}, {4097, 1}, {37, 350}, {12293, 1}, {785, 256}, {1000, 33}, {256, 64}, {300, 41}}) {
    const long rows = shape.first, cols = shape.second, n = rows * cols;
    INFO(rows << " x " << cols);
    Kokkos::View<double*, Kokkos::HostSpace> x("x", std::size_t(n));
    // Magnitudes over 12 decades and both signs, so that the order shows in the last bits.
    for (long i = 0; i < n; ++i) x(i) = rng.uniform() * std::pow(10.0, double(i % 12) - 6.0);
    double expected = 0;
    for (long c = 0; c * 4096 < n; ++c) {
      double chunk = 0;
      for (long t = c * 4096; t < std::min(n, (c + 1) * 4096); ++t) chunk += x(t);
      expected += chunk;
    }
    double plain = 0;
    for (long t = 0; t < n; ++t) plain += x(t);
    if (n <= 4096) CHECK(std::memcmp(&plain, &expected, sizeof(double)) == 0);
    const double ref = ordered_sum_on<Reference>(x, rows, cols), dev = ordered_sum_on<Backend>(x, rows, cols);
    CHECK(std::memcmp(&ref, &expected, sizeof(double)) == 0);
    if (host_backend) CHECK(std::memcmp(&dev, &expected, sizeof(double)) == 0);
    else CHECK(std::abs(dev - expected) <= 1e-12 * std::abs(expected) + 1e-300);
  }
}
