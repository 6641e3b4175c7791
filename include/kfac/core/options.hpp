#pragma once
/// \file options.hpp
/// \brief Hyperparameters of the Preconditioner, each a constant or a function of the step.

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kfac/core/comm_precision.hpp"
#include "kfac/error.hpp"

namespace kfac {
/// \brief The cost a greedy assignment balances.
enum class AssignmentCost { compute, memory };

/// \brief How KAISA's rank grid is laid out: worker groups (the gw ranks that share a layer's
/// decompositions, every inv_update_steps) and receiver groups (one member of every worker
/// group; they share preconditioned gradients every step under HYBRID/MEM-OPT).
///
/// `contiguous_receivers` (default, as kfac-pytorch): receiver group j is the consecutive ranks
/// j W/gw ... (j+1) W/gw - 1 and worker groups are strided, so with node-major rank numbering the
/// every-step gradient broadcasts stay inside a node and only the rarer decomposition broadcasts
/// cross nodes. `contiguous_workers` (kfac 0.1): worker groups are consecutive ranks.
enum class GroupLayout { contiguous_receivers, contiguous_workers };
}  // namespace kfac

namespace kfac {

/// \brief How the host framework reduced the loss over the batch.
///
/// With a mean-reduced loss the output gradients a layer sees are 1/batch of the per-sample
/// gradients, so G computed from them would be batch^2 too small, and a fixed damping would
/// then dominate it (K-FAC silently degrades to clipped SGD). kfac multiplies output gradients
/// by the batch size before forming G when the reduction is `mean`, so that G is the Fisher
/// factor of per-sample gradients either way.
enum class LossReduction { mean, sum };

/// \brief What a layer's running factors start from.
///
/// `batch` (kfac's default): the first statistics update sets each factor to its batch estimate.
/// `identity` (kfac-pytorch's): factors start at the identity, so the first update gives
/// decay I + (1 - decay) (batch estimate), and later ones average as usual. Blocks whose
/// statistics are not Kronecker factors (BatchNorm2d's unit-wise Fisher, NG-SGD) start from
/// their first batch either way.
enum class InitialFactors { batch, identity };

/// \brief What happens when observations or gradients contain NaN/Inf.
///
/// `raise`: observe_* throws kfac::Error at once, on the rank that saw it (single-process use).
/// `skip`: the value is recorded, and step() decides globally (one small collective): if any rank
/// saw a non-finite observation or gradient, every rank skips the whole K-FAC update of that step
/// (factors and decompositions keep their last good values, gradients are left as given) and
/// counts it in Preconditioner::skipped_steps().
enum class NonFinitePolicy { raise, skip };

/// \brief A hyperparameter: a constant, or a function of the optimizer step (0-based).
template <class T>
class Hyperparameter {
 public:
  Hyperparameter(T value) : fn_([value](long) { return value; }) {}  // NOLINT: implicit by design
  Hyperparameter(std::function<T(long)> fn) : fn_(std::move(fn)) {}  // NOLINT
  template <class F, class = std::enable_if_t<std::is_invocable_r<T, F, long>::value &&
                                              !std::is_convertible<F, T>::value>>
  Hyperparameter(F fn) : fn_(std::function<T(long)>(std::move(fn))) {}  // NOLINT
  T operator()(long step) const { return fn_(step); }

