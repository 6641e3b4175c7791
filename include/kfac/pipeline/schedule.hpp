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

#include <cmath>

namespace kfac {

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
  /// Inputs stage k keeps in flight at most: its delay + 1.
  static long stash_depth(int k, int stages) { return delay(k, stages) + 1; }
  /// Factor on the gradient that stage k applies, relative to exact back-propagation through
  /// the shrunk pipeline: each stage k < K - 1 multiplies the output gradient it receives by
  /// beta before its own backward, so the factors compound to beta^(K - 1 - k).
  static double gradient_scale(int k, int stages, double beta) { return std::pow(beta, stages - 1 - k); }
};

}  // namespace kfac
