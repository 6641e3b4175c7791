#pragma once
/// \file step_phases.hpp
/// \brief The phases of one Preconditioner::step(), over the registry and a distribution
/// state: statistics update and averaging, decompositions (atomic: a failure on any rank puts
/// every rank back where it was), preconditioning. See docs/design.md for the data flow.

#include <algorithm>
#include <cmath>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "kfac/core/agreement.hpp"
#include "kfac/core/backup.hpp"
#include "kfac/core/half.hpp"
#include "kfac/core/in_flight.hpp"
#include "kfac/core/bucketing.hpp"
#include "kfac/core/comm_precision.hpp"
#include "kfac/core/registry.hpp"
#include "kfac/error.hpp"
#include "kfac/impl/profiling.hpp"

namespace kfac {
namespace impl {

/// What one step does to one layer.
struct Due {
  bool factor = false, inv = false;
  StepValues values{};
  bool defer = false;  ///< the due decomposition is swapped in decomposition_delay steps later
};

/// Counts the non-finite values of a state buffer.
template <class Exec>
long nonfinite_in(const Exec& exec, const Buffer& b) {
  using M = typename Exec::memory_space;
  using U = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
  if (b.scalar_size == 8)
    return count_nonfinite(exec, Kokkos::View<const double*, M, U>(static_cast<const double*>(b.data), b.count));
  if (b.scalar_size == 2)
    return count_nonfinite(exec, Kokkos::View<const Half*, M, U>(static_cast<const Half*>(b.data), b.count));
  return count_nonfinite(exec, Kokkos::View<const float*, M, U>(static_cast<const float*>(b.data), b.count));
}

/// The rank each averaged buffer of layer l is reduced to (-1: every rank): the rule of
/// impl::factor_owners_of, with the decomposers of this assignment.
template <class Block, class Dist>
std::vector<int> factor_owners(Block& b, const Dist& dist, const Options& o, std::size_t l) {
  const auto state = b.averaged_state();
  const bool units = b.units() > 0 && int(state.size()) == b.units();
  std::vector<int> decomposers;
  for (std::size_t k = 0; k < state.size(); ++k) decomposers.push_back(units ? dist.factor_owner(o, l, int(k)) : -1);
  return factor_owners_of(decomposers, units, b.units_coupled(),
                          state.empty() ? 0 : state.front().storage.scalar_size);
}

/// Collective: every rank's copy of a factor reduced to its owner becomes the owner's (the
/// global average): before a checkpoint is written, and before a new work assignment. Layers
/// [0, planned) only (those the current assignment knows).
template <class Scalar, class Exec, class Dist>
void share_owned_factors(const Exec& exec, const Registry<Scalar, Exec>& reg, const Dist& dist,
                         const Options& o, std::size_t planned) {
  std::vector<FactorBuffer> owned;
  for (std::size_t l = 0; l < planned && l < reg.size(); ++l) {
    if (reg[l].skipped) continue;
    auto state = reg[l].block->averaged_state();
    const auto owners = factor_owners(*reg[l].block, dist, o, l);
    for (std::size_t k = 0; k < state.size(); ++k)
      if ((state[k].owner = owners[k]) >= 0) owned.push_back(state[k]);
  }
  dist.share_factors(exec, owned);
}

/// Memory held per layer, the shadow block of a deferred decomposition in workspace_bytes
/// (Preconditioner::memory_report).
template <class Scalar, class Exec, class Request>
std::vector<MemoryReport> memory_report(const Registry<Scalar, Exec>& reg, const InFlight<Scalar, Exec, Request>& f) {
  std::vector<MemoryReport> r;
  for (std::size_t l = 0; l < reg.size(); ++l) {
    r.push_back(reg[l].block->memory());
    r.back().workspace_bytes += f.bytes(l);
  }
  return r;
}

/// Collective, the work assignment after a registration check (Preconditioner::
/// check_registration): the owners share their factors (owners may change), the distribution
/// plans from every held unit's cost, and layers this rank no longer holds release their
/// decompositions.
template <class Scalar, class Exec, class Dist>
void assign_work(const Exec& exec, Registry<Scalar, Exec>& reg, Dist& dist, const Options& o) {
  share_owned_factors(exec, reg, dist, o, dist.assignment().layers());
  std::vector<std::vector<UnitCost>> costs(reg.size());
  for (std::size_t l = 0; l < reg.size(); ++l)
    for (int u = 0; !reg[l].skipped && u < reg[l].block->units(); ++u) costs[l].push_back(reg[l].block->unit_cost(u));
  dist.plan(o, costs);
  for (std::size_t l = 0; l < reg.size(); ++l)
    if (!dist.holds(l)) {
      reg[l].block->release_units();
      reg[l].decomposed = false;
    }
}

/// What step `step` does to each layer. A due decomposition is deferred (Options::
/// decomposition_delay) when the layer has decomposable units and a decomposition in use on
/// every holder (`fresh`: not so after a registration or a load that restored none). Throws
/// when a decomposition falls due while the layer's previous one is still in flight.
template <class Scalar, class Exec, class Request>
std::vector<Due> due_at(const Registry<Scalar, Exec>& reg, const InFlight<Scalar, Exec, Request>& flying,
                        const Options& o, long step, bool fresh) {
  std::vector<Due> due(reg.size());
  for (std::size_t l = 0; l < reg.size(); ++l) {
    const auto& e = reg[l];
    due[l] = {step >= e.schedule.next_factor, step >= e.schedule.next_inv, e.values_at(o, step)};
    due[l].defer = due[l].inv && o.decomposition_delay > 0 && !fresh && e.schedule.last_inv >= 0 && e.block->units() > 0;
    if (due[l].inv && !e.skipped && flying.in_flight(l) && step < flying.deferred(l).swap_at())
      throw Error(e.block->name(), "a decomposition is due at step " + std::to_string(step) + " while the one of step " +
                                       std::to_string(flying.deferred(l).launched_at()) + " is swapped in only at step " +
                                       std::to_string(flying.deferred(l).swap_at()) + ": decomposition_delay (" +
                                       std::to_string(o.decomposition_delay) + ") must not exceed inv_update_steps");
  }
  return due;
}

/// The work in flight of a Preconditioner over distribution state `Dist`.
template <class Scalar, class Exec, class Dist>
using in_flight_for = InFlight<Scalar, Exec, typename Dist::request_type>;

template <class Scalar, class Exec, class Dist>
class StepPhases {
 public:
  using in_flight_type = in_flight_for<Scalar, Exec, Dist>;
  StepPhases(const Exec& exec, Registry<Scalar, Exec>& reg, Dist& dist, in_flight_type& flying, const Options& o,
             const std::vector<Due>& due, long step)
      : exec_(exec), reg_(reg), dist_(dist), flying_(flying), o_(o), due_(due), step_(step) {}
  StepPhases(const StepPhases&) = delete;
  StepPhases& operator=(const StepPhases&) = delete;
  /// Nothing but deferred decompositions is left in flight, even when a phase threw (the next
  /// collectives must match).
  ~StepPhases() { flying_.drain(finisher()); }

