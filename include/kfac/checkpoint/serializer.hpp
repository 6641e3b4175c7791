#pragma once
/// \file serializer.hpp
/// \brief Checkpoint bodies: what a preconditioner's state looks like on disk, written from and
/// read into the blocks' checkpoint views. Version 2 is written; version 1 (kfac 0.1) is read.
///
/// Version 2 body (integers little-endian; str = u32 length + bytes; buffers = u32 count, then
/// per buffer: scalar size u8, value count u64, raw values):
///
///     counters   i64 x 5  step, next statistics step, next decomposition step, last
///                         statistics step, last decomposition step (over all layers)
///     world i32, rank i32, flags u32 (bit 0: decompositions requested), layer count u32
///     per layer: name str, signature str,
///                schedule i64 x 4 (next statistics, next decomposition, last statistics,
///                last decomposition step of this layer),
///                has_state u8, state buffers (the block's checkpoint view),
///                has_decomposition u8, damping f64 (of the layer's last decomposition),
///                unit count u32, then per unit its buffers.
///     when flags bit 1 is set (decompositions in flight, Options::decomposition_delay):
///     count u32, then per in-flight decomposition: layer index u32, launch step i64, swap
///     step i64, damping f64, unit count u32 and the units this rank computes (u32 each), and
///     the statistics it is computed from (buffers, empty when the rank computes no unit).
///
/// Version 1 differs per layer: no schedule (every layer follows the global counters), and
/// after the damping always exactly two buffer lists, the decompositions of A and of G.
/// State (statistics) is global and restores at any world size; decompositions are per rank.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <istream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "kfac/checkpoint/format.hpp"
#include "kfac/core/registry.hpp"

namespace kfac {
namespace impl {

/// A checked checkpoint, not yet applied. The value pointers point into `body`.
struct CheckpointPlan {
  struct InFlight {
    std::size_t layer = 0;
    long launched = 0, swap_at = 0;
    double damping = 0;
    std::vector<int> units;
    std::vector<const char*> state;
  };
  struct Layer {
    LayerSchedule schedule;
    bool has_schedule = false;
    bool has_state = false, has_decomposition = false;
    double damping = 0;
    std::vector<const char*> state;
    std::vector<std::vector<const char*>> units;
  };
  std::vector<char> body;
  std::uint32_t version = 0;
  long counters[5] = {};
  int world = 0, rank = 0;
  std::vector<Layer> layers;
  std::vector<InFlight> in_flight;
};

template <class Exec>
std::string to_host_bytes(const Buffer& b) {
  using memory_space = typename Exec::memory_space;
  std::string out(b.bytes(), '\0');
  Kokkos::View<const char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(
      static_cast<const char*>(b.data), b.bytes());
  Kokkos::View<char*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(&out[0], b.bytes());
  Kokkos::deep_copy(h, d);
  return out;
}
template <class Exec>
void from_host_bytes(const Buffer& b, const char* src) {
  using memory_space = typename Exec::memory_space;
  Kokkos::View<char*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(static_cast<char*>(b.data), b.bytes());
  Kokkos::View<const char*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(src, b.bytes());
  Kokkos::deep_copy(d, h);
}

/// Writes a version-2 checkpoint of `reg`.
/// `clock` = step, last statistics step, last decomposition step.
/// `flying`: the deferred decompositions in flight (impl::InFlight::snapshot).
template <class Scalar, class Exec, class Snapshot>
void save_checkpoint(std::ostream& os, const Registry<Scalar, Exec>& reg, const std::vector<Snapshot>& flying,
                     const long (&clock)[3], int world, int rank, bool with_decompositions) {
  long next_factor = clock[0], next_inv = clock[0];
  for (const auto& e : reg.entries()) {
    next_factor = std::min(next_factor, e.schedule.next_factor);
    next_inv = std::min(next_inv, e.schedule.next_inv);
  }
  ByteWriter w;
  for (long v : {clock[0], next_factor, next_inv, clock[1], clock[2]}) w.put(std::int64_t(v));
  w.put(std::int32_t(world));
  w.put(std::int32_t(rank));
  const bool any_flying = with_decompositions && !flying.empty();
  w.put(std::uint32_t((with_decompositions ? 1 : 0) | (any_flying ? 2 : 0)));
  w.put(std::uint32_t(reg.size()));
  auto put_buffers = [&](const std::vector<Buffer>& bufs) {
    w.put(std::uint32_t(bufs.size()));
    for (const auto& b : bufs) {
      w.put(std::uint8_t(b.scalar_size));
      w.put(std::uint64_t(b.count));
      const std::string bytes = to_host_bytes<Exec>(b);
      w.put_raw(bytes.data(), bytes.size());
    }
  };
  for (const auto& e : reg.entries()) {
    auto& block = *e.block;
    w.put_string(block.name());
    w.put_string(block.signature());
    // A named array, not a braced list in the range-for: nvcc 13's host code for the latter does not compile.
    const long schedule[] = {e.schedule.next_factor, e.schedule.next_inv, e.schedule.last_factor, e.schedule.last_inv};
    for (long v : schedule) w.put(std::int64_t(v));
    w.put(std::uint8_t(block.has_statistics()));
    put_buffers(block.has_statistics() ? block.checkpoint_state() : std::vector<Buffer>{});
    const bool dec = with_decompositions && e.decomposed;
    w.put(std::uint8_t(dec));
    w.put(e.decomposition_damping);
    const int units = dec ? block.units() : 0;
    w.put(std::uint32_t(units));
    for (int u = 0; u < units; ++u) put_buffers(block.unit_buffers(u));
  }
  if (any_flying) w.put(std::uint32_t(flying.size()));
  for (const auto& d : any_flying ? flying : std::vector<Snapshot>{}) {
    w.put(std::uint32_t(d.layer));
    w.put(std::int64_t(d.launched));
    w.put(std::int64_t(d.swap_at));
    w.put(d.damping);
    w.put(std::uint32_t(d.units.size()));
    for (int u : d.units) w.put(std::uint32_t(u));
    put_buffers(d.state);
  }
  write_checkpoint(os, w.bytes());
}

/// The reader of one checkpoint body: each value checked as it is read (parse_checkpoint).
class CheckpointReader {
 public:
  /// Real counters stay far below 2^53; the bound keeps step() from overflowing `long`.
  static constexpr long max_step = 1L << 53;

