/// \file main.cpp
/// \brief Fashion-MNIST demo: trains one small network with SGD, Adam and K-FAC from the same
/// initialisation and batch order, and compares test accuracy against training wall time, over
/// several seeds and learning rates if asked, single-process or data-parallel under mpiexec.
///
/// Wall time counts training steps only; test-set evaluations (several per epoch) are excluded
/// from it, so optimizers are compared on the work that produces the model.
///
/// On the MLP a step is a few small GEMMs, and K-FAC's own work (products with fc1's 785x785 and
/// 256x256 factors, every step) costs about as much again as the step; on the CNN a step costs
/// far more, K-FAC adds little to it, and reaches a given accuracy in fewer steps.

#include "common/command_line.hpp"
#include "common/trainer.hpp"
#include "common/world.hpp"
#include "fashion_mnist/report.hpp"

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

// OpenBLAS's thread control. Weak, so the demo still links against another BLAS.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

struct Args {
  std::string optimizer = "all";
  nn::TrainSettings train;
  int epochs = 8;
  int threads = 0;
  std::string out = "results";
  std::string data = "/usr/share/datasets/fashion-mnist";
  int train_subset = 0;
  int test_subset = 0;
  int eval_every = 0;  ///< 0: 4 times per epoch
  double target_acc = 0.88;
  bool stop_at_target = false;  ///< end a run at its first evaluation at or above target_acc
  bool append = false;
  bool help = false;  ///< -h or --help: print the usage and exit 0 (MPI finalised as usual)
  std::vector<std::uint64_t> seeds{1, 2, 3};
  std::map<std::string, std::vector<double>> lrs;  ///< per optimizer; empty: its default
  std::string model_figures = "measured";  ///< the cost-model line's machine figures: measured | defaults
  nn::ModelFigures figures;                ///< what run() measured (or the defaults)
};

