/// \file main.cpp
/// \brief The deep-autoencoder benchmark (issue 44 item 4): the network of Hinton & Salakhutdinov
/// (2006) as Martens & Grosse (2015, section 13) train it, on Fashion-MNIST's training images, with
/// one optimizer per run: SGD with momentum, Adam, K-FAC with a given learning rate and damping,
/// or self-tuned K-FAC (kfac::SelfTuning with its defaults). A run trains until its budget of
/// training seconds (or steps) is spent and prints one CSV line per evaluation of the training
/// error; scripts/autoencoder_benchmark.sh sweeps and compares them.
///
/// Network: 784-1000-500-250-30-250-500-1000-784, logistic units except the linear 30-unit code
/// layer, logistic outputs; loss: sigmoid cross-entropy of the reconstruction, summed over the
/// 784 pixels and averaged over the batch; pixels in [0, 1]. Reported metric (theirs): the
/// training squared error, \f$\|\sigma(z) - x\|^2\f$ summed over pixels and averaged over images,
/// on the first --eval-subset training images. Times count training steps only.

#include "common/adam.hpp"
#include "common/command_line.hpp"
#include "common/dataset.hpp"
#include "common/kfac_glue.hpp"
#include "common/network.hpp"
#include "common/sgd.hpp"
#include "common/sigmoid_cross_entropy.hpp"

#include <Kokkos_Core.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

struct Args {
  std::string optimizer = "kfac";
  bool adaptive = false;
  double lr = 0;  ///< 0: the optimizer's default below
  double momentum = 0.9;
  int batch = 256;
  std::uint64_t seed = 1;
  double budget_s = 60;   ///< training seconds per run
  long max_steps = 0;     ///< 0: no limit
  int evals = 20;         ///< evaluations over the budget, besides the one at step 0
  int train_subset = 0;   ///< 0: all 60000 training images
  int eval_subset = 10000;
  int threads = 0;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string out;        ///< CSV file to append to (a header when new); stdout always gets the rows
  nn::KfacSettings kfac;
  bool help = false;
};

void usage() {
  std::printf(
      "usage: autoencoder [options]   deep autoencoder 784-1000-500-250-30-250-500-1000-784 on Fashion-MNIST\n"
      "  --optimizer sgd|adam|kfac       (default kfac)\n"
      "  --adaptive                      kfac: self-tuned (kfac::SelfTuning, its defaults): --lr, --momentum,\n"
      "                                  --damping and --kl-clip are refused with it\n"
      "  --solve-every N                 with --adaptive: the step size and momentum solved (R-op passes) every N\n"
      "                                  steps after the first 10, the solves' means in between (default 1)\n"
      "  --lr X                          learning rate (defaults: sgd 0.01, adam 1e-3, kfac 0.1)\n"
      "  --momentum X                    sgd and kfac momentum (default 0.9)\n"
      "  --damping X --kl-clip X         kfac (default 0.1, 1e-2)\n"
      "  --factor-every N --inv-every N  kfac factor and decomposition intervals (default 5, 20)\n"
      "  --inverse eigen|cholesky|randomized   kfac inversion (default randomized: kfac::RandomizedEigen)\n"
      "  --rank N                        randomized: eigenpairs kept per factor (default 64)\n"
      "  --fisher empirical|sampled      kfac: G from the output gradients at the data's targets, or at targets\n"
      "                                  drawn from the model, Bernoulli(sigmoid(z)): the true Fisher (default\n"
      "                                  empirical)\n"
      "  --fisher-samples N              --fisher sampled: draws per image on each factor step (default 1)\n"
      "  --batch N                       images per step (default 256)\n"
      "  --seed N                        initialisation and batch order (default 1)\n"
      "  --budget S                      training seconds per run (default 60)\n"
      "  --max-steps N                   stop after N steps too (default 0: no limit)\n"
      "  --evals N                       evaluations over the budget after the one at step 0 (default 20)\n"
      "  --train-subset N --eval-subset N   training images used (default all) and evaluated (default 10000)\n"
      "  --threads N                     BLAS threads (default: OpenBLAS's choice)\n"
      "  --data DIR                      Fashion-MNIST files (default /usr/share/datasets/fashion-mnist)\n"
      "  --out FILE                      also append the CSV rows to FILE (a header when it is new)\n"
      "  -h, --help                      this text\n"
      "prints: optimizer,lr,damping,seed,step,seconds,train_error,train_loss per evaluation\n");
}

