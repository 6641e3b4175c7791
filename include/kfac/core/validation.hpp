#pragma once
/// \file validation.hpp
/// \brief Checks at the public boundary: what a view handed to the Preconditioner must be.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/core/block.hpp"
#include "kfac/core/options.hpp"
#include "kfac/core/traits.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {

template <class View>
std::string shape_string(const View& v) {
  long e[8] = {};
  for (unsigned r = 0; r < View::rank; ++r) e[r] = long(v.extent(r));
  return extents_string(e, int(View::rank));
}

inline void fail_if(const std::string& name, const std::string& why) {
  if (!why.empty()) throw Error(name, why);
}

/// What as_tensor's static_asserts require; false stops its body from instantiating (the
/// static_assert's message is then the whole error, not the first of a page).
template <class Scalar, class Exec, class View>
constexpr bool observation_ok() {
  if constexpr (!Kokkos::is_view<View>::value) return false;
  else return (View::rank >= 1 && View::rank <= 4) && std::is_same<typename View::non_const_value_type, Scalar>::value &&
              Kokkos::SpaceAccessibility<Exec, typename View::memory_space>::accessible;
}

/// Row-major rank-2 (batch, features), rank-3 (batch, tokens, features) or rank-4 (N, C, H, W)
/// view, or the rank-1 (batch) token ids of an Embedding -> unmanaged rank-4 view, trailing
/// extents 1. Which ranks a layer takes is its own check (impl::Extents::rank).
template <class Scalar, class Exec, class View>
Tensor4<Scalar, Exec> as_tensor(const std::string& name, const View& v, const char* what) {
  static_assert(Kokkos::is_view<View>::value, "kfac: observations must be Kokkos views");
  static_assert(View::rank >= 1 && View::rank <= 4,
                "kfac: observations are (batch, features), (batch, tokens, features) or (N, C, H, W) views, or "
                "(batch) / (batch, tokens) token ids");
  static_assert(std::is_same<typename View::non_const_value_type, Scalar>::value,
                "kfac: observations must have the Preconditioner's Scalar type");
  static_assert(Kokkos::SpaceAccessibility<Exec, typename View::memory_space>::accessible,
                "kfac: observation not accessible from the execution space");
  if constexpr (!observation_ok<Scalar, Exec, View>()) {
    return {};
  } else {
    if (!std::is_same<typename View::array_layout, Kokkos::LayoutRight>::value || !v.span_is_contiguous())
      throw Error(name, std::string(what) + " must be a contiguous row-major (LayoutRight) view");
    const std::size_t d1 = View::rank >= 2 ? v.extent(1) : 1, d2 = View::rank >= 3 ? v.extent(2) : 1,
                      d3 = View::rank == 4 ? v.extent(3) : 1;
    return Tensor4<Scalar, Exec>(v.data(), v.extent(0), d1, d2, d3);
  }
}

template <class Scalar, class Exec, class Entry, class W, class B>
void take_checked_gradient(Entry& entry, const W& weight, const B& bias);

/// The bytes [first, last) of a view's values.
template <class V>
std::pair<const char*, const char*> bytes_of(const V& v) {
  const char* p = reinterpret_cast<const char*>(v.data());
  return {p, p + v.span() * sizeof(typename V::value_type)};
}
inline bool overlap(std::pair<const char*, const char*> a, std::pair<const char*, const char*> b) {
  return a.first < a.second && b.first < b.second && a.first < b.second && b.first < a.second;
}
/// Refuses a gradient of layer `name` that shares memory with its own other half or with a
/// gradient set for another layer this step (tied weights): each layer preconditions its
/// gradient in place, so the second would precondition the first one's output.
template <class Registry, class W, class B>
void check_gradient_not_shared(const Registry& reg, const std::string& name, const W& weight, const B& bias) {
  const auto w = bytes_of(weight), b = bytes_of(bias);
  if (overlap(w, b)) throw Error(name, "the weight and bias gradients overlap in memory");
  for (const auto& e : reg.entries()) {
    if (!e.has_gradient || e.block->name() == name) continue;
    for (const auto& theirs : {bytes_of(e.w), bytes_of(e.b)})
      if (overlap(w, theirs) || overlap(b, theirs))
        throw Error(name, "the gradient shares memory with the gradient set for layer '" + e.block->name() +
                              "' (tied weights?): each layer preconditions its gradient in place, so two layers "
                              "must not be handed the same buffer; give each its own copy");
  }
}