void usage() {
  std::printf(
      "usage: fashion_mnist [options]        (data-parallel: mpiexec -n P fashion_mnist [options])\n"
      "  --optimizer sgd|adam|kfac|ngsgd|all   optimizers to run (comma list), from the same start\n"
      "                                  (default all = sgd,adam,kfac)\n"
      "  --model mlp|cnn                 784-256-256-10 MLP, or a 2-conv BatchNorm net (default mlp)\n"
      "  --epochs N                      epochs per run (default 8)\n"
      "  --batch N                       samples per step, over all processes (default 256)\n"
      "  --lr X[,Y...]                   learning rate(s) of every optimizer run\n"
      "  --lr-sgd L --lr-adam L --lr-kfac L --lr-ngsgd L   comma lists per optimizer (a learning-rate sweep)\n"
      "                                  (defaults: mlp sgd %g, adam %g, kfac %g; cnn sgd %g, adam %g, kfac %g; ngsgd %g)\n"
      "  --momentum X                    SGD / K-FAC momentum (default 0.9)\n"
      "  --weight-decay X                L2 on weights (default 0)\n"
      "  --damping X --kl-clip X --factor-decay X --factor-every N --inv-every N\n"
      "                                  K-FAC settings (mlp 0.3, 1e-2, 0.95, 10, 100; cnn 0.1, 1e-3, 0.95, 10, 100)\n"
      "  --inverse eigen|cholesky|randomized   K-FAC inversion of Dense/Conv2d factors (mlp randomized, cnn eigen);\n"
      "                                  randomized: the top --rank eigenpairs of each factor, the rest as their mean\n"
      "  --rank R                        eigenpairs kept per factor by --inverse randomized (default 32)\n"
      "  --factored-damping 0|1          --inverse randomized: damp each factor by sqrt(damping), the cholesky form\n"
      "                                  (mlp 1, cnn 0: the form each model's damping was tuned with)\n"
      "  --factor-precision float|half   K-FAC factors of Dense/Conv2d layers in float or binary16 (kfac::HalfPrecision,\n"
      "                                  Osawa et al.; decompositions in float; default float)\n"
      "  --strategy auto|comm-opt|hybrid|mem-opt   under mpiexec: KAISA's work assignment for K-FAC, i.e. the\n"
      "                                  gradient-worker fraction 1, 1/2 or 1/P; auto: the fraction, split preconditioning\n"
      "                                  and reduce-to-owner (unless given) the cost model predicts fastest (default auto)\n"
      "  --grad-worker-fraction F        the fraction itself, in [1/P, 1] (overrides --strategy)\n"
      "  --reduce-to-owner 0|1           under mpiexec: sum each K-FAC factor only to the rank that inverts it (default 0)\n"
      "  --split-preconditioning 0|1     under mpiexec: divide each layer's preconditioning among its gradient workers\n"
      "                                  by rows, then all-gather them (default 0)\n"
      "  --overlap-communication 0|1     under mpiexec: K-FAC's collectives as nonblocking ones overlapped with its\n"
      "                                  preconditioning (default 1; 0: blocking, the same bits)\n"
      "  --adaptive                      self-tuned K-FAC (kfac::SelfTuning, its defaults): step size, momentum and\n"
      "                                  damping from the exact curvature each step (R-op products), no lr, momentum,\n"
      "                                  damping or KL clip to choose: --damping, --kl-clip, --lr-kfac,\n"
      "                                  --damping-start and --kl-clip-power are refused, and --lr and --momentum\n"
      "                                  unless another optimizer runs too (they are its settings then); one process\n"
      "  --solve-every N                 with --adaptive: solve for the step size and momentum (two R-op passes)\n"
      "                                  every N steps after the first 10, using the solves' means in between\n"
      "                                  (kfac::Adaptive::solve_interval; default 1: every step, the paper's)\n"
      "  --fisher empirical|sampled      K-FAC's G from the output gradients at the data's labels, or at labels drawn\n"
      "                                  from the model's softmax (the true Fisher; one extra backward pass per draw\n"
      "                                  on factor steps; default empirical)\n"
      "  --fisher-samples N              --fisher sampled: labels drawn per sample on each factor step (default 1)\n"
      "  --model-figures measured|defaults   machine figures of the K-FAC cost-model line: measured at start-up\n"
      "                                  by kfac::measure_machine_figures (about 1.5 s), or kfac::MachineFigures'\n"
      "                                  defaults (default measured)\n"
      "  --decomposition-delay D         K-FAC decompositions used D steps after they fall due, computed meanwhile\n"
      "                                  (on a second thread on the Serial backend); 0 = at once (default 0)\n"
      "  --eigen-refresh T               eigen: refresh eigenvalues in the kept eigenbasis while the factor is\n"
      "                                  within relative distance T of it, else decompose exactly (default 0: always)\n"
      "  --ngsgd-period N --ngsgd-alpha X --ngsgd-rank R   NG-SGD settings (default 4, 4, 20; Kaldi's ranks:\n"
      "                                  --ngsgd-rank -1 = min(20|80, (d+1)/2))\n"
      "  --average-every N               under mpiexec: each rank trains on its own shard, parameters averaged\n"
      "                                  every N steps (sgd, ngsgd); 0 = synchronous data-parallel (default 0)\n"
      "  --average-momentum 0|1          also average the SGD momentum buffers (default 0)\n"
      "  --recipe none|large-batch       large-batch: K-FAC under kfac::recipes::large_batch (lr scaled with the\n"
      "                                  batch from 256, warmed up over 1/4 epoch (sgd, adam: 1), polynomial decay to the last\n"
      "                                  epoch, damping from min(10, batch/256)x down over 1 epoch, KL clip x batch/256,\n"
      "                                  factors and decompositions every step for 1 epoch, then every 2, 4, ...\n"
      "                                  steps up to half an epoch); SGD and Adam get the same lr plan (linear\n"
      "                                  scaling, warm-up, decay); --lr values are then rates at batch 256 (default none)\n"
      "  --warmup-epochs E --decay-power P --kl-clip-power Q --damping-start D --fresh-epochs F\n"
      "  --max-interval-epochs M         the recipe's settings (default kfac 0.25 and sgd/adam 1, 2, 1, min(10, batch/256)x --damping,\n"
      "                                  1, 0.5)\n"
      "  --seeds A,B,...                 seeds of initialisation and batch order (default 1,2,3)\n"
      "  --seed N                        one seed (same as --seeds N)\n"
      "  --threads N                     BLAS threads (default: leave OpenBLAS's choice)\n"
      "  --out DIR                       where log.csv and accuracy.png go (default results)\n"
      "  --append                        append to DIR/log.csv instead of starting it afresh\n"
      "  -h, --help                      this text\n"
      "  --data DIR                      Fashion-MNIST files (default /usr/share/datasets/fashion-mnist)\n"
      "  --train-subset N --test-subset N   use only the first N samples\n"
      "  --eval-every N                  evaluate every N steps and at epoch ends (default: mlp 20,\n"
      "                                  cnn 0 = 4 times per epoch)\n"
      "  --target-acc X                  accuracy for the time-to-target columns (default 0.88)\n"
      "  --stop-at-target 0|1            1: end each run at its first evaluation at or above --target-acc\n"
      "                                  (its time and epochs to target are those of the full run; default 0)\n",
      nn::default_lr(nn::OptimizerKind::sgd, "mlp"), nn::default_lr(nn::OptimizerKind::adam, "mlp"),
      nn::default_lr(nn::OptimizerKind::kfac, "mlp"), nn::default_lr(nn::OptimizerKind::sgd, "cnn"),
      nn::default_lr(nn::OptimizerKind::adam, "cnn"), nn::default_lr(nn::OptimizerKind::kfac, "cnn"),
      nn::default_lr(nn::OptimizerKind::ngsgd, "mlp"));
}

