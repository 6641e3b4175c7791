/// \file step_cost.cpp
/// \brief Per-step cost of each optimizer of the examples' trainer (SGD, Adam, K-FAC, NG-SGD),
/// measured in one run and printed as a ratio to the plain SGD step, and where K-FAC's time goes:
/// its phases and its overhead over forward + backward, for any number of K-FAC configurations
/// (inverse x decomposition interval) side by side.
///
/// A step is what the demo times: forward, loss, backward, the optimizer (with its
/// preconditioner). All trainers start from the same weights and step through the same batches,
/// one step of each in turn (the order rotating every round), so machine noise hits all of them
/// alike; each figure is the median (and the mean, which includes the steps that do extra work:
/// statistics updates every `--factor-every`/`--ngsgd-period` steps, decompositions every
/// `--inv-every`) over the timed steps after the warm-up steps.
///
/// Usage: bench_step_cost [--model mlp|cnn|peer-mlp|peer-cnn] [--batch 256] [--steps 200]
///                        [--warmup 20] [--optimizers sgd,ngsgd,kfac,adam] [--threads 1]
///                        [--data DIR] [--ngsgd-rank R] [--ngsgd-period N] [--factor-every N]
///                        [--inv-every N] [--kfac-configs eigen/1,cholesky/10/d1,eigen/1/r0.05,...]
///                        [--lr X] [--damping X] [--kl-clip X] [--decay X] [--clock wall|cpu]
/// `--kfac-configs` replaces the one K-FAC trainer by one per item `inverse/interval` (inverse
/// eigen or cholesky, a decomposition every `interval` steps; `/dN`: Options::decomposition_delay
/// N, the decompositions computed on a second host thread where the backend allows it: time
/// those with the wall clock, which the thread CPU clock does not see; `/rT`, eigen only:
/// Eigendecomposition::with_refresh_tolerance T; inverse randomized: kfac::RandomizedEigen,
/// `/kR` its rank, default the demo's) and prints the phase table:
/// observe (the observe_* and set_gradient calls), factor update, decomposition, precondition,
/// KL clip (with the write-back), the rest of step() (checks), the K-FAC overhead (all of it)
/// and forward + backward (the step without the overhead), each as median and amortized mean
/// per step, timed through the Kokkos Tools regions of kfac and of the examples' glue.
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
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
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
  /// K-FAC configurations (inverse, decomposition interval); empty: one, from the settings above.
  struct KfacConfig {
    std::string inverse;
    int every = 0;
    long delay = 0;
    double refresh = 0;
    int rank = 0;  // randomized: /kR, 0 = the demo's
  };
  std::vector<KfacConfig> kfac_configs;
  double lr = 0, damping = 0, kl_clip = -1, decay = -1;  // 0 / -1: the demo's
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
    else if (key == "--lr") a.lr = std::atof(v.c_str());
    else if (key == "--damping") a.damping = std::atof(v.c_str());
    else if (key == "--kl-clip") a.kl_clip = std::atof(v.c_str());
    else if (key == "--decay") a.decay = std::atof(v.c_str());
    else if (key == "--kfac-configs") {
      for (const std::string& item : bench::split(v)) {
        const auto parts = bench::split(item, '/');
        Args::KfacConfig c{parts[0], parts.size() > 1 ? std::atoi(parts[1].c_str()) : 0};
        bool ok = parts.size() >= 2 && (c.inverse == "eigen" || c.inverse == "cholesky" || c.inverse == "randomized") &&
                  c.every >= 1;
        for (std::size_t k = 2; ok && k < parts.size(); ++k) {
          const std::string& p = parts[k];
          if (p.size() > 1 && p[0] == 'd') ok = (c.delay = std::atol(p.c_str() + 1)) >= 1;
          else if (p.size() > 1 && p[0] == 'r') ok = c.inverse == "eigen" && (c.refresh = std::atof(p.c_str() + 1)) > 0 && c.refresh < 1;
          else if (p.size() > 1 && p[0] == 'k') ok = c.inverse == "randomized" && (c.rank = std::atoi(p.c_str() + 1)) >= 1;
          else ok = false;
        }
        if (!ok)
          usage(("--kfac-configs: expected eigen/N, cholesky/N or randomized/N, then /dD, (eigen) /rT and (randomized) /kR, got " +
                 item).c_str());
        a.kfac_configs.push_back(c);
      }
    }
    else if (key == "--clock") {
      if (v != "wall" && v != "cpu") usage("--clock must be wall or cpu");
      a.cpu_clock = v == "cpu";
    }
    else if (key == "--optimizers") {
      a.optimizers.clear();
      for (const std::string& item : bench::split(v)) a.optimizers.push_back(nn::parse_optimizer(item));
    } else usage(("unknown option " + key).c_str());
  }
  if (a.model != "mlp" && a.model != "cnn" && a.model != "peer-mlp" && a.model != "peer-cnn")
    usage("--model must be mlp, cnn, peer-mlp or peer-cnn");
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

