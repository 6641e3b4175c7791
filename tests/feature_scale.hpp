#pragma once
// A layer kind defined by the tests alone, with no file under include/ touched (the seam of
// design.md's "Layer kinds"): a per-feature scale y = s * x over the last dimension (no shift),
// whose unit-wise Fisher is that of LayerNorm(bias = false) fed the same x. test_batch_norm
// registers it with the core directly, test_torch_kinds through the LibTorch front end.
#include <kfac/kfac.hpp>
#include <string>

namespace kfac_test {

struct FeatureScale {
  static constexpr bool is_kronecker = false;
  static constexpr const char* kind = "feature_scale";
  long d;
  kfac::index_t units() const { return d; }
  bool bias() const { return false; }
  kfac::index_t weight_rows() const { return d; }
  kfac::index_t weight_cols() const { return 1; }
  std::string describe() const { return std::string(kind) + "(d=" + std::to_string(d) + ")"; }
  std::string check_input(const kfac::impl::Extents& e) const {
    return kfac::impl::are_feature_rows(e, d) ? "" : "input has shape " + e.str() + ", expected (batch, tokens, d)";
  }
  std::string check_output_grad(const kfac::impl::Extents& e, const kfac::impl::Extents&) const {
    return check_input(e);
  }
  template <class Exec, class XHat, class Grad, class Sums>
  void add_unit_products(const Exec& exec, const XHat& x, const Grad& dy, double scale, const Sums& sums) const {
    const int t = int(kfac::impl::tokens_of(kfac::impl::extents_of(dy), d));
    kfac::impl::add_unit_products(exec, "test::feature_scale", x.data(), dy.data(), scale, int(dy.extent(0)), int(d), t,
                                  std::size_t(t * d), 1, std::size_t(d), sums);
  }
};

}  // namespace kfac_test
