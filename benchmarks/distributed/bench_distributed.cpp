/// \file bench_distributed.cpp
/// \brief Distributed K-FAC under MPI: decomposition and preconditioning time, bytes per phase
/// and memory per rank for COMM-OPT, HYBRID and MEM-OPT, each beside kfac::CostModel's
/// prediction for the same layers, world size and options.
///
/// Run it under mpiexec with 1, 2, ... ranks (run.sh does 1 and 2 and prints the speedup).
/// Method, per model and strategy:
/// - data: the global batch is made of shards; rank r observes shards r S .. r S + S - 1
///   (`--shards S`, default 1), each a fresh random micro-batch on every factor update,
///   determined by the shard's index. A one-rank run with `--shards 2` therefore builds the same
///   factors as two ranks with one shard each, and decomposes the same matrices (syevd's time
///   depends on the spectrum, so comparing different matrices would blur the speedup).
/// - warm-up: `--warmup` steps (even) with a factor update every step, so the factors are full
///   rank; decompositions every 2 steps. Bytes are read here: step 1 carries factor averaging +
///   gradients, step 2 adds decompositions.
/// - timed: factors are frozen (the factor interval jumps to 2^40 after the warm-up) and
///   decompositions still come every 2 steps, so timed steps alternate "decompose + precondition"
///   and "precondition only" with identical work otherwise. Every step starts after an
///   MPI_Barrier; its time is the largest over ranks. The decomposition phase is the median over
///   `--reps` repetitions of (decomposing step - following plain step); preconditioning is the
///   median plain step (GEMMs, gradient broadcasts when f < 1, KL clip, copies). Minima and CPU
///   time are printed too: on a machine shared with other work they show what was disturbed.
/// - training schedule: a second Preconditioner runs `--schedule-reps` windows of
///   `--schedule-inv` steps with fresh observations and a factor update every step and a
///   decomposition every `--schedule-inv` steps; its mean step (observe + step(), the largest
///   over ranks) is printed beside CostPrediction::step_seconds() for the same schedule, with the
///   observation rows of the global batch (factor computation included), and their ratio.
/// - baseline: with several ranks, rank 0 also runs a one-rank Preconditioner (MPI_COMM_SELF) on
///   the whole global batch, its step pairs interleaved with the distributed ones (the other ranks
///   wait at a barrier), so the speedup compares runs seconds apart on the same matrices.
/// - per-rank decomposition: after the run every rank times LAPACK dsyevd, called directly, on
///   the factors it decomposes: the measured counterpart of the model's per-rank compute time.
/// - memory: Preconditioner::memory_report() on every rank after the last step.
/// The model's figures are measured at start-up on all ranks at once (`--figures defaults` uses
/// MachineFigures{} instead). `--calibrate` only prints the figures; `--resnet50-table` prints the
/// model's ResNet-50 table (one rank).
///
/// Usage: mpiexec -n N bench_distributed [--model mlp|resnet|small|all] [--strategies comm,hybrid,mem]
///          (each also as comm+own, hybrid+own, mem+own: with Kaisa::reduce_to_owner)
///          [--reps 5] [--warmup 6] [--batch 256] [--conv-batch 16] [--shards 1]
///          [--schedule-inv 10] [--schedule-reps 3] [--overlap 1|0 (Kaisa::overlap_communication)]
///          [--figures measured|defaults] [--csv FILE] [--calibrate]
///          [--resnet50-table [--bandwidth B] [--latency L] [--eigen-seconds-per-n3 S] [--gemm-flops F]]
/// Exit status: 0, or 1 when measured bytes or memory differ from the model (they are exact
/// predictions), 2 for bad arguments.

#include <cblas.h>
#include <dlfcn.h>
#include <lapacke.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/planning/calibration.hpp>
#include <kfac/planning/cost_model.hpp>
#include <kfac/kfac.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using Host = Kokkos::DefaultHostExecutionSpace;
using Pre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V4 = Kokkos::View<double****, Kokkos::LayoutRight, Kokkos::HostSpace>;
using Clock = std::chrono::steady_clock;

