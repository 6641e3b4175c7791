#pragma once
/// \file parameter_averager.hpp
/// \brief Periodic parameter averaging across ranks that train independently (Povey, Zhang &
/// Khudanpur 2014: each job trains on its own data; every N minibatches the parameters are
/// averaged and every job continues from the average).

#include <Kokkos_Core.hpp>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kfac/core/agreement.hpp"
#include "kfac/core/block.hpp"
#include "kfac/distributed/bucketed_sum.hpp"
#include "kfac/core/comm_precision.hpp"
#include "kfac/error.hpp"

namespace kfac {

/// \brief Replaces a fixed set of parameter views by their (optionally weighted) average over
/// the ranks, in buckets of at most `bucket_bytes` (one collective each, impl::plan_buckets as
/// for GradientAverager). Afterwards every rank holds the same bits: the sums are reduced to
/// rank 0 and broadcast (MpiComm::sum), and every rank divides the same sum by the same total.
///
/// Weighted average: \f$p \leftarrow \sum_r w_r p_r / \sum_r w_r\f$, each rank passing its own
/// \f$w_r \ge 0\f$ (e.g. the samples it saw since the last average; unweighted: all 1). The
/// first average after an add() checks, in one collective, that every rank registered the same
/// views (count, sizes, scalar types): on a mismatch every rank throws the same kfac::Error
/// before any data moves, so no rank is left waiting. Momentum buffers: register them with
/// add() to average them with the same weights; leave them out to keep each rank's own
/// (Povey et al. average the parameters only; see docs/parameter_averaging.md). With one rank,
/// averaging is the identity and sends nothing.
///
/// Views must be contiguous, of float or double, in memory that `Exec` can access (as for
/// GradientAverager): buckets are packed and unpacked by kernels on `Exec` into a staging view
/// in its memory, and a communicator that cannot read that memory gets a host copy of the
/// packed bucket. The weights are host scalars.
///
/// What happens to each job's other state at an average is the caller's: by default nothing
/// (kfac keeps each rank's NG-SGD estimates across averages). Kaldi's recipe starts fresh jobs
/// from the averaged model, so their NG-SGD estimates start again, and trains each of the P
/// jobs with P times the learning rate: with_after_average (e.g. constructing a new
/// Preconditioner) and with_lr_times_jobs / learning_rate offer both (docs/parameter_averaging.md).
/// \tparam Comm SerialComm or MpiComm.
/// \tparam Exec the execution space whose memory holds the parameters (the host's by default;
///         `Kokkos::DefaultExecutionSpace` for device views).
template <class Comm, class Exec = Kokkos::DefaultHostExecutionSpace>
class ParameterAverager {
 public:
  using execution_space = Exec;
  using memory_space = typename Exec::memory_space;

  /// \param comm [in] the ranks whose parameters are averaged (a copy of the handle is kept).
  /// \param every [in] maybe_average() averages after every `every` steps (>= 1).
  /// \param bucket_bytes [in] upper bound of one collective's payload (>= 8).
  explicit ParameterAverager(Comm comm, long every = 1, std::size_t bucket_bytes = std::size_t(16) << 20)
      : comm_(std::move(comm)), every_(every), bucket_bytes_(bucket_bytes) {
    if (every_ < 1) throw Error("", "ParameterAverager: every must be >= 1 (got " + std::to_string(every_) + ")");
    if (bucket_bytes_ < 8) throw Error("", "ParameterAverager: bucket_bytes must be at least 8");
  }

  /// \brief `f` runs on every rank after each completed average() (also on one rank; not when
  /// the average throws), e.g. to re-initialise the job's NG-SGD estimates as Kaldi's fresh
  /// jobs do. Default: nothing runs (estimates are kept across averages).
  ParameterAverager& with_after_average(std::function<void()> f) {
    after_average_ = std::move(f);
    return *this;
  }
  /// \brief Kaldi's learning-rate rule for P jobs: learning_rate(lr) is P lr when on, lr when
  /// off (the default).
  ParameterAverager& with_lr_times_jobs(bool on) {
    lr_times_jobs_ = on;
    return *this;
  }
  /// The learning rate each job should train with, given the single-job rate `lr`.
  double learning_rate(double lr) const { return lr_times_jobs_ ? lr * comm_.size() : lr; }

