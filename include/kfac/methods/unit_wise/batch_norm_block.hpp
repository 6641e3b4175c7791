#pragma once
/// \file batch_norm_block.hpp
/// \brief The block of a normalization layer's scale-and-shift (BatchNorm2d, LayerNorm),
/// preconditioned with the unit-wise or diagonal Fisher: closed form, no decomposable units.

#include <limits>
#include <string>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/precision.hpp"
#include "kfac/layers/batch_norm.hpp"
#include "kfac/layers/layer_norm.hpp"
#include "kfac/methods/kfac/factors.hpp"

namespace kfac {

/// \brief Per-unit Fisher blocks of a normalization layer's scale and shift (Osawa et al. 2019):
/// the channels of BatchNorm2d, the features of LayerNorm.
///
/// Per unit c the running Fisher is \f$F_c = E_n[(g^\gamma, g^\beta)^T (g^\gamma, g^\beta)]\f$
/// (3 stored values), the per-sample products formed by the layer type (`add_unit_products`).
/// kfac::UnitWise preconditions with \f$(F_c + \gamma I)^{-1}\f$ (2x2, closed form; 1x1 for a
/// layer without a shift); kfac::Diagonal with \f$\mathrm{diag}(F_c) + \gamma\f$.
template <class FactorPolicy, class Prec, class Scalar, class Exec, class LayerType = BatchNorm2d>
class BatchNormBlock final : public impl::Block<Scalar, Exec> {
  static_assert(std::is_same<FactorPolicy, UnitWise>::value ||
                    std::is_same<FactorPolicy, Diagonal>::value,
                "BatchNorm2d takes the factor policy kfac::UnitWise or kfac::Diagonal");
  static_assert(!std::is_same<typename Prec::factor_type, Half>::value,
                "BatchNorm2d: half-precision factors (kfac::Half) are for Kronecker layers; its "
                "unit-wise Fisher is 3 values per channel: store it in float or double");
  using F = typename Prec::factor_type;
  using D = typename Prec::decomposition_type;
  using Stored = Kokkos::View<Scalar****, Kokkos::LayoutRight, typename Exec::memory_space>;

 public:
  using base = impl::Block<Scalar, Exec>;
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  BatchNormBlock(std::string name, const LayerType& layer)
      : base(std::move(name), describe(layer)), layer_(layer), c_(int(layer.units())),
        sums_("kfac::bn::sums", c_, 3), gradient_(c_, 1, layer.bias()) {
    gradient_.terms_per_column();  // <V, X> sums one 2-vector (or value) per unit
    this->use_gradient(gradient_);
    // an output gradient pairs with the normalized input observed before it
    this->use_observations(impl::ObservationPairs(layer, impl::ObservationPairs::Order::input_first));
  }

  /// The description: a (units x 1) weight (gamma) with a bias (beta) when the layer has one;
  /// no decomposable units (closed forms); the checkpoint holds the 3 Fisher values per unit.
  static impl::BlockDescription describe(const LayerType& layer) {
    impl::BlockDescription d;
    d.kind = LayerType::kind;
    d.signature = layer.describe() + "/" + FactorPolicy::name + "/f" + std::to_string(sizeof(F)) + "d" +
                  std::to_string(sizeof(D)) + "s" + std::to_string(sizeof(Scalar));
    d.rows = layer.units();
    d.cols = 1;
    d.bias = layer.bias();
    d.checkpoint = {{std::size_t(3 * layer.units()), sizeof(F)}};
    d.averaged = {{index_t(3 * layer.units()), false, false}};
    d.memory.registered = 3 * std::size_t(layer.units()) * sizeof(double);  // the sums, from registration on
    return d;
  }

  void add_input(const Exec& exec, const tensor_type& x) override {
    Stored copy(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::bn::xhat"), x.extent(0),
                x.extent(1), x.extent(2), x.extent(3));
    Kokkos::deep_copy(exec, copy, x);
    inputs_.push_back(copy);
  }

