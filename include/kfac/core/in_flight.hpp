#pragma once
/// \file in_flight.hpp
/// \brief The one owner of a Preconditioner's work in flight: decompositions computed off the
/// critical path (DeferredDecomposition, one per layer that has launched one), the collectives
/// started by the distribution (factor sums with their broadcasts still to start and the
/// write-back of the averages, gradient broadcasts and all-gathers, unit broadcasts), and the
/// layers whose decomposition waits for its units' broadcasts (the settle list). Every
/// completion of kfac's in-flight work is in this file and in started.hpp (the started
/// collectives, which impl::Pipeline also keeps its transfers in): a started collective's
/// `wait()`, a deferred decomposition's future; the MPI requests themselves are completed by
/// the transport's one polling loop (impl::Watchdog::wait).
///
/// **Deferred decompositions** (Options::decomposition_delay = d >= 1): a
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
/// With a sharer (Kaisa::background_sharing, impl::BackgroundSharer), the same thread then
/// broadcasts the layer's units within its worker group, unit by unit in the order of
/// share_unit, on a communicator of the layer's own: every holder of the layer runs such a job
/// (those that compute none of its units only receive, into a shadow of their own), so the
/// decompositions reach every holder before step s + d, which then only copies them in.
///
/// **Started collectives** (Kaisa::overlap_communication) are kept in the order they were
/// started, with what is still to start after them and what finishes them: InFlight holds a
/// started factor sum's broadcast until it may start (StartedSum) and the write-back of the
/// averages (StartedSums), so neither the communicator's requests nor the distribution's state
/// hold work in flight. The one ordering rule: a sum to every rank is a reduce followed by a
/// broadcast that starts only when the reduce is complete, and every rank must start those
/// broadcasts in the same order; InFlight starts a sum's broadcast only when every sum started
/// before it has started its own.
///
/// StartedCollectives, the part that holds started collectives, is also what an
/// impl::Pipeline keeps its stage transfers in.

#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/core/backup.hpp"
#include "kfac/core/block.hpp"
#include "kfac/core/started.hpp"

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

/// The communicator has nonblocking collectives (kfac::MpiComm::start_sum and its kin).
template <class C, class = void>
struct has_nonblocking : std::false_type {};
template <class C>
struct has_nonblocking<C, std::void_t<typename C::request_type>> : std::true_type {};
/// Comm::request_type's stand-in for a communicator without nonblocking collectives: always
/// complete.
struct NoRequest {
  bool test() { return true; }
  void wait() {}
};
template <class C, bool = has_nonblocking<C>::value>
struct request_of { using type = NoRequest; };
template <class C>
struct request_of<C, true> { using type = typename C::request_type; };
/// What a distribution's started collectives return: Comm::request_type, or NoRequest.
template <class C>
using request_of_t = typename request_of<C>::type;

/// \brief The work in flight of one Preconditioner (see the file's description).
/// \tparam Request the communicator's request type (impl::request_of_t<Comm>): `test()`,
/// `wait()`; a default-constructed one is complete.
template <class Scalar, class Exec, class Request>
class InFlight {
 public:
  using deferred_type = DeferredDecomposition<Scalar, Exec>;

  // ---- deferred decompositions, one per layer ----

  /// Layer l's deferred decomposition (made the first time).
  deferred_type& deferred(std::size_t l) {
    if (deferred_.size() <= l) deferred_.resize(l + 1);
    if (!deferred_[l]) deferred_[l] = std::make_unique<deferred_type>();
    return *deferred_[l];
  }
  /// Layer l has a deferred decomposition in flight (deferred(l) then tells when it swaps in).
  bool in_flight(std::size_t l) const { return l < deferred_.size() && deferred_[l] && deferred_[l]->in_flight(); }
  const deferred_type& deferred(std::size_t l) const { return *deferred_.at(l); }
  /// Waits for layer l's deferred decomposition (or computes it, when it was not started on
  /// a thread of its own) and returns it; see DeferredDecomposition::wait.
  deferred_type& await(std::size_t l) {
    deferred_.at(l)->wait();
    return *deferred_[l];
  }
  /// Forgets every deferred decomposition (their shadows' memory is kept).
  void drop_all() {
    for (auto& d : deferred_)
      if (d) d->drop();
  }
  /// Memory of layer l's shadow block.
  std::size_t bytes(std::size_t l) const { return l < deferred_.size() && deferred_[l] ? deferred_[l]->bytes() : 0; }

