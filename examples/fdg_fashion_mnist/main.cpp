// FDG on Fashion-MNIST: an MLP split into K stages on K ranks (kfac::Pipeline, decoupled training
// with delayed gradients), against plain back-propagation on rank 0 alone and synchronous
// model-parallel back-propagation on the same K ranks. Prints progress, a table per run, means
// over seeds, the speed ratios from this one run, and the speed-up modelled for K = 2..8 from
// the measured per-layer times; writes a CSV log and a plot.
//
//   OPENBLAS_NUM_THREADS=1 mpiexec -n 2 build/examples/fdg_fashion_mnist --epochs 3 --seeds 1,2,3
//
// docs/pipeline.md has the flags and the measured table.
#include <mpi.h>

#include <kfac/pipeline/pipeline.hpp>

#include "common/cross_entropy.hpp"
#include "common/dataset.hpp"
#include "common/mlp_stage.hpp"
#include "fashion_mnist/report.hpp"

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

struct Args {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string out = "results/fdg";
  std::vector<int> widths = {784, 512, 512, 512, 512, 10};
  std::vector<std::string> modes = {"bp", "sync", "fdg"};
  std::vector<double> betas = {1.0, 0.5};
  std::vector<std::uint64_t> seeds = {1, 2, 3};
  int epochs = 3, batch = 128, train_subset = 0, test_subset = 0;
  double lr = 0.05, momentum = 0.9, target = 0.85, kfac_lr = 0.1;
  double require_acc = 0;  ///< exit 1 when a run ends below this test accuracy (the ctest run)
  kfac::FdgUpdateOrder order = kfac::FdgUpdateOrder::update_then_forward;
  bool help = false;
};

void usage() {
  std::printf(
      "usage: mpiexec -n K fdg_fashion_mnist [options]   (K ranks: the FDG and synchronous runs use K stages)\n"
      "  --modes LIST          comma list of bp, sync, fdg, kfac, fdg-kfac (default bp,sync,fdg)\n"
      "  --betas LIST          gradient-shrinking factors of the fdg runs, in (0, 1] (default 1,0.5)\n"
      "  --update-order O      update-then-forward (the authors' code; default) or forward-then-update\n"
      "  --widths LIST         the MLP's layer widths, 784 first and 10 last (default 784,512,512,512,512,10)\n"
      "  --seeds LIST          initialisation and batch-order seeds (default 1,2,3)\n"
      "  --epochs N            epochs per run (default 3)\n"
      "  --batch N             samples per batch (default 128)\n"
      "  --lr X --momentum X   SGD settings (default 0.05, 0.9)\n"
      "  --kfac-lr X           learning rate of the kfac and fdg-kfac runs (default 0.1)\n"
      "  --target X            accuracy for the time-to-target column (default 0.85)\n"
      "  --train-subset N --test-subset N   the first N samples only\n"
      "  --data DIR            Fashion-MNIST files (default /usr/share/datasets/fashion-mnist)\n"
      "  --out DIR             log.csv and the plot, created if missing (default results/fdg)\n"
      "  --require-acc X       exit 1 when a run ends below this test accuracy\n"
      "  -h, --help            this text\n");
}

template <class T>
std::vector<T> list_of(const std::string& s) {
  std::vector<T> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::stringstream is(item);
    T x;
    if (!(is >> x)) throw std::invalid_argument("cannot read '" + item + "' in '" + s + "'");
    v.push_back(x);
  }
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k.rfind("--kokkos-", 0) == 0) continue;
    if (k == "-h" || k == "--help") {
      a.help = true;
      return a;
    }
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--data") a.data = v;
    else if (k == "--out") a.out = v;
    else if (k == "--widths") a.widths = list_of<int>(v);
    else if (k == "--modes") a.modes = list_of<std::string>(v);
    else if (k == "--betas") a.betas = list_of<double>(v);
    else if (k == "--seeds") a.seeds = list_of<std::uint64_t>(v);
    else if (k == "--epochs") a.epochs = std::stoi(v);
    else if (k == "--batch") a.batch = std::stoi(v);
    else if (k == "--train-subset") a.train_subset = std::stoi(v);
    else if (k == "--test-subset") a.test_subset = std::stoi(v);
    else if (k == "--lr") a.lr = std::stod(v);
    else if (k == "--kfac-lr") a.kfac_lr = std::stod(v);
    else if (k == "--momentum") a.momentum = std::stod(v);
    else if (k == "--target") a.target = std::stod(v);
    else if (k == "--require-acc") a.require_acc = std::stod(v);
    else if (k == "--update-order") {
      if (v == "update-then-forward") a.order = kfac::FdgUpdateOrder::update_then_forward;
      else if (v == "forward-then-update") a.order = kfac::FdgUpdateOrder::forward_then_update;
      else throw std::invalid_argument("--update-order: update-then-forward or forward-then-update, not " + v);
    } else throw std::invalid_argument("unknown flag " + k + " (see --help)");
  }
  for (const auto& m : a.modes)
    if (m != "bp" && m != "sync" && m != "fdg" && m != "kfac" && m != "fdg-kfac")
      throw std::invalid_argument("--modes: bp, sync, fdg, kfac or fdg-kfac, not " + m);
  return a;
}