int g_rank = 0, g_size = 1;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
/// CPU time of this process. OpenMPI ranks spin while they wait, so on an idle machine this
/// tracks wall time; on a shared one it leaves out the time the rank was descheduled.
double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}
double max_over_ranks(double v) {
  double r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return r;
}
std::vector<double> gather(double v) {
  std::vector<double> all(std::size_t(g_size), 0.0);
  MPI_Allgather(&v, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
  return all;
}
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

/// OpenBLAS's thread count, looked up at run time (libopenblas is reached through libblas.so.3).
int blas_threads() {
  void* p = dlsym(RTLD_DEFAULT, "openblas_get_num_threads");
  if (!p) return -1;
  int (*get)() = nullptr;
  std::memcpy(&get, &p, sizeof(get));
  return get();
}

// ---------------------------------------------------------------- models
/// One layer of a benchmark model with the shapes of its observations.
struct Spec {
  enum Type { dense, conv, batch_norm } type;
  std::string name;
  int in = 0, out = 0;          // features or channels
  int k = 1, stride = 1, pad = 0;
  int hw = 1;                   // input height = width (conv, batch norm)
  bool bias = true;             // conv: ResNets' convolutions have none
  int out_hw() const { return type == conv ? (hw + 2 * pad - k) / stride + 1 : hw; }

  template <class F>
  void visit(F&& f) const {
    if (type == dense) f(kfac::Dense(in, out));
    else if (type == conv)
      f(kfac::Conv2d(in, out, k, k).with_stride(stride, stride).with_padding(pad, pad).with_bias(bias));
    else f(kfac::BatchNorm2d(in));
  }
};

struct Model {
  std::string name, description;
  int batch = 0;  // per shard
  std::vector<Spec> layers;
};

Model mlp(int batch) {
  Model m{"mlp", "MLP 784-1024-1024-10 (dense, bias)", batch, {}};
  m.layers = {{Spec::dense, "fc1", 784, 1024}, {Spec::dense, "fc2", 1024, 1024},
              {Spec::dense, "fc3", 1024, 10}};
  return m;
}

/// ResNet-18's stem and first two stages on 16x16 inputs: a 3x3 stem, two 64-channel basic
/// blocks, two 128-channel basic blocks (the first strided, with a 1x1 projection shortcut),
/// bias-free convolutions each followed by BatchNorm, and a 128 -> 10 classifier. A factors:
/// 27, 5 x 576, 64, 3 x 1152, 129; G factors up to 128.
Model resnet_like(int batch) {
  Model m{"resnet", "ResNet-18 stages 1-2 (10 conv + 10 BN + fc, 16x16 input)", batch, {}};
  auto conv = [&](const std::string& n, int c, int o, int k, int s, int hw) {
    m.layers.push_back({Spec::conv, n, c, o, k, s, k / 2, hw, false});
    m.layers.push_back({Spec::batch_norm, n + ".bn", o, o, 1, 1, 0, m.layers.back().out_hw()});
  };
  conv("stem", 3, 64, 3, 1, 16);
  conv("layer1.0.conv1", 64, 64, 3, 1, 16);
  conv("layer1.0.conv2", 64, 64, 3, 1, 16);
  conv("layer1.1.conv1", 64, 64, 3, 1, 16);
  conv("layer1.1.conv2", 64, 64, 3, 1, 16);
  conv("layer2.0.conv1", 64, 128, 3, 2, 16);
  conv("layer2.0.conv2", 128, 128, 3, 1, 8);
  conv("layer2.0.downsample", 64, 128, 1, 2, 16);
  conv("layer2.1.conv1", 128, 128, 3, 1, 8);
  conv("layer2.1.conv2", 128, 128, 3, 1, 8);
  m.layers.push_back({Spec::dense, "fc", 128, 10});
  return m;
}

/// Small layers for the ctest smoke run: every code path, a second of work.
Model small(int batch) {
  Model m{"small", "small smoke-test net (2 dense, conv, BN)", batch, {}};
  m.layers = {{Spec::conv, "conv", 3, 8, 3, 1, 1, 8}, {Spec::batch_norm, "bn", 8, 8, 1, 1, 0, 8},
              {Spec::dense, "fc1", 20, 16}, {Spec::dense, "fc2", 16, 10}};
  return m;
}

/// The model's layers; with `global_batch` > 0 each also says how many observation rows a step
/// brings (the batch, times the output positions of a convolution), so that the model
/// predicts the factor computation too.
std::vector<kfac::LayerShape> shapes_of(const Model& m, long global_batch = 0) {
  std::vector<kfac::LayerShape> v;
  for (const auto& s : m.layers)
    s.visit([&](const auto& layer) {
      v.push_back(kfac::LayerShape::of(s.name, layer));
      const long positions = s.type == Spec::conv ? long(s.out_hw()) * s.out_hw() : 1;
      if (s.type != Spec::batch_norm) v.back().with_observation_rows(kfac::index_t(global_batch * positions));
    });
  return v;
}

/// One shard of the global batch: its observations, fresh on every factor-update step and
/// determined by the shard's index alone, so a one-rank run that observes shards 0..S-1 builds
/// the same factors as S ranks observing one shard each (and decomposes the same matrices).
struct Shard {
  std::vector<V4> x, g;  // conv and batch norm (N, C, H, W)
  std::vector<V2> x2, g2;  // dense (N, features)
  std::mt19937_64 rng;

  Shard(const Model& m, unsigned index) : rng(1234u + index) {
    for (const auto& s : m.layers) {
      const int n = m.batch;
      if (s.type == Spec::dense) {
        x2.push_back(V2("x", n, s.in)); g2.push_back(V2("g", n, s.out));
        x.push_back(V4()); g.push_back(V4());
      } else {
        const int c_out = s.type == Spec::conv ? s.out : s.in;
        x.push_back(V4("x", n, s.in, s.hw, s.hw)); g.push_back(V4("g", n, c_out, s.out_hw(), s.out_hw()));
        x2.push_back(V2()); g2.push_back(V2());
      }
    }
  }
  void next() {
    for (auto* list : {&x, &g}) for (auto& v : *list) fill(v, rng);
    for (auto* list : {&x2, &g2}) for (auto& v : *list) fill(v, rng);
  }
  template <class V>
  static void fill(const V& v, std::mt19937_64& rng) {
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = u(rng);
  }
};

/// The gradients handed to step(): the same on every rank (as after data-parallel averaging),
/// restored before each step because step() overwrites them.
struct Gradients {
  std::vector<V2> w2;  // dense weight (out, in)
  std::vector<V4> w4;  // conv weight (O, C, k, k)
  std::vector<V1> w1, b;  // batch norm gamma; biases (empty for bias-free convs)
  std::vector<std::vector<double>> saved;

  explicit Gradients(const Model& m) {
    std::mt19937_64 rng(4242);
    for (const auto& s : m.layers) {
      w2.push_back(s.type == Spec::dense ? V2("w", s.out, s.in) : V2());
      w4.push_back(s.type == Spec::conv ? V4("w", s.out, s.in, s.k, s.k) : V4());
      w1.push_back(s.type == Spec::batch_norm ? V1("gamma", s.in) : V1());
      b.push_back(s.type == Spec::conv && !s.bias ? V1() : V1("b", s.type == Spec::batch_norm ? s.in : s.out));
    }
    for (std::size_t l = 0; l < m.layers.size(); ++l) {
      Shard::fill(w2[l], rng); Shard::fill(w4[l], rng); Shard::fill(w1[l], rng); Shard::fill(b[l], rng);
      saved.push_back(std::vector<double>(weight(l), weight(l) + weight_size(l)));
      saved.push_back(std::vector<double>(b[l].data(), b[l].data() + b[l].span()));
    }
  }
  double* weight(std::size_t l) const { return w2[l].span() ? w2[l].data() : w4[l].span() ? w4[l].data() : w1[l].data(); }
  std::size_t weight_size(std::size_t l) const { return w2[l].span() + w4[l].span() + w1[l].span(); }
  void restore() {
    for (std::size_t l = 0; l < b.size(); ++l) {
      std::copy(saved[2 * l].begin(), saved[2 * l].end(), weight(l));
      std::copy(saved[2 * l + 1].begin(), saved[2 * l + 1].end(), b[l].data());
    }
  }
};

/// One rank's inputs: the shards it observes and the gradients.
struct Data {
  std::vector<Shard> shards;
  Gradients grads;
  Data(const Model& m, unsigned first_shard, unsigned count) : grads(m) {
    for (unsigned i = 0; i < count; ++i) shards.emplace_back(m, first_shard + i);
  }
};

/// Restores the gradients and, on factor-update steps, draws every shard's next micro-batch.
void prepare(const Pre& pre, Data& d) {
  d.grads.restore();
  if (pre.wants_observations())
    for (auto& sh : d.shards) sh.next();
}

/// Observes every shard on factor-update steps and sets the gradients (what a training loop
/// hands to kfac between backward and step()).
void hand_over(Pre& pre, const Model& m, const Data& d) {
  const bool observe = pre.wants_observations();
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    const auto& s = m.layers[l];
    if (observe)
      for (const auto& sh : d.shards) {
        if (s.type == Spec::dense) { pre.observe_input(s.name, sh.x2[l]); pre.observe_output_grad(s.name, sh.g2[l]); }
        else { pre.observe_input(s.name, sh.x[l]); pre.observe_output_grad(s.name, sh.g[l]); }
      }
    const auto& g = d.grads;
    if (s.type == Spec::dense) pre.set_gradient(s.name, g.w2[l], g.b[l]);
    else if (s.type == Spec::conv && s.bias) pre.set_gradient(s.name, g.w4[l], g.b[l]);
    else if (s.type == Spec::conv) pre.set_gradient(s.name, g.w4[l]);
    else pre.set_gradient(s.name, g.w1[l], g.b[l]);
  }
}