  /// Updates the due layers' statistics and averages them over the replica group. When the
  /// step also decomposes, the old statistics are kept first, for a rollback.
  void update_statistics() {
    const ScopedRegion region("kfac::step::statistics");
    [[maybe_unused]] const auto scope = comm_scope(dist_.comm(), "statistics");
    const bool decomposes = decomposes_now();
    std::vector<FactorBuffer> averaged;
    for (std::size_t l = 0; l < reg_.size(); ++l) {
      auto& e = reg_[l];
      had_state_.push_back(e.block->has_statistics());
      if (e.skipped || !due_[l].factor) continue;
      const bool had = e.block->has_statistics();
      if (decomposes && had)
        for (const auto& b : e.block->checkpoint_state()) backup_.save(exec_, b);
      // Reduced-precision payloads carry the increment over the old value. A factor reduced to
      // its owner is zeroed first, so that it carries only this rank's new term (1 - decay) c_r,
      // whatever this rank's copy held (only the owner's copy is the global average); the owner
      // then adds its decay f_old (the base) to the average of the terms.
      const double decay = due_[l].values.factor_decay;
      const auto old = e.block->averaged_state();
      const std::vector<int> owners = factor_owners(*e.block, dist_, o_, l);
      const int me = dist_.comm().rank();
      std::vector<const void*> bases;
      for (std::size_t k = 0; k < old.size(); ++k) {
        if (!had) bases.push_back(nullptr);
        else if (owners[k] >= 0) {
          bases.push_back(owners[k] == me ? keep(old[k].storage, decay) : nullptr);
          zero(exec_, old[k].storage);
        } else bases.push_back(dist_.sends_increments(o_, old[k].storage.scalar_size) ? keep(old[k].storage) : nullptr);
      }
      e.block->observe_gradient(exec_, e.w, e.b);  // Shampoo-like statistics; a no-op for the others
      // Identity start: every rank adds the same decay I, so the replica average keeps it.
      if (!had && o_.initial_factors == InitialFactors::identity) e.block->start_statistics_at_identity(exec_);
      e.block->update_statistics(exec_, decay);
      auto now = e.block->averaged_state();  // the first update allocates the storage
      for (std::size_t k = 0; k < now.size(); ++k) {
        now[k].base = bases[k];
        now[k].owner = k < owners.size() ? owners[k] : -1;
        averaged.push_back(now[k]);
      }
    }
    // Kaisa::overlap_communication: when nothing reads the new statistics before the
    // preconditioning is done (no decomposition computed, swapped in or launched at this
    // step), the sums run while precondition() works and complete at its end.
    bool launching = false;
    for (std::size_t l = 0; l < reg_.size(); ++l) launching = launching || launches(l);
    if (!decomposes && !launching)
      flying_.add_sums(dist_.start_average(exec_, averaged, o_));
    else dist_.average(exec_, averaged, o_);
  }

