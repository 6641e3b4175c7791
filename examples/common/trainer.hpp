#pragma once
/// \file trainer.hpp
/// \brief One model, one optimizer and one training set: the step that the demo times and the
/// tests repeat.

#include "common/adam.hpp"
#include "common/cross_entropy.hpp"
#include "common/dataset.hpp"
#include "common/kfac_glue.hpp"
#include "common/network.hpp"
#include "common/ngsgd_glue.hpp"
#include "common/parameter_averaging.hpp"
#include "common/sgd.hpp"
#include "common/world.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace nn {

enum class OptimizerKind { sgd, adam, kfac, ngsgd };

inline const char* to_string(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::sgd: return "sgd";
    case OptimizerKind::adam: return "adam";
    case OptimizerKind::kfac: return "kfac";
    case OptimizerKind::ngsgd: return "ngsgd";
  }
  return "?";
}

inline OptimizerKind parse_optimizer(const std::string& s) {
  if (s == "sgd") return OptimizerKind::sgd;
  if (s == "adam") return OptimizerKind::adam;
  if (s == "kfac") return OptimizerKind::kfac;
  if (s == "ngsgd") return OptimizerKind::ngsgd;
  throw std::invalid_argument("unknown optimizer '" + s + "' (expected sgd, adam, kfac, ngsgd or all)");
}

/// \brief Learning rates used when none is given, per model. MLP: the best of the sweep in
/// docs/fashion_mnist.md (mean time to 88% test accuracy over 3 seeds); CNN: not swept.
inline double default_lr(OptimizerKind k, const std::string& model = "mlp") {
  const bool cnn = model == "cnn";
  switch (k) {
    case OptimizerKind::sgd: return 0.05;
    case OptimizerKind::adam: return cnn ? 1e-3 : 2e-3;
    case OptimizerKind::kfac: return cnn ? 0.05 : 0.1;
    case OptimizerKind::ngsgd: return 0.05;
  }
  return 0.0;
}

/// \brief K-FAC settings used unless overridden, per model (docs/fashion_mnist.md has the sweeps):
/// the MLP uses randomized rank-32 factors (kfac::RandomizedEigen) with each factor damped by
/// √damping, the form of the damped Cholesky inverses its damping 0.3 and kl_clip 1e-2 were tuned
/// with (scripts/time_to_accuracy.sh measured it faster to 88% than those exact inverses, at the
/// same final accuracy); the CNN the eigendecomposition, damping 0.1 and kl_clip 1e-3. Both
/// update factors every 10 steps and decompose every 100.
inline KfacSettings default_kfac(const std::string& model) {
  KfacSettings k;
  if (model == "mlp") {
    k.inverse = "randomized";
    k.rank = 32;
    k.factored_damping = true;
    k.damping = 0.3;
    k.kl_clip = 1e-2;
  }
  return k;
}

/// | type | name | description | default |
/// |---|---|---|---|
/// | string | model | "mlp" or "cnn" | mlp |
/// | OptimizerKind | optimizer | sgd, adam or kfac | sgd |
/// | int | batch | samples per step | 256 |
/// | uint64 | seed | initialisation and shuffling | 1 |
/// | double | lr | learning rate; 0 picks default_lr(optimizer) | 0 |
/// | double | momentum | SGD and K-FAC momentum | 0.9 |
/// | double | weight_decay | L2 on weights, every optimizer | 0 |
/// | KfacSettings | kfac | K-FAC settings (its lr and momentum are overridden by the above) | default_kfac("mlp") |
/// | NgsgdSettings | ngsgd | NG-SGD settings (lr, momentum, weight decay overridden as for K-FAC) | Kaldi's |
/// | long | average_every | 0: synchronous data-parallel; N: each rank on its own shard, parameters averaged every N steps (sgd, ngsgd) | 0 |
/// | bool | average_momentum | average the SGD momentum buffers with the parameters (docs/parameter_averaging.md) | false |
/// | RecipeSettings | recipe | name "none", or "large-batch": K-FAC under kfac::recipes::large_batch, SGD and Adam with its learning-rate plan (linear scaling from batch 256, warm-up, decay); `lr` is then the rate at batch 256 (its batch, steps per epoch and epochs are set here) | none |
/// | double | epochs | length of training, for the recipe's decay | 8 |
/// | (in kfac) | kfac.adaptive | self-tuned K-FAC: kfac::SelfTuning sets step, momentum, damping (lr 1) | false |
struct TrainSettings {
  std::string model = "mlp";
  OptimizerKind optimizer = OptimizerKind::sgd;
  int batch = 256;
  std::uint64_t seed = 1;
  double lr = 0.0;
  double momentum = 0.9;
  double weight_decay = 0.0;
  KfacSettings kfac = default_kfac("mlp");
  NgsgdSettings ngsgd;
  long average_every = 0;
  bool average_momentum = false;
  RecipeSettings recipe;
  double epochs = 8;
};