void feed(Pre& pre, const Model& m, Data& d) {
  prepare(pre, d);
  hand_over(pre, m, d);
}

template <class LayerType>
using Kron = kfac::KroneckerBlock<LayerType, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::DoublePrecision,
                                  double, Host>;

/// Times LAPACK dsyevd, called directly, on the factors this rank decomposes under the run's
/// assignment (all ranks at once, as in the run): the measured counterpart of the model's
/// per-rank decomposition time, without the schedule's broadcasts and waits.
double own_decomposition_seconds(const Pre& pre, const Model& m) {
  std::vector<double> a, w;
  double total = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    const auto& s = m.layers[l];
    if (s.type == Spec::batch_norm) continue;
    for (int which = 0; which < 2; ++which) {
      if (pre.assignment().decomposer(l, which) != g_rank) continue;
      auto time = [&](const auto& layer) {
        const auto& f = which == 0 ? layer.factor_a() : layer.factor_g();
        const int n = int(f.extent(0));
        a.assign(std::size_t(n) * n, 0.0);
        w.resize(std::size_t(n));
        for (int j = 0; j < n; ++j)
          for (int i = 0; i <= j; ++i) a[std::size_t(i) + std::size_t(j) * n] = f(i, j);
        const auto t0 = Clock::now();
        LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'U', n, a.data(), n, w.data());
        total += seconds_since(t0);
      };
      if (s.type == Spec::dense) time(pre.layer_as<Kron<kfac::Dense>>(s.name));
      else time(pre.layer_as<Kron<kfac::Conv2d>>(s.name));
    }
  }
  return total;
}