 private:
  std::function<T(long)> fn_;
};

/// \brief Ready-made schedules.
namespace schedules {
/// \brief Stale-Fisher schedule (after Osawa et al. 2019): the interval between updates starts
/// at `first` steps and doubles every `double_every` steps, up to `max_interval`.
/// Factors change fast early in training and slowly later, so later updates can be sparser.
inline std::function<long(long)> stale_fisher(long first, long max_interval, long double_every) {
  if (first < 1 || max_interval < first || double_every < 1)
    throw Error("", "stale_fisher: expected 1 <= first <= max_interval and double_every >= 1");
  return [=](long step) {
    long interval = first;
    for (long s = double_every; s <= step && interval < max_interval; s += double_every)
      interval *= 2;
    return interval < max_interval ? interval : max_interval;
  };
}
/// \brief Step decay: `value * factor^(step / every)`.
inline std::function<double(long)> step_decay(double value, double factor, long every) {
  if (every < 1) throw Error("", "step_decay: every = " + std::to_string(every) + ": expected an interval >= 1");
  if (!(factor > 0) || !std::isfinite(factor) || !std::isfinite(value))
    throw Error("", "step_decay: expected a finite value and a finite factor > 0");
  return [=](long step) { return value * std::pow(factor, double(step / every)); };
}
}  // namespace schedules

/// \brief All Preconditioner settings, built with `with_*` calls.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | double | lr | learning rate used by KL clipping | 0.1 |
/// | double | damping | Tikhonov damping added to the Kronecker product | 0.001 |
/// | double | factor_decay | running-average weight of the old factor, in [0, 1) ([0, 1] from the identity) | 0.95 |
/// | double | kl_clip | KL-clip bound; 0 disables clipping | 0.001 |
/// | long | factor_update_steps | interval between factor updates | 1 |
/// | long | inv_update_steps | interval between decompositions | 10 |
/// | LossReduction | loss_reduction | how the loss was reduced over the batch | mean |
/// | InitialFactors | initial_factors | what Kronecker factors start from: the first batch, or the identity (kfac-pytorch) | batch |
/// | bool | precompute_reciprocal | store 1/(lambda_G lambda_A^T + damping) at decomposition time | false |
/// | vector<string> | skip_layers | layer names or kinds ("dense", "conv2d", "batch_norm") left unpreconditioned | {} |
/// | double | grad_worker_fraction | KAISA gradient-worker fraction f in [1/world, 1] (1 = COMM-OPT). This row and the distribution rows below (assignment_cost to split_preconditioning, comm_precision, background_sharing, overlap_communication) are kfac 0.2's spelling of kfac::Kaisa's settings, read only when the Preconditioner is given no policy object | 1.0 |
/// | AssignmentCost | assignment_cost | what greedy placement balances: compute (n^3) or memory (n^2) | compute |
/// | bool | colocate_factors | decompose a layer's A and G on the same rank | true |
/// | GroupLayout | group_layout | which KAISA groups are consecutive ranks | contiguous_receivers |
/// | size_t | bucket_bytes | upper bound of one factor-averaging collective's payload | 16 MiB |
/// | bool | reduce_to_owner | reduce each decomposed factor only to the rank that decomposes it (MPI_Reduce), not to every rank; halves the factor bytes; save() becomes collective | false |
/// | bool | split_preconditioning | divide each layer's preconditioning among the ranks that hold its decompositions (its gradient workers; every rank under COMM-OPT): each computes a block of the output's rows, then they all-gather them (explicit inverses: one all-gather; eigen: two) | false |
/// | CommPrecision | comm_precision | payload type of factor averaging | native |
/// | NonFinitePolicy | nonfinite | raise at once, or skip the step on every rank | raise |
/// | int | max_damping_retries | decomposition failures retried with more damping | 3 |
/// | double | damping_retry_factor | damping multiplier of each retry (> 1) | 10 |
/// | long | decomposition_delay | d: a decomposition due at step s is computed from the statistics of step s (on a second host thread where the backend allows it) and used from step s + d; 0 = at once; at most every layer's inv_update_steps | 0 |
/// | bool | background_sharing | with decomposition_delay, a decomposition computed on a second thread is also broadcast from it to the layer's other holders as soon as it is done, not at step s + d (needs MPI_THREAD_MULTIPLE on every rank and host memory; otherwise the broadcast stays at step s + d) | true |
/// | bool | overlap_communication | collectives of a step run as nonblocking ones overlapped with its computation: factor sums with the preconditioning on steps that decompose nothing, each layer's preconditioned-gradient broadcast and split-preconditioning all-gather with the next layer's work (kfac::MpiComm, host memory or a CUDA-aware communicator; the same bits and bytes as the blocking collectives) | true |
struct Options {
  Hyperparameter<double> lr{0.1};
  Hyperparameter<double> damping{0.001};
  Hyperparameter<double> factor_decay{0.95};
  Hyperparameter<double> kl_clip{0.001};
  Hyperparameter<long> factor_update_steps{1L};
  Hyperparameter<long> inv_update_steps{10L};
  LossReduction loss_reduction = LossReduction::mean;
  InitialFactors initial_factors = InitialFactors::batch;
  bool precompute_reciprocal = false;
  std::vector<std::string> skip_layers;
  double grad_worker_fraction = 1.0;
  AssignmentCost assignment_cost = AssignmentCost::compute;
  bool colocate_factors = true;
  GroupLayout group_layout = GroupLayout::contiguous_receivers;
  std::size_t bucket_bytes = std::size_t(16) << 20;
  bool reduce_to_owner = false;
  bool split_preconditioning = false;
  CommPrecision comm_precision = CommPrecision::native;
  NonFinitePolicy nonfinite = NonFinitePolicy::raise;
  int max_damping_retries = 3;
  double damping_retry_factor = 10.0;
  long decomposition_delay = 0;
  bool background_sharing = true;
  bool overlap_communication = true;