/// Times the Kokkos Tools regions named "kfac::..." for the trainer that is stepping.
struct RegionClock {
  bool cpu = false;
  bool active = false;                               // inside a timed step
  std::vector<std::pair<std::string, double>> open;  // name, start
  std::map<std::string, double> step_ms;             // this step's time per region

  static RegionClock& get() {
    static RegionClock c;
    return c;
  }
  static void push(const char* name) { get().open.emplace_back(name, bench::now_ms(get().cpu)); }
  static void pop() {
    RegionClock& c = get();
    if (c.open.empty()) return;
    const auto [name, t0] = c.open.back();
    c.open.pop_back();
    if (c.active && name.rfind("kfac::", 0) == 0) c.step_ms[name] += bench::now_ms(c.cpu) - t0;
  }
};

/// The phase columns of the table, and the region each one times.
struct Phase {
  const char *label, *region;
};
const std::vector<Phase>& phases() {
  static const std::vector<Phase> p{{"observe", "kfac::examples::observe"},
                                    {"factor update", "kfac::step::statistics"},
                                    {"decomposition", "kfac::step::decompose"},
                                    {"precondition", "kfac::step::precondition"},
                                    {"KL clip", "kfac::step::kl_clip"}};
  return p;
}

struct Series {
  std::string label;
  bool kfac = false;
  std::vector<double> step;                       // the whole step
  std::map<std::string, std::vector<double>> ms;  // per table column
};

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
  std::vector<Series> series;
  auto add = [&](nn::OptimizerKind k, const std::string& inverse, int inv_every, long delay, double refresh, int rank) {
    nn::TrainSettings s;
    s.model = a.model;
    s.optimizer = k;
    s.batch = a.batch;
    s.lr = a.lr;
    s.kfac = nn::default_kfac(a.model);
    if (a.factor_every > 0) s.kfac.factor_update_steps = a.factor_every;
    if (a.inv_every > 0) s.kfac.inv_update_steps = a.inv_every;
    if (inv_every > 0) s.kfac.inv_update_steps = inv_every;
    if (!inverse.empty()) s.kfac.inverse = inverse;
    s.kfac.decomposition_delay = delay;
    s.kfac.eigen_refresh = refresh;
    if (rank > 0) s.kfac.rank = rank;
    if (a.damping > 0) s.kfac.damping = a.damping;
    if (a.kl_clip >= 0) s.kfac.kl_clip = a.kl_clip;
    if (a.decay >= 0) s.kfac.factor_decay = a.decay;
    s.ngsgd.rank = a.ngsgd_rank;
    s.ngsgd.update_period = a.ngsgd_period;
    trainers.push_back(std::make_unique<nn::Trainer>(train, s));
    Series r;
    r.kfac = k == nn::OptimizerKind::kfac;
    r.label = r.kfac ? s.kfac.inverse + "/" + std::to_string(s.kfac.inv_update_steps) : nn::to_string(k);
    if (r.kfac && delay > 0) r.label += "/d" + std::to_string(delay);
    if (r.kfac && refresh > 0) {
      char t[32];
      std::snprintf(t, sizeof t, "/r%g", refresh);
      r.label += t;
    }
    if (r.kfac && s.kfac.inverse == "randomized") r.label += "/k" + std::to_string(s.kfac.rank);
    series.push_back(std::move(r));
  };
  for (nn::OptimizerKind k : a.optimizers) {
    if (k != nn::OptimizerKind::kfac || a.kfac_configs.empty()) add(k, "", 0, 0, 0, 0);
    else
      for (const auto& c : a.kfac_configs) add(k, c.inverse, c.every, c.delay, c.refresh, c.rank);
  }

  RegionClock& clock = RegionClock::get();
  clock.cpu = a.cpu_clock;
  Kokkos::Tools::Experimental::set_push_region_callback(&RegionClock::push);
  Kokkos::Tools::Experimental::set_pop_region_callback(&RegionClock::pop);
  const std::size_t n = trainers.size();
  const int per_epoch = trainers[0]->steps_per_epoch();
  for (int t = 0; t < a.warmup + a.steps; ++t) {
    const int epoch = t / per_epoch, step = t % per_epoch;
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = (j + std::size_t(t)) % n;  // rotate who goes first
      if (step == 0) trainers[i]->start_epoch(epoch);
      clock.step_ms.clear();
      clock.active = true;
      const double t0 = bench::now_ms(a.cpu_clock);
      trainers[i]->step(step);
      const double t1 = bench::now_ms(a.cpu_clock);
      clock.active = false;
      if (t < a.warmup) continue;
      Series& r = series[i];
      r.step.push_back(t1 - t0);
      if (!r.kfac) continue;
      const double overhead = clock.step_ms["kfac::examples::kfac"];
      double phased = 0;
      for (const Phase& p : phases()) {
        const double v = clock.step_ms[p.region];
        r.ms[p.label].push_back(v);
        phased += v;
      }
      r.ms["other"].push_back(overhead - phased);
      r.ms["K-FAC overhead"].push_back(overhead);
      r.ms["forward + backward"].push_back(t1 - t0 - overhead);
    }
  }
  Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
  Kokkos::Tools::Experimental::set_pop_region_callback(nullptr);

  std::size_t sgd = n;
  for (std::size_t i = 0; i < n; ++i)
    if (series[i].label == "sgd") sgd = i;
  std::printf("%-16s %12s %12s %14s %14s\n", "method", "median ms", "mean ms", "median / sgd", "mean / sgd");
  for (const Series& r : series) {
    const double med = bench::median(r.step), avg = bench::mean(r.step);
    if (sgd < n)
      std::printf("%-16s %12.3f %12.3f %14.3f %14.3f\n", r.label.c_str(), med, avg,
                  med / bench::median(series[sgd].step), avg / bench::mean(series[sgd].step));
    else
      std::printf("%-16s %12.3f %12.3f %14s %14s\n", r.label.c_str(), med, avg, "-", "-");
  }

  bool any_kfac = false;
  for (const Series& r : series) any_kfac = any_kfac || r.kfac;
  if (!any_kfac) return 0;
  std::vector<std::string> columns;
  for (const Phase& p : phases()) columns.push_back(p.label);
  for (const char* c : {"other", "K-FAC overhead", "forward + backward"}) columns.push_back(c);
  std::printf("\nK-FAC per step, ms, median / amortized mean over the timed steps:\n\n| config |");
  for (const auto& c : columns) std::printf(" %s |", c.c_str());
  std::printf(" overhead / (fwd + bwd) |\n|---|");
  for (std::size_t c = 0; c <= columns.size(); ++c) std::printf("---:|");
  std::printf("\n");
  for (Series& r : series) {
    if (!r.kfac) continue;
    std::printf("| %s |", r.label.c_str());
    for (const auto& c : columns) std::printf(" %.1f / %.1f |", bench::median(r.ms[c]), bench::mean(r.ms[c]));
    std::printf(" %.2f |\n", bench::mean(r.ms["K-FAC overhead"]) / bench::mean(r.ms["forward + backward"]));
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