double to_number(const std::string& key, const std::string& value) {
  try {
    std::size_t used = 0;
    const double v = std::stod(value, &used);
    if (used != value.size()) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    throw std::invalid_argument(key + ": '" + value + "' is not a number");
  }
}

std::vector<double> to_numbers(const std::string& key, const std::string& value) {
  std::vector<double> v;
  std::stringstream in(value);
  for (std::string item; std::getline(in, item, ',');) v.push_back(to_number(key, item));
  if (v.empty()) throw std::invalid_argument(key + " needs at least one value");
  return v;
}

/// \brief Under --adaptive, kfac::SelfTuning chooses K-FAC's step size, momentum and damping, and
/// there is no KL clip: a flag that would set one of them would be ignored, so it is refused
/// (naming it). --lr and --momentum also set SGD's, Adam's and NG-SGD's: refused only when K-FAC
/// is the one optimizer of the run.
void refuse_tuned_flags(const std::vector<std::string>& given, const std::string& optimizer) {
  const bool kfac_only = optimizer == "kfac";
  for (const std::string& key : given) {
    const bool kfac_flag = key == "--damping" || key == "--kl-clip" || key == "--lr-kfac" || key == "--damping-start" ||
                           key == "--kl-clip-power";
    if (kfac_flag || (kfac_only && (key == "--lr" || key == "--momentum")))
      throw std::invalid_argument(key + ": not used with --adaptive (self-tuned K-FAC chooses its step size, momentum "
                                  "and damping, and has no KL clip); drop " + key + " or --adaptive");
  }
}

