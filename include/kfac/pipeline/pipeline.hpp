#pragma once
/// \file pipeline.hpp
/// \brief Fully decoupled training with delayed gradients (FDG; Zhuang, Wang, Liu, Zhang and
/// Lin 2019): a network split into K stages on K ranks of a communicator, each stage forwarding
/// the newest batch and back-propagating an older one at every step, so that no stage waits for
/// the forward or the backward of another within a step.
///
/// Schedule (kfac::FdgSchedule): at step t stage k forwards batch t - k and back-propagates batch
/// t - 2(K - 1) + k, whose input it stashed 2(K - k - 1) steps earlier. Activations go down the
/// pipeline and gradients up it with MPI_Isend / MPI_Irecv; what is sent at step t is received
/// during step t and used at step t + 1, so communication overlaps the next step's compute.
/// Within a step a stage below the last back-propagates the old batch and updates before it
/// forwards the new one, as the authors' code does (kfac::FdgUpdateOrder::update_then_forward;
/// PipelineOptions::with_update_order(forward_then_update) forwards first, kfac 0.1's order).
///
/// Gradient shrinking, as the authors' code does it: every stage k < K - 1 multiplies the
/// output gradient it receives by beta before its backward, so its parameter gradient and the
/// input gradient it passes on carry beta once per stage below the last: beta^(K - 1 - k) in all.
/// The host's optimizer then applies its own learning rate, momentum and weight decay to that
/// shrunk gradient (beta does not scale weight decay).
///
/// Faults: whatever a stage throws (or a bad batch) is recorded on its rank; the rank still
/// sends the messages its neighbours expect that step, and a non-blocking max over the ranks of
/// each step's status, completed at the top of the next step, stops every stage there with the
/// failing stage's message. Nothing waits on a message that will never come.
///
/// The communicator is the user's (duplicated by kfac::MpiComm), so several pipelines, or a
/// pipeline per data-parallel replica, can coexist; ranks from K on take no part.

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <deque>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/core/agreement.hpp"
#include "kfac/core/started.hpp"
#include "kfac/distributed/mpi_comm.hpp"
#include "kfac/error.hpp"
#include "kfac/pipeline/schedule.hpp"
#include "kfac/pipeline/stage.hpp"

namespace kfac {

/// How the batches flow: `fdg` (decoupled, delayed gradients) or `synchronous` (model-parallel
/// back-propagation: every batch goes down and up the whole pipeline before the next starts;
/// the baseline the FDG speed-up is measured against).
enum class PipelineSchedule { fdg, synchronous };

/// \brief Settings of a kfac::Pipeline, built with `with_*` calls (each returns a copy).
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | int | stages | K, the number of stages (ranks 0..K-1 of the communicator); 0: every rank | 0 |
/// | long | batch_size | samples per batch; every batch of a run must have exactly this many | required |
/// | double | beta | gradient-shrinking factor in (0, 1]; 1 shrinks nothing | 1 |
/// | PipelineSchedule | schedule | fdg or synchronous | fdg |
/// | FdgUpdateOrder | update_order | under fdg, whether a stage below the last updates before (the authors' code) or after it forwards | update_then_forward |
struct PipelineOptions {
  int stages = 0;
  long batch_size = 0;
  double beta = 1.0;
  PipelineSchedule schedule = PipelineSchedule::fdg;
  FdgUpdateOrder update_order = FdgUpdateOrder::update_then_forward;
  PipelineOptions with_stages(int v) const { auto o = *this; o.stages = v; return o; }
  PipelineOptions with_batch_size(long v) const { auto o = *this; o.batch_size = v; return o; }
  PipelineOptions with_beta(double v) const { auto o = *this; o.beta = v; return o; }
  PipelineOptions with_schedule(PipelineSchedule v) const { auto o = *this; o.schedule = v; return o; }
  PipelineOptions with_update_order(FdgUpdateOrder v) const { auto o = *this; o.update_order = v; return o; }
};

/// What one rank measured over one train() call.
struct PipelineReport {
  long batches = 0, steps = 0;
  double seconds = 0;           ///< wall time of the call
  double forward_seconds = 0;   ///< in the stage's forward (and the loss, on the last stage)
  double backward_seconds = 0;  ///< in the stage's backward
  double update_seconds = 0;    ///< in apply_update
  double wait_seconds = 0;      ///< waiting for messages and for the other stages' status
  double compute_seconds() const { return forward_seconds + backward_seconds + update_seconds; }
};

/// \brief A K-stage pipeline over the ranks of a communicator; rank k runs stage k.
/// \tparam Stage the host's module (contract in kfac/pipeline/stage.hpp)
template <class Stage>
class Pipeline {
 public:
  using scalar_type = typename Stage::scalar_type;
  using tensor_type = StageTensor<scalar_type>;
  static_assert(std::is_same<scalar_type, float>::value || std::is_same<scalar_type, double>::value,
                "kfac::Pipeline: scalar_type must be float or double");