  CheckpointReader(const std::vector<char>& body, std::uint32_t version)
      : r_(body.data(), body.size()), version_(version) {}
  ByteReader& bytes() { return r_; }

  /// The five step counters (the step, the next statistics and decomposition steps, the last
  /// of each), checked by check_counters().
  void read_counters(long* counters) {
    for (int k = 0; k < 5; ++k) counters[k] = long(r_.get<std::int64_t>("step counters"));
    step_ = counters[0];
  }
  void check_counters(const long* counters) const {
    for (int k = 0; k < 3; ++k) check_next(counters[k]);
    for (int k = 3; k < 5; ++k) check_last(counters[k]);
  }
  void check_next(long v) const {
    if (v < 0 || v > max_step) throw Error("", "checkpoint has step counter " + std::to_string(v) + ": corrupt");
  }
  void check_last(long v) const {
    if (v < -1 || v >= step_)
      throw Error("", "checkpoint has last-update step " + std::to_string(v) + " at step " + std::to_string(step_) +
                          ": corrupt");
  }
  /// A list of buffers of the given shapes (or none), finite, as pointers into the body.
  void read_buffers(const std::string& name, const std::vector<BufferShape>& shapes, std::vector<const char*>& out) {
    const std::uint32_t n = r_.get<std::uint32_t>("buffer count");
    if (n == 0) return;
    if (n != shapes.size())
      throw Error(name, "checkpoint buffer count " + std::to_string(n) + " does not match " +
                            std::to_string(shapes.size()));
    for (const auto& [cnt, size] : shapes) {
      const auto ss = r_.get<std::uint8_t>("scalar size");
      const auto c = r_.get<std::uint64_t>("value count");
      if (ss != size || c != cnt)
        throw Error(name, "checkpoint buffer has " + std::to_string(c) + " values of " +
                              std::to_string(int(ss)) + " bytes, expected " + std::to_string(cnt) +
                              " of " + std::to_string(size));
      const char* values = r_.get_raw(std::size_t(c) * ss, "buffer values");
      // save() never writes NaN/Inf (statistics and decompositions are checked when made);
      // loading one would poison every later decomposition.
      if (!all_finite(values, std::size_t(c), ss))
        throw Error(name, "checkpoint has NaN/Inf values in its saved state: corrupt");
      out.push_back(values);
    }
  }