double number(const std::string& key, const std::string& value) {
  try {
    std::size_t used = 0;
    const double v = std::stod(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(key + ": '" + value + "' is not a number");
}

Args parse(const std::vector<std::string>& argv) {
  Args a;
  a.kfac.damping = 0.1;
  a.kfac.kl_clip = 1e-2;
  a.kfac.factor_update_steps = 5;
  // The top-64 eigenpairs of each factor, the rest as their mean (kfac::RandomizedEigen): on this
  // network's 785- to 1001-wide factors the full eigendecomposition made the first step 2.5-3x and
  // every other step 2.6x as long for the same loss; decompositions every 20 steps rather than 50
  // cost 5% more per step and gave self-tuned K-FAC a much lower loss early (probes of 2026-12-07,
  // docs/self_tuning.md, "K-FAC's inversion for the autoencoder").
  a.kfac.inv_update_steps = 20;
  a.kfac.inverse = "randomized";
  a.kfac.rank = 64;
  std::vector<std::string> tuned;  // flags that self-tuned K-FAC would ignore
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string key = argv[i];
    if (key == "-h" || key == "--help") {
      a.help = true;
      return a;
    }
    if (key == "--adaptive") {
      a.adaptive = true;
      continue;
    }
    if (i + 1 >= argv.size()) throw std::invalid_argument(key + " needs a value");
    if (key == "--lr" || key == "--momentum" || key == "--damping" || key == "--kl-clip") tuned.push_back(key);
    const std::string value = argv[++i];
    auto num = [&](auto& dst) { dst = static_cast<std::remove_reference_t<decltype(dst)>>(number(key, value)); };
    if (key == "--optimizer") a.optimizer = value;
    else if (key == "--lr") num(a.lr);
    else if (key == "--momentum") num(a.momentum);
    else if (key == "--damping") num(a.kfac.damping);
    else if (key == "--kl-clip") num(a.kfac.kl_clip);
    else if (key == "--factor-every") num(a.kfac.factor_update_steps);
    else if (key == "--inv-every") num(a.kfac.inv_update_steps);
    else if (key == "--inverse") a.kfac.inverse = value;
    else if (key == "--rank") num(a.kfac.rank);
    else if (key == "--solve-every") num(a.kfac.adaptive_solve_interval);
    else if (key == "--fisher") a.kfac.fisher = value;
    else if (key == "--fisher-samples") num(a.kfac.fisher_samples);
    else if (key == "--batch") num(a.batch);
    else if (key == "--seed") num(a.seed);
    else if (key == "--budget") num(a.budget_s);
    else if (key == "--max-steps") num(a.max_steps);
    else if (key == "--evals") num(a.evals);
    else if (key == "--train-subset") num(a.train_subset);
    else if (key == "--eval-subset") num(a.eval_subset);
    else if (key == "--threads") num(a.threads);
    else if (key == "--data") a.data = value;
    else if (key == "--out") a.out = value;
    else throw std::invalid_argument("unknown option " + key + " (see --help)");
  }
  if (a.optimizer != "sgd" && a.optimizer != "adam" && a.optimizer != "kfac")
    throw std::invalid_argument("--optimizer: expected sgd, adam or kfac");
  if (a.adaptive && a.optimizer != "kfac") throw std::invalid_argument("--adaptive: only with --optimizer kfac");
  if (a.kfac.adaptive_solve_interval < 1 || (a.kfac.adaptive_solve_interval != 1 && !a.adaptive))
    throw std::invalid_argument("--solve-every: expected N >= 1, with --adaptive");
  if (a.adaptive && !tuned.empty())
    throw std::invalid_argument(tuned[0] + ": not used with --adaptive (self-tuned K-FAC chooses its step size, "
                                "momentum and damping, and has no KL clip); drop " + tuned[0] + " or --adaptive");
  if (a.lr < 0 || a.batch < 1 || a.evals < 1 || !(a.budget_s > 0))
    throw std::invalid_argument("--lr >= 0, --batch >= 1, --evals >= 1 and --budget > 0 expected");
  nn::check_fisher(a.kfac);
  if (a.kfac.fisher != "empirical" && a.optimizer != "kfac")
    throw std::invalid_argument("--fisher: only with --optimizer kfac");
  if (a.lr == 0) a.lr = a.optimizer == "sgd" ? 0.01 : a.optimizer == "adam" ? 1e-3 : 0.1;
  a.kfac.lr = a.lr;
  a.kfac.momentum = a.momentum;
  a.kfac.adaptive = a.adaptive;
  a.kfac.fisher_seed = a.seed;
  return a;
}

using Clock = std::chrono::steady_clock;

/// The squared error and loss on the first images of `data` (evaluation: not timed).
nn::ReconstructionStats evaluate(nn::Network& net, nn::SigmoidCrossEntropy& loss, const nn::Dataset& data, int count) {
  nn::ReconstructionStats total;
  const int n = count < data.size() ? count : data.size();
  for (int begin = 0; begin < n; begin += 500) {
    const int end = begin + 500 < n ? begin + 500 : n;
    const nn::Batch b = nn::slice(data, begin, end);
    total += loss.forward(net.forward(b.x, nn::Mode::eval), b.x);
  }
  return total;
}

int run(const Args& a) {
  if (a.threads > 0 && openblas_set_num_threads) openblas_set_num_threads(a.threads);
  const nn::Dataset train = nn::load_fashion_mnist(a.data, "train", a.train_subset, nn::Pixels::unit);
  nn::Network net = nn::make_autoencoder(a.seed);
  nn::Batcher batches(train, a.batch, nn::derive_seed(a.seed, 3));
  nn::SigmoidCrossEntropy loss, eval_loss;

  std::unique_ptr<nn::Sgd> sgd;
  std::unique_ptr<nn::Adam> adam;
  std::unique_ptr<nn::KfacSgd> kfac;
  if (a.optimizer == "sgd")
    sgd = std::make_unique<nn::Sgd>(net.params(), nn::SgdOptions{}.with_lr(a.lr).with_momentum(a.momentum));
  if (a.optimizer == "adam") adam = std::make_unique<nn::Adam>(net.params(), nn::AdamOptions{}.with_lr(a.lr));
  if (a.optimizer == "kfac") kfac = std::make_unique<nn::KfacSgd>(net, a.kfac);

  std::string name = a.optimizer + (a.adaptive ? "+adaptive" : "");
  if (a.kfac.fisher == "sampled")
    name += "+sampled" + (a.kfac.fisher_samples > 1 ? std::to_string(a.kfac.fisher_samples) : std::string());
  char lr_text[32], damping_text[32];
  std::snprintf(lr_text, sizeof lr_text, "%g", a.lr);
  std::snprintf(damping_text, sizeof damping_text, "%g", a.kfac.damping);
  std::FILE* csv = nullptr;
  if (!a.out.empty()) {
    std::FILE* probe = std::fopen(a.out.c_str(), "r");
    const bool fresh = !probe;
    if (probe) std::fclose(probe);
    csv = std::fopen(a.out.c_str(), "a");
    if (!csv) throw std::runtime_error("cannot open " + a.out);
    if (fresh) std::fprintf(csv, "optimizer,lr,damping,seed,step,seconds,train_error,train_loss\n");
  }
  double train_s = 0;
  long step = 0;
  auto report = [&] {
    const nn::ReconstructionStats e = evaluate(net, eval_loss, train, a.eval_subset);
    std::string lr = lr_text, damping = a.optimizer == "kfac" ? damping_text : "-";
#if KFAC_EXAMPLES_HAVE_KFAC
    if (a.adaptive && kfac && kfac->tuning()) {
      char b[32];
      std::snprintf(b, sizeof b, "%.4g", kfac->tuning()->lambda());
      damping = b;
      lr = "auto";
    }
#endif
    char row[256];
    std::snprintf(row, sizeof row, "%s,%s,%s,%llu,%ld,%.3f,%.4f,%.4f\n", name.c_str(), lr.c_str(), damping.c_str(),
                  (unsigned long long)a.seed, step, train_s, e.mean_squared_error(), e.mean_loss());
    std::fputs(row, stdout);
    std::fflush(stdout);
    if (csv) {
      std::fputs(row, csv);
      std::fflush(csv);
    }
    return e;
  };
  std::printf("# autoencoder: %s, %d training images, batch %d, seed %llu, budget %g s%s\n", name.c_str(), train.size(),
              batches.batch_size(), (unsigned long long)a.seed, a.budget_s,
              a.max_steps > 0 ? (", at most " + std::to_string(a.max_steps) + " steps").c_str() : "");
  report();
  int next_eval = 1;
  int epoch = 0, i = batches.steps_per_epoch();
  bool failed = false;
  while (train_s < a.budget_s && (a.max_steps == 0 || step < a.max_steps) && !failed) {
    if (i == batches.steps_per_epoch()) {
      batches.start_epoch(epoch++);
      i = 0;
    }
    const Clock::time_point t0 = Clock::now();
    const nn::Batch b = batches.get(i++);
    const nn::Tensor target = nn::as_tensor(nn::as_matrix(b.x));
    const nn::Tensor logits = net.forward(b.x, nn::Mode::train);
    const nn::ReconstructionStats s = loss.forward_backward(logits, target);
    if (kfac) kfac->observe_sampled(net, logits, loss);  // --fisher sampled, on statistics steps
    net.backward(loss.grad());
    try {
      if (sgd) sgd->step();
      if (adam) adam->step();
#if KFAC_EXAMPLES_HAVE_KFAC
      if (kfac && a.adaptive) {
        auto after = [&] { return loss.forward(net.forward(b.x, nn::Mode::probe), target).mean_loss(); };
        kfac->step_adaptive(net, nn::AdaptiveLoss{nn::loss_curvature(loss), logits, s.mean_loss(), after});
      } else if (kfac) {
        kfac->step(net);
      }
#else
      if (kfac) kfac->step(net);
#endif
    } catch (const std::exception& e) {  // e.g. kfac::Error on non-finite products
      std::printf("# %s stopped at step %ld: %s\n", name.c_str(), step + 1, e.what());
      failed = true;
    }
    Kokkos::fence();
    train_s += std::chrono::duration<double>(Clock::now() - t0).count();
    ++step;
    if (!std::isfinite(s.loss_sum)) {
      std::printf("# %s stopped at step %ld: the training loss is not finite\n", name.c_str(), step);
      failed = true;
    }
    const bool last = failed || train_s >= a.budget_s || (a.max_steps > 0 && step >= a.max_steps);
    if (last || train_s * a.evals >= next_eval * a.budget_s) {  // every budget/evals seconds of training
      report();
      while (train_s * a.evals >= next_eval * a.budget_s) ++next_eval;
    }
  }
#if KFAC_EXAMPLES_HAVE_KFAC
  if (kfac && kfac->tuning()) {
    const auto t = *kfac->tuning();  // a copy: tuning() returns a value
    std::printf("# %s: %ld solves, last alpha %.4g mu %.4g, damping %.4g after %ld updates (last rho %.3g)\n",
                name.c_str(), t.solves(), t.last_step().alpha, t.last_step().mu, t.lambda(), t.damping_updates(),
                t.last_damping_update().rho);
  }
#endif
  std::printf("# %s: %ld steps in %.2f s (%.2f ms/step)\n", name.c_str(), step, train_s, 1e3 * train_s / double(step));
  if (csv) std::fclose(csv);
  return failed ? 3 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> kokkos_argv;
  std::vector<std::string> own;
  nn::split_kokkos_options(argc, argv, kokkos_argv, own);
  Args args;
  try {
    args = parse(own);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "autoencoder: %s\n", e.what());
    return 2;
  }
  if (args.help) {
    usage();
    return 0;
  }
  int kokkos_argc = int(kokkos_argv.size());
  Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_argv.data());
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "autoencoder: %s\n", e.what());
    return 1;
  }
}