  /// Computes this rank's units, and swaps in the deferred decompositions due now; agrees with
  /// every rank on failures (one collective, only on steps that decompose or swap), then
  /// shares the units; then launches the decompositions deferred from this step. On a failure
  /// anywhere, every rank restores its state, drops the decompositions due to be swapped in,
  /// and throws. Returns the number of damping retries that were needed.
  long decompose() {
    [[maybe_unused]] const auto scope = comm_scope(dist_.comm(), "decompositions");
    long retries = 0;
    if (decomposes_now()) retries = decompose_now();
    for (std::size_t l = 0; l < reg_.size(); ++l)
      if (launches(l)) launch(l);
    return retries;
  }

  /// Starts layer l's deferred decomposition from its statistics of this step (Options::
  /// decomposition_delay), on every rank: the ranks that compute none of its units only
  /// keep the schedule.
  void launch(std::size_t l) {
    auto& e = reg_[l];
    std::vector<int> mine;
    for (int u = 0; dist_.holds(l) && u < e.block->units(); ++u)
      if (dist_.computes(l, u)) mine.push_back(u);
    // The shadow starts as a copy of the layer: its statistics, and the decompositions in use of
    // the units it computes (a refresh starts from them, Eigendecomposition::with_refresh_tolerance).
    const auto fill = [&, units = mine](Block<Scalar, Exec>& shadow) {
      copy_into(exec_, e.block->checkpoint_state(), shadow.checkpoint_state());
      for (int u : units) copy_into(exec_, e.block->unit_buffers(u), shadow.unit_buffers(u));
    };
    // Kaisa::background_sharing: every holder takes part in the broadcasts from its thread.
    const bool background = dist_.holds(l) && e.block->units() > 0 && e.block->decomposes_off_thread() &&
                            dist_.shares_in_background(o_);
    flying_.deferred(l).launch(exec_, e.make_block, fill, std::move(mine), due_[l].values.damping, step_,
                               step_ + o_.decomposition_delay,
                               background ? dist_.background_sharer(l) : BackgroundSharer{});
  }