std::string clock_time() {
  const std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", std::localtime(&t));
  return buf;
}

// ---------------------------------------------------------------- calibration
/// The machine figures, measured on every rank at once by kfac::measure_machine_figures (the
/// calls kfac makes; broadcasts from rank 0 for latency and bandwidth), the same on every rank.
kfac::MachineFigures calibrate(bool print) {
  const int n = 1024;
  const kfac::MachineFigures f = kfac::measure_machine_figures(Host(), kfac::MpiComm(MPI_COMM_WORLD), n);
  if (print && g_rank == 0)
    std::printf("figures (measured, %d rank(s) at once, n = %d): eigen %.3g s/n^3, cholesky %.3g s/n^3, "
                "dgemm %.3g flop/s, latency %.3g s, bandwidth %.3g B/s, memory %.3g B/s\n",
                g_size, n, f.eigen_seconds_per_n3, f.cholesky_seconds_per_n3, f.gemm_flops, f.latency,
                f.bandwidth, f.memory_bandwidth);
  return f;
}

/// One figure of every rank's prediction.
template <class F>
std::vector<double> per_rank(const kfac::CostPrediction& p, F f) {
  std::vector<double> v;
  for (const auto& r : p.ranks) v.push_back(f(r));
  return v;
}

// ---------------------------------------------------------------- one benchmark
struct Config {
  std::vector<std::string> models{"mlp", "resnet"};
  std::vector<std::string> strategies{"comm", "hybrid", "mem"};
  int reps = 5, warmup = 6, batch = 256, conv_batch = 16, shards = 1;
  int schedule_inv = 10, schedule_reps = 3;  ///< the training-schedule measurement (0 windows: off)
  bool overlap = true;  ///< Kaisa::overlap_communication of every run
  bool measured_figures = true, calibrate_only = false, resnet50_table = false;
  double bandwidth = 0, latency = 0, eigen = 0, gemm = 0;
  std::string csv;
};

struct Strategy {
  std::string name;
  double fraction;
  bool to_owner = false;  ///< Kaisa::reduce_to_owner
};

/// Strategies that exist at this world size (HYBRID needs 1 < f W < W: 4 ranks or more).
std::vector<Strategy> strategies(const Config& c) {
  std::vector<Strategy> v;
  for (const auto& s : c.strategies) {
    if (s == "comm") v.push_back({"COMM-OPT", 1.0});
    if (s == "hybrid" && g_size >= 4 && g_size % 2 == 0) v.push_back({"HYBRID", 0.5});
    if (s == "mem" && g_size > 1) v.push_back({"MEM-OPT", 1.0 / g_size});
    // The same with reduce-to-owner (factors summed only to their decomposers).
    if (s == "comm+own" && g_size > 1) v.push_back({"COMM-OPT+own", 1.0, true});
    if (s == "hybrid+own" && g_size >= 4 && g_size % 2 == 0) v.push_back({"HYBRID+own", 0.5, true});
    if (s == "mem+own" && g_size > 1) v.push_back({"MEM-OPT+own", 1.0 / g_size, true});
  }
  return v;
}

kfac::Options bench_options(int warmup) {
  const long last_factor_step = warmup - 1;
  return kfac::Options{}
      .with_loss_reduction(kfac::LossReduction::sum)
      .with_factor_update_steps([last_factor_step](long s) { return s < last_factor_step ? 1L : 1L << 40; })
      .with_inv_update_steps(2L);
}

/// The training schedule's options: a factor update every step, a decomposition every
/// `schedule_inv` steps (the run and its prediction both read them).
kfac::Options schedule_options(const Config& c) {
  return kfac::Options{}
      .with_loss_reduction(kfac::LossReduction::sum)
      .with_factor_update_steps(1L)
      .with_inv_update_steps(long(c.schedule_inv));
}

/// The strategy's KAISA settings (the run and its prediction both read them).
kfac::Kaisa strategy_kaisa(const Config& c, const Strategy& st) {
  return kfac::Kaisa{}
      .with_grad_worker_fraction(st.fraction)
      .with_reduce_to_owner(st.to_owner)
      .with_overlap_communication(c.overlap);
}

