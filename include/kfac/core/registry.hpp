#pragma once
/// \file registry.hpp
/// \brief The registered layers: each block with its per-layer settings, schedule and the
/// gradient handed to the current step.

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kfac/core/any_layer.hpp"
#include "kfac/core/block.hpp"
#include "kfac/error.hpp"
#include "kfac/core/method_settings.hpp"
#include "kfac/core/options.hpp"
#include "kfac/core/validation.hpp"

namespace kfac {
namespace impl {

/// When a layer's statistics and decompositions were and will next be updated.
struct LayerSchedule {
  long next_factor = 0, next_inv = 0;  ///< steps of the next update
  long last_factor = -1, last_inv = -1;  ///< steps of the last update (-1: never)
};

template <class Scalar, class Exec>
struct Entry {
  using block_type = Block<Scalar, Exec>;
  std::unique_ptr<block_type> block;
  Overrides overrides;
  bool skipped = false;
  LayerSchedule schedule;
  bool decomposed = false;  ///< this rank holds a usable decomposition (closed forms: "finished")
  double decomposition_damping = 0;
  bool has_gradient = false;
  bool poisoned = false;  ///< an observation of this step was dropped (NaN/Inf under skip)
  typename block_type::grad_matrix w;
  typename block_type::grad_vector b;
  /// Makes another block of the same layer and method (the shadow of deferred decompositions,
  /// which impl::InFlight keeps).
  std::function<std::unique_ptr<block_type>()> make_block;

  void clear_gradient() {
    has_gradient = false;
    w = {};
    b = {};
  }
  StepValues values_at(const Options& o, long step) const {
    try {
      return overrides.values_at(o, step);
    } catch (const Error& e) {
      throw about_layer(block->name(), e);
    }
  }
};

template <class Scalar, class Exec>
class Registry {
 public:
  using entry_type = Entry<Scalar, Exec>;

  /// Adds a layer; throws (and adds nothing) when the name is empty or taken.
  /// `make` makes the layer's block (and later the shadows of its deferred decompositions).
  entry_type& add(std::function<std::unique_ptr<Block<Scalar, Exec>>()> make, Overrides overrides,
                  bool skipped, long step) {
    auto block = make();
    const std::string& name = block->name();
    if (name.empty()) throw Error("", "register_layer: a layer name must not be empty");
    if (index_.count(name)) throw Error(name, "a layer with this name is already registered");
    entry_type e;
    e.block = std::move(block);
    e.make_block = std::move(make);
    e.overrides = std::move(overrides);
    e.skipped = skipped;
    // A layer registered after training started gets statistics and a decomposition at the
    // next step.
    e.schedule.next_factor = e.schedule.next_inv = step;
    index_[name] = entries_.size();
    entries_.push_back(std::move(e));
    return entries_.back();
  }
  entry_type& at(const std::string& name) { return entries_[index_of(name)]; }
  const entry_type& at(const std::string& name) const { return entries_[index_of(name)]; }
  std::size_t index_of(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error(name, "no layer with this name is registered");
    return it->second;
  }
  /// The layers' names, in registration order.
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    for (const auto& e : entries_) v.push_back(e.block->name());
    return v;
  }
  /// Some layer's statistics (`statistics`) or decomposition (else) is due at `step`.
  bool any_due(long step, bool statistics) const {
    for (const auto& e : entries_)
      if (step >= (statistics ? e.schedule.next_factor : e.schedule.next_inv)) return true;
    return false;
  }
  /// Statistics and a decomposition for every layer at `step` at the latest.
  void everything_due_at(long step) {
    for (auto& e : entries_) {
      e.schedule.next_factor = std::min(e.schedule.next_factor, step);
      e.schedule.next_inv = std::min(e.schedule.next_inv, step);
    }
  }
  /// Forgets a skipped step's observations and gradients (NonFinitePolicy::skip).
  void forget_step() {
    for (auto& e : entries_) {
      e.block->clear_observations();
      e.clear_gradient();
      e.poisoned = false;
    }
  }
  std::vector<entry_type>& entries() { return entries_; }
  const std::vector<entry_type>& entries() const { return entries_; }
  std::size_t size() const { return entries_.size(); }
  entry_type& operator[](std::size_t l) { return entries_[l]; }
  const entry_type& operator[](std::size_t l) const { return entries_[l]; }

 private:
  std::vector<entry_type> entries_;
  std::map<std::string, std::size_t> index_;
};

/// Every Options::skip_layers entry names a registered layer or a kind of layer (one of
/// `kinds`, which may match none: "batch_norm" for a network without one, or a registered
/// layer's own kind); a misspelt name would otherwise leave its layer preconditioned silently.
template <class Reg>
void check_skip_layers(const Options& o, const Reg& reg, std::initializer_list<const char*> kinds) {
  std::string listed;
  for (const char* k : kinds) listed += (listed.empty() ? "" : ", ") + std::string(k);
  for (const auto& s : o.skip_layers) {
    bool found = false;
    for (const char* k : kinds) found = found || s == k;
    for (const auto& e : reg.entries()) found = found || s == e.block->name() || s == e.block->kind();
    if (!found)
      throw Error("", "Options::skip_layers entry '" + s + "' matches no registered layer name or kind of layer (" +
                          listed + ", or a registered layer's own kind)");
  }
}
/// Whether Options::skip_layers lists the layer `name` or its `kind`.
inline bool skip_listed(const Options& o, const std::string& name, const char* kind) {
  for (const auto& s : o.skip_layers)
    if (s == name || s == kind) return true;
  return false;
}

/// Preconditioner::register_layer: checks the layer's own settings at `step` (now rather than
/// at its first step()) and that `name` is free, then adds it (skipped when Options::skip_layers
/// lists its name or kind). Throws and adds nothing on a problem, naming the layer.
template <class Scalar, class Exec>
void add_layer(Registry<Scalar, Exec>& reg, const std::string& name, const AnyLayer<Scalar, Exec>& layer,
               const Options& o, long step) {
  try {
    layer.overrides.values_at(o, step);
  } catch (const Error& e) {
    throw about_layer(name, e);
  }
  for (const auto& e : reg.entries())
    if (e.block->name() == name) throw Error(name, "a layer with this name is already registered");
  allocating(name, "register_layer", [&] {
    reg.add([make = layer.make, name] { return make(name); }, layer.overrides,
            skip_listed(o, name, layer.kind.c_str()), step);
  });
}

}  // namespace impl
}  // namespace kfac