  /// The step succeeded: observations are consumed and the schedules advance.
  void commit(long step, long& last_factor, long& last_inv) {
    for (std::size_t l = 0; l < reg_.size(); ++l) {
      auto& e = reg_[l];
      auto& s = e.schedule;
      if (due_[l].factor) {
        e.block->clear_observations();
        s.last_factor = last_factor = step;
        s.next_factor = step + due_[l].values.factor_update_steps;
      }
      if (due_[l].inv) {
        s.last_inv = last_inv = step;
        s.next_inv = step + due_[l].values.inv_update_steps;
      }
    }
  }

  /// Scales every V by the KL-clip factor \f$\nu = \min(1, \sqrt{\kappa / |\eta^2 \langle V, X\rangle|})\f$
  /// (1 without clipping), writes it into the caller's gradients and returns \f$\nu\f$. Every
  /// rank holds every V by now, so every rank computes the same scale.
  double clip_and_write_back(double kl_clip, double lr) {
    const ScopedRegion region("kfac::step::kl_clip");
    double vg = 0;  // only KL clipping needs it
    for (auto& e : reg_.entries()) if (!e.skipped && kl_clip > 0) vg += e.block->inner_product(exec_);
    double nu = 1.0;
    if (kl_clip > 0 && vg != 0) nu = std::min(1.0, std::sqrt(kl_clip / std::abs(vg * lr * lr)));
    for (auto& e : reg_.entries()) if (!e.skipped) e.block->write_back(exec_, e.w, e.b, nu);
    exec_.fence();
    return nu;
  }

  /// Holders precondition their layers; receivers get V from their group's holder. Every rank
  /// first preconditions all of its own layers and only then waits for the broadcasts, so
  /// that under MEM-OPT/HYBRID the ranks' GEMMs overlap instead of taking turns.
  /// Under Kaisa::split_preconditioning a layer's holders divide its apply by rows and
  /// gather the rows after each pass (precondition_split).
  /// With Kaisa::overlap_communication (Dist::overlaps()) each layer's broadcast starts as
  /// soon as its V is done (receivers start theirs at once) and the collectives in flight are
  /// advanced after every layer; factor sums in flight (start_average) complete after the
  /// Kronecker layers, before the closed forms, which read their statistics, are applied.
  /// Every rank starts the broadcasts in the same order: undivided layers, then divided ones,
  /// each in layer order.
  void precondition() {
    const ScopedRegion region("kfac::step::precondition");
    const bool overlap = dist_.overlaps();
    std::vector<int> passes(reg_.size(), 0);  // of the divided applies; 0: applied whole
    std::vector<char> divided(reg_.size(), 0), later(reg_.size(), 0);
    [[maybe_unused]] const auto scope = comm_scope(dist_.comm(), "preconditioning");
    for (std::size_t l = 0; l < reg_.size(); ++l) {
      auto& e = reg_[l];
      if (e.skipped) continue;
      [[maybe_unused]] const auto layer_scope = comm_scope(dist_.comm(), "layer '", e.block->name(), "'");
      flying_.settle(l, finisher());  // its units arrive while the layers before it are preconditioned
      divided[l] = dist_.split_parts(o_, l) > 1 && e.block->split_passes() > 0;
      e.block->load_gradient(exec_, e.w, e.b);  // receivers too: X enters the KL-clip sum
      if (dist_.holds(l)) {
        if (divided[l]) passes[l] = e.block->split_passes();
        else if (e.block->units() == 0 && flying_.averaging()) later[l] = 1;
        else e.block->apply(exec_, due_[l].values.damping);
      }
      if (overlap && !divided[l]) {
        exec_.fence();
        flying_.add(Started::gradient, l, dist_.share_gradient(l, e.block->preconditioned()));
        flying_.progress();
      }
    }
    precondition_split(passes, overlap);
    if (overlap)
      for (std::size_t l = 0; l < reg_.size(); ++l)
        if (divided[l]) flying_.add(Started::gradient, l, dist_.share_gradient(l, reg_[l].block->preconditioned()));
    flying_.complete_sums();
    for (std::size_t l = 0; l < reg_.size(); ++l)
      if (later[l]) reg_[l].block->apply(exec_, due_[l].values.damping);
    if (overlap) return flying_.complete_sharing();
    if (!dist_.shares_gradients()) return;
    exec_.fence();
    for (std::size_t l = 0; l < reg_.size(); ++l)
      if (!reg_[l].skipped) dist_.share_gradient(l, reg_[l].block->preconditioned());
  }