/// The step as a training loop runs it, to set beside the model's CostPrediction::step_seconds():
/// fresh observations and a factor update every step, a decomposition every `schedule_inv`
/// steps. A step's time is observe + set_gradient + step() (drawing the data is not in it),
/// the largest over ranks, each step after a barrier. Returns the median over `schedule_reps`
/// windows of `schedule_inv` steps of the mean step time (one window before them warms up), and
/// the part of it spent in observe + set_gradient (the largest over ranks).
std::pair<double, double> schedule_seconds(const Config& c, const Model& m, const Strategy& st) {
  kfac::MpiComm comm(MPI_COMM_WORLD);
  Pre pre(schedule_options(c), Host(), comm, strategy_kaisa(c, st));
  for (const auto& s : m.layers) s.visit([&](const auto& layer) { pre.register_layer(s.name, layer); });
  Data d(m, unsigned(g_rank * c.shards), unsigned(c.shards));
  std::vector<double> windows, observing;
  for (int w = 0; w <= c.schedule_reps; ++w) {
    double total = 0, observe = 0;
    for (int k = 0; k < c.schedule_inv; ++k) {
      prepare(pre, d);
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = Clock::now();
      hand_over(pre, m, d);
      observe += max_over_ranks(seconds_since(t0));
      pre.step();
      total += max_over_ranks(seconds_since(t0));
    }
    if (w == 0) continue;  // the warm-up window
    windows.push_back(total / c.schedule_inv);
    observing.push_back(observe / c.schedule_inv);
  }
  return {median(windows), median(observing)};
}