  /// \brief Collective over `comm`: checks the options and that every stage's output width is
  /// the next stage's input width; throws the same kfac::Error on every rank otherwise.
  /// \param comm [in] rank k < K runs stage k (K = `options.stages`, 0: every rank); a sub-communicator of the K ranks is split off
  /// \param stage [in] this rank's stage (kept by reference; ignored on ranks >= K)
  /// \param options [in] stages, batch size, beta, schedule and update order, the same on every rank (copied)
  Pipeline(const MpiComm& comm, Stage& stage, const PipelineOptions& options)
      : comm_(comm), stage_(&stage), opt_(options) {
    impl::check_stage<Stage>();
    const int size = comm.size(), rank = comm.rank();
    constexpr int kFields = 8;
    const double mine[kFields] = {double(options.stages), options.beta, double(stage.input_features()),
                                  double(stage.output_features()), double(sizeof(scalar_type)),
                                  double(options.batch_size), double(int(options.schedule)),
                                  double(int(options.update_order))};
    std::vector<double> all(std::size_t(kFields) * size);
    std::copy(mine, mine + kFields, all.begin() + std::ptrdiff_t(kFields) * rank);
    {
      [[maybe_unused]] const auto scope = comm_.scope("Pipeline's constructor");
      comm_.all_gather(all.data(), std::vector<std::size_t>(std::size_t(size), sizeof(mine)));
    }
    stages_ = validate(all, kFields, size);
    group_ = comm.split(rank < stages_ ? 0 : 1);
    if (rank >= stages_) return;
    index_ = rank;
    in_ = stage.input_features();
    out_ = stage.output_features();
    const long n = options.batch_size;
    for (int i = 0; i < 2; ++i) {
      if (index_ > 0) recv_act_[i] = tensor_type("kfac::pipeline::recv_act", n, in_);
      if (index_ + 1 < stages_) {
        send_act_[i] = tensor_type("kfac::pipeline::send_act", n, out_);
        recv_grad_[i] = tensor_type("kfac::pipeline::recv_grad", n, out_);
      }
      if (index_ > 0) send_grad_[i] = tensor_type("kfac::pipeline::send_grad", n, in_);
    }
  }
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Whether this rank runs a stage (rank < K).
  bool active() const { return index_ >= 0; }
  /// This rank's stage k, or -1 on ranks >= K.
  int stage_index() const { return index_; }
  int stages() const { return stages_; }
  double beta() const { return opt_.beta; }
  const PipelineOptions& options() const { return opt_; }
  /// Steps between the forward of a batch on this stage and the update with its gradient.
  long delay() const { return fdg() ? FdgSchedule::delay(index_, stages_) : 0; }
  /// Updates of this stage between the forward of a batch and the update with its gradient,
  /// once the pipeline is full (FdgSchedule::staleness; 0 under the synchronous schedule).
  long staleness() const { return fdg() ? FdgSchedule::staleness(index_, stages_, opt_.update_order) : 0; }
  /// The communicator of the K stage ranks (MPI_COMM_NULL on the others).
  MPI_Comm comm() const { return group_.comm(); }

  /// \brief One epoch of `batches` batches, drained: on return every batch's gradient has been
  /// applied on every stage (fill and drain take 2(K - 1) extra steps under fdg). Collective
  /// over the K stage ranks; returns at once on the others.
  /// \param batches [in] the number of batches of the epoch, the same on every stage rank
  /// \param input [in] `tensor_type input(long batch)`: batch `batch`'s input (N, in); called on stage 0 only
  /// \param loss [in] `tensor_type loss(long batch, const tensor_type& output)`: dLoss/d(output)
  ///   for that batch, (N, out); called on the last stage only
  /// \throws kfac::Error on every stage when any stage failed (or the ranks passed different
  ///   `batches`); the updates of the steps before the failure stay applied, and the pipeline
  ///   is ready for another call.
  template <class Input, class Loss>
  PipelineReport train(long batches, Input&& input, Loss&& loss) {
    PipelineReport report;
    if (!active()) return report;
    [[maybe_unused]] const auto scope = comm_.scope("Pipeline::train, stage " + std::to_string(index_));
    agree_on_batches(batches);
    const double t0 = MPI_Wtime();
    report.batches = batches;
    report.steps = opt_.schedule == PipelineSchedule::fdg ? FdgSchedule::steps(batches, stages_) : batches;
    for (long t = 0; t < report.steps; ++t) {
      if (opt_.schedule == PipelineSchedule::fdg) fdg_step(t, batches, input, loss, report);
      else synchronous_step(t, input, loss, report);
    }
    finish_step(report);
    report.seconds = MPI_Wtime() - t0;
    return report;
  }