  /// One layer's record: its name and signature (checked against `block`), schedule,
  /// statistics and decomposition.
  template <class Block>
  CheckpointPlan::Layer read_layer(const Block& block) {
    const std::string name = r_.get_string("layer name");
    const std::string sig = r_.get_string("layer signature");
    if (name != block.name()) throw Error(block.name(), "checkpoint has layer '" + name + "' in this position");
    if (sig != block.signature())
      throw Error(name, "checkpoint was written for " + sig + ", this layer is " + block.signature());
    CheckpointPlan::Layer p;
    if (version_ >= 2) {
      long s[4];
      for (long& v : s) v = long(r_.get<std::int64_t>("layer schedule"));
      check_next(s[0]);
      check_next(s[1]);
      check_last(s[2]);
      check_last(s[3]);
      p.schedule = {s[0], s[1], s[2], s[3]};
      p.has_schedule = true;
    }
    p.has_state = r_.get<std::uint8_t>("factor flag") != 0;
    read_buffers(name, block.checkpoint_shapes(), p.state);
    if (p.has_state != !p.state.empty())
      throw Error(name, "checkpoint factor flag disagrees with its buffers: corrupt");
    p.has_decomposition = r_.get<std::uint8_t>("decomposition flag") != 0;
    p.damping = r_.get<double>("decomposition damping");
    if (!std::isfinite(p.damping) || p.damping < 0 || (p.has_decomposition && p.damping == 0))
      throw Error(name, "checkpoint has decomposition damping " + std::to_string(p.damping) + ": corrupt");
    read_units(block, p);
    return p;
  }

  /// A decomposition launched before the save (Options::decomposition_delay), of a layer after
  /// `previous` (-1: the first) among `reg`'s.
  template <class Reg>
  CheckpointPlan::InFlight read_in_flight(const Reg& reg, long previous) {
    CheckpointPlan::InFlight d;
    d.layer = r_.get<std::uint32_t>("in-flight layer");
    if (d.layer >= reg.size() || long(d.layer) <= previous)
      throw Error("", "checkpoint has an in-flight decomposition of layer " + std::to_string(d.layer) + ": corrupt");
    const auto& block = *reg[d.layer].block;
    d.launched = long(r_.get<std::int64_t>("in-flight launch step"));
    d.swap_at = long(r_.get<std::int64_t>("in-flight swap step"));
    d.damping = r_.get<double>("in-flight damping");
    if (d.launched < 0 || d.launched >= step_ || d.swap_at <= d.launched || d.swap_at > max_step ||
        !std::isfinite(d.damping) || !(d.damping > 0))
      throw Error(block.name(), "checkpoint has an in-flight decomposition of step " + std::to_string(d.launched) +
                                    " due at step " + std::to_string(d.swap_at) + ": corrupt");
    const std::uint32_t units = r_.get<std::uint32_t>("in-flight unit count");
    for (std::uint32_t k = 0; k < units; ++k) {
      const auto u = r_.get<std::uint32_t>("in-flight unit");
      if (int(u) >= block.units() || (k > 0 && int(u) <= d.units.back()))
        throw Error(block.name(), "checkpoint has in-flight unit " + std::to_string(u) + ": corrupt");
      d.units.push_back(int(u));
    }
    read_buffers(block.name(), block.checkpoint_shapes(), d.state);
    if (d.units.empty() != d.state.empty())
      throw Error(block.name(), "checkpoint in-flight units disagree with their statistics: corrupt");
    return d;
  }