 private:
  /// The divided applies, pass by pass: each holder computes its rows of every divided layer,
  /// then the rows are gathered layer by layer (so that the ranks' GEMMs overlap), then the
  /// next pass; with `overlap`, each layer's all-gather starts as soon as its rows are done.
  /// Every row is computed by one rank, so the holders end with the same bits.
  void precondition_split(const std::vector<int>& passes, bool overlap) {
    const int most = passes.empty() ? 0 : *std::max_element(passes.begin(), passes.end());
    for (int pass = 0; pass < most; ++pass) {
      for (std::size_t l = 0; l < reg_.size(); ++l) {
        if (passes[l] <= pass) continue;
        auto& b = *reg_[l].block;
        const auto rows = row_block(b.split_rows(), dist_.split_part(l), dist_.split_parts(o_, l));
        b.apply_rows(exec_, due_[l].values.damping, pass, rows.first, rows.second);
        if (!overlap) continue;
        exec_.fence();
        flying_.add(Started::gradient, l, dist_.gather_rows(l, b.preconditioned(), b.split_rows()));
        flying_.progress();
      }
      if (overlap) {
        flying_.complete_sharing();
        continue;
      }
      exec_.fence();
      for (std::size_t l = 0; l < reg_.size(); ++l)
        if (passes[l] > pass) dist_.gather_rows(l, reg_[l].block->preconditioned(), reg_[l].block->split_rows());
    }
  }

  /// What completes a layer's decomposition once its units' broadcasts, left in flight by
  /// decompose_now() (Kaisa::overlap_communication), have arrived.
  auto finisher() {
    return [this](std::size_t l, double damping) {
      auto& e = reg_[l];
      e.block->finish_decomposition(exec_, damping, o_.precompute_reciprocal);
      e.decomposed = true;
      e.decomposition_damping = damping;
    };
  }

  /// Layer l decomposes at once.
  bool needs(std::size_t l) const {
    const auto& e = reg_[l];
    return !e.skipped && ((due_[l].inv && !due_[l].defer) || (!e.decomposed && dist_.holds(l)));
  }
  /// Layer l's deferred decomposition is swapped in at this step (the first that runs from its
  /// swap step on: a skipped step swaps nothing).
  bool swaps(std::size_t l) const {
    return !reg_[l].skipped && flying_.in_flight(l) && step_ >= flying_.deferred(l).swap_at();
  }
  bool launches(std::size_t l) const { return !reg_[l].skipped && due_[l].inv && due_[l].defer; }
  bool decomposes_now() const {
    for (std::size_t l = 0; l < reg_.size(); ++l)
      if (needs(l) || swaps(l)) return true;
    return false;
  }

