#pragma once
/// \file registry.hpp
/// \brief The registered layers: each block with its per-layer settings, schedule and the
/// gradient handed to the current step.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/error.hpp"
#include "kfac/core/method_settings.hpp"

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
  std::vector<entry_type>& entries() { return entries_; }
  const std::vector<entry_type>& entries() const { return entries_; }
  std::size_t size() const { return entries_.size(); }
  entry_type& operator[](std::size_t l) { return entries_[l]; }
  const entry_type& operator[](std::size_t l) const { return entries_[l]; }

 private:
  std::vector<entry_type> entries_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace impl
}  // namespace kfac
