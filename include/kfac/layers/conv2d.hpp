#pragma once
/// \file conv2d.hpp
/// \brief Layer-type policy for 2-D convolutions (NCHW), after Grosse & Martens' KFC (2016).

#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief 2-D convolution, input (N, C, H, W), weight (O, C, kh, kw), output (N, O, Ho, Wo).
///
/// With \f$a_{n,t}\f$ the im2col patch (length C kh kw, plus a trailing 1 with a bias) at output
/// location t of sample n, \f$g_{n,t}\f$ the output gradient there, and T = Ho Wo locations,
/// KFC's factors under spatial homogeneity and spatially uncorrelated derivatives are
/// \f[ A = \frac{1}{N}\sum_n \sum_t a_{n,t} a_{n,t}^T, \qquad
///     G = \frac{1}{N\,T}\sum_n \sum_t g_{n,t} g_{n,t}^T , \f]
/// i.e. A sums over locations and G averages over them, so that \f$A \otimes G\f$ approximates
/// the Fisher of the per-sample weight gradient \f$\sum_t g_{n,t} a_{n,t}^T\f$.
/// Patch column order is c*kh*kw + i*kw + j, the row-major flattening of the weight (C, kh, kw).
///
/// `with_factor_scaling(Conv2d::FactorScaling::kfac_pytorch)` gives kfac-pytorch's factors
/// instead: each row (patch and bias 1 alike, and each output gradient) divided by T, and both
/// Gram sums divided by their N T rows, i.e. \f$A = \frac{1}{N T^3}\sum_{n,t} a a^T\f$ and
/// \f$G = \frac{1}{N T^3}\sum_{n,t} g g^T\f$ (T³ and T² smaller than KFC's): what the Python
/// package's default conventions use to reproduce kfac-pytorch's steps.
class Conv2d {
 public:
  static constexpr bool is_kronecker = true;
  static constexpr const char* kind = "conv2d";
  /// How the Gram sums over (sample, location) rows are normalised (see the class comment).
  enum class FactorScaling { kfc, kfac_pytorch };

  Conv2d(index_t in_channels, index_t out_channels, index_t kernel_h, index_t kernel_w)
      : c_(in_channels), o_(out_channels), kh_(kernel_h), kw_(kernel_w) {
    if (c_ < 1 || o_ < 1 || kh_ < 1 || kw_ < 1)
      throw Error("", "Conv2d: expected channels and kernel extents >= 1");
  }
  Conv2d& with_stride(index_t sh, index_t sw) {
    if (sh < 1 || sw < 1) throw Error("", "Conv2d: expected stride >= 1");
    sh_ = sh; sw_ = sw; return *this;
  }
  Conv2d& with_padding(index_t ph, index_t pw) {
    if (ph < 0 || pw < 0) throw Error("", "Conv2d: expected padding >= 0");
    ph_ = ph; pw_ = pw; return *this;
  }
  Conv2d& with_dilation(index_t dh, index_t dw) {
    if (dh < 1 || dw < 1) throw Error("", "Conv2d: expected dilation >= 1");
    dh_ = dh; dw_ = dw; return *this;
  }
  Conv2d& with_bias(bool b) { bias_ = b; return *this; }
  Conv2d& with_factor_scaling(FactorScaling f) { scaling_ = f; return *this; }

