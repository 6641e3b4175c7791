/// \file step_cost.cpp
/// \brief Per-step cost of each optimizer of the examples' trainer (SGD, Adam, K-FAC, NG-SGD) on
/// the demo's MLP 784-256-256-10 or its CNN, measured in one run and printed as a ratio to the
/// plain SGD step.
///
/// A step is what the demo times: forward, loss, backward, the optimizer (with its
/// preconditioner). All trainers start from the same weights and step through the same batches,
/// one step of each in turn (the order rotating every round), so machine noise hits all of them
/// alike; each figure is the median (and the mean, which includes the steps that do extra work:
/// statistics updates every `--factor-every`/`--ngsgd-period` steps, decompositions every
/// `--inv-every`) over the timed steps after the warm-up steps.
///
/// Usage: bench_step_cost [--model mlp|cnn] [--batch 256] [--steps 200] [--warmup 20]
///                        [--optimizers sgd,ngsgd,kfac,adam] [--threads 1] [--data DIR]
///                        [--ngsgd-rank R] [--ngsgd-period N] [--factor-every N] [--inv-every N]
///                        [--clock wall|cpu]
/// `--clock cpu` times each step by the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID)
/// instead of the wall clock: with one BLAS thread that is the step's whole cost, and it is not
/// inflated when other processes share the cores (cache sharing still is).
/// Without the Fashion-MNIST files (or with --data none) the batches are random images.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "common/dataset.hpp"
#include "common/rng.hpp"
#include "common/trainer.hpp"

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

struct Args {
  std::string model = "mlp", data = "/usr/share/datasets/fashion-mnist";
  int batch = 256, steps = 200, warmup = 20, threads = 1;
  std::vector<nn::OptimizerKind> optimizers{nn::OptimizerKind::sgd, nn::OptimizerKind::ngsgd,
                                            nn::OptimizerKind::kfac, nn::OptimizerKind::adam};
  long ngsgd_rank = -1, ngsgd_period = 4;
  int factor_every = 0, inv_every = 0;
  bool cpu_clock = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "bench_step_cost: %s\n(see the header of benchmarks/step_cost.cpp)\n", why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + key).c_str());
    const std::string v = argv[++i];
    if (key == "--model") a.model = v;
    else if (key == "--data") a.data = v;
    else if (key == "--batch") a.batch = std::atoi(v.c_str());
    else if (key == "--steps") a.steps = std::atoi(v.c_str());
    else if (key == "--warmup") a.warmup = std::atoi(v.c_str());
    else if (key == "--threads") a.threads = std::atoi(v.c_str());
    else if (key == "--ngsgd-rank") a.ngsgd_rank = std::atol(v.c_str());
    else if (key == "--ngsgd-period") a.ngsgd_period = std::atol(v.c_str());
    else if (key == "--factor-every") a.factor_every = std::atoi(v.c_str());
    else if (key == "--inv-every") a.inv_every = std::atoi(v.c_str());
    else if (key == "--clock") {
      if (v != "wall" && v != "cpu") usage("--clock must be wall or cpu");
      a.cpu_clock = v == "cpu";
    }
    else if (key == "--optimizers") {
      a.optimizers.clear();
      for (std::size_t b = 0; b <= v.size();) {
        const std::size_t e = std::min(v.find(',', b), v.size());
        a.optimizers.push_back(nn::parse_optimizer(v.substr(b, e - b)));
        b = e + 1;
      }
    } else usage(("unknown option " + key).c_str());
  }
  if (a.model != "mlp" && a.model != "cnn") usage("--model must be mlp or cnn");
  if (a.batch < 1 || a.steps < 1 || a.warmup < 0) usage("--batch and --steps must be >= 1, --warmup >= 0");
  return a;
}

nn::Dataset random_images(int n, std::uint64_t seed) {
  nn::SplitMix64 rng(seed);
  std::vector<float> pixels(static_cast<std::size_t>(n) * 784);
  std::vector<int> labels(static_cast<std::size_t>(n));
  for (auto& p : pixels) p = float(rng.normal());
  for (auto& l : labels) l = int(rng.below(10));
  return nn::make_dataset(pixels, labels, 1, 28, 28, 10);
}

/// Milliseconds of the wall clock, or of this thread's CPU time.
double now_ms(bool cpu) {
  if (!cpu) return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}

int run(const Args& a) {
  if (a.threads > 0 && openblas_set_num_threads) openblas_set_num_threads(a.threads);
  const int needed = a.batch * (a.steps + a.warmup);
  nn::Dataset train;
  bool real = false;
  if (a.data != "none") {
    try {
      train = nn::load_fashion_mnist(a.data, "train", std::min(needed, 60000));
      real = true;
    } catch (const std::exception&) {
    }
  }
  if (!real) train = random_images(std::min(needed, 20000), 7);
  std::printf("step cost: model %s, batch %d, %d timed steps after %d warm-up, %d BLAS thread(s), %s, %s clock\n",
              a.model.c_str(), a.batch, a.steps, a.warmup, a.threads,
              real ? "Fashion-MNIST batches" : "random images", a.cpu_clock ? "thread CPU" : "wall");

  std::vector<std::unique_ptr<nn::Trainer>> trainers;
  for (nn::OptimizerKind k : a.optimizers) {
    nn::TrainSettings s;
    s.model = a.model;
    s.optimizer = k;
    s.batch = a.batch;
    s.kfac = nn::default_kfac(a.model);
    if (a.factor_every > 0) s.kfac.factor_update_steps = a.factor_every;
    if (a.inv_every > 0) s.kfac.inv_update_steps = a.inv_every;
    s.ngsgd.rank = a.ngsgd_rank;
    s.ngsgd.update_period = a.ngsgd_period;
    trainers.push_back(std::make_unique<nn::Trainer>(train, s));
  }
  const std::size_t n = trainers.size();
  std::vector<std::vector<double>> ms(n);
  const int per_epoch = trainers[0]->steps_per_epoch();
  for (int t = 0; t < a.warmup + a.steps; ++t) {
    const int epoch = t / per_epoch, step = t % per_epoch;
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = (j + std::size_t(t)) % n;  // rotate who goes first
      if (step == 0) trainers[i]->start_epoch(epoch);
      const double t0 = now_ms(a.cpu_clock);
      trainers[i]->step(step);
      const double t1 = now_ms(a.cpu_clock);
      if (t >= a.warmup) ms[i].push_back(t1 - t0);
    }
  }
  std::size_t sgd = n;
  for (std::size_t i = 0; i < n; ++i)
    if (a.optimizers[i] == nn::OptimizerKind::sgd) sgd = i;
  std::printf("%-8s %12s %12s %14s %14s\n", "method", "median ms", "mean ms", "median / sgd", "mean / sgd");
  for (std::size_t i = 0; i < n; ++i) {
    const double med = median(ms[i]), avg = mean(ms[i]);
    if (sgd < n)
      std::printf("%-8s %12.3f %12.3f %14.3f %14.3f\n", nn::to_string(a.optimizers[i]), med, avg,
                  med / median(ms[sgd]), avg / mean(ms[sgd]));
    else
      std::printf("%-8s %12.3f %12.3f %14s %14s\n", nn::to_string(a.optimizers[i]), med, avg, "-", "-");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  Kokkos::initialize();
  int rc = 0;
  try {
    rc = run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step_cost: %s\n", e.what());
    rc = 1;
  }
  Kokkos::finalize();
  return rc;
}