 private:
  /// A layer's decomposed units, consistent with its decomposition flag.
  template <class Block>
  void read_units(const Block& block, CheckpointPlan::Layer& p) {
    const std::string& name = block.name();
    // Version 1 always has two lists (empty for closed forms); version 2 says how many.
    const std::uint32_t units = version_ >= 2 ? r_.get<std::uint32_t>("unit count") : 2;
    const int expected = block.units();
    if (version_ >= 2 && units != 0 && int(units) != expected)
      throw Error(name, "checkpoint has " + std::to_string(units) + " decomposed units, expected " +
                            std::to_string(expected));
    p.units.resize(units);
    for (std::uint32_t u = 0; u < units; ++u)
      read_buffers(name, int(u) < expected ? block.unit_shapes(int(u)) : std::vector<BufferShape>{}, p.units[u]);
    if (p.has_decomposition && !p.has_state)
      throw Error(name, "checkpoint has a decomposition without factors: corrupt");
    bool complete = expected == 0 || int(p.units.size()) >= expected;
    for (int u = 0; complete && u < expected; ++u) complete = !p.units[std::size_t(u)].empty();
    if (p.has_decomposition && !complete)
      throw Error(name, "checkpoint decomposition flag disagrees with its buffers: corrupt");
    if (!p.has_decomposition)
      for (const auto& list : p.units)
        if (!list.empty()) throw Error(name, "checkpoint decomposition flag disagrees with its buffers: corrupt");
  }

