#pragma once
/// \file method_settings.hpp
/// \brief Per-layer overrides every method accepts, and the precision placeholder.

#include <optional>
#include <type_traits>

#include "kfac/core/options.hpp"
#include "kfac/core/precision.hpp"

namespace kfac {

/// \brief Precision placeholder: factors and decompositions in the Preconditioner's Scalar.
struct ScalarPrecision {};

namespace impl {
template <class Prec, class Scalar>
struct resolve_precision {
  using type = Prec;
};
template <class Scalar>
struct resolve_precision<ScalarPrecision, Scalar> {
  using type = Precision<Scalar>;
};
template <class Prec, class Scalar>
using resolve_precision_t = typename resolve_precision<Prec, Scalar>::type;

/// \brief The settings a method may override for its own layer; unset ones follow Options.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | Hyperparameter<double> | damping | this layer's damping | Options::damping |
/// | Hyperparameter<double> | factor_decay | running-average weight of this layer's old statistics | Options::factor_decay |
/// | Hyperparameter<long> | factor_update_steps | interval between this layer's statistics updates | Options::factor_update_steps |
/// | Hyperparameter<long> | inv_update_steps | interval between this layer's decompositions | Options::inv_update_steps |
///
/// A mix-in of settings only (CRTP, so the builders return the method's own type).
template <class Method>
struct LayerOverrides {
  std::optional<Hyperparameter<double>> damping, factor_decay;
  std::optional<Hyperparameter<long>> factor_update_steps, inv_update_steps;

  Method& with_damping(Hyperparameter<double> v) { damping = std::move(v); return self(); }
  Method& with_factor_decay(Hyperparameter<double> v) { factor_decay = std::move(v); return self(); }
  Method& with_factor_update_steps(Hyperparameter<long> v) {
    factor_update_steps = std::move(v);
    return self();
  }
  Method& with_inv_update_steps(Hyperparameter<long> v) {
    inv_update_steps = std::move(v);
    return self();
  }
  /// The hyperparameters of this layer at `step`: the overrides, else the global ones.
  StepValues values_at(const Options& o, long step) const {
    Options mine = o;
    if (damping) mine.damping = *damping;
    if (factor_decay) mine.factor_decay = *factor_decay;
    if (factor_update_steps) mine.factor_update_steps = *factor_update_steps;
    if (inv_update_steps) mine.inv_update_steps = *inv_update_steps;
    return StepValues::at(mine, step);
  }
  bool overrides_anything() const {
    return damping || factor_decay || factor_update_steps || inv_update_steps;
  }

 private:
  Method& self() { return static_cast<Method&>(*this); }
};

/// The overrides of any method, as the Preconditioner keeps them per layer.
struct Overrides : LayerOverrides<Overrides> {};

/// A method object derived from LayerOverrides<Method> carries per-layer overrides; any other
/// method object (the smallest one a user writes: method_tag, name, accepts, make_block) has none,
/// and its layers follow the Preconditioner's Options.
template <class Method, std::enable_if_t<!std::is_base_of<LayerOverrides<Method>, Method>::value, int> = 0>
Overrides overrides_of(const Method&) {
  return {};
}
template <class Method>
Overrides overrides_of(const LayerOverrides<Method>& m) {
  Overrides o;
  o.damping = m.damping;
  o.factor_decay = m.factor_decay;
  o.factor_update_steps = m.factor_update_steps;
  o.inv_update_steps = m.inv_update_steps;
  return o;
}
}  // namespace impl
}  // namespace kfac