/// The largest gradient magnitude layer `e` preconditions without overflow at `damping`: every
/// method's preconditioner is a damped inverse with norm <= 1/damping (the decomposition's
/// damping, when smaller), so \f$|V| \le \sqrt{n} \max|X| / \gamma\f$ must fit the apply's
/// type and the caller's, and the KL-clip sum \f$\langle V, X\rangle \le n \max|X|^2 / \gamma\f$
/// a double (n: the gradient's values with its bias).
template <class Entry>
double gradient_limit(const Entry& e, double damping) {
  using Scalar = typename std::decay_t<decltype(e.w)>::non_const_value_type;
  const auto& block = *e.block;
  const double n = double(block.weight_rows()) * double(block.weight_cols() + (block.has_bias() ? 1 : 0));
  double top = double(std::numeric_limits<Scalar>::max());
  if (block.plan().apply.scalar == sizeof(float)) top = std::min(top, double(std::numeric_limits<float>::max()));
  const double g = std::min(1.0, e.decomposition_damping > 0 ? std::min(damping, e.decomposition_damping) : damping);
  return std::min(top * g / std::sqrt(n), std::sqrt(std::numeric_limits<double>::max() * g / n));
}

/// Checks a (weight, bias) gradient against the block's shape and stores it in `entry`.
template <class Scalar, class Exec, class Entry, class W, class B>
void take_gradient(Entry& entry, const W& weight, const B& bias) {
  static_assert(std::is_same<typename W::non_const_value_type, Scalar>::value &&
                    std::is_same<typename B::non_const_value_type, Scalar>::value,
                "kfac::set_gradient: gradients must have the Preconditioner's Scalar type");
  static_assert(Kokkos::SpaceAccessibility<Exec, typename W::memory_space>::accessible,
                "kfac::set_gradient: gradient not accessible from the execution space");
  static_assert(!std::is_const<typename W::value_type>::value &&
                    !std::is_const<typename B::value_type>::value,
                "kfac::set_gradient: gradients are preconditioned in place; pass non-const views");
  if constexpr (std::is_same<typename W::non_const_value_type, Scalar>::value &&
                std::is_same<typename B::non_const_value_type, Scalar>::value)
    take_checked_gradient<Scalar, Exec>(entry, weight, bias);
}

/// take_gradient's body, once its static_asserts hold.
template <class Scalar, class Exec, class Entry, class W, class B>
void take_checked_gradient(Entry& entry, const W& weight, const B& bias) {
  const auto& block = *entry.block;
  const std::string& name = block.name();
  const index_t rows = block.weight_rows(), cols = block.weight_cols();
  long n = 1;
  for (unsigned r = 0; r < W::rank; ++r) n *= long(weight.extent(r));
  if (long(weight.extent(0)) != rows || n != long(rows) * cols)
    throw Error(name, "weight gradient has shape " + shape_string(weight) + ", expected " +
                          std::to_string(rows) + " x " + std::to_string(cols) + " values");
  if (!weight.span_is_contiguous() ||
      (W::rank > 1 && !std::is_same<typename W::array_layout, Kokkos::LayoutRight>::value))
    throw Error(name, "weight gradient must be a contiguous row-major (LayoutRight) view");
  if (block.has_bias() && (long(bias.extent(0)) != rows || !bias.span_is_contiguous()))
    throw Error(name, "bias gradient has length " + std::to_string(bias.extent(0)) +
                          ", expected a contiguous vector of length " + std::to_string(rows));
  if (!block.has_bias() && bias.extent(0) != 0)
    throw Error(name, "layer has no bias but a bias gradient was given");
  entry.w = GradMatrix<Scalar, Exec>(const_cast<Scalar*>(weight.data()), rows, cols);
  entry.b = GradVector<Scalar, Exec>(const_cast<Scalar*>(bias.data()), bias.extent(0));
  entry.has_gradient = true;
}

