#pragma once
// Scaffolding shared by the preconditioner-level tests: the host preconditioner and its layer
// types, views <-> Eigen in double, bitwise comparison, and a checker for kfac::Error.
#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <kfac/kfac.hpp>
#include <string>
#include <vector>

#include "reference.hpp"

namespace kfac_test {

using Host = Kokkos::DefaultHostExecutionSpace;
using Pre = kfac::Preconditioner<double, Host>;
/// The concrete layer behind a registration with the given policies, for `layer_as`
/// (KroneckerBlock, or DiagonalBlock for Diagonal factors: the method's block_type).
template <class LayerType, class Factor = kfac::Symmetric, class Inverse = kfac::Eigendecomposition<>>
using KLayer = typename kfac::KFAC<Factor, Inverse, kfac::DoublePrecision>::template block_type<LayerType, double, Host>;
template <class Factor = kfac::UnitWise>
using BnLayer = kfac::BatchNormBlock<Factor, kfac::DoublePrecision, double, Host>;

template <class T>
using V1 = Kokkos::View<T*, Kokkos::LayoutRight, Kokkos::HostSpace>;
template <class T>
using V2 = Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace>;
template <class T>
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::HostSpace>;

/// Options with no KL clipping and no loss-reduction scaling, so results are plain solves.
inline kfac::Options plain_options(double damping = 1e-2) {
  return kfac::Options{}.with_damping(damping).with_kl_clip(0.0).with_loss_reduction(
      kfac::LossReduction::sum);
}

/// A Symmetric factor (upper triangle valid) as the full symmetric matrix.
template <class F>
MatrixXd symmetric_from_upper(const F& f) {
  const int n = int(f.extent(0));
  MatrixXd m(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = i; j < n; ++j) m(i, j) = m(j, i) = double(f(i, j));
  return m;
}

/// A weight gradient of any rank, seen as (extent(0), rest), with the bias as a last column.
template <class W>
MatrixXd grad_with_bias(const W& w, const V1<double>& b) {
  const int rows = int(w.extent(0)), cols = int(w.span() / w.extent(0));
  const bool bias = b.extent(0) > 0;
  MatrixXd m(rows, cols + (bias ? 1 : 0));
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) m(i, j) = double(w.data()[i * cols + j]);
    if (bias) m(i, cols) = b(i);
  }
  return m;
}

/// A deep copy with the same type and extents.
template <class V>
V clone(const V& v) {
  V c(Kokkos::view_alloc(std::string(v.label()) + "_copy"), v.layout());
  Kokkos::deep_copy(c, v);
  return c;
}

/// True when two contiguous views hold the same extents and the same bytes.
template <class A, class B>
bool same_bits(const A& a, const B& b) {
  static_assert(sizeof(typename A::value_type) == sizeof(typename B::value_type), "same scalar");
  if (a.span() != b.span() || unsigned(A::rank) != unsigned(B::rank)) return false;
  for (unsigned r = 0; r < A::rank; ++r)
    if (a.extent(r) != b.extent(r)) return false;
  return a.span() == 0 || std::memcmp(a.data(), b.data(), a.span() * sizeof(typename A::value_type)) == 0;
}

/// One step's data of a Dense layer: input, output gradient, weight and bias gradient.
struct DenseBatch {
  V2<double> x, g, w;
  V1<double> b;  // empty for a layer without bias

  DenseBatch(int in, int out, bool bias, int batch, Rng& rng)
      : x(random_view<double>(batch, in, rng)), g(random_view<double>(batch, out, rng)),
        w(random_view<double>(out, in, rng)), b(bias ? random_vector<double>(out, rng) : V1<double>()) {}

  /// A = mean of (x, 1)(x, 1)^T and G = mean of g g^T over the batch (per-sample gradients).
  MatrixXd factor_a() const {
    const int n = int(x.extent(0)), in = int(x.extent(1));
    MatrixXd xa(n, in + (b.extent(0) ? 1 : 0));
    xa.leftCols(in) = to_eigen(x);
    if (b.extent(0)) xa.col(in).setOnes();
    return xa.transpose() * xa / n;
  }
  MatrixXd factor_g() const {
    const MatrixXd gm = to_eigen(g);
    return gm.transpose() * gm / double(g.extent(0));
  }
  MatrixXd gradient() const { return grad_with_bias(w, b); }
  /// The same data with gradient buffers of its own, for a twin preconditioner.
  DenseBatch twin() const {
    DenseBatch t = *this;
    t.w = clone(w);
    t.b = clone(b);
    return t;
  }

  /// Observes x and g and hands over (w, b), which step() then overwrites.
  void feed(Pre& pre, const std::string& name) const {
    pre.observe_input(name, x);
    pre.observe_output_grad(name, g);
    pre.set_gradient(name, w, b);
  }
};

/// Runs `f`, which must throw kfac::Error about `layer` whose message contains every one of
/// `parts`. Returns the message (empty when the check failed).
inline std::string expect_error(const std::function<void()>& f, const std::string& layer,
                                const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const kfac::Error& e) {
    const std::string what = e.what();
    INFO("message: " << what);
    CHECK(e.layer() == layer);
    if (!layer.empty()) CHECK(what.find("'" + layer + "'") != std::string::npos);
    for (const auto& p : parts) {
      INFO("expected to contain: " << p);
      CHECK(what.find(p) != std::string::npos);
    }
    return what;
  }
  FAIL("expected a kfac::Error about layer '" << layer << "'");
  return {};
}

}  // namespace kfac_test