  ByteReader r_;
  std::uint32_t version_;
  long step_ = 0;
};

/// Reads and checks a checkpoint (version 1 or 2) against `reg`; throws kfac::Error and
/// changes nothing on any problem.
template <class Scalar, class Exec>
CheckpointPlan parse_checkpoint(std::istream& is, const Registry<Scalar, Exec>& reg) {
  CheckpointPlan cp;
  cp.body = read_checkpoint(is, cp.version);
  CheckpointReader in(cp.body, cp.version);
  ByteReader& r = in.bytes();
  in.read_counters(cp.counters);
  cp.world = r.get<std::int32_t>("world size");
  cp.rank = r.get<std::int32_t>("rank");
  const auto flags = r.get<std::uint32_t>("flags");
  const std::uint32_t count = r.get<std::uint32_t>("layer count");
  if (count != reg.size())
    throw Error("", "checkpoint has " + std::to_string(count) + " layers, this preconditioner has " +
                        std::to_string(reg.size()));
  in.check_counters(cp.counters);
  for (std::uint32_t i = 0; i < count; ++i) cp.layers.push_back(in.read_layer(*reg[i].block));
  const std::uint32_t flying = (flags & 2) ? r.get<std::uint32_t>("in-flight count") : 0;
  for (std::uint32_t f = 0; f < flying; ++f)
    cp.in_flight.push_back(in.read_in_flight(reg, f > 0 ? long(cp.in_flight.back().layer) : -1L));
  if (!r.done()) throw Error("", "checkpoint has trailing bytes: corrupt");
  return cp;
}

/// \brief Hash of what a checkpoint restores identically on every rank of a replica group
/// (Preconditioner::load agrees on it): the step counters, each layer's schedule and whether it
/// has statistics, and its averaged statistics (BlockDescription::averaged, the first buffers of
/// its state: what the ranks average after every update, and what save() shares first under
/// reduce_to_owner). Left out, as they legitimately differ by rank: the decompositions (per
/// rank, restored only at the same world size and rank), the world size and rank written, a
/// method's private state (NG-SGD's subspaces, never averaged) and the in-flight decompositions.
template <class Scalar, class Exec>
std::uint64_t replicated_hash(const CheckpointPlan& cp, const Registry<Scalar, Exec>& reg) {
  std::string s;
  auto put = [&s](const void* p, std::size_t n) { s.append(static_cast<const char*>(p), n); };
  put(cp.counters, sizeof(cp.counters));
  for (std::size_t l = 0; l < cp.layers.size(); ++l) {
    const auto& p = cp.layers[l];
    const long schedule[] = {p.schedule.next_factor, p.schedule.next_inv, p.schedule.last_factor, p.schedule.last_inv};
    if (p.has_schedule) put(schedule, sizeof(schedule));
    s += char(p.has_state);
    const auto& shapes = reg[l].block->checkpoint_shapes();
    const std::size_t averaged = std::min(reg[l].block->description().averaged.size(), p.state.size());
    for (std::size_t k = 0; k < averaged; ++k) put(p.state[k], shapes[k].first * shapes[k].second);
  }
  return fnv1a(s);
}

/// True when this rank's checkpoint can restore its decompositions under the current work
/// assignment: same world size and rank, and a decomposition for every layer the rank holds.
template <class Scalar, class Exec, class Holds>
bool decompositions_fit(const CheckpointPlan& cp, const Registry<Scalar, Exec>& reg, int world,
                        int rank, Holds&& holds) {
  if (cp.world != world || cp.rank != rank) return false;
  for (std::size_t l = 0; l < cp.layers.size(); ++l) {
    const auto& p = cp.layers[l];
    if (!reg[l].skipped && p.has_state && !p.has_decomposition && reg[l].block->units() > 0 && holds(l))
      return false;
  }
  return true;
}

/// Applies a checked plan: restores state everywhere and decompositions when `same_layout`.
/// Returns false when some saved decomposition was not restored.
template <class Scalar, class Exec, class InFlight>
bool apply_checkpoint(const CheckpointPlan& cp, Registry<Scalar, Exec>& reg, InFlight& flying, bool same_layout,
                      const Exec& exec, bool precompute) {
  bool restored = true;
  flying.drop_all();
  for (std::size_t i = 0; i < cp.layers.size(); ++i) {
    auto& e = reg[i];
    auto& block = *e.block;
    const auto& p = cp.layers[i];
    block.clear_observations();
    e.clear_gradient();
    if (p.has_state) {
      block.allocate_state();
      auto bufs = block.checkpoint_state();
      for (std::size_t k = 0; k < bufs.size(); ++k) from_host_bytes<Exec>(bufs[k], p.state[k]);
    } else {
      block.release_state();
    }
    if (p.has_schedule) {
      e.schedule = p.schedule;
    } else {
      e.schedule = {cp.counters[1], cp.counters[2], cp.counters[3], cp.counters[4]};
    }
    e.decomposition_damping = p.damping;
    e.decomposed = false;
    if (p.has_decomposition && same_layout) {
      block.allocate_units();
      for (int u = 0; u < block.units(); ++u) {
        auto bufs = block.unit_buffers(u);
        for (std::size_t k = 0; k < bufs.size(); ++k) from_host_bytes<Exec>(bufs[k], p.units[std::size_t(u)][k]);
      }
      block.finish_decomposition(exec, p.damping, precompute);
      e.decomposed = true;
    } else if (p.has_decomposition) {
      restored = false;
    }
  }
  // A layer saved without statistics gets them at the next step, and with it every layer (as
  // after a late registration, see Preconditioner::register_layer).
  bool any_without = false;
  for (const auto& p : cp.layers) any_without = any_without || !p.has_state;
  if (any_without)
    for (auto& e : reg.entries()) {
      e.schedule.next_factor = std::min(e.schedule.next_factor, cp.counters[0]);
      e.schedule.next_inv = std::min(e.schedule.next_inv, cp.counters[0]);
    }
  // Decompositions in flight resume (recomputed from their statistics: the same bits) only
  // with the decompositions they would replace.
  for (const auto& d : same_layout ? cp.in_flight : std::vector<CheckpointPlan::InFlight>{}) {
    auto& e = reg[d.layer];
    const auto fill = [&](Block<Scalar, Exec>& shadow) {
      auto bufs = shadow.checkpoint_state();
      for (std::size_t k = 0; k < bufs.size(); ++k) from_host_bytes<Exec>(bufs[k], d.state[k]);
      for (int u : e.decomposed ? d.units : std::vector<int>{}) copy_into(exec, e.block->unit_buffers(u), shadow.unit_buffers(u));
    };
    flying.deferred(d.layer).launch(exec, e.make_block, fill, d.units, d.damping, d.launched, d.swap_at);
  }
  exec.fence();
  return restored;
}

}  // namespace impl
}  // namespace kfac