int run_one(const Config& c, const Model& m, const Strategy& st, const kfac::MachineFigures& figures,
            std::FILE* csv) {
  const std::string started = clock_time();
  kfac::MpiComm comm(MPI_COMM_WORLD);
  const kfac::Options opts = bench_options(c.warmup);
  const kfac::Kaisa kaisa = strategy_kaisa(c, st);
  Pre pre(opts, Host(), comm, kaisa);
  for (const auto& s : m.layers) s.visit([&](const auto& layer) { pre.register_layer(s.name, layer); });
  Data d(m, unsigned(g_rank * c.shards), unsigned(c.shards));
  // With several ranks, rank 0 also runs a one-rank baseline (MPI_COMM_SELF) whose steps are
  // interleaved with the distributed ones, so the speedup compares runs seconds apart.
  std::unique_ptr<Pre> base;
  std::unique_ptr<Data> base_data;
  if (g_size > 1 && g_rank == 0) {
    base = std::make_unique<Pre>(bench_options(c.warmup), Host(), kfac::MpiComm(MPI_COMM_SELF));
    for (const auto& s : m.layers) s.visit([&](const auto& layer) { base->register_layer(s.name, layer); });
    base_data = std::make_unique<Data>(m, 0u, unsigned(g_size * c.shards));  // the whole global batch
  }

  // Warm-up; bytes of step 1 (factors + gradients) and step 2 (+ decompositions).
  std::size_t bytes_step1 = 0;
  for (int s = 0; s < c.warmup; ++s) {
    feed(pre, m, d);
    comm.reset_bytes();
    pre.step();
    if (s == 1) bytes_step1 = comm.bytes_sent();
    if (base) {
      feed(*base, m, *base_data);
      base->step();
    }
  }
  // Timed: alternating decomposing and plain steps, factors frozen.
  std::vector<double> t_inv, t_plain, diff, cpu_diff;
  double cpu_inv = 0;
  std::size_t bytes_inv = 0, bytes_plain = 0;
  std::vector<double> base_inv, base_plain, base_diff;
  for (int rep = 0; rep < c.reps; ++rep) {
    if (g_size > 1) {  // the baseline's pair of steps; the other ranks wait at the barrier
      for (int half = 0; half < 2; ++half) {
        double t = 0;
        if (base) {
          feed(*base, m, *base_data);
          const auto t0 = Clock::now();
          base->step();
          t = seconds_since(t0);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        (half == 0 ? base_inv : base_plain).push_back(t);
      }
      base_diff.push_back(base_inv.back() - base_plain.back());
    }
    for (int half = 0; half < 2; ++half) {
      feed(pre, m, d);
      if (pre.will_decompose() != (half == 0) || pre.wants_observations()) {
        if (g_rank == 0) std::fprintf(stderr, "bench_distributed: unexpected schedule at step %ld\n", pre.step_count());
        return 1;
      }
      comm.reset_bytes();
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = Clock::now();
      const double c0 = cpu_seconds();
      pre.step();
      const double cpu = max_over_ranks(cpu_seconds() - c0);
      const double t = max_over_ranks(seconds_since(t0));
      (half == 0 ? t_inv : t_plain).push_back(t);
      if (half == 0) cpu_inv = cpu; else cpu_diff.push_back(cpu_inv - cpu);
      (half == 0 ? bytes_inv : bytes_plain) = comm.bytes_sent();
    }
    diff.push_back(t_inv.back() - t_plain.back());
  }
  const auto own = gather(own_decomposition_seconds(pre, m));
  const std::size_t grad_bytes = bytes_plain, dec_bytes = bytes_inv - bytes_plain,
                    factor_bytes = bytes_step1 - bytes_plain;

  const kfac::CostModel model(shapes_of(m), figures);
  const kfac::CostPrediction p = model.predict(g_size, opts, kaisa);
  // The training schedule, and the model's step time for it (factor computation included).
  const auto sched = c.schedule_reps > 0 ? schedule_seconds(c, m, st) : std::pair<double, double>{0, 0};
  const double sched_ms = 1e3 * sched.first;
  const kfac::CostPrediction ps =
      kfac::CostModel(shapes_of(m, long(g_size) * c.shards * m.batch), figures)
          .predict(g_size, schedule_options(c), strategy_kaisa(c, st));
  const auto& mine = p.ranks[std::size_t(g_rank)];
  const auto report = pre.memory_report();
  std::size_t mem[3] = {0, 0, 0};
  bool memory_exact = report.size() == mine.memory.size();
  for (std::size_t l = 0; l < report.size(); ++l) {
    mem[0] += report[l].factor_bytes;
    mem[1] += report[l].decomposition_bytes;
    mem[2] += report[l].workspace_bytes;
    if (memory_exact)
      memory_exact = report[l].factor_bytes == mine.memory[l].factor_bytes &&
                     report[l].decomposition_bytes == mine.memory[l].decomposition_bytes &&
                     report[l].workspace_bytes == mine.memory[l].workspace_bytes;
  }
  bool assignment_exact = true;
  for (std::size_t l = 0; l < m.layers.size(); ++l)
    for (int which = 0; which < 2; ++which)
      assignment_exact = assignment_exact && pre.assignment().decomposer(l, which) == p.assignment.decomposer(l, which);
  const bool bytes_exact = factor_bytes == mine.factor_bytes_sent && dec_bytes == mine.decomposition_bytes_sent &&
                           grad_bytes == mine.gradient_bytes_sent;
  int ok = memory_exact && bytes_exact && assignment_exact, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);

  const double dec_ms = 1e3 * median(diff), pre_ms = 1e3 * median(t_plain);
  // Minima: the least disturbed repetition, for a machine shared with other work.
  const double dec_min_ms = 1e3 * (*std::min_element(t_inv.begin(), t_inv.end()) -
                                   *std::min_element(t_plain.begin(), t_plain.end()));
  const double pre_min_ms = 1e3 * *std::min_element(t_plain.begin(), t_plain.end());
  const double dec_cpu_ms = 1e3 * median(cpu_diff);
  const double base_ms = g_size > 1 ? 1e3 * median(base_diff) : dec_ms;
  const auto fb = gather(double(factor_bytes)), db = gather(double(dec_bytes)), gb = gather(double(grad_bytes));
  const auto mt = gather(double(mem[0] + mem[1] + mem[2])), md = gather(double(mem[1]));
  if (g_rank == 0) {
    auto mib = [](double b) { return b / double(1 << 20); };
    auto list = [&](const std::vector<double>& v, double scale, int decimals = 0) {
      std::string s;
      char buf[64];
      for (double x : v) {
        std::snprintf(buf, sizeof(buf), "%.*f", decimals, x * scale);
        s += (s.empty() ? "" : "/") + std::string(buf);
      }
      return s;
    };
    double max_mem = *std::max_element(mt.begin(), mt.end());
    std::printf("\n%s, %s, %d rank(s), f = %g (%d gradient worker(s) per layer), BLAS threads %d, %s-%s, load %s\n",
                m.description.c_str(), st.name.c_str(), g_size, st.fraction, p.assignment.grad_workers(),
                blas_threads(), started.c_str(), clock_time().c_str(), load_average().c_str());
    std::printf("  decomposition phase  %9.1f ms (min %9.1f, CPU %9.1f)   model %9.1f ms   (per-rank compute, model: %s ms)\n",
                dec_ms, dec_min_ms, dec_cpu_ms, 1e3 * p.decomposition_phase_seconds,
                list(per_rank(p, [](const kfac::RankCost& r) { return r.decomposition_seconds; }), 1e3, 1).c_str());
    if (g_size > 1)
      std::printf("  one-rank baseline    %9.1f ms (interleaved, rank 0 alone): speedup %.2fx\n", base_ms,
                  base_ms / dec_ms);
    std::printf("  own syevd per rank   %s ms (LAPACK timed directly on this rank's factors)\n",
                list(own, 1e3, 1).c_str());
    std::printf("  plain step           %9.1f ms (min %9.1f)   model %9.1f ms   (preconditioning phase)\n", pre_ms,
                pre_min_ms, 1e3 * p.preconditioning_phase_seconds);
    std::printf("  bytes/factor update  %s   model %zu per rank (%zu collectives)\n", list(fb, 1).c_str(),
                mine.factor_bytes_sent, p.factor_collectives);
    std::printf("  bytes/decomposition  %s   model %s\n", list(db, 1).c_str(),
                list(per_rank(p, [](const kfac::RankCost& r) { return double(r.decomposition_bytes_sent); }), 1).c_str());
    std::printf("  bytes/step gradients %s   model %s\n", list(gb, 1).c_str(),
                list(per_rank(p, [](const kfac::RankCost& r) { return double(r.gradient_bytes_sent); }), 1).c_str());
    std::printf("  memory/rank KiB      %s   model %s   (decompositions %s KiB)\n", list(mt, 1.0 / 1024).c_str(),
                list(per_rank(p, [](const kfac::RankCost& r) { return double(r.memory_bytes()); }), 1.0 / 1024).c_str(),
                list(md, 1.0 / 1024).c_str());
    std::printf("  exact: bytes, memory and assignment equal the model on every rank: %s\n", all_ok ? "yes" : "NO");
    if (c.schedule_reps > 0)
      std::printf("  training step        %9.1f ms (observe %.1f)   model %9.1f ms (factors %.1f + averaging %.1f + "
                  "decomposition %.1f / %d + preconditioning %.1f): model/measured %.2f\n",
                  sched_ms, 1e3 * sched.second, 1e3 * ps.step_seconds(), 1e3 * ps.factor_compute_seconds, 1e3 * ps.factor_comm_seconds,
                  1e3 * ps.decomposition_phase_seconds, c.schedule_inv, 1e3 * ps.preconditioning_phase_seconds,
                  1e3 * ps.step_seconds() / sched_ms);
    if (csv)
      std::fprintf(csv, "%s,%s,%d,%d,%g,%.3f,%.3f,%.3f,%.3f,%.0f,%.0f,%.0f,%.3f,%.3f,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f\n", m.name.c_str(),
                   st.name.c_str(), g_size, blas_threads(), st.fraction, dec_ms, 1e3 * p.decomposition_phase_seconds,
                   pre_ms, 1e3 * p.preconditioning_phase_seconds, *std::max_element(fb.begin(), fb.end()),
                   *std::max_element(db.begin(), db.end()), *std::max_element(gb.begin(), gb.end()), mib(max_mem),
                   mib(double(p.max_memory_bytes())), all_ok, dec_min_ms, pre_min_ms, dec_cpu_ms,
                   1e3 * *std::max_element(own.begin(), own.end()), base_ms, sched_ms, 1e3 * ps.step_seconds());
  }
  return all_ok ? 0 : 1;
}

