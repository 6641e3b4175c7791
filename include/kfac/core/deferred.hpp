#pragma once
/// \file deferred.hpp
/// \brief Decompositions off the critical path (Options::decomposition_delay = d >= 1): a
/// decomposition due at step s is computed from the statistics of step s into a shadow copy of
/// the layer's block and swapped in at step s + d, the same step on every rank whatever the
/// timing, so results do not depend on which thread finished first.
///
/// The shadow's units are computed on a second host thread where the block allows it
/// (Block::decomposes_off_thread: Kokkos::Serial with LAPACK), overlapping the rest of step s
/// and the host's next forward and backward passes; elsewhere (OpenMP, CUDA, the portable
/// solvers) they are computed on the calling thread when swapped in. Either way the bits are
/// those of the same computation on the statistics of step s.
///
/// With a sharer (Options::background_sharing, impl::BackgroundSharer), the same thread then
/// broadcasts the layer's units within its worker group, unit by unit in the order of
/// share_unit, on a communicator of the layer's own: every holder of the layer runs such a job
/// (those that compute none of its units only receive, into a shadow of their own), so the
/// decompositions reach every holder before step s + d, which then only copies them in.

#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "kfac/core/backup.hpp"
#include "kfac/core/block.hpp"

namespace kfac {
namespace impl {

/// The in-flight decomposition of one layer (on every rank: the schedule part is global; the
/// shadow exists only on ranks that compute some of the layer's units).
template <class Scalar, class Exec>
class DeferredDecomposition {
 public:
  using block_type = Block<Scalar, Exec>;
  using factory_type = std::function<std::unique_ptr<block_type>()>;

  DeferredDecomposition() = default;
  DeferredDecomposition(const DeferredDecomposition&) = delete;
  DeferredDecomposition& operator=(const DeferredDecomposition&) = delete;
  ~DeferredDecomposition() { forget(); }

  bool in_flight() const { return swap_at_ >= 0; }
  long launched_at() const { return launched_; }
  long swap_at() const { return swap_at_; }
  double damping() const { return damping_; }
  /// The units this rank computes (empty: it only receives them, or holds none).
  const std::vector<int>& units() const { return units_; }
  block_type& shadow() { return *shadow_; }
  /// The units travelled from the background thread (launched with a sharer).
  bool shared_in_background() const { return bool(share_); }
  /// What the sharer sent: {bytes, MPI calls} (after wait()).
  std::pair<std::size_t, std::size_t> sent() const { return sent_; }

  /// Starts decomposing `units` of the shadow (made by `make` the first time), whose
  /// statistics `fill(shadow)` writes (the layer's of step `step`), to be swapped in at step
  /// `swap_at`; then, with `share`, shares every unit of the layer from the same thread (a
  /// rank that computes none of them receives them into its shadow).
  template <class Fill>
  void launch(const Exec& exec, const factory_type& make, Fill&& fill, std::vector<int> units,
              double damping, long step, long swap_at, BackgroundSharer share = {}) {
    drop();
    launched_ = step;
    swap_at_ = swap_at;
    damping_ = damping;
    units_ = std::move(units);
    share_ = std::move(share);
    if (units_.empty() && !share_) return;
    if (!shadow_) shadow_ = make();
    if (!units_.empty()) {
      shadow_->allocate_state();
      fill(*shadow_);
    }
    shadow_->allocate_units();
    if (!units_.empty()) shadow_->prepare_decomposition(exec);  // the traces' reductions stay on this thread
    exec.fence();
    failures_.assign(units_.size(), nullptr);
    block_type* b = shadow_.get();
    auto job = [this, b, exec, damping]() {
      for (std::size_t k = 0; k < units_.size(); ++k) {
        try {
          b->decompose(exec, units_[k], damping);
        } catch (...) {
          failures_[k] = std::current_exception();
        }
      }
      exec.fence();
      // A unit whose computation failed travels too, so that every holder's broadcasts match;
      // the swap step retries it and shares it again (StepPhases::decompose_now).
      try {
        for (int u = 0; share_ && u < b->units(); ++u) {
          const auto s = share_(u, b->unit_buffers(u));
          sent_.first += s.first;
          sent_.second += s.second;
        }
      } catch (...) {
        share_failure_ = std::current_exception();
      }
    };
    async_ = b->decomposes_off_thread();
    work_ = std::async(async_ ? std::launch::async : std::launch::deferred, job);
  }

  /// Waits for the computation (or runs it, when deferred); afterwards failure(k) is the
  /// exception of units()[k]'s first attempt, or null.
  void wait() {
    if (work_.valid()) work_.get();
    if (share_failure_) std::rethrow_exception(std::exchange(share_failure_, nullptr));
  }
  const std::exception_ptr& failure(std::size_t k) const { return failures_[k]; }

  /// Forgets the in-flight decomposition (its shadow's memory is kept for the next one); one
  /// not started (computed when swapped in) is not computed at all.
  void drop() {
    forget();
    launched_ = swap_at_ = -1;
    units_.clear();
    failures_.clear();
    share_ = nullptr;
    sent_ = {0, 0};
    share_failure_ = nullptr;
  }
  /// Memory of the shadow: its copy of the statistics and its decompositions.
  std::size_t bytes() const {
    if (!shadow_) return 0;
    const MemoryReport m = shadow_->memory();
    return m.factor_bytes + m.decomposition_bytes;
  }

 private:
  std::unique_ptr<block_type> shadow_;
  std::vector<int> units_;
  std::vector<std::exception_ptr> failures_;
  BackgroundSharer share_;
  std::pair<std::size_t, std::size_t> sent_{0, 0};
  std::exception_ptr share_failure_;
  long launched_ = -1, swap_at_ = -1;
  double damping_ = 0;
  std::future<void> work_;
  bool async_ = false;

  /// Waits for a running computation (it cannot be stopped); drops one not started.
  void forget() {
    if (async_ && work_.valid()) work_.wait();
    work_ = std::future<void>();
  }
};

}  // namespace impl
}  // namespace kfac