/// \param argv [in] the command line without the program name and the --kokkos-* options
Args parse(const std::vector<std::string>& argv) {
  Args a;
  // The model first: its K-FAC defaults are what the other flags override.
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--model" && i + 1 < argv.size()) a.train.model = argv[i + 1];
    if (argv[i].rfind("--model=", 0) == 0) a.train.model = argv[i].substr(8);
  }
  a.train.kfac = nn::default_kfac(a.train.model);
  // An MLP evaluation is cheap, and time to the target needs a finer grid than quarter epochs.
  a.eval_every = a.train.model == "mlp" ? 20 : 0;
  const std::size_t argc = argv.size();
  std::vector<std::string> given;  // the flags on the command line, for the --adaptive check below
  for (std::size_t i = 0; i < argc; ++i) {
    std::string key = argv[i], value;
    if (key == "-h" || key == "--help") {
      a.help = true;
      return a;
    }
    if (key == "--append") {
      a.append = true;
      continue;
    }
    if (key == "--adaptive") {
      a.train.kfac.adaptive = true;
      continue;
    }
    const auto eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw std::invalid_argument(key + " needs a value");
    }
    given.push_back(key);
    auto num = [&](auto& dst) { dst = static_cast<std::remove_reference_t<decltype(dst)>>(to_number(key, value)); };
    if (key == "--optimizer") a.optimizer = value;
    else if (key == "--model") a.train.model = value;
    else if (key == "--epochs") num(a.epochs);
    else if (key == "--batch") num(a.train.batch);
    else if (key == "--lr") a.lrs["all"] = to_numbers(key, value);
    else if (key == "--lr-sgd") a.lrs["sgd"] = to_numbers(key, value);
    else if (key == "--lr-adam") a.lrs["adam"] = to_numbers(key, value);
    else if (key == "--lr-kfac") a.lrs["kfac"] = to_numbers(key, value);
    else if (key == "--lr-ngsgd") a.lrs["ngsgd"] = to_numbers(key, value);
    else if (key == "--ngsgd-period") num(a.train.ngsgd.update_period);
    else if (key == "--ngsgd-alpha") num(a.train.ngsgd.alpha);
    else if (key == "--ngsgd-rank") num(a.train.ngsgd.rank);
    else if (key == "--average-every") num(a.train.average_every);
    else if (key == "--average-momentum") num(a.train.average_momentum);
    else if (key == "--momentum") num(a.train.momentum);
    else if (key == "--weight-decay") num(a.train.weight_decay);
    else if (key == "--damping") num(a.train.kfac.damping);
    else if (key == "--kl-clip") num(a.train.kfac.kl_clip);
    else if (key == "--factor-decay") num(a.train.kfac.factor_decay);
    else if (key == "--inv-every") num(a.train.kfac.inv_update_steps);
    else if (key == "--factor-every") num(a.train.kfac.factor_update_steps);
    else if (key == "--inverse") a.train.kfac.inverse = value;
    else if (key == "--rank") num(a.train.kfac.rank);
    else if (key == "--factor-precision") a.train.kfac.factor_precision = value;
    else if (key == "--factored-damping") num(a.train.kfac.factored_damping);
    else if (key == "--strategy") a.train.kfac.strategy = value;
    else if (key == "--grad-worker-fraction") num(a.train.kfac.grad_worker_fraction);
    else if (key == "--reduce-to-owner") {
      num(a.train.kfac.reduce_to_owner);
      a.train.kfac.reduce_to_owner_given = true;
    } else if (key == "--split-preconditioning") {
      num(a.train.kfac.split_preconditioning);
      a.train.kfac.split_preconditioning_given = true;
    }
    else if (key == "--overlap-communication") num(a.train.kfac.overlap_communication);
    else if (key == "--model-figures") a.model_figures = value;
    else if (key == "--decomposition-delay") num(a.train.kfac.decomposition_delay);
    else if (key == "--eigen-refresh") num(a.train.kfac.eigen_refresh);
    else if (key == "--recipe") a.train.recipe.name = value;
    else if (key == "--warmup-epochs") num(a.train.recipe.warmup_epochs);
    else if (key == "--decay-power") num(a.train.recipe.decay_power);
    else if (key == "--kl-clip-power") num(a.train.recipe.kl_clip_power);
    else if (key == "--damping-start") num(a.train.recipe.damping_start);
    else if (key == "--fresh-epochs") num(a.train.recipe.fresh_epochs);
    else if (key == "--max-interval-epochs") num(a.train.recipe.max_interval_epochs);
    else if (key == "--seed" || key == "--seeds") {
      a.seeds.clear();
      for (double v : to_numbers(key, value)) {
        if (v < 0 || v != std::floor(v)) throw std::invalid_argument(key + ": seeds are whole numbers >= 0");
        a.seeds.push_back(std::uint64_t(v));
      }
    }
    else if (key == "--threads") num(a.threads);
    else if (key == "--out") a.out = value;
    else if (key == "--data") a.data = value;
    else if (key == "--train-subset") num(a.train_subset);
    else if (key == "--test-subset") num(a.test_subset);
    else if (key == "--eval-every") num(a.eval_every);
    else if (key == "--target-acc") num(a.target_acc);
    else if (key == "--stop-at-target") num(a.stop_at_target);
    else if (key == "--solve-every") num(a.train.kfac.adaptive_solve_interval);
    else if (key == "--fisher") a.train.kfac.fisher = value;
    else if (key == "--fisher-samples") num(a.train.kfac.fisher_samples);
    else throw std::invalid_argument("unknown option " + key + " (see --help)");
  }
  if (a.epochs < 1 || a.train.batch < 1) throw std::invalid_argument("--epochs and --batch must be >= 1");
  if (a.train.kfac.adaptive) refuse_tuned_flags(given, a.optimizer);
  if (a.train.kfac.adaptive_solve_interval < 1 ||
      (a.train.kfac.adaptive_solve_interval != 1 && !a.train.kfac.adaptive))
    throw std::invalid_argument("--solve-every: expected N >= 1, with --adaptive");
  if (a.train.recipe.name != "none" && a.train.recipe.name != "large-batch")
    throw std::invalid_argument("--recipe: expected none or large-batch");
  a.train.epochs = a.epochs;
  for (const auto& [who, list] : a.lrs)
    for (double lr : list)
      if (!(lr > 0)) throw std::invalid_argument("learning rates must be > 0 (" + who + ")");
  if (a.train.kfac.inverse != "eigen" && a.train.kfac.inverse != "cholesky" && a.train.kfac.inverse != "randomized")
    throw std::invalid_argument("--inverse: expected eigen, cholesky or randomized");
  if (a.train.kfac.rank < 1) throw std::invalid_argument("--rank: expected >= 1");
  nn::check_fisher(a.train.kfac);
  if (a.train.kfac.strategy != "auto" && a.train.kfac.strategy != "comm-opt" && a.train.kfac.strategy != "hybrid" &&
      a.train.kfac.strategy != "mem-opt")
    throw std::invalid_argument("--strategy: expected auto, comm-opt, hybrid or mem-opt");
  if (a.train.kfac.grad_worker_fraction < 0 || a.train.kfac.grad_worker_fraction > 1)
    throw std::invalid_argument("--grad-worker-fraction: expected a value in [1/P, 1]");
  return a;
}

/// \brief The learning rates to run `kind` with: its own list, else --lr, else its default.
std::vector<double> learning_rates(const Args& a, nn::OptimizerKind kind) {
  const auto own = a.lrs.find(nn::to_string(kind));
  if (own != a.lrs.end()) return own->second;
  const auto all = a.lrs.find("all");
  if (all != a.lrs.end()) return all->second;
  return {nn::default_lr(kind, a.train.model)};
}