  /// Adds the per-sample (gamma, beta) gradient products of one micro-batch to the sums.
  void add_output_grad(const Exec& exec, const tensor_type& dy, double scale) override {
    const std::size_t k = this->observations().output_grads();  // its input's index
    layer_.add_unit_products(exec, inputs_[k], dy, scale, sums_);
    inputs_[k] = Stored();  // folded into the sums: only O(units) stays pending
    samples_ += long(dy.extent(0));
  }
  /// Overflow: a channel's new (gamma, gamma) or (beta, beta) value above the factor type's range.
  impl::ObservationCheck check_observations() const override {
    impl::ObservationCheck check;
    if (samples_ > 0) {
      auto h = Kokkos::create_mirror_view(sums_);
      Kokkos::deep_copy(h, sums_);
      const double big = double(std::numeric_limits<F>::max());
      for (int c = 0; c < c_ && !check.overflow; ++c)
        check.overflow = !(h(c, 0) / double(samples_) <= big) || !(h(c, 2) / double(samples_) <= big);
    }
    if (inputs_.empty()) check.problem = "no observations were given";
    else if (this->observations().output_grads() != inputs_.size())
      check.problem = "observed " + std::to_string(inputs_.size()) + " inputs but " +
                      std::to_string(this->observations().output_grads()) +
                      " output gradients";
    else if (check.overflow) check.problem = "observations would overflow the factor type";
    return check;
  }
  void drop_observations() override {
    inputs_.clear();
    samples_ = 0;
    Kokkos::deep_copy(sums_, 0.0);
  }

  std::vector<impl::Buffer> checkpoint_state() override { return {impl::buffer_of(f_)}; }
  void allocate_state() override {
    allocate_factor_storage();
    this->set_statistics(true);
  }
  void release_state() override {
    f_ = decltype(f_)();
    this->set_statistics(false);
  }
  void update_statistics(const Exec& exec, double decay) override {
    allocate_factor_storage();
    const bool had = this->has_statistics();
    const double old_w = had ? decay : 0.0, new_w = (had ? 1.0 - decay : 1.0) / double(samples_);
    auto f = f_;
    auto sums = sums_;
    Kokkos::parallel_for(
        "kfac::bn::update", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>(exec, {0, 0}, {c_, 3}),
        KOKKOS_LAMBDA(int c, int k) { f(c, k) = F(old_w * double(f(c, k)) + new_w * sums(c, k)); });
    this->set_statistics(true);
  }
  /// Per unit c, column c of X and V is (dgamma, dbeta), or dgamma alone without a shift.
  void precondition(const Exec& exec, double damping, const impl::ApplyPart&) override {
    auto f = f_;
    auto x = gradient_.x();
    auto out = gradient_.v();
    const D d = D(damping);
    const bool shift = layer_.bias();
    Kokkos::parallel_for(
        "kfac::bn::solve", Kokkos::RangePolicy<Exec>(exec, 0, c_), KOKKOS_LAMBDA(int c) {
          const D xg = x(0, c);
          const D a = D(f(c, 0)) + d;
          if (!shift) {
            out(0, c) = xg / a;
            return;
          }
          const D xb = x(1, c), off = D(f(c, 1)), e = D(f(c, 2)) + d;
          if (std::is_same<FactorPolicy, UnitWise>::value) {
            const D det = a * e - off * off;
            out(0, c) = (e * xg - off * xb) / det;
            out(1, c) = (a * xb - off * xg) / det;
          } else {
            out(0, c) = xg / a;
            out(1, c) = xb / e;
          }
        });
  }
  MemoryReport memory() const override {
    MemoryReport r{this->name(), this->kind(), f_.size() * sizeof(F), 0, gradient_.bytes()};
    r.workspace_bytes += sums_.size() * sizeof(double);
    for (const auto& v : inputs_) r.workspace_bytes += v.size() * sizeof(Scalar);
    return r;
  }

  /// (C x 3) running Fisher blocks: columns (gamma-gamma, gamma-beta, beta-beta).
  const Kokkos::View<F**, Kokkos::LayoutLeft, typename Exec::memory_space>& fisher() const { return f_; }

 private:
  void allocate_factor_storage() {
    if (f_.extent(0) == 0) f_ = Kokkos::View<F**, Kokkos::LayoutLeft, typename Exec::memory_space>("kfac::bn::F", c_, 3);
  }

  LayerType layer_;
  int c_;
  std::vector<Stored> inputs_;
  long samples_ = 0;
  Kokkos::View<double**, Kokkos::LayoutLeft, typename Exec::memory_space> sums_;
  Kokkos::View<F**, Kokkos::LayoutLeft, typename Exec::memory_space> f_;
  impl::GradientWorkspace<D, Scalar, Exec> gradient_;
};

/// The former name (blocks were called layers until 2026-12), kept for code written against it.
template <class FactorPolicy, class Prec, class Scalar, class Exec>
using BatchNormLayer = BatchNormBlock<FactorPolicy, Prec, Scalar, Exec>;
/// The block of a LayerNorm (the same closed forms over its features).
template <class FactorPolicy, class Prec, class Scalar, class Exec>
using LayerNormBlock = BatchNormBlock<FactorPolicy, Prec, Scalar, Exec, LayerNorm>;

}  // namespace kfac