class Trainer {
 public:
  /// \param train [in] kept by reference-counted views; the caller may drop its copy
  /// \param world [in] one process, or the ranks of a data-parallel run: each trains on its
  ///   slice of every global batch of `s.batch` samples (see world.hpp)
  Trainer(const Dataset& train, const TrainSettings& s, const World& world = World())
      : settings_(s), world_(world), net_(make_model(s.model, s.seed)),
        batcher_(make_batcher(train, s, world)), sync_(net_, s.average_every > 0 ? World() : world),
        rule_(make_rule(net_, s, world, batcher_)) {
    if (s.recipe.name != "none" && s.recipe.name != "large-batch")
      throw std::invalid_argument("unknown recipe '" + s.recipe.name + "' (expected none or large-batch)");
    if (s.recipe.name == "large-batch") {
      if (s.average_every > 0 || s.optimizer == OptimizerKind::ngsgd)
        throw std::invalid_argument("--recipe large-batch: synchronous sgd, adam or kfac only");
      if (s.optimizer != OptimizerKind::kfac) lr_ = first_order_lr(recipe_for(s, batcher_), lr());
    }
    if (s.average_every > 0) {
      if (s.optimizer != OptimizerKind::sgd && s.optimizer != OptimizerKind::ngsgd)
        throw std::invalid_argument("--average-every: only sgd and ngsgd train with parameter averaging");
      const Sgd& sgd = std::holds_alternative<Sgd>(rule_) ? std::get<Sgd>(rule_) : std::get<NgsgdSgd>(rule_).sgd();
      averaging_ = std::make_unique<ParameterAveraging>(
          net_.params(), s.average_momentum ? sgd.velocity() : std::vector<Vector>{}, s.average_every, world);
    } else if (s.optimizer == OptimizerKind::ngsgd && world.size() > 1) {
      throw std::invalid_argument("ngsgd on several ranks needs --average-every N (its estimates are per rank)");
    }
    gradient_bytes_ = s.average_every > 0 ? 0 : gradient_bytes_per_step(net_, world);
  }

  /// \brief Reshuffles for `epoch` (0-based); every epoch starts with this.
  void start_epoch(int epoch) { batcher_.start_epoch(epoch); }
  int steps_per_epoch() const { return batcher_.steps_per_epoch(); }
  /// \brief Samples per step over all ranks (averaging mode: P local batches).
  int batch_size() const { return batcher_.batch_size() * (settings_.average_every > 0 ? world_.size() : 1); }

  /// \brief One training step on batch `step` of the current epoch; returns once the device is
  /// done, so that a host clock around it measures the step. The statistics are of the whole
  /// global batch (summed over the ranks).
  BatchStats step(int step) {
    const Batch b = batcher_.get(step);
    const Tensor logits = net_.forward(b.x, Mode::train);
    BatchStats stats = loss_.forward_backward(logits, b.y);
    if (auto* kfac = std::get_if<KfacSgd>(&rule_)) kfac->observe_sampled(net_, logits, loss_);  // --fisher sampled
    net_.backward(loss_.grad());
    sync_.average();
    if (auto* sgd = std::get_if<Sgd>(&rule_)) {
      if (lr_) sgd->set_lr(lr_(steps_taken_));
      sgd->step();
    }
    if (auto* adam = std::get_if<Adam>(&rule_)) {
      if (lr_) adam->set_lr(lr_(steps_taken_));
      adam->step();
    }
    if (auto* kfac = std::get_if<KfacSgd>(&rule_)) {
#if KFAC_EXAMPLES_HAVE_KFAC
      if (settings_.kfac.adaptive) {
        auto after = [&] { return loss_.forward(net_.forward(b.x, Mode::probe), b.y).mean_loss(); };
        kfac->step_adaptive(net_, AdaptiveLoss{loss_curvature(loss_), logits, stats.mean_loss(), after});
      } else {
        kfac->step(net_);
      }
#else
      kfac->step(net_);
#endif
    }
    if (auto* ngsgd = std::get_if<NgsgdSgd>(&rule_)) ngsgd->step(net_);
    Kokkos::fence();
    just_averaged_ = averaging_ && averaging_->after_step(steps_taken_);
    ++steps_taken_;
    if (world_.size() > 1) {
      std::vector<double> v{stats.loss_sum, double(stats.correct), double(stats.count)};
      world_.sum(v);
      stats.loss_sum = v[0];
      stats.correct = long(v[1]);
      stats.count = long(v[2]);
    }
    return stats;
  }

  /// \brief Loss and accuracy on a whole dataset in evaluation mode (running BN statistics).
  BatchStats evaluate(const Dataset& data, int batch = 500) {
    BatchStats total;
    for (int begin = 0; begin < data.size(); begin += batch) {
      const int end = begin + batch < data.size() ? begin + batch : data.size();
      const Batch b = slice(data, begin, end);
      total += loss_.forward(net_.forward(b.x, Mode::eval), b.y);
    }
    return total;
  }