  bool bias() const { return bias_; }
  FactorScaling factor_scaling() const { return scaling_; }
  index_t a_dim() const { return c_ * kh_ * kw_ + (bias_ ? 1 : 0); }
  index_t g_dim() const { return o_; }
  index_t weight_rows() const { return o_; }
  index_t weight_cols() const { return c_ * kh_ * kw_; }
  /// Output extents, 0 when the (dilated) kernel does not fit inside the padded image. The
  /// span is tested before dividing: C++ division truncates toward zero, so a span of -1
  /// would otherwise give one output row.
  index_t out_h(index_t h) const { return out_extent(h, ph_, dh_, kh_, sh_); }
  index_t out_w(index_t w) const { return out_extent(w, pw_, dw_, kw_, sw_); }
  std::string describe() const {
    auto s = [](index_t v) { return std::to_string(v); };
    return std::string(kind) + "(c=" + s(c_) + ",o=" + s(o_) + ",k=" + s(kh_) + "x" + s(kw_) +
           ",s=" + s(sh_) + "x" + s(sw_) + ",p=" + s(ph_) + "x" + s(pw_) + ",d=" + s(dh_) + "x" +
           s(dw_) + ",bias=" + s(bias_) + (scaling_ == FactorScaling::kfc ? "" : ",scaling=kfac_pytorch") + ")";
  }