/// Everything step() needs, checked before anything changes; throws kfac::Error naming the layer.
/// `poisoned`: the step will be skipped (NaN/Inf under the skip policy), so its observations
/// are not checked.
template <class Registry, class DueList, class Exec>
void validate_step(const Registry& reg, const DueList& due, const Options& o, const Exec& exec, long step,
                   bool poisoned, double payload_max) {
  for (std::size_t l = 0; l < reg.size(); ++l) {
    const auto& e = reg[l];
    if (e.skipped) continue;
    const auto& n = e.block->name();
    if (!e.has_gradient)
      throw Error(n, "no gradient was set for step " + std::to_string(step) + " (call set_gradient before step)");
    if (o.nonfinite == NonFinitePolicy::raise) {
      const double limit = gradient_limit(e, due[l].values.damping);
      if (count_beyond(exec, e.w, limit) + count_beyond(exec, e.b, limit) > 0) {
        const long bad = count_nonfinite(exec, e.w) + count_nonfinite(exec, e.b);
        if (bad > 0)
          throw Error(n, "gradient contains " + std::to_string(bad) + " NaN/Inf value(s) at step " + std::to_string(step));
        throw Error(n, "gradient has values of magnitude above " + std::to_string(limit) + " at step " +
                           std::to_string(step) + ": preconditioned at damping " + std::to_string(due[l].values.damping) +
                           " they could overflow the gradient's type or the KL-clip sum (|V| <= sqrt(n) max|X| / "
                           "damping); the step was refused and the gradient left as given");
      }
    }
    if (due[l].factor && !poisoned) {
      const ObservationCheck pending = e.block->check_observations();
      if (!pending.problem.empty())
        throw Error(n, pending.problem + " before the factor update at step " + std::to_string(step));
      if (!(pending.scale <= payload_max))
        throw Error(n, "observations would overflow the reduced-precision communication payload (statistic " +
                           std::to_string(pending.scale) + ", largest payload value " +
                           std::to_string(payload_max) + ") at step " + std::to_string(step));
    } else if (!due[l].factor && !e.block->has_statistics()) {
      throw Error(n, "has no factors yet: it must be observed on a factor-update step before it can be preconditioned");
    }
  }
}

/// False when `t` has NaN/Inf and the policy is skip; throws under raise.
template <class Exec, class T>
bool check_finite(const Exec& exec, const Options& o, const std::string& name, const T& t, const char* what) {
  const long bad = count_nonfinite(exec, t);
  if (bad == 0) return true;
  if (o.nonfinite == NonFinitePolicy::skip) return false;
  throw Error(name, std::string(what) + " contains " + std::to_string(bad) + " NaN/Inf value(s); the observation was not used");
}

/// True when some layer's gradient has NaN/Inf or values beyond gradient_limit(), or its due observations would overflow the
/// statistics' type or the communication payload.
template <class Registry, class DueList, class Exec>
bool nonfinite_step(const Registry& reg, const DueList& due, const Exec& exec, double payload_max) {
  for (std::size_t l = 0; l < reg.size(); ++l) {
    const auto& e = reg[l];
    if (e.skipped) continue;
    const double limit = gradient_limit(e, due[l].values.damping);
    if (e.has_gradient && (count_beyond(exec, e.w, limit) > 0 || count_beyond(exec, e.b, limit) > 0)) return true;
    if (!due[l].factor) continue;
    const ObservationCheck pending = e.block->check_observations();
    if (pending.overflow || !(pending.scale <= payload_max)) return true;
  }
  return false;
}