 private:
  static constexpr int kActivationTag = 7301, kGradientTag = 7302;

  bool fdg() const { return active() && opt_.schedule == PipelineSchedule::fdg; }


  /// Every rank sees every rank's options and widths, so every rank throws the same error.
  static int validate(const std::vector<double>& all, int fields, int size) {
    auto at = [&](int r, int f) { return all[std::size_t(r) * fields + f]; };
    for (int r = 0; r < size; ++r) {
      const std::string who = "pipeline (rank " + std::to_string(r) + "): ";
      const double beta = at(r, 1);
      if (!(beta > 0.0 && beta <= 1.0))
        throw Error("", who + "beta = " + std::to_string(beta) + " is outside (0, 1] (every rank refused the pipeline)");
      if (at(r, 0) < 0) throw Error("", who + "stages must be >= 1 (0: every rank of the communicator)");
      if (at(r, 5) < 1) throw Error("", who + "batch_size must be set (>= 1) with PipelineOptions::with_batch_size");
      if (at(r, 6) != double(int(PipelineSchedule::fdg)) && at(r, 6) != double(int(PipelineSchedule::synchronous)))
        throw Error("", who + "schedule is neither PipelineSchedule::fdg nor synchronous");
      if (at(r, 7) != double(int(FdgUpdateOrder::update_then_forward)) &&
          at(r, 7) != double(int(FdgUpdateOrder::forward_then_update)))
        throw Error("", who + "update_order is neither FdgUpdateOrder::update_then_forward nor forward_then_update");
    }
    for (int r = 1; r < size; ++r)
      for (int f : {0, 1, 4, 5, 6, 7})
        if (at(r, f) != at(0, f))
          throw Error("", "pipeline: ranks 0 and " + std::to_string(r) +
                              " passed different stages, beta, batch_size, schedule, update_order or scalar type");
    const int stages = at(0, 0) == 0 ? size : int(at(0, 0));
    if (stages > size)
      throw Error("", "pipeline: " + std::to_string(stages) + " stages need " + std::to_string(stages) +
                          " ranks; the communicator has " + std::to_string(size));
    for (int k = 0; k < stages; ++k) {
      if (at(k, 2) < 1 || at(k, 3) < 1)
        throw Error("", "pipeline stage " + std::to_string(k) + ": input and output features must be >= 1");
      if (at(k, 5) * std::max(at(k, 2), at(k, 3)) > double(INT_MAX))
        throw Error("", "pipeline stage " + std::to_string(k) + ": a batch's activations exceed one MPI message");
    }
    for (int k = 0; k + 1 < stages; ++k)
      if (at(k, 3) != at(k + 1, 2))
        throw Error("", "pipeline stage " + std::to_string(k) + " outputs " + std::to_string(long(at(k, 3))) +
                            " features per sample but stage " + std::to_string(k + 1) + " expects " +
                            std::to_string(long(at(k + 1, 2))) + " (every rank refused the pipeline)");
    return stages;
  }

  void agree_on_batches(long batches) {
    long v[2];
    impl::put_same_pair(v, batches);
    comm_.allreduce_max(v, 2, group_);
    if (!impl::same_on_every_rank(v) || batches < 0)
      throw Error("", "pipeline: the stages passed different (or negative) batch counts to train(); nothing was run");
  }

  // --- one step's messages -------------------------------------------------------------------