  /// Registers a parameter (or momentum) view; its storage must outlive the averager.
  template <class View>
  void add(const View& v) {
    buffers_.push_back(impl::averaged_buffer_of<Exec>(v, "ParameterAverager"));
    checked_ = false;
  }

  /// \brief Collective: averages when `step + 1` is a multiple of `every` (after steps N - 1,
  /// 2N - 1, ... for 0-based steps). Returns whether it averaged.
  bool maybe_average(long step, double weight = 1.0) {
    if ((step + 1) % every_ != 0) return false;
    average(weight);
    return true;
  }

  /// \brief Collective: every registered view becomes \f$\sum_r w_r p_r / \sum_r w_r\f$.
  /// Throws (on every rank alike) when the ranks registered different views, a weight is
  /// negative or not finite, or all weights are 0; nothing is changed then.
  void average(double weight = 1.0) {
    [[maybe_unused]] const auto scope = impl::comm_scope(comm_, "ParameterAverager::average, average ", averages_ + 1);
    collectives_ = 0;
    const bool bad = !(weight >= 0) || !std::isfinite(weight);
    if (comm_.size() == 1) {  // the identity; the weight is still checked
      if (bad || weight == 0) throw Error("", "ParameterAverager: weight " + std::to_string(weight) + ": expected a finite value > 0 on one rank");
      ++averages_;
      if (after_average_) after_average_();
      return;
    }
    const std::size_t sent_before = comm_.bytes_sent();
    if (!checked_) check_same_views();
    // The total weight, and whether any rank passed a bad one: 16 bytes, every time, so that
    // every rank runs the same collectives whatever weights they pass.
    double w[2] = {bad ? 0.0 : weight, bad ? 1.0 : 0.0};
    comm_.sum(w, 2, sizeof(double), CommPrecision::native);
    ++collectives_;
    if (w[1] > 0) {
      bytes_ += comm_.bytes_sent() - sent_before;
      throw Error("", "ParameterAverager: " + std::to_string(long(w[1])) +
                          " rank(s) passed a negative or non-finite weight (this rank: " +
                          std::to_string(weight) + "); nothing was averaged");
    }
    if (!(w[0] > 0)) {
      bytes_ += comm_.bytes_sent() - sent_before;
      throw Error("", "ParameterAverager: the weights of all ranks are 0; nothing was averaged");
    }
    const Exec exec;
    collectives_ += impl::bucketed_sum<float>(exec, comm_, buffers_, bucket_bytes_, float(weight), float(1.0 / w[0]), staging_);
    collectives_ += impl::bucketed_sum<double>(exec, comm_, buffers_, bucket_bytes_, weight, 1.0 / w[0], staging_);
    bytes_ += comm_.bytes_sent() - sent_before;
    ++averages_;
    if (after_average_) after_average_();
  }

  /// Collectives used by the last average() (the view check included).
  std::size_t collectives() const { return collectives_; }
  /// Payload bytes this averager handed to collectives so far (as Comm::bytes_sent counts them).
  std::size_t bytes_sent() const { return bytes_; }
  /// Averages done so far.
  long averages() const { return averages_; }
  long every() const { return every_; }
  std::size_t views() const { return buffers_.size(); }

 private:
  /// One collective (a hash over ranks): the same number, sizes and types of views everywhere.
  void check_same_views() {
    ++collectives_;
    impl::check_same_buffers(comm_, buffers_, "ParameterAverager", "parameter");
    checked_ = true;
  }

  Comm comm_;
  long every_;
  std::size_t bucket_bytes_;
  std::vector<impl::Buffer> buffers_;
  bool checked_ = false;
  std::size_t collectives_ = 0, bytes_ = 0;
  long averages_ = 0;
  std::function<void()> after_average_;
  bool lr_times_jobs_ = false;
  Kokkos::View<char*, memory_space> staging_;
};

}  // namespace kfac