  std::string check_input(const impl::Extents& e) const {
    if (e.rank < 2 || e.rank == 3 || e[1] != c_ || out_h(index_t(e[2])) < 1 || out_w(index_t(e[3])) < 1)
      return "input has shape " + e.str() + ", expected (batch, " +
             std::to_string(c_) + ", H, W) with the kernel fitting inside the padded image";
    return {};
  }
  /// Output gradients must match the spatial size implied by the last observed input
  /// (`input` all zero when none was observed).
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    const index_t in_h_ = index_t(input[2]), in_w_ = index_t(input[3]);
    if (e.rank < 2 || e.rank == 3 || e[1] != o_ || (in_h_ > 0 && (e[2] != out_h(in_h_) || e[3] != out_w(in_w_))))
      return "output gradient has shape " + e.str() +
             ", expected (batch, " + std::to_string(o_) + ", " +
             (in_h_ > 0 ? std::to_string(out_h(in_h_)) + ", " + std::to_string(out_w(in_w_))
                        : std::string("Ho, Wo")) + ")";
    return {};
  }

  /// Rows of the im2col matrix: one per (sample, output location); A's normalizer is N (KFC)
  /// or N T³ (kfac-pytorch's scaling).
  index_t a_rows(const impl::Extents& x) const {
    return index_t(x[0]) * out_h(index_t(x[2])) * out_w(index_t(x[3]));
  }
  double a_normalizer(const impl::Extents& x) const {
    const double t = double(out_h(index_t(x[2]))) * double(out_w(index_t(x[3])));
    return scaling_ == FactorScaling::kfc ? double(x[0]) : double(x[0]) * t * t * t;
  }
  /// G rows are (sample, location); G's normalizer is N T (KFC) or N T³.
  index_t g_rows(const impl::Extents& g) const { return index_t(g[0] * g[2] * g[3]); }
  double g_normalizer(const impl::Extents& g) const {
    const double t = double(g[2] * g[3]);
    return scaling_ == FactorScaling::kfc ? double(g[0]) * t : double(g[0]) * t * t * t;
  }

  template <class Exec, class Scalar, class Rows>
  void fill_a_rows(const Exec& exec, const impl::Tensor4<Scalar, Exec>& x, const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const int n = int(x.extent(0)), h = int(x.extent(2)), w = int(x.extent(3));
    const int ho = out_h(h), wo = out_w(w), kh = kh_, kw = kw_, c = c_;
    const int sh = sh_, sw = sw_, ph = ph_, pw = pw_, dh = dh_, dw = dw_;
    const int patch = c * kh * kw;
    const bool bias = bias_;
    if constexpr (impl::host_accessible_v<Exec>) {
      // One row (sample, output location) per index, filled in order, the kernel columns
      // inside the image found once per row: no division per entry. The two-index form below
      // took 1.7x as long on the host (8.8 against 5.1 ms of CPU for the 32 -> 64 channel 3 x 3
      // layer of the demo CNN at batch 128).
      Kokkos::parallel_for(
          "kfac::conv2d::im2col", Kokkos::RangePolicy<Exec>(exec, 0, n * ho * wo), KOKKOS_LAMBDA(int r) {
            const int smp = r / (ho * wo), loc = r % (ho * wo), oy = loc / wo, ox = loc % wo;
            const int x0 = ox * sw - pw;
            // the kernel columns that fall inside the image: [j_lo, j_hi)
            int j_lo = 0, j_hi = kw;
            while (j_lo < kw && x0 + j_lo * dw < 0) ++j_lo;
            while (j_hi > j_lo && x0 + (j_hi - 1) * dw >= w) --j_hi;
            int col = 0;
            for (int ch = 0; ch < c; ++ch)
              for (int i = 0; i < kh; ++i) {
                const int y = oy * sh - ph + i * dh;
                if (y < 0 || y >= h) {
                  for (int j = 0; j < kw; ++j) rows(r, col + j) = T(0);
                } else {
                  const Scalar* line = &x(smp, ch, y, 0) + x0;
                  for (int j = 0; j < j_lo; ++j) rows(r, col + j) = T(0);
                  for (int j = j_lo; j < j_hi; ++j) rows(r, col + j) = T(line[j * dw]);
                  for (int j = j_hi; j < kw; ++j) rows(r, col + j) = T(0);
                }
                col += kw;
              }
            if (bias) rows(r, col) = T(1);
          });
      return;
    }
    Kokkos::parallel_for(
        "kfac::conv2d::im2col",
        impl::RowMajorRange<Exec>(exec, {0, 0}, {n * ho * wo, patch + int(bias)}),
        KOKKOS_LAMBDA(int r, int col) {
          if (col == patch) { rows(r, col) = T(1); return; }
          const int s = r / (ho * wo), loc = r % (ho * wo), oy = loc / wo, ox = loc % wo;
          const int ch = col / (kh * kw), k = col % (kh * kw), i = k / kw, j = k % kw;
          const int y = oy * sh - ph + i * dh, xx = ox * sw - pw + j * dw;
          rows(r, col) = (y >= 0 && y < h && xx >= 0 && xx < w) ? T(x(s, ch, y, xx)) : T(0);
        });
  }
  template <class Exec, class Scalar, class Rows>
  void fill_g_rows(const Exec& exec, const impl::Tensor4<Scalar, Exec>& g, double scale,
                   const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const int n = int(g.extent(0)), o = int(g.extent(1)), ho = int(g.extent(2)),
              wo = int(g.extent(3));
    const T s = T(scale);
    if constexpr (impl::host_accessible_v<Exec>) {  // as in fill_a_rows: a row per index
      Kokkos::parallel_for(
          "kfac::conv2d::g_rows", Kokkos::RangePolicy<Exec>(exec, 0, n * ho * wo), KOKKOS_LAMBDA(int r) {
            const int smp = r / (ho * wo), loc = r % (ho * wo), oy = loc / wo, ox = loc % wo;
            for (int c = 0; c < o; ++c) rows(r, c) = s * T(g(smp, c, oy, ox));
          });
      return;
    }
    Kokkos::parallel_for(
        "kfac::conv2d::g_rows",
        impl::RowMajorRange<Exec>(exec, {0, 0}, {n * ho * wo, o}),
        KOKKOS_LAMBDA(int r, int c) {
          const int smp = r / (ho * wo), loc = r % (ho * wo);
          rows(r, c) = s * T(g(smp, c, loc / wo, loc % wo));
        });
  }

 private:
  static index_t out_extent(index_t in, index_t pad, index_t dil, index_t k, index_t stride) {
    const index_t span = in + 2 * pad - dil * (k - 1) - 1;
    return span < 0 ? 0 : span / stride + 1;
  }

  index_t c_, o_, kh_, kw_;
  index_t sh_ = 1, sw_ = 1, ph_ = 0, pw_ = 0, dh_ = 1, dw_ = 1;
  bool bias_ = true;
  FactorScaling scaling_ = FactorScaling::kfc;
};

}  // namespace kfac