// ---------------------------------------------------------------- ResNet-50 table (model only)
void resnet50_table(const Config& c) {
  kfac::MachineFigures f;
  if (c.bandwidth > 0) f.with_bandwidth(c.bandwidth);
  if (c.latency > 0) f.with_latency(c.latency);
  if (c.eigen > 0) f.with_eigen_seconds_per_n3(c.eigen);
  if (c.gemm > 0) f.with_gemm_flops(c.gemm);
  const kfac::CostModel model(kfac::shapes::resnet50(), f);
  const auto one = model.predict(1, 1.0);
  std::printf("ResNet-50: %zu layers, figures: eigen %.3g s/n^3, dgemm %.3g flop/s, bandwidth %.3g B/s, latency %.3g s\n",
              model.layers().size(), f.eigen_seconds_per_n3, f.gemm_flops, f.bandwidth, f.latency);
  std::printf("1 rank: memory %.0f MiB (factors %.0f, decompositions %.0f, workspace %.0f), decomposition %.1f s, "
              "preconditioning %.2f s\n\n",
              one.ranks[0].memory_bytes() / 1048576.0, one.ranks[0].factor_memory() / 1048576.0,
              one.ranks[0].decomposition_memory() / 1048576.0, one.ranks[0].workspace_memory() / 1048576.0,
              one.decomposition_phase_seconds, one.preconditioning_phase_seconds);
  std::printf("| ranks | strategy | gw | max memory/rank MiB | max decomp. MiB | decomp. phase s | max rank decomp. s "
              "| precond. phase s | max rank precond. s | MiB/factor update | max MiB/decomp. | max MiB/step grads "
              "| max MiB/step (1, 10) | s/step (1, 10) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int w = 8; w <= 1024; w *= 2) {
    const std::pair<const char*, double> strategies[] = {
        {"COMM-OPT", 1.0}, {"HYBRID f=1/2", 0.5}, {"HYBRID gw=8", 8.0 / w}, {"MEM-OPT", 1.0 / w}};
    for (const auto& [name, fraction] : strategies) {
      if (std::string(name) == "HYBRID gw=8" && w == 8) continue;  // that is COMM-OPT
      const auto p = model.predict(w, kfac::Kaisa{}.with_grad_worker_fraction(fraction));
      double max_dec_mem = 0, max_dec_bytes = 0, max_grad = 0, max_pre = 0;
      for (const auto& r : p.ranks) {
        max_pre = std::max(max_pre, r.preconditioning_seconds);
        max_dec_mem = std::max(max_dec_mem, double(r.decomposition_memory()));
        max_dec_bytes = std::max(max_dec_bytes, double(r.decomposition_bytes_sent));
        max_grad = std::max(max_grad, double(r.gradient_bytes_sent));
      }
      std::printf("| %d | %s | %d | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f | %.1f | %.0f | %.2f |\n", w,
                  name, p.assignment.grad_workers(), p.max_memory_bytes() / 1048576.0, max_dec_mem / 1048576.0,
                  p.decomposition_phase_seconds, p.max_decomposition_seconds(), p.preconditioning_phase_seconds,
                  max_pre, p.ranks[0].factor_bytes_sent / 1048576.0, max_dec_bytes / 1048576.0, max_grad / 1048576.0,
                  p.max_bytes_per_step() / 1048576.0, p.step_seconds());
    }
  }
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::size_t start = 0;
  while (start <= s.size()) {
    const std::size_t e = s.find(',', start);
    v.push_back(s.substr(start, e == std::string::npos ? std::string::npos : e - start));
    if (e == std::string::npos) break;
    start = e + 1;
  }
  return v;
}

