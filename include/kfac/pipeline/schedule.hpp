#pragma once
/// \file schedule.hpp
/// \brief Which batch each stage of a K-stage FDG pipeline forwards and back-propagates at each
/// step, and how much the gradient it applies is shrunk (docs/pipeline.md has the table).
///
/// At step t batch t enters stage 0. Stage k forwards batch t - k (its input was produced by
/// stage k - 1 one step earlier) and back-propagates batch t - 2(K - 1) + k (the gradient was
/// produced by stage k + 1 one step earlier): the gradient stage k applies at step t belongs to
/// a batch it forwarded 2(K - k - 1) steps earlier, the delay of Zhuang et al. (2019). Every
/// message is consumed one step after it is sent, so no stage waits on work of the same step.
///
/// Within a step, a stage below the last either back-propagates and updates before it forwards
/// (the authors' code, ZHUANGHP/FDG `TrainDg`: zero_grad, backward, step, then forward; the
/// default) or forwards first (kfac 0.1's order). The batches are the same; what differs is the
/// weights the forward sees, hence how many updates a gradient is stale by (staleness()).

#include <cmath>

namespace kfac {

/// \brief What a stage below the last does first within an FDG step.
/// `update_then_forward`: back-propagate the delayed batch, update, then forward the new batch
/// with the updated weights (Zhuang et al.'s code; default). `forward_then_update`: forward the
/// new batch, then back-propagate and update (kfac 0.1.0); every such stage's gradient is one
/// update staler. The last stage forwards, back-propagates and updates the same batch in either.
enum class FdgUpdateOrder { update_then_forward, forward_then_update };

struct FdgSchedule {
  /// Steps of the stage k of a K-stage pipeline between the forward of a batch and the
  /// update with its gradient: 2(K - k - 1).
  static long delay(int k, int stages) { return 2L * (stages - k - 1); }
  /// Batch that stage k forwards at step t (may be outside [0, batches): then none).
  static long forward_batch(int k, long t) { return t - k; }
  /// Batch whose gradient stage k back-propagates and applies at step t.
  static long backward_batch(int k, int stages, long t) { return t - 2L * (stages - 1) + k; }
  /// Steps of an epoch of `batches` batches, the drain included: batches + 2(K - 1).
  static long steps(long batches, int stages) { return batches + 2L * (stages - 1); }
  /// Updates of stage k between the forward of a batch and the update with that batch's
  /// gradient, once the pipeline is full: 2(K - k - 1) - 1 with `update_then_forward` below the
  /// last stage (the update of the forward's own step comes before it), 2(K - k - 1) with
  /// `forward_then_update`, 0 on the last stage. During the fill fewer updates intervene.
  static long staleness(int k, int stages, FdgUpdateOrder order = FdgUpdateOrder::update_then_forward) {
    return k + 1 < stages && order == FdgUpdateOrder::update_then_forward ? delay(k, stages) - 1 : delay(k, stages);
  }
  /// Inputs stage k keeps in flight at most: its delay below the last stage under
  /// `update_then_forward` (a batch leaves before the next arrives), otherwise delay + 1.
  static long stash_depth(int k, int stages, FdgUpdateOrder order = FdgUpdateOrder::update_then_forward) {
    return staleness(k, stages, order) + 1;
  }
  /// Factor on the gradient that stage k applies, relative to exact back-propagation through
  /// the shrunk pipeline: each stage k < K - 1 multiplies the output gradient it receives by
  /// beta before its own backward, so the factors compound to beta^(K - 1 - k).
  static double gradient_scale(int k, int stages, double beta) { return std::pow(beta, stages - 1 - k); }
};

}  // namespace kfac