  long decompose_now() {
    const ScopedRegion region("kfac::step::decompose");
    const Computed c = compute_units();
    const long verdict = agree_on_units(c);
    share_units(verdict);
    for (std::size_t l = 0; l < reg_.size(); ++l)
      if (swaps(l)) flying_.deferred(l).drop();
    backup_.clear();
    return c.retries;
  }

  /// What compute_units() did on this rank.
  struct Computed {
    std::optional<Error> failed;
    long failed_layer = 0;  ///< 1-based, 0 = none
    long retries = 0;
    bool reshare = false;  ///< a unit shared in the background was retried here: share again
  };
  /// This rank's units of the layers due (or swapped in) now, backed up first, with damping
  /// retries; stops at the first failure.
  Computed compute_units() {
    Computed c;
    for (std::size_t l = 0; l < reg_.size() && !c.failed; ++l) {
      auto& e = reg_[l];
      const bool swap = swaps(l);
      if (!(swap || needs(l)) || e.block->units() == 0 || !dist_.holds(l)) continue;
      e.block->allocate_units();
      std::vector<int> units;
      if (swap) {
        units = flying_.await(l).units();
      } else {
        e.block->prepare_decomposition(exec_);
        for (int u = 0; u < e.block->units(); ++u)
          if (dist_.computes(l, u)) units.push_back(u);
      }
      for (std::size_t k = 0; k < units.size() && !c.failed; ++k) {
        const int u = units[k];
        if (e.decomposed)
          for (const auto& b : e.block->unit_buffers(u)) backup_.save(exec_, b);
        try {
          if (!swap) {
            c.retries += with_retries(*e.block, u, due_[l].values.damping);
          } else {  // the first attempt ran in flight; retries, if any, run here on the shadow
            auto& d = flying_.deferred(l);
            const long r = with_retries(d.shadow(), u, d.damping(), &d.failure(k));
            c.retries += r;
            c.reshare = c.reshare || (r > 0 && d.shared_in_background());
            copy_into(exec_, d.shadow().unit_buffers(u), e.block->unit_buffers(u));
          }
        } catch (const Error& err) {
          c.failed = err;
        } catch (const std::exception& err) {  // e.g. std::bad_alloc inside a solver
          c.failed = Error(e.block->name(), std::string("decomposition failed: ") + err.what());
        }
        if (c.failed) c.failed_layer = long(l) + 1;
      }
    }
    return c;
  }

  /// The lowest failing rank tells every rank what failed, so that all restore their state and
  /// throw the same error. Returns the verdict otherwise: 1 when some unit must be shared again
  /// (compute_units' reshare on some rank), else 0.
  long agree_on_units(const Computed& c) {
    const int world = dist_.agreement_size(), rank = world == 1 ? 0 : dist_.comm().rank();
    // verdict world - rank + 1 names the failing rank; 1: no failure, but a unit to share again.
    const long verdict = dist_.agree_max(c.failed_layer > 0 ? long(world - rank) + 1 : c.reshare ? 1L : 0L);
    if (verdict <= 1) return verdict;
    rollback();
    for (std::size_t l = 0; l < reg_.size(); ++l)
      if (swaps(l)) flying_.deferred(l).drop();
    if (world == 1) throw *c.failed;
    const int root = world - int(verdict - 1);
    const bool me = rank == root;
    const std::string layer = dist_.share_message(me ? c.failed->layer() : "", root);
    const std::string what = dist_.share_message(me ? bare_message(*c.failed) : "", root);
    throw Error(layer, what + " (on rank " + std::to_string(root) + "; every rank restored its state)");
  }