/// F+B cost of layer i (multiply-adds per sample): the first layer needs no input gradient.
double layer_cost(const std::vector<int>& w, int i) { return double(w[i]) * w[i + 1] * (i == 0 ? 2 : 3); }

/// Cut points (K + 1 of them) of the contiguous split of the layers that minimises the costliest stage.
std::vector<int> balanced_cuts(const std::vector<double>& cost, int stages) {
  const int layers = int(cost.size());
  std::vector<int> best, cur = {0};
  double best_max = HUGE_VAL;
  std::function<void(int, int, double)> go = [&](int from, int left, double worst) {
    if (left == 1) {
      double c = 0;
      for (int i = from; i < layers; ++i) c += cost[i];
      if (std::max(worst, c) < best_max) {
        best_max = std::max(worst, c);
        best = cur;
        best.push_back(layers);
      }
      return;
    }
    double c = 0;
    for (int end = from + 1; end <= layers - left + 1; ++end) {
      c += cost[end - 1];
      cur.push_back(end);
      go(end, left - 1, std::max(worst, c));
      cur.pop_back();
    }
  };
  go(0, stages, 0.0);
  return best;
}

struct Run {
  demo::RunSummary summary;
  std::string mode;
  int stages = 1;
  double beta = 1, samples_per_s = 0;
  std::vector<double> stage_compute, layer_seconds;  ///< per step, per stage / per layer (rank 0's view)
  double step_seconds = 0;
};

double max_over(double v, MPI_Comm c) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, c);
  return v;
}

/// Test accuracy of the model split over the stage ranks: batches go down the chain in eval mode.
double evaluate(nn::MlpStage& stage, int k, int stages, const nn::Dataset& test) {
  const int n = test.size(), chunk = 1000;
  long correct = 0;
  if (k < stages) {
    using HostMatrix = nn::MlpStage::HostMatrix;  // what travels between the stage ranks
    const HostMatrix all = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), nn::as_matrix(test.images));
    auto labels = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), test.labels);
    for (int first = 0; first < n; first += chunk) {
      const int m = std::min(chunk, n - first);
      HostMatrix x;
      if (k == 0) {
        x = Kokkos::subview(all, std::make_pair(first, first + m), Kokkos::ALL);
      } else {
        x = HostMatrix("nn::eval::x", m, stage.input_features());
        MPI_Recv(x.data(), int(x.size()), MPI_FLOAT, k - 1, 11, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      }
      const HostMatrix y = stage.predict(x);
      if (k + 1 < stages) {
        MPI_Send(y.data(), int(y.size()), MPI_FLOAT, k + 1, 11, MPI_COMM_WORLD);
      } else {
        for (int i = 0; i < m; ++i) {
          int arg = 0;
          for (int j = 1; j < int(y.extent(1)); ++j)
            if (y(i, j) > y(i, arg)) arg = j;
          correct += arg == labels(first + i) ? 1 : 0;
        }
      }
    }
  }
  MPI_Bcast(&correct, 1, MPI_LONG, stages - 1, MPI_COMM_WORLD);
  return double(correct) / double(n);
}