/// The Preconditioner's template arguments, each checked with a message naming it.
template <class Scalar, class Exec, class Comm, class Distribution>
struct PreconditionerArguments {
  static_assert(Kokkos::is_execution_space<Exec>::value,
                "kfac::Preconditioner<Scalar, Exec, Comm, Distribution>: Exec must be a Kokkos execution space "
                "(Kokkos::DefaultExecutionSpace, Kokkos::DefaultHostExecutionSpace, Kokkos::Serial, ...); a memory "
                "space such as Kokkos::HostSpace says where data lives, not where kernels run");
  static_assert(std::is_floating_point<Scalar>::value,
                "kfac::Preconditioner<Scalar, ...>: Scalar is the type of the framework's observations and "
                "gradients: float or double");
  static_assert(is_communicator_v<Comm>,
                "kfac::Preconditioner: Comm must be a communicator (kfac::SerialComm, kfac::MpiComm)");
  static_assert(is_distribution_v<Distribution>,
                "kfac::Preconditioner: Distribution must be kfac::Kaisa or kfac::Independent");
  static constexpr bool ok = true;
};

/// Runs `f`, which may allocate the layer's memory: a failed allocation (Kokkos throws
/// std::bad_alloc in 3.4, std::runtime_error in 4.x) becomes a kfac::Error naming the layer.
template <class F>
void allocating(const std::string& name, const char* call, F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc& e) {
    throw Error(name, std::string(call) + ": cannot allocate the layer's memory (" + e.what() + ")");
  } catch (const std::runtime_error& e) {
    throw Error(name, std::string(call) + ": cannot allocate the layer's memory (" + e.what() + ")");
  }
}

/// Preconditioner::observe_input for entry `e`: the input `t` (of `rank` extents) is checked
/// against the layer, then handed to it when its statistics are updated at this step (`due`)
/// and the layer is neither skipped nor poisoned (a poisoned layer ignores the rest of its
/// step). Returns false when `t` holds NaN/Inf and NonFinitePolicy::skip poisons the layer.
template <class Exec, class Entry, class Tensor>
bool take_input(const Exec& exec, const Options& o, Entry& e, const Tensor& t, int rank, bool due) {
  const std::string& name = e.block->name();
  fail_if(name, e.block->check_input(extents_of(t, rank)));
  if (t.extent(0) == 0) throw Error(name, "input has an empty batch (batch = 0)");
  if (!due || e.skipped || e.poisoned) return true;
  if (!check_finite(exec, o, name, t, "input")) return !(e.poisoned = true);
  allocating(name, "observe_input", [&] { e.block->observe_input(exec, t, rank); });
  return true;
}
/// Preconditioner::observe_output_grad for entry `e`, as take_input; an output gradient that
/// is not used has its shape checked by the layer all the same. Scaled by the batch for a mean
/// loss (Options::loss_reduction).
template <class Exec, class Entry, class Tensor>
bool take_output_grad(const Exec& exec, const Options& o, Entry& e, const Tensor& t, int rank, bool due) {
  const std::string& name = e.block->name();
  if (t.extent(0) == 0) throw Error(name, "output gradient has an empty batch (batch = 0)");
  if (!due || e.skipped || e.poisoned) {
    fail_if(name, e.block->observations().check_output_grad_alone(extents_of(t, rank)));
    return true;
  }
  fail_if(name, e.block->check_output_grad(extents_of(t, rank)));
  if (!check_finite(exec, o, name, t, "output gradient")) return !(e.poisoned = true);
  allocating(name, "observe_output_grad", [&] {
    const double scale = o.loss_reduction == LossReduction::mean ? double(t.extent(0)) : 1.0;
    e.block->observe_output_grad(exec, t, scale, rank);
  });
  return true;
}

}  // namespace impl
}  // namespace kfac