  /// \brief Averaging mode: averages now (e.g. after the last step, so that the final model is
  /// the average). Returns whether it did: false in the synchronous mode or right after an average.
  bool average_now() {
    if (!averaging_ || just_averaged_) return false;
    averaging_->average_now();
    just_averaged_ = true;
    return true;
  }
  /// \brief Averaging mode: whether the last step ended with an average (all ranks agree).
  bool just_averaged() const { return just_averaged_; }
  const ParameterAveraging* averaging() const { return averaging_.get(); }
  /// \brief Bytes this rank sent so far: the parameter averager's in averaging mode; in the
  /// synchronous mode the gradient averaging's (measured per step, times the steps taken) plus
  /// NG-SGD's (0) or K-FAC's (factors, decompositions, preconditioned gradients).
  std::size_t bytes_sent() const {
    std::size_t b = averaging_ ? averaging_->bytes_sent() : gradient_bytes_ * std::size_t(steps_taken_);
    if (auto* ngsgd = std::get_if<NgsgdSgd>(&rule_)) b += ngsgd->bytes_sent();
    if (auto* kfac = std::get_if<KfacSgd>(&rule_)) b += kfac->bytes_sent();
    return b;
  }

  Network& network() { return net_; }
  /// \brief The K-FAC rule, or null under another optimizer.
  const KfacSgd* kfac() const { return std::get_if<KfacSgd>(&rule_); }
  const TrainSettings& settings() const { return settings_; }
  /// \brief The learning rate; self-tuned K-FAC: 1 (its update is applied as solved).
  double lr() const {
    if (settings_.optimizer == OptimizerKind::kfac && settings_.kfac.adaptive) return 1.0;
    return settings_.lr > 0 ? settings_.lr : default_lr(settings_.optimizer, settings_.model);
  }

 private:
  using Rule = std::variant<Sgd, Adam, KfacSgd, NgsgdSgd>;

  /// Synchronous mode: every rank its slice of the same global batch. Averaging mode: every rank
  /// its own shard, batches of batch / P from it (the same samples per step over all ranks).
  static Batcher make_batcher(const Dataset& train, const TrainSettings& s, const World& world) {
    if (s.average_every == 0) return Batcher(train, s.batch, derive_seed(s.seed, 3), world.rank(), world.size());
    if (s.batch % world.size() != 0)
      throw std::invalid_argument("nn::Trainer: the batch (" + std::to_string(s.batch) + ") must split evenly over " +
                                  std::to_string(world.size()) + " processes");
    return Batcher(shard(train, world.rank(), world.size()), s.batch / world.size(), derive_seed(s.seed, 3));
  }

  /// The recipe's settings with this run's batch (over all ranks; at most the training set),
  /// steps per epoch and length.
  static RecipeSettings recipe_for(const TrainSettings& s, const Batcher& batches) {
    RecipeSettings r = s.recipe;
    r.batch = batches.batch_size();
    r.steps_per_epoch = batches.steps_per_epoch();
    r.epochs = s.epochs;
    return r;
  }

  static Rule make_rule(Network& net, const TrainSettings& s, const World& world, const Batcher& batches) {
    const double lr = s.lr > 0 ? s.lr : default_lr(s.optimizer, s.model);
    switch (s.optimizer) {
      case OptimizerKind::sgd:
        return Sgd(net.params(), SgdOptions{}.with_lr(lr).with_momentum(s.momentum).with_weight_decay(s.weight_decay));
      case OptimizerKind::adam:
        return Adam(net.params(), AdamOptions{}.with_lr(lr).with_weight_decay(s.weight_decay));
      case OptimizerKind::kfac: {
        KfacSettings k = s.kfac;
        k.lr = lr;
        k.momentum = s.momentum;
        k.weight_decay = s.weight_decay;
        k.recipe = recipe_for(s, batches);
        k.fisher_seed = s.seed;
        return KfacSgd(net, k, world);
      }
      case OptimizerKind::ngsgd: {
        NgsgdSettings g = s.ngsgd;
        g.lr = lr;
        g.momentum = s.momentum;
        g.weight_decay = s.weight_decay;
        return NgsgdSgd(net, g, world);
      }
    }
    throw std::logic_error("unreachable");
  }

  TrainSettings settings_;
  World world_;
  Network net_;
  Batcher batcher_;
  GradientSync sync_;
  SoftmaxCrossEntropy loss_;
  Rule rule_;
  std::unique_ptr<ParameterAveraging> averaging_;
  std::size_t gradient_bytes_ = 0;
  std::function<double(long)> lr_;  ///< SGD's or Adam's scheduled rate (--recipe); empty: constant
  long steps_taken_ = 0;
  bool just_averaged_ = false;
};

}  // namespace nn