Run train_one(const Args& args, const std::string& mode, int stages, double beta, std::uint64_t seed,
              const nn::Dataset& train, const nn::Dataset& test, demo::CsvLog* log, demo::Progress& progress) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::vector<int>& w = args.widths;
  std::vector<double> cost;
  for (int i = 0; i + 1 < int(w.size()); ++i) cost.push_back(layer_cost(w, i));
  const std::vector<int> cuts = balanced_cuts(cost, stages);
  const int k = rank < stages ? rank : 0;
  const bool kfac = mode == "kfac" || mode == "fdg-kfac";
  const double lr = kfac ? args.kfac_lr : args.lr;
  nn::MlpStage stage(w, cuts[k], cuts[k + 1], seed, nn::SgdOptions{}.with_lr(lr).with_momentum(args.momentum));
  if (kfac) {  // the MLP's K-FAC settings of the main demo with exact damped inverses (its --inverse cholesky), per stage
    nn::KfacSettings s;
    s.lr = lr;
    s.momentum = args.momentum;
    s.inverse = "cholesky";
    s.damping = 0.3;
    s.kl_clip = 1e-2;
    stage.enable_kfac(s);
  }
  const auto schedule = mode == "sync" ? kfac::PipelineSchedule::synchronous : kfac::PipelineSchedule::fdg;
  kfac::Pipeline<nn::MlpStage> pipe(kfac::MpiComm(MPI_COMM_WORLD), stage,
                                    kfac::PipelineOptions{}.with_stages(stages).with_batch_size(args.batch)
                                        .with_beta(beta).with_schedule(schedule).with_update_order(args.order));
  nn::Batcher batcher(train, args.batch, seed);
  nn::SoftmaxCrossEntropy xent;
  nn::BatchStats stats;
  // The pipeline exchanges host tensors; the batches and the loss live in nn::ExecSpace's memory
  // (the mirrors are the same views when that is the host).
  auto input = [&](long i) {
    return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), nn::as_matrix(batcher.get(int(i)).x));
  };
  auto loss = [&](long i, const nn::MlpStage::HostMatrix& out) {
    const nn::Batch b = batcher.get(int(i));
    const nn::Matrix dev = Kokkos::create_mirror_view_and_copy(nn::MemSpace(), out);
    stats += xent.forward_backward(nn::as_tensor(dev), b.y);
    return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), nn::as_matrix(xent.grad()));
  };

  Run run;
  run.mode = mode;
  run.stages = stages;
  run.beta = beta;
  char name[64];
  if (mode == "fdg" || mode == "fdg-kfac")
    std::snprintf(name, sizeof name, mode == "fdg" ? "fdg%d_b%g" : "fdg%d-kfac_b%g", stages, beta);
  else if (mode == "sync")
    std::snprintf(name, sizeof name, "sync%d", stages);
  else
    std::snprintf(name, sizeof name, "%s", mode.c_str());
  run.summary.optimizer = name;
  run.summary.lr = lr;
  run.summary.seed = seed;
  const int steps = batcher.steps_per_epoch();
  run.summary.steps_per_epoch = steps;
  double wall = 0, compute = 0, pipe_seconds = 0;
  long total_steps = 0;
  for (int e = 0; e < args.epochs; ++e) {
    batcher.start_epoch(e);
    stats = nn::BatchStats{};
    const kfac::PipelineReport rep = pipe.train(steps, input, loss);
    const double epoch_s = max_over(rep.seconds, MPI_COMM_WORLD);
    wall += epoch_s;
    pipe_seconds += rep.seconds;
    compute += rep.compute_seconds();
    total_steps += rep.steps;
    double mean_loss = stats.mean_loss();
    MPI_Bcast(&mean_loss, 1, MPI_DOUBLE, stages - 1, MPI_COMM_WORLD);
    const double acc = evaluate(stage, rank, stages, test);
    const demo::EvalPoint pt{e + 1, long(e + 1) * steps, wall, mean_loss, acc};
    run.summary.evals.push_back(pt);
    if (log) log->row(run.summary, pt);
    char line[256];
    std::snprintf(line, sizeof line, "%-10s seed %llu epoch %d/%d: %7.0f samples/s, loss %.4f, test %.2f%%, %s",
                  name, (unsigned long long)seed, e + 1, args.epochs, double(steps) * args.batch / epoch_s,
                  mean_loss, 100 * acc, demo::format_seconds(wall).c_str());
    if (rank == 0) progress.finish(line);
  }
  run.summary.train_s = wall;
  run.samples_per_s = double(steps) * args.epochs * args.batch / wall;
  // Per-step compute of every stage, and this stage's per-layer times, gathered on rank 0.
  const int size = [] { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }();
  double mine = rank < stages && total_steps ? compute / double(total_steps) : 0.0;
  run.stage_compute.assign(size, 0.0);
  MPI_Gather(&mine, 1, MPI_DOUBLE, run.stage_compute.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  run.stage_compute.resize(stages);
  run.step_seconds = max_over(rank < stages && total_steps ? pipe_seconds / double(total_steps) : 0.0, MPI_COMM_WORLD);
  std::vector<double> layers(cost.size(), 0.0);
  if (rank < stages)
    for (int i = cuts[k]; i < cuts[k + 1]; ++i) layers[i] = stage.layer_seconds()[i - cuts[k]] / double(total_steps);
  MPI_Allreduce(MPI_IN_PLACE, layers.data(), int(layers.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  run.layer_seconds = layers;
  return run;
}

int run_all(const Args& args) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (openblas_set_num_threads) openblas_set_num_threads(1);
  const bool lead = rank == 0;
  // Rank 0 writes the outputs. It opens them before any collective, and every rank learns
  // whether it could: a rank that throws alone would leave the others waiting for it.
  std::unique_ptr<demo::CsvLog> log;
  std::string cannot;
  if (lead) {
    try {
      demo::make_output_dir(args.out);
      log = std::make_unique<demo::CsvLog>(args.out + "/log.csv", false);
    } catch (const std::exception& e) {
      cannot = e.what();
    }
  }
  int failed = cannot.empty() ? 0 : 1;
  MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (failed) throw std::runtime_error(lead ? cannot : "rank 0 cannot write to " + args.out);
  const nn::Dataset train = nn::load_fashion_mnist(args.data, "train", args.train_subset);
  const nn::Dataset test = nn::load_fashion_mnist(args.data, "t10k", args.test_subset);
  if (lead) {
    std::printf("FDG on Fashion-MNIST: MLP");
    for (int x : args.widths) std::printf(" %d", x);
    std::printf(", batch %d, lr %g, momentum %g, %d epochs, %d ranks (one BLAS thread each)\n", args.batch, args.lr,
                args.momentum, args.epochs, size);
  }
  demo::Progress progress;
  std::vector<Run> runs;
  for (std::uint64_t seed : args.seeds)
    for (const std::string& mode : args.modes)
      for (double beta : mode.rfind("fdg", 0) == 0 ? args.betas : std::vector<double>{1.0})
        runs.push_back(train_one(args, mode, mode == "bp" || mode == "kfac" ? 1 : size, beta, seed, train, test,
                                 log.get(), progress));
  if (!lead) return 0;

  // Means over seeds per configuration.
  struct Row {
    std::string name;
    std::vector<double> sps, acc, tt;
    const Run* any = nullptr;
  };
  std::vector<Row> rows;
  for (const Run& r : runs) {
    auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& x) { return x.name == r.summary.optimizer; });
    if (it == rows.end()) it = rows.insert(rows.end(), Row{r.summary.optimizer, {}, {}, {}, &r});
    it->sps.push_back(r.samples_per_s);
    it->acc.push_back(r.summary.final_acc());
    it->tt.push_back(r.summary.time_to(args.target));
  }
  std::printf("\n| run | seeds | samples/s | final test acc | time to %.0f%% |\n|---|---|---|---|---|\n", 100 * args.target);
  for (const Row& r : rows) {
    const demo::Spread s = demo::spread(r.sps), a = demo::spread(r.acc), t = demo::spread(r.tt);
    std::printf("| %s | %d | %.0f ± %.0f | %.2f%% ± %.2f | %s |\n", r.name.c_str(), s.n, s.mean, s.sd, 100 * a.mean,
                100 * a.sd, demo::format_seconds(t.mean).c_str());
  }
  auto mean_of = [&](const std::string& name, int what) {
    for (const Row& r : rows)
      if (r.name == name) return demo::spread(what == 0 ? r.sps : r.acc).mean;
    return std::numeric_limits<double>::quiet_NaN();
  };
  const std::string sync = "sync" + std::to_string(size);
  std::printf("\nratios from this run (means over seeds; the machine's load: see uptime):\n");
  for (const Row& r : rows) {
    if (r.name.rfind("fdg", 0) != 0) continue;
    if (r.name.find("kfac") != std::string::npos) {
      std::printf("  %s: samples/s %.2fx kfac (1 rank); final accuracy %+.2f points vs kfac\n", r.name.c_str(),
                  mean_of(r.name, 0) / mean_of("kfac", 0), 100 * (mean_of(r.name, 1) - mean_of("kfac", 1)));
      continue;
    }
    std::printf("  %s: samples/s %.2fx %s, %.2fx bp (1 rank); final accuracy %+.2f points vs bp\n", r.name.c_str(),
                mean_of(r.name, 0) / mean_of(sync, 0), sync.c_str(), mean_of(r.name, 0) / mean_of("bp", 0),
                100 * (mean_of(r.name, 1) - mean_of("bp", 1)));
  }
  // Model: per-layer compute of plain BP (bp run, per step) split evenly into K stages, plus the
  // per-step overhead the K = `size` FDG run measured (step time minus its slowest stage's
  // compute), times the fill/drain factor n / (n + 2(K - 1)).
  const Run* bp = nullptr;
  const Run* fdg = nullptr;
  for (const Run& r : runs) {
    if (r.mode == "bp" && !bp) bp = &r;
    if (r.mode == "fdg" && !fdg) fdg = &r;
  }
  if (bp && fdg && size > 1) {
    double t_bp = 0;
    for (double x : bp->layer_seconds) t_bp += x;
    const double slowest = *std::max_element(fdg->stage_compute.begin(), fdg->stage_compute.end());
    const double overhead = std::max(0.0, fdg->step_seconds - slowest);
    const double n = bp->summary.steps_per_epoch;
    std::printf("\nmodelled FDG speed-up over plain BP (per-layer BP compute %.2f ms/step; overhead %.2f ms/step "
                "measured at K = %d; stage compute",
                1e3 * t_bp, 1e3 * overhead, size);
    for (double c : fdg->stage_compute) std::printf(" %.2f", 1e3 * c);
    std::printf(" ms/step)\n| K | even split | this MLP's layers, best contiguous split |\n|---|---|---|\n");
    for (int K = 2; K <= 8; ++K) {
      const double fill = n / (n + 2.0 * (K - 1));
      const double even = t_bp / (t_bp / K + overhead) * fill;
      std::printf("| %d | %.2fx |", K, even);
      if (K <= int(bp->layer_seconds.size())) {
        const std::vector<int> cuts = balanced_cuts(bp->layer_seconds, K);
        double worst = 0;
        for (int s = 0; s < K; ++s) {
          double c = 0;
          for (int i = cuts[s]; i < cuts[s + 1]; ++i) c += bp->layer_seconds[i];
          worst = std::max(worst, c);
        }
        std::printf(" %.2fx |\n", t_bp / (worst + overhead) * fill);
      } else {
        std::printf(" - (fewer layers than stages) |\n");
      }
    }
  }
  std::vector<const demo::RunSummary*> shown;
  for (const Run& r : runs)
    if (r.summary.seed == args.seeds.front()) shown.push_back(&r.summary);
  demo::plot(args.out, log->path(), shown,
             "FDG on Fashion-MNIST, " + std::to_string(size) + " ranks, seed " + std::to_string(args.seeds.front()));
  std::printf("log: %s\n", log->path().c_str());
  for (const Run& r : runs)
    if (r.summary.final_acc() < args.require_acc) {
      std::printf("FAILED: %s seed %llu ended at %.2f%% test accuracy, below --require-acc %.2f%%\n",
                  r.summary.optimizer.c_str(), (unsigned long long)r.summary.seed, 100 * r.summary.final_acc(),
                  100 * args.require_acc);
      return 1;
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    std::vector<char*> kokkos_argv{argv[0]};
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]).rfind("--kokkos-", 0) == 0) kokkos_argv.push_back(argv[i]);
    int kokkos_argc = int(kokkos_argv.size());
    Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_argv.data());
    try {
      const Args args = parse(argc, argv);
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      if (args.help && rank == 0) usage();
      rc = args.help ? 0 : run_all(args);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fdg_fashion_mnist: %s\n", e.what());
      rc = 1;
    }
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