  /// Shares every decomposed layer's units with the layer's other holders (or takes those that
  /// arrived in the background; `verdict` 1: send them again) and settles the layer, or leaves
  /// it to precondition() while the broadcasts are in flight.
  void share_units(long verdict) {
    for (std::size_t l = 0; l < reg_.size(); ++l) {
      auto& e = reg_[l];
      const bool swap = swaps(l);
      if (!(swap || needs(l)) || !dist_.holds(l)) continue;
      const double damping = swap ? flying_.deferred(l).damping() : due_[l].values.damping;
      if (e.block->units() > 0) {
        exec_.fence();
        const bool received = swap && flying_.deferred(l).shared_in_background();
        if (received) dist_.count_background(flying_.deferred(l).sent());
        if (received && verdict == 0) {  // the others' units arrived in the background
          const auto& mine = flying_.deferred(l).units();
          for (int u = 0; u < e.block->units(); ++u)
            if (std::find(mine.begin(), mine.end(), u) == mine.end())
              copy_into(exec_, flying_.deferred(l).shadow().unit_buffers(u), e.block->unit_buffers(u));
        } else {
          for (int u = 0; u < e.block->units(); ++u)
            flying_.add(Started::unit, l, dist_.share_unit(l, u, e.block->unit_buffers(u)));
          if (dist_.overlaps()) {  // the broadcasts are in flight: precondition() settles the layer
            flying_.leave_unsettled(l, damping);
            continue;
          }
        }
      }
      finisher()(l, damping);
    }
  }

  /// A failed decomposition (LAPACK info, Cholesky breakdown, Newton-Schulz divergence, NaN/Inf
  /// in the result) is retried with damping x damping_retry_factor, up to max_damping_retries
  /// times (Block::decompose with attempt >= 1: a changed problem, not the same computation again), then
  /// reported.
  /// `first`: the first attempt already ran (a deferred decomposition), with this outcome.
  long with_retries(Block<Scalar, Exec>& b, int u, double damping, const std::exception_ptr* first = nullptr) {
    double d = damping;
    for (int attempt = 0;; ++attempt) {
      try {
        if (attempt > 0 || !first) b.decompose(exec_, u, d, attempt);
        else if (*first) std::rethrow_exception(*first);
        for (const auto& buf : b.unit_buffers(u))
          if (nonfinite_in(exec_, buf) > 0)
            throw Error(b.name(), "decomposition has NaN/Inf values (is the factor finite?)");
        return attempt > 0 ? 1 : 0;
      } catch (const Error& err) {
        if (attempt >= o_.max_damping_retries)
          throw Error(b.name(), "decomposition of " +
                                    unit_name(b, u) +
                                    " failed after " + std::to_string(attempt) + " damping increase(s): " + err.what());
        d *= o_.damping_retry_factor;
      }
    }
  }

  static std::string unit_name(const Block<Scalar, Exec>& b, int u) {
    const std::string& name = b.description().units[std::size_t(u)].name;
    return name.empty() ? "unit " + std::to_string(u) : name;
  }

  /// A copy of `b` that lives until the end of the step.
  const void* keep(const Buffer& b) {
    if (const void* saved = backup_.copy_for(b)) return saved;  // already copied for a rollback
    kept_.push_back(copy_of(exec_, b));
    return kept_.back().data();
  }
  /// A copy of `b` times `scale` that lives until the end of the step.
  const void* keep(const Buffer& b, double scale) {
    kept_.push_back(scaled_copy_of(exec_, b, scale));
    return kept_.back().data();
  }

  /// Puts statistics and decompositions back as they were before this step.
  void rollback() {
    backup_.restore(exec_);
    for (std::size_t l = 0; l < reg_.size(); ++l) {
      auto& e = reg_[l];
      if (!had_state_[l] && e.block->has_statistics()) e.block->release_state();
      if (!e.decomposed && e.block->units() > 0) e.block->release_units();  // allocated by this step
    }
  }

  const Exec& exec_;
  Registry<Scalar, Exec>& reg_;
  Dist& dist_;
  in_flight_type& flying_;
  const Options& o_;
  const std::vector<Due>& due_;
  const long step_;
  StateBackup<Exec> backup_;
  std::vector<char> had_state_;
  std::vector<Kokkos::View<char*, typename Exec::memory_space>> kept_;
};

}  // namespace impl
}  // namespace kfac