std::vector<nn::OptimizerKind> optimizers(const std::string& s, bool lead) {
  if (s != "all") {
    std::vector<nn::OptimizerKind> list;
    std::stringstream in(s);
    for (std::string item; std::getline(in, item, ',');) list.push_back(nn::parse_optimizer(item));
    return list;
  }
  std::vector<nn::OptimizerKind> all{nn::OptimizerKind::sgd, nn::OptimizerKind::adam};
  // NG-SGD is not in "all", to keep the main job (scripts/quickstart.sh) at its ~3 minutes:
  // --optimizer sgd,adam,kfac,ngsgd adds it.
  if (KFAC_EXAMPLES_HAVE_KFAC) all.push_back(nn::OptimizerKind::kfac);
  else if (lead) std::printf("note: built without kfac; comparing sgd and adam only\n");
  return all;
}

/// \brief The name of a run in the tables, log and plot: "sgd", or "sgd+avg100" in averaging mode;
/// K-FAC on several ranks with a gradient-worker fraction below 1 is "kfac+f0.5" (KAISA HYBRID or
/// MEM-OPT), so that the CSV log tells the strategies apart.
std::string run_name(nn::OptimizerKind k, const nn::TrainSettings& s, int world_size = 1) {
  std::string n = nn::to_string(k);
  if (s.recipe.name == "large-batch") n += "+lb";
  if (s.average_every > 0) n += "+avg" + std::to_string(s.average_every) + (s.average_momentum ? "m" : "");
  if (k == nn::OptimizerKind::kfac && world_size > 1) {
    const double f = nn::resolve_grad_worker_fraction(s.kfac, world_size);  // 0: auto
    if (f > 0 && f < 1) {
      char b[32];
      std::snprintf(b, sizeof b, "+f%.3g", f);
      n += b;
    }
    if (s.kfac.reduce_to_owner) n += "+own";
    if (s.kfac.split_preconditioning) n += "+split";
    if (!s.kfac.overlap_communication) n += "+blocking";
  }
  if (k == nn::OptimizerKind::kfac) {  // an inversion other than the model's default: "+cholesky", "+rank64f"
    const nn::KfacSettings d = nn::default_kfac(s.model);
    const auto& c = s.kfac;
    if (c.inverse == "randomized" && (d.inverse != c.inverse || d.rank != c.rank || d.factored_damping != c.factored_damping))
      n += "+rank" + std::to_string(c.rank) + (c.factored_damping ? "f" : "");
    else if (c.inverse != d.inverse) n += "+" + c.inverse;
  }
  if (k == nn::OptimizerKind::kfac && s.kfac.adaptive) n += "+adaptive";
  if (k == nn::OptimizerKind::kfac && s.kfac.fisher == "sampled")
    n += "+sampled" + (s.kfac.fisher_samples > 1 ? std::to_string(s.kfac.fisher_samples) : std::string());
  if (k == nn::OptimizerKind::kfac && s.kfac.factor_precision == "half") n += "+half";
  if (k == nn::OptimizerKind::kfac && s.kfac.decomposition_delay > 0) n += "+d" + std::to_string(s.kfac.decomposition_delay);
  if (k == nn::OptimizerKind::kfac && s.kfac.eigen_refresh > 0) {
    char b[32];
    std::snprintf(b, sizeof b, "+r%g", s.kfac.eigen_refresh);
    n += b;
  }
  return n;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// \brief One run: an optimizer at one learning rate and seed. Only rank 0 evaluates, prints
/// and logs; the other ranks wait for it at a barrier after each evaluation, so that no rank's
/// step timer includes it.
demo::RunSummary train_one(const Args& args, nn::TrainSettings s, const nn::World& world, const nn::Dataset& train,
                           const nn::Dataset& test, demo::CsvLog* log) {
  const bool lead = world.rank() == 0;
  nn::Trainer trainer(train, s, world);
  const int steps = trainer.steps_per_epoch();
  // Default: 4 evaluations per epoch, evenly spaced, the last at its end.
  const int per_epoch = steps < 4 ? steps : 4;
  auto eval_due = [&](long global_step, int i) {
    // Averaging mode: right after each average (when the ranks agree) and after the last step.
    if (s.average_every > 0) return trainer.just_averaged() || global_step == long(steps) * args.epochs;
    if (args.eval_every > 0) return global_step % args.eval_every == 0 || i + 1 == steps;
    return (i + 1) * per_epoch / steps != i * per_epoch / steps;
  };
  const long total_steps = long(steps) * args.epochs;
  const std::string name = run_name(s.optimizer, s, world.size());
  const std::string schedule = s.average_every > 0 ? "test after each average" : args.eval_every > 0 ? "test every " + std::to_string(args.eval_every) + " steps"
                                                    : "test " + std::to_string(per_epoch) + " times per epoch";
  if (lead)
    std::printf("[%s] lr %g, seed %llu, %d steps/epoch of %d samples%s, %s\n", name.c_str(), trainer.lr(),
                (unsigned long long)s.seed, steps, trainer.batch_size(),
                world.size() > 1 ? (" over " + std::to_string(world.size()) + " processes").c_str() : "",
                schedule.c_str());

#if KFAC_EXAMPLES_HAVE_KFAC
  if (lead && s.recipe.name == "large-batch" && s.optimizer == nn::OptimizerKind::kfac && s.kfac.adaptive) {
    std::printf("[%s] recipe large-batch, self-tuned: the recipe's factor and decomposition intervals; step size, "
                "momentum and damping from kfac::SelfTuning\n", name.c_str());
  } else if (lead && s.recipe.name == "large-batch") {
    nn::RecipeSettings rs = s.recipe;
    rs.batch = trainer.batch_size();
    rs.steps_per_epoch = steps;
    rs.epochs = args.epochs;
    const auto r = nn::recipe_of(rs, trainer.lr(), s.optimizer == nn::OptimizerKind::kfac ? 0.25 : 1.0);
    const auto lr = r.lr_schedule();
    std::printf("[%s] recipe large-batch: lr %g at batch 256 -> %g at %ld over %ld warm-up steps, decay (power %g) to %g",
                name.c_str(), r.lr, r.scaled_lr(), rs.batch, r.clock().step_at(r.warmup_epochs), r.decay_power,
                lr(long(steps) * args.epochs - 1));
    if (s.optimizer == nn::OptimizerKind::kfac) {
      nn::KfacSettings ks = s.kfac;
      ks.lr = trainer.lr();
      ks.recipe = rs;
      const auto k = nn::recipe_of(ks);
      std::printf("; damping %g -> %g over %ld steps; kl_clip %g; factor/decomposition interval 1 for %ld steps, then up to %ld",
                  k.initial_damping(), k.damping, k.clock().step_at(k.damping_epochs), k.scaled_kl_clip(),
                  k.clock().step_at(k.fresh_epochs), k.factor_intervals()(1L << 40));
    }
    std::printf("\n");
  }
#endif

  demo::RunSummary run;
  run.optimizer = name;
  run.lr = trainer.lr();
  run.seed = s.seed;
  run.steps_per_epoch = steps;
  demo::Progress progress;
  const Clock::time_point start = Clock::now();
  double train_s = 0.0, loss_since_eval = 0.0;
  long step = 0, steps_since_eval = 0;

  auto evaluate = [&](int epoch) {
    const double acc = lead ? trainer.evaluate(test).accuracy() : std::numeric_limits<double>::quiet_NaN();
    world.barrier();
    const double loss = steps_since_eval ? loss_since_eval / double(steps_since_eval)
                                         : std::numeric_limits<double>::quiet_NaN();
    run.evals.push_back({epoch, step, train_s, loss, acc});
    if (log) log->row(run, run.evals.back());
    loss_since_eval = 0.0;
    steps_since_eval = 0;
  };
  evaluate(0);

  bool at_target = false;  // --stop-at-target: ends the run, not a failure
  for (int epoch = 1; epoch <= args.epochs && !run.stopped && !at_target; ++epoch) {
    trainer.start_epoch(epoch - 1);
    nn::BatchStats epoch_stats;
    for (int i = 0; i < steps; ++i) {
      const Clock::time_point t0 = Clock::now();
      const std::clock_t cpu0 = std::clock();
      nn::BatchStats b;
      std::string failure;
      try {
        b = trainer.step(i);
        if (step + 1 == total_steps) trainer.average_now();  // the final model is the average
        if (!std::isfinite(b.loss_sum)) failure = "the training loss is not finite (try a smaller --lr)";
      } catch (const std::exception& e) {  // e.g. kfac::Error on non-finite observations
        failure = e.what();
      }
      train_s += seconds_since(t0);
      run.train_cpu_s += double(std::clock() - cpu0) / CLOCKS_PER_SEC;
      ++step;
      if (!failure.empty()) {
        if (lead) progress.finish("[" + name + "] stopped at step " + std::to_string(step) + ": " + failure);
        run.stopped = true;
        break;
      }
      epoch_stats += b;
      loss_since_eval += b.mean_loss();
      ++steps_since_eval;
      if (eval_due(step, i)) {
        evaluate(epoch);
        if (args.stop_at_target) {  // rank 0 evaluated: every rank takes its answer
          std::vector<double> reached{lead && run.evals.back().test_acc >= args.target_acc ? 1.0 : 0.0};
          world.sum(reached);
          at_target = reached[0] > 0;
        }
      }
      if (at_target) {
        if (lead) progress.finish("[" + name + "] reached the target at step " + std::to_string(step) + " (--stop-at-target)");
        break;
      }
      if (!lead) continue;

      const double wall = seconds_since(start);
      const double eta = wall / double(step) * double(total_steps - step);
      char line[256];
      std::snprintf(line, sizeof line,
                    "[%s] epoch %d/%d step %d/%d  loss %.4f  train acc %.2f%%  test acc %.2f%%  %.0f samples/s  "
                    "train %s  ETA %s",
                    name.c_str(), epoch, args.epochs, i + 1, steps, epoch_stats.mean_loss(),
                    100 * epoch_stats.accuracy(), 100 * run.evals.back().test_acc,
                    double(step) * trainer.batch_size() / train_s, demo::format_seconds(train_s).c_str(),
                    demo::format_seconds(eta).c_str());
      if (i + 1 == steps) progress.finish(line);
      else progress.update(line, wall);
    }
  }
  run.train_s = train_s;
  run.total_s = seconds_since(start);
  if (const nn::KfacSgd* kfac = trainer.kfac(); kfac && lead && step > 0) {
    // kfac's share of the step beside the cost model's prediction (issue 16's "within 20 %")
    const nn::KfacStepCost c = kfac->predicted(trainer.network(), world.size(), args.figures);
    const double measured = kfac->kfac_seconds() / double(step);
    std::printf("[%s] kfac per step: %.2f ms measured on rank 0 (observe + step()), cost model %.2f ms with %s figures "
                "(factors %.2f + averaging %.2f every %ld, decompositions %.2f every %ld, preconditioning %.2f): "
                "model/measured %.2f\n",
                name.c_str(), 1e3 * measured, 1e3 * c.step_s, args.figures.measured ? "measured" : "default", 1e3 * c.factors_s, 1e3 * c.averaging_s, c.factor_interval,
                1e3 * c.decomposition_s, c.inv_interval, 1e3 * c.preconditioning_s, c.step_s / measured);
  }
#if KFAC_EXAMPLES_HAVE_KFAC
  if (const nn::KfacSgd* kfac = trainer.kfac(); kfac && lead && kfac->tuning()) {
    const auto t = *kfac->tuning();  // a copy: tuning() returns a value
    std::printf("[%s] self-tuned: %ld solves, last alpha %.4g mu %.4g, damping %.4g after %ld updates "
                "(last rho %.3g)\n",
                name.c_str(), t.solves(), t.last_step().alpha, t.last_step().mu, t.lambda(), t.damping_updates(),
                t.last_damping_update().rho);
  }
#endif
  if (const nn::KfacSgd* kfac = trainer.kfac(); kfac && lead && !kfac->chosen().empty())
    std::printf("[%s] distribution chosen by the cost model (--strategy auto): %s\n", name.c_str(), kfac->chosen().c_str());
  if (lead && world.size() > 1) {
    const double epochs_run = double(step) / steps;
    std::printf("[%s] communication: %.3g MB sent per epoch by rank 0 (%s)\n", name.c_str(),
                double(trainer.bytes_sent()) / epochs_run / 1e6,
                s.average_every > 0 ? ("kfac::ParameterAverager, " + std::to_string(trainer.averaging()->averages()) + " averages").c_str()
                                    : s.optimizer == nn::OptimizerKind::kfac ? "kfac::GradientAverager and K-FAC's collectives"
                                                                             : "kfac::GradientAverager, every step");
  }
  return run;
}

int run(const Args& args, const nn::World& world) {
  const bool lead = world.rank() == 0;
  if (args.threads > 0) {
    if (openblas_set_num_threads) openblas_set_num_threads(args.threads);
    else if (lead) std::printf("note: --threads ignored (the BLAS in use is not OpenBLAS)\n");
  }
  const std::vector<nn::OptimizerKind> kinds = optimizers(args.optimizer, lead);
  if (args.model_figures != "measured" && args.model_figures != "defaults")
    throw std::invalid_argument("--model-figures: expected measured or defaults");
  if (lead) demo::make_output_dir(args.out);

  const nn::Dataset train = nn::load_fashion_mnist(args.data, "train", args.train_subset);
  const nn::Dataset test = nn::load_fashion_mnist(args.data, "t10k", args.test_subset);
  if (lead) {
    std::printf("Fashion-MNIST: %d training and %d test images; model %s, batch %d", train.size(), test.size(),
                args.train.model.c_str(), args.train.batch);
    if (world.size() > 1) std::printf(" (%d per process, %d processes)", args.train.batch / world.size(), world.size());
    std::printf("\ntimes count training steps only (test evaluations are excluded)\n");
    if (world.size() > 1 && std::find(kinds.begin(), kinds.end(), nn::OptimizerKind::kfac) != kinds.end()) {
      const double f = nn::resolve_grad_worker_fraction(args.train.kfac, world.size());
      if (f <= 0)
        std::printf("K-FAC distribution: KAISA, the gradient-worker fraction, split preconditioning and reduce-to-owner "
                    "the cost model predicts fastest (--strategy auto; chosen at the first step, printed after the run)%s\n",
                    args.train.kfac.overlap_communication ? ", collectives overlapped" : ", blocking collectives");
      else
        std::printf("K-FAC distribution: KAISA, gradient-worker fraction %.3g (%s; %d of %d ranks precondition each layer%s)%s%s\n",
                    f, args.train.kfac.grad_worker_fraction > 0 ? "--grad-worker-fraction" : args.train.kfac.strategy.c_str(),
                    int(std::lround(f * world.size())), world.size(),
                    args.train.kfac.split_preconditioning ? ", each a block of its rows (split preconditioning)" : "",
                    args.train.kfac.reduce_to_owner ? ", factors reduced to their owners" : "",
                    args.train.kfac.overlap_communication ? ", collectives overlapped" : ", blocking collectives");
    }
  }

  Args with_figures = args;
  if (args.model_figures == "measured" && std::find(kinds.begin(), kinds.end(), nn::OptimizerKind::kfac) != kinds.end()) {
    with_figures.figures = nn::measure_model_figures(world);  // collective
#if KFAC_EXAMPLES_HAVE_KFAC
    const kfac::MachineFigures& f = with_figures.figures.machine;
    if (lead)
      std::printf("cost-model figures measured on %d rank(s) at once: dgemm %.3g flop/s (float %.2fx), eigen %.3g s/n^3, "
                  "cholesky %.3g s/n^3, memory %.3g B/s, latency %.3g s, bandwidth %.3g B/s\n",
                  world.size(), f.gemm_flops, f.float_speedup, f.eigen_seconds_per_n3, f.cholesky_seconds_per_n3,
                  f.memory_bandwidth, f.latency, f.bandwidth);
#endif
  }

  std::unique_ptr<demo::CsvLog> log;
  if (lead) log = std::make_unique<demo::CsvLog>(args.out + "/log.csv", args.append);
  std::vector<demo::RunSummary> runs;
  for (nn::OptimizerKind k : kinds)
    for (double lr : learning_rates(args, k))
      for (std::uint64_t seed : args.seeds) {
        nn::TrainSettings s = args.train;
        s.optimizer = k;
        s.lr = lr;
        s.seed = seed;
        s.kfac.figures = with_figures.figures;  // what --strategy auto predicts with
        runs.push_back(train_one(with_figures, s, world, train, test, log.get()));
      }
  if (!lead) return 0;

  demo::print_summary(runs, args.target_acc);
  std::printf("log: %s\n", log->path().c_str());
  // The plot: each optimizer at its best learning rate (else its first), first seed.
  const auto groups = demo::group_runs(runs);
  std::vector<const demo::RunSummary*> shown;
  for (nn::OptimizerKind k : kinds) {
    nn::TrainSettings named = args.train;
    const std::string name = run_name(k, named, world.size());
    const demo::Group* g = demo::best_group(groups, name, args.target_acc);
    for (const auto& x : groups)
      if (!g && x.optimizer == name) g = &x;
    if (g) shown.push_back(g->runs.front());
  }
  demo::plot(args.out, log->path(), shown,
             "Fashion-MNIST " + args.train.model + ", batch " + std::to_string(args.train.batch) + ", seed " +
                 std::to_string(args.seeds.front()) + (world.size() > 1 ? ", " + std::to_string(world.size()) + " processes" : ""));
  return 0;
}

/// \brief MPI for the run's lifetime when launched by mpiexec (Open MPI or a PMI launcher set
/// the environment); a plain start stays a single process without touching MPI.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv) {
#if KFAC_EXAMPLES_HAVE_MPI
    const char* launched[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"};
    for (const char* v : launched)
      if (std::getenv(v)) active_ = true;
    int provided = 0;  // threads: kfac shares deferred decompositions from their threads
    if (active_) MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
#else
    (void)argc;
    (void)argv;
#endif
  }
  ~MpiSession() {
#if KFAC_EXAMPLES_HAVE_MPI
    if (active_) MPI_Finalize();
#endif
  }
  nn::World world() const {
#if KFAC_EXAMPLES_HAVE_MPI
    if (active_) return nn::World(MPI_COMM_WORLD);
#endif
    return nn::World();
  }
  void abort() const {
#if KFAC_EXAMPLES_HAVE_MPI
    if (active_) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  }

 private:
  bool active_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(&argc, &argv);
  const nn::World world = mpi.world();
  std::vector<char*> kokkos_argv;
  std::vector<std::string> own;
  nn::split_kokkos_options(argc, argv, kokkos_argv, own);
  Args args;
  try {
    args = parse(own);
  } catch (const std::exception& e) {
    if (world.rank() == 0) std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
  if (args.help) {
    if (world.rank() == 0) usage();
    return 0;
  }
  int kokkos_argc = int(kokkos_argv.size());
  Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_argv.data());
  try {
    return run(args, world);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist (rank %d): %s\n", world.rank(), e.what());
    if (world.size() > 1) mpi.abort();  // the other ranks may be waiting in a collective
    return 1;
  }
}