  void keep(MpiComm::Request r) { transfers_.add(impl::Started::transfer, 0, std::move(r)); }
  void post_recv(const tensor_type& buf, int from, int tag) {
    keep(comm_.start_recv(buf.data(), buf.size() * sizeof(scalar_type), from, tag, group_));
  }
  void post_send(const tensor_type& buf, int to, int tag) {
    keep(comm_.start_send(buf.data(), buf.size() * sizeof(scalar_type), to, tag, group_));
  }
  void wait_all(PipelineReport& report) {
    const double t0 = MPI_Wtime();
    transfers_.complete_all();
    report.wait_seconds += MPI_Wtime() - t0;
  }
  /// Posts the max over stages of this step's status (non-blocking; read at the next step).
  void post_status() {
    status_out_ = failed_ ? long(stages_ - index_) : 0L;
    keep(comm_.start_max(&status_out_, &status_in_, 1, group_));
    status_posted_ = true;
  }
  /// Completes the previous step and throws on every stage when some stage failed in it.
  void finish_step(PipelineReport& report) {
    wait_all(report);
    if (!status_posted_ || status_in_ == 0) return;
    status_posted_ = false;
    const int root = stages_ - int(status_in_);
    const std::string what = comm_.broadcast_string(index_ == root ? error_ : std::string(), root, group_);
    reset();
    throw Error("", what + " (the pipeline stopped on every stage)");
  }
  void reset() {
    failed_ = false;
    error_.clear();
    for (auto& s : stash_) pool_.push_back(s.second);
    stash_.clear();
  }

  /// Runs f unless this rank already failed in this step; records what it throws.
  template <class F>
  void guarded(long batch, long step, double& seconds, F&& f) {
    if (failed_) return;
    const double t0 = MPI_Wtime();
    std::string what;
    bool threw = true;
    try {
      f();
      threw = false;
    } catch (const std::exception& e) {
      what = e.what();
      if (what.compare(0, 6, "kfac: ") == 0) what = what.substr(6);
    } catch (...) {
      what = "an exception that is not a std::exception";
    }
    seconds += MPI_Wtime() - t0;
    if (threw) {
      failed_ = true;
      error_ = "pipeline stage " + std::to_string(index_) + " (batch " + std::to_string(batch) + ", step " +
               std::to_string(step) + "): " + what;
    }
  }
  void expect_shape(const tensor_type& t, long rows, long cols, const char* what, long batch) const {
    if (long(t.extent(0)) != rows || long(t.extent(1)) != cols)
      throw Error("", std::string(what) + " of batch " + std::to_string(batch) + " is (" + std::to_string(t.extent(0)) +
                          ", " + std::to_string(t.extent(1)) + "); the pipeline expects (" + std::to_string(rows) +
                          ", " + std::to_string(cols) + ") (every batch must have batch_size samples)");
  }

  // --- the stage's work -------------------------------------------------------------------------

  /// Forward of `batch` from `in` (stashed first); the output is checked.
  tensor_type forward(long batch, const tensor_type& in) {
    tensor_type kept;
    if (!pool_.empty()) { kept = pool_.back(); pool_.pop_back(); }
    else kept = tensor_type("kfac::pipeline::stash", opt_.batch_size, in_);
    Kokkos::deep_copy(kept, in);
    stash_.emplace_back(batch, kept);
    tensor_type out = stage_->forward(batch, kept);
    expect_shape(out, opt_.batch_size, out_, "the stage's output", batch);
    return out;
  }
  /// Backward of `batch` (the oldest stashed input) from `grad`, scaled by beta except on the
  /// last stage; the input gradient goes to `send`; then the update.
  void backward(long batch, const tensor_type& grad, const tensor_type& send, PipelineReport& report, long step) {
    guarded(batch, step, report.backward_seconds, [&] {
      if (stash_.empty() || stash_.front().first != batch)
        throw Error("", "internal: the stash does not hold batch " + std::to_string(batch));
      if (index_ + 1 < stages_ && opt_.beta != 1.0) {
        const scalar_type beta = scalar_type(opt_.beta);
        scalar_type* g = grad.data();
        for (std::size_t i = 0; i < grad.size(); ++i) g[i] *= beta;
      }
      const tensor_type ig = stage_->backward(batch, stash_.front().second, grad, index_ > 0);
      if (index_ > 0) {
        expect_shape(ig, opt_.batch_size, in_, "the stage's input gradient", batch);
        Kokkos::deep_copy(send, ig);
      }
      pool_.push_back(stash_.front().second);
      stash_.pop_front();
    });
    guarded(batch, step, report.update_seconds, [&] { stage_->apply_update(batch); });
  }

  template <class Input>
  tensor_type stage_input(long batch, Input& input) {
    if (index_ > 0) return tensor_type();
    tensor_type x = input(batch);
    expect_shape(x, opt_.batch_size, in_, "the input", batch);
    return x;
  }