bool parse(int argc, char** argv, Config& c) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--model") {
      const auto v = value();
      c.models = v == "all" ? std::vector<std::string>{"mlp", "resnet"} : split(v);
      for (const auto& m : c.models)
        if (m != "mlp" && m != "resnet" && m != "small") return false;
    }
    else if (a == "--strategies") c.strategies = split(value());
    else if (a == "--reps") c.reps = std::stoi(value());
    else if (a == "--warmup") c.warmup = std::stoi(value());
    else if (a == "--batch") c.batch = std::stoi(value());
    else if (a == "--conv-batch") c.conv_batch = std::stoi(value());
    else if (a == "--shards") c.shards = std::stoi(value());
    else if (a == "--schedule-inv") c.schedule_inv = std::stoi(value());
    else if (a == "--schedule-reps") c.schedule_reps = std::stoi(value());
    else if (a == "--overlap") c.overlap = std::stoi(value()) != 0;
    else if (a == "--figures") c.measured_figures = value() == "measured";
    else if (a == "--csv") c.csv = value();
    else if (a == "--calibrate") c.calibrate_only = true;
    else if (a == "--resnet50-table") c.resnet50_table = true;
    else if (a == "--bandwidth") c.bandwidth = std::stod(value());
    else if (a == "--latency") c.latency = std::stod(value());
    else if (a == "--eigen-seconds-per-n3") c.eigen = std::stod(value());
    else if (a == "--gemm-flops") c.gemm = std::stod(value());
    else return false;
  }
  return c.reps >= 1 && c.warmup >= 4 && c.warmup % 2 == 0 && c.batch >= 1 && c.conv_batch >= 1 && c.shards >= 1 &&
         c.schedule_inv >= 1 && c.schedule_reps >= 0;
}

}  // namespace

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  Config c;
  bool good = false;
  try {
    good = parse(argc, argv, c);
  } catch (const std::exception& e) {
    if (g_rank == 0) std::fprintf(stderr, "bench_distributed: %s\n", e.what());
  }
  if (!good) {
    if (g_rank == 0)
      std::fprintf(stderr, "usage: mpiexec -n N bench_distributed [--model mlp|resnet|small|all] [--strategies comm,hybrid,mem] "
                           "[--reps 5] [--warmup 6 (even, >= 4)] [--batch 256] [--conv-batch 16] [--shards 1] "
                           "[--schedule-inv 10] [--schedule-reps 3 (0: no training-schedule run)] [--overlap 1|0] "
                           "[--figures measured|defaults] [--csv FILE] [--calibrate] [--resnet50-table "
                           "[--bandwidth B/s] [--latency s] [--eigen-seconds-per-n3 s] [--gemm-flops F]]\n");
    MPI_Finalize();
    return 2;
  }
  int status = 0;
  Kokkos::initialize(argc, argv);
  {
    if (c.resnet50_table) {
      if (g_rank == 0) resnet50_table(c);
    } else {
      const kfac::MachineFigures figures = c.measured_figures || c.calibrate_only ? calibrate(true) : kfac::MachineFigures{};
      std::FILE* csv = nullptr;
      if (!c.csv.empty() && g_rank == 0) csv = std::fopen(c.csv.c_str(), "a");
      if (!c.calibrate_only)
        for (const auto& name : c.models) {
          const Model m = name == "mlp" ? mlp(c.batch) : name == "small" ? small(c.conv_batch) : resnet_like(c.conv_batch);
          for (const auto& st : strategies(c)) status |= run_one(c, m, st, figures, csv);
        }
      if (csv) std::fclose(csv);
    }
  }
  Kokkos::finalize();
  MPI_Finalize();
  return status;
}