  Options& with_lr(Hyperparameter<double> v) { lr = std::move(v); return *this; }
  Options& with_damping(Hyperparameter<double> v) { damping = std::move(v); return *this; }
  Options& with_factor_decay(Hyperparameter<double> v) { factor_decay = std::move(v); return *this; }
  Options& with_kl_clip(Hyperparameter<double> v) { kl_clip = std::move(v); return *this; }
  Options& with_factor_update_steps(Hyperparameter<long> v) { factor_update_steps = std::move(v); return *this; }
  Options& with_inv_update_steps(Hyperparameter<long> v) { inv_update_steps = std::move(v); return *this; }
  Options& with_loss_reduction(LossReduction r) { loss_reduction = r; return *this; }
  Options& with_initial_factors(InitialFactors f) { initial_factors = f; return *this; }
  Options& with_precompute_reciprocal(bool b) { precompute_reciprocal = b; return *this; }
  Options& with_skip_layers(std::vector<std::string> names) { skip_layers = std::move(names); return *this; }
  Options& with_grad_worker_fraction(double f) { grad_worker_fraction = f; return *this; }
  Options& with_assignment_cost(AssignmentCost c) { assignment_cost = c; return *this; }
  Options& with_colocate_factors(bool b) { colocate_factors = b; return *this; }
  Options& with_group_layout(GroupLayout g) { group_layout = g; return *this; }
  Options& with_bucket_bytes(std::size_t b) { bucket_bytes = b; return *this; }
  Options& with_reduce_to_owner(bool b) { reduce_to_owner = b; return *this; }
  Options& with_split_preconditioning(bool b) { split_preconditioning = b; return *this; }
  Options& with_comm_precision(CommPrecision p) { comm_precision = p; return *this; }
  Options& with_nonfinite_policy(NonFinitePolicy p) { nonfinite = p; return *this; }
  Options& with_max_damping_retries(int n) { max_damping_retries = n; return *this; }
  Options& with_decomposition_delay(long d) {
    if (d < 0) throw Error("", "decomposition_delay: expected a number of steps >= 0");
    decomposition_delay = d;
    return *this;
  }
  Options& with_background_sharing(bool b) { background_sharing = b; return *this; }
  Options& with_overlap_communication(bool b) { overlap_communication = b; return *this; }
  Options& with_damping_retry_factor(double f) {
    if (!(f > 1) || !std::isfinite(f)) throw Error("", "damping_retry_factor: expected a finite value > 1");
    damping_retry_factor = f;
    return *this;
  }
};

/// \brief The hyperparameter values in force at one step, checked.
struct StepValues {
  double lr, damping, factor_decay, kl_clip;
  long factor_update_steps, inv_update_steps;

  static StepValues at(const Options& o, long step) {
    StepValues v{o.lr(step), o.damping(step), o.factor_decay(step), o.kl_clip(step),
                 o.factor_update_steps(step), o.inv_update_steps(step)};
    auto bad = [&](const char* name, double x, const char* want) {
      throw Error("", std::string(name) + " = " + std::to_string(x) + " at step " +
                          std::to_string(step) + ": expected " + want);
    };
    if (!(v.lr > 0) || !std::isfinite(v.lr)) bad("lr", v.lr, "a finite value > 0");
    if (!(v.damping > 0) || !std::isfinite(v.damping)) bad("damping", v.damping, "a finite value > 0");
    // From the identity, decay 1 keeps the factors at I (kfac-pytorch allows it); from the batch it
    // would keep the first batch's forever.
    const bool from_identity = o.initial_factors == InitialFactors::identity;
    if (from_identity ? !(v.factor_decay >= 0 && v.factor_decay <= 1) : !(v.factor_decay >= 0 && v.factor_decay < 1))
      bad("factor_decay", v.factor_decay, from_identity ? "a value in [0, 1] (factors from the identity)" : "a value in [0, 1)");
    if (!(v.kl_clip >= 0) || !std::isfinite(v.kl_clip)) bad("kl_clip", v.kl_clip, "a finite value >= 0");
    if (v.factor_update_steps < 1) bad("factor_update_steps", double(v.factor_update_steps), "an interval >= 1");
    if (v.inv_update_steps < 1) bad("inv_update_steps", double(v.inv_update_steps), "an interval >= 1");
    return v;
  }
};

}  // namespace kfac