  /// Forward of this step's batch on the last stage, the loss, backward and update, the input
  /// gradient sent up.
  template <class Loss>
  void last_stage(long f, const tensor_type& in, Loss& loss, PipelineReport& report, long step) {
    tensor_type og;
    guarded(f, step, report.forward_seconds, [&] {
      const tensor_type out = forward(f, in);
      og = loss(f, out);
      expect_shape(og, opt_.batch_size, out_, "the loss gradient", f);
    });
    backward(f, og, send_grad_[step & 1], report, step);
    if (index_ > 0) post_send(send_grad_[step & 1], index_ - 1, kGradientTag);
  }

  template <class Input, class Loss>
  void fdg_step(long t, long batches, Input& input, Loss& loss, PipelineReport& report) {
    finish_step(report);  // the previous step's messages and status
    const int k = index_;
    const bool last = k + 1 == stages_;
    auto valid = [&](long b) { return b >= 0 && b < batches; };
    const long f = FdgSchedule::forward_batch(k, t), b = FdgSchedule::backward_batch(k, stages_, t);
    // What the next step consumes, produced by the neighbours during this one.
    if (k > 0 && valid(FdgSchedule::forward_batch(k, t + 1)))
      post_recv(recv_act_[(t + 1) & 1], k - 1, kActivationTag);
    if (!last && valid(FdgSchedule::backward_batch(k, stages_, t + 1)))
      post_recv(recv_grad_[(t + 1) & 1], k + 1, kGradientTag);
    // Back-propagation and update of the delayed batch (stages below the last).
    auto update = [&] {
      if (last || !valid(b)) return;
      backward(b, recv_grad_[t & 1], send_grad_[t & 1], report, t);
      if (k > 0) post_send(send_grad_[t & 1], k - 1, kGradientTag);
    };
    const bool update_first = opt_.update_order == FdgUpdateOrder::update_then_forward;
    if (update_first) update();
    if (valid(f)) {
      tensor_type in = k > 0 ? recv_act_[t & 1] : tensor_type();
      if (last) {
        if (k == 0) guarded(f, t, report.forward_seconds, [&] { in = stage_input(f, input); });
        last_stage(f, in, loss, report, t);
      } else {
        guarded(f, t, report.forward_seconds, [&] {
          if (k == 0) in = stage_input(f, input);
          Kokkos::deep_copy(send_act_[t & 1], forward(f, in));
        });
        post_send(send_act_[t & 1], k + 1, kActivationTag);  // also after a failure: k + 1 waits for it
      }
    }
    if (!update_first) update();
    post_status();
  }

  /// Model-parallel back-propagation of batch t: down the stages, the loss, up the stages.
  template <class Input, class Loss>
  void synchronous_step(long t, Input& input, Loss& loss, PipelineReport& report) {
    finish_step(report);
    const int k = index_;
    const bool last = k + 1 == stages_;
    tensor_type in;
    if (k > 0) {
      post_recv(recv_act_[0], k - 1, kActivationTag);
      wait_all(report);
      in = recv_act_[0];
    } else {
      guarded(t, t, report.forward_seconds, [&] { in = stage_input(t, input); });
    }
    if (last) {
      last_stage(t, in, loss, report, t);
    } else {
      guarded(t, t, report.forward_seconds, [&] { Kokkos::deep_copy(send_act_[0], forward(t, in)); });
      post_send(send_act_[0], k + 1, kActivationTag);
      post_recv(recv_grad_[0], k + 1, kGradientTag);
      wait_all(report);
      backward(t, recv_grad_[0], send_grad_[0], report, t);
      if (k > 0) post_send(send_grad_[0], k - 1, kGradientTag);
    }
    post_status();
  }

  MpiComm comm_;  ///< its watchdog waits for every request
  Stage* stage_;
  PipelineOptions opt_;
  int stages_ = 1, index_ = -1, in_ = 0, out_ = 0;
  MpiComm::Group group_;
  tensor_type recv_act_[2], send_act_[2], recv_grad_[2], send_grad_[2];
  std::deque<std::pair<long, tensor_type>> stash_;  ///< inputs of batches in flight, oldest first
  std::vector<tensor_type> pool_;                    ///< stash buffers free for reuse
  impl::StartedCollectives<MpiComm::Request> transfers_;  ///< this step's transfers and status
  long status_out_ = 0, status_in_ = 0;
  bool status_posted_ = false, failed_ = false;
  std::string error_;
};

}  // namespace kfac