  /// A deferred decomposition in flight, as a checkpoint holds it.
  struct Snapshot {
    std::size_t layer = 0;
    long launched = -1, swap_at = -1;
    double damping = 0;
    std::vector<int> units;    ///< the units this rank computes
    std::vector<Buffer> state; ///< the statistics it is computed from (empty when `units` is)
  };
  /// The deferred decompositions in flight, in layer order.
  std::vector<Snapshot> snapshot() const {
    std::vector<Snapshot> out;
    for (std::size_t l = 0; l < deferred_.size(); ++l) {
      if (!in_flight(l)) continue;
      auto& d = *deferred_[l];
      out.push_back({l, d.launched_at(), d.swap_at(), d.damping(), d.units(),
                     d.units().empty() ? std::vector<Buffer>{} : d.shadow().checkpoint_state()});
    }
    return out;
  }

  // ---- started collectives ----

  /// Keeps a started collective until it is completed.
  void add(Started kind, std::size_t layer, Request r) { started_.add(kind, layer, std::move(r)); }
  void add(Started kind, std::size_t layer, std::vector<Request> rs) { started_.add(kind, layer, std::move(rs)); }
  /// Keeps started factor sums; their write-back runs once they are all complete (until then
  /// the factors must be neither read nor written).
  void add_sums(StartedSums<Request> sums) {
    if (sums.sums.empty()) return;
    for (auto& s : sums.sums) started_.add(std::move(s));
    after_sums_ = sums.write_back ? std::move(sums.write_back) : [] {};
  }
  /// True while factor sums are in flight.
  bool averaging() const { return bool(after_sums_); }
  /// Advances every started collective, in the order they were started.
  void progress() { started_.progress(); }
  /// Completes the factor sums (in the order they were started) and writes the averages back.
  void complete_sums() {
    started_.complete_where([](Started k, std::size_t) { return k == Started::sum; });
    if (after_sums_) std::exchange(after_sums_, nullptr)();
  }
  /// Completes the gradient broadcasts and all-gathers, then every unit broadcast.
  void complete_sharing() {
    started_.complete_where([](Started k, std::size_t) { return k == Started::gradient; });
    started_.complete_where([](Started k, std::size_t) { return k == Started::unit; });
  }

  // ---- the settle list: decompositions waiting for their units' broadcasts ----

  /// Layer l's decomposition is finished (with `damping`) once its unit broadcasts arrive.
  void leave_unsettled(std::size_t l, double damping) {
    if (unsettled_.size() <= l) unsettled_.resize(l + 1, -1.0);
    unsettled_[l] = damping;
  }
  /// When layer l is unsettled: completes its unit broadcasts, then `finish(l, damping)`.
  template <class Finish>
  void settle(std::size_t l, Finish&& finish) {
    if (l >= unsettled_.size() || unsettled_[l] < 0) return;
    const double damping = std::exchange(unsettled_[l], -1.0);
    started_.complete_where([l](Started k, std::size_t layer) { return k == Started::unit && layer == l; });
    finish(l, damping);
  }
  /// Leaves nothing in flight but the deferred decompositions: settles every layer (with
  /// `finish(l, damping)`), completes the sums, then the sharing.
  template <class Finish>
  void drain(Finish&& finish) {
    for (std::size_t l = 0; l < unsettled_.size(); ++l) settle(l, finish);
    complete_sums();
    complete_sharing();
  }

 private:
  std::vector<std::unique_ptr<deferred_type>> deferred_;  ///< per layer (null: never launched)
  StartedCollectives<Request> started_;
  std::function<void()> after_sums_;
  std::vector<double> unsettled_;  ///< per layer: the damping of its unsettled decomposition (-1: none)
};

}  // namespace impl
}  // namespace kfac
