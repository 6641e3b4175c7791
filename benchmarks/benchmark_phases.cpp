/// \file benchmark_phases.cpp
/// \brief Times each phase of one square, bias-free kfac::Dense layer on the host — factor
/// update, decomposition, preconditioning — against the bare OpenBLAS/LAPACK calls that do the
/// same math, in one run, and prints library/bare for each.
///
/// Library and bare runs alternate in one loop (and take turns going first), so machine noise
/// hits both; each row reports the medians of the timed repetitions after one warm-up run.
/// What each phase includes is printed with the results and described in docs/benchmarks.md.
///
/// Usage: benchmark_phases [--sizes 256,512,1024,2048] [--batch 256] [--threads 2] [--reps N]
///                         [--phases factor,decomposition,preconditioning,step] [--breakdown]
/// The exit status is 0 whether or not the target is met; it is 1 only when the library and the
/// bare calls disagree (the comparison would then be meaningless) and 2 for bad arguments.

#include <cblas.h>
#include <dlfcn.h>
#include <lapacke.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <kfac/kfac.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.hpp"

#if !defined(KFAC_HAVE_LAPACK)
#error "benchmark_phases compares against bare BLAS/LAPACK: configure with KFAC_ENABLE_LAPACK=ON"
#endif

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using Layer = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
                                   kfac::DoublePrecision, double, Exec>;
using Clock = std::chrono::steady_clock;
using Observation = Kokkos::View<const double**, Kokkos::LayoutRight, Kokkos::HostSpace,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using Gradient = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace,
                              Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

constexpr double target_ratio = 1.11;
constexpr int target_from_n = 1024;

struct Config {
  std::vector<int> sizes{256, 512, 1024, 2048};
  int batch = 256;
  int threads = 2;
  int reps = 0;           // 0: chosen per phase from the warm-up time
  double budget_s = 6.0;  // time aimed at per phase and size when reps = 0
  int min_reps = 5, max_reps = 21;
  bool factor = true, decomposition = true, preconditioning = true, step = true;
  bool breakdown = false;
  double decay = 0.95;
  double damping = 1e-3;
};

// ---------------------------------------------------------------- OpenBLAS thread control
/// OpenBLAS's thread functions, looked up at run time. They are not CBLAS: Debian's libblas.so.3
/// wrapper does not export them, so whether a direct reference links depends on how CMake's
/// FindBLAS resolved; and with another BLAS there is nothing to set.
struct BlasThreads {
  void (*set)(int) = nullptr;
  int (*get)() = nullptr;
  char* (*config)() = nullptr;

  BlasThreads() {
    lookup("openblas_set_num_threads", set);
    lookup("openblas_get_num_threads", get);
    lookup("openblas_get_config", config);
  }
  template <class F>
  static void lookup(const char* name, F& f) {
    void* p = dlsym(RTLD_DEFAULT, name);
    static_assert(sizeof(p) == sizeof(f), "function and object pointers differ in size");
    std::memcpy(&f, &p, sizeof(f));  // the POSIX way to turn dlsym's result into a function
  }
};

// ---------------------------------------------------------------- helpers
/// Times consecutive calls: each lap() closes one interval, started by the previous lap() or
/// by construction.
class Laps {
 public:
  void lap() {
    const auto now = Clock::now();
    ms_.push_back(std::chrono::duration<double, std::milli>(now - last_).count());
    last_ = now;
  }
  std::vector<double> take() { return std::move(ms_); }

 private:
  Clock::time_point last_ = Clock::now();
  std::vector<double> ms_;
};

using bench::median;
using bench::minimum;

void fill_random(std::vector<double>& v, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (auto& x : v) x = u(rng);
}

/// max |a - b| / max |b| over the upper triangles of two column-major n x n matrices.
template <class A>
double rel_diff_upper(const A& a, const std::vector<double>& b, int n) {
  double d = 0, s = 0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i <= j; ++i) {
      d = std::max(d, std::abs(a(i, j) - b[i + std::size_t(j) * n]));
      s = std::max(s, std::abs(b[i + std::size_t(j) * n]));
    }
  return s > 0 ? d / s : d;
}

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(a[i] - b[i]));
    s = std::max(s, std::abs(b[i]));
  }
  return s > 0 ? d / s : d;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto p = line.find(':');
      return p == std::string::npos ? line : line.substr(p + 2);
    }
  return "unknown";
}

// ---------------------------------------------------------------- the bare calls
/// The library's math as bare CBLAS/LAPACKE calls on column-major n x n buffers, with nothing
/// else: no copies the math does not need, no checks.
class Bare {
 public:
  Bare(int n, double decay)
      : n_(n),
        decay_(decay),
        a_(nn()),
        g_(nn()),
        qa_(nn()),
        qg_(nn()),
        la_(n),
        lg_(n),
        t1_(nn()),
        t2_(nn()) {}

  /// F = decay F + (1 - decay) / batch * x^T x, upper triangle, for F = A (inputs x) and G
  /// (output gradients g); the first update sets F = x^T x / batch, as the library does.
  /// x is (batch x n) row-major, i.e. column-major (n x batch): x^T x is a NoTrans syrk on it.
  void update_factors(const double* x, const double* g, int batch) {
    const double alpha = (has_factors_ ? 1.0 - decay_ : 1.0) / batch;
    const double beta = has_factors_ ? decay_ : 0.0;
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasNoTrans, n_, batch, alpha, x, n_, beta, a_.data(),
                n_);
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasNoTrans, n_, batch, alpha, g, n_, beta, g_.data(),
                n_);
    has_factors_ = true;
  }

  /// Q, lambda of A and G: a copy (syevd overwrites its input), syevd, eigenvalues clamped at
  /// 0 (as the library does before dividing by lambda_G lambda_A^T + damping).
  void decompose() {
    eigh(a_, qa_, la_);
    eigh(g_, qg_, lg_);
  }

  /// Replaces the row-major (n x n) gradient X in w by
  /// V = Q_G [(Q_G^T X Q_A) ./ (lambda_G lambda_A^T + damping)] Q_A^T and returns <V, X> (the
  /// KL-clip sum the library also returns). Row-major X is column-major X^T, so this computes
  /// V^T = Q_A [(Q_A^T X^T Q_G) ./ (lambda_A lambda_G^T + damping)] Q_G^T in place: four dgemm
  /// and one pass that divides and, as <V, X> = <S, Q_G^T X Q_A> for the scaled S, sums.
  double precondition(double* w, double damping) {
    const int n = n_;
    double* t1 = t1_.data();
    double* t2 = t2_.data();
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, w, n, qg_.data(), n, 0.0,
                t1, n);  // X^T Q_G
    cblas_dgemm(CblasColMajor, CblasTrans, CblasNoTrans, n, n, n, 1.0, qa_.data(), n, t1, n, 0.0,
                t2, n);  // Q_A^T (.)
    double vg = 0;
    for (int i = 0; i < n; ++i) {
      const double lg = lg_[i];
      double* col = t2 + std::size_t(i) * n;
      for (int j = 0; j < n; ++j) {
        const double t = col[j], s = t / (la_[j] * lg + damping);
        col[j] = s;
        vg += s * t;
      }
    }
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0, t2, n, qg_.data(), n, 0.0,
                t1, n);  // (.) Q_G^T
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, qa_.data(), n, t1, n, 0.0,
                w, n);  // Q_A (.)
    return vg;
  }

  const std::vector<double>& a() const { return a_; }
  const std::vector<double>& lambda_a() const { return la_; }

 private:
  std::size_t nn() const { return std::size_t(n_) * n_; }
  void eigh(const std::vector<double>& f, std::vector<double>& q, std::vector<double>& w) {
    std::memcpy(q.data(), f.data(), nn() * sizeof(double));
    const int info = LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'U', n_, q.data(), n_, w.data());
    if (info != 0) throw std::runtime_error("bare dsyevd failed, info = " + std::to_string(info));
    for (auto& l : w)
      if (!(l > 0)) l = 0;
  }

  int n_;
  double decay_;
  bool has_factors_ = false;
  std::vector<double> a_, g_, qa_, qg_, la_, lg_, t1_, t2_;
};

// ---------------------------------------------------------------- measurement
/// One table row: per-repetition times; `lib_parts` splits the library time over its calls.
struct Row {
  int n = 0;
  std::string phase;
  bool in_target = true;
  std::vector<std::string> part_names;
  std::vector<std::vector<double>> lib_parts;  // [part][rep]
  std::vector<double> lib, bare;
  double lib_ms() const { return median(lib); }
  double bare_ms() const { return median(bare); }
  double ratio() const { return lib_ms() / bare_ms(); }
  double min_ratio() const { return minimum(lib) / minimum(bare); }
};

double sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

/// Runs one warm-up pair, then the timed pairs, alternating which side goes first so that
/// cache state and drifting machine load are shared fairly. `lib` and `bare` return the times
/// (ms) of their calls (Laps::take) and do their untimed preparation before starting the clock.
template <class Lib, class BareFn>
void measure(const Config& c, Row& row, Lib&& lib, BareFn&& bare) {
  const double warm_ms = sum(lib()) + sum(bare());
  const int reps =
      c.reps > 0 ? c.reps
                 : std::clamp(int(std::ceil(c.budget_s * 1e3 / warm_ms)), c.min_reps, c.max_reps);
  row.lib_parts.assign(row.part_names.size(), {});
  auto run_lib = [&] {
    const auto parts = lib();
    for (std::size_t p = 0; p < parts.size(); ++p) row.lib_parts[p].push_back(parts[p]);
    row.lib.push_back(sum(parts));
  };
  auto run_bare = [&] { row.bare.push_back(sum(bare())); };
  for (int r = 0; r < reps; ++r) {
    if (r % 2 == 0) {
      run_lib();
      run_bare();
    } else {
      run_bare();
      run_lib();
    }
  }
}

void print_row(const Row& r) {
  std::printf("| %d | %s | %.3f | %.3f | %.3f | %.3f | %zu |\n", r.n, r.phase.c_str(), r.lib_ms(),
              r.bare_ms(), r.ratio(), r.min_ratio(), r.lib.size());
  std::fflush(stdout);
}

struct Check {
  std::string what;
  double value, tolerance;
};

/// Benchmarks one layer size; appends its rows and consistency checks.
void run_size(const Config& c, int n, std::vector<Row>& rows, std::vector<Check>& checks) {
  const int batch = c.batch;
  const Exec exec;
  const std::string at = "n=" + std::to_string(n) + " ";
  std::mt19937_64 rng(1234567u + unsigned(n));
  std::vector<double> x(std::size_t(batch) * n), g(std::size_t(batch) * n);
  std::vector<double> x0(std::size_t(n) * n), w_lib(x0.size()), w_bare(x0.size());
  fill_random(x0, rng);
  const Observation xv(x.data(), batch, n), gv(g.data(), batch, n);
  const Layer::tensor_type xt(x.data(), batch, n, 1, 1), gt(g.data(), batch, n, 1, 1);
  const Layer::grad_vector no_bias;
  const Gradient wl(w_lib.data(), n, n);
  // Enough distinct batches before timing to make A and G full rank, as they are in training
  // (a rank-deficient factor makes syevd deflate and run several times faster).
  const int priming = (n + batch - 1) / batch + 1;
  auto new_row = [&](const char* phase, std::vector<std::string> parts) {
    Row r;
    r.n = n;
    r.phase = phase;
    r.part_names = std::move(parts);
    return r;
  };
  auto finish_row = [&](Row& r) {
    print_row(r);
    rows.push_back(r);
  };

  // ---- phases 1-3 on one layer object, so that each phase is timed on its own
  Layer layer("fc", kfac::Dense(n, n, /*bias=*/false));
  Bare bare(n, c.decay);
  // Library calls are fenced before each lap so that a lap holds all the work of its call.
  auto lib_factor = [&] {
    Laps t;
    layer.observe_input(exec, xt);
    exec.fence();
    t.lap();
    layer.observe_output_grad(exec, gt, 1.0);
    exec.fence();
    t.lap();
    layer.update_statistics(exec, c.decay);
    layer.clear_observations();
    exec.fence();
    t.lap();
    return t.take();
  };
  auto bare_factor = [&] {
    Laps t;
    bare.update_factors(x.data(), g.data(), batch);
    t.lap();
    return t.take();
  };
  auto lib_decomposition = [&] {
    Laps t;
    layer.allocate_units();  // allocates once; step() calls it the same way
    layer.decompose(exec, 0, c.damping);
    exec.fence();
    t.lap();
    layer.decompose(exec, 1, c.damping);
    exec.fence();
    t.lap();
    layer.finish_decomposition(exec, c.damping, /*precompute=*/false);
    exec.fence();
    t.lap();
    return t.take();
  };
  auto bare_decomposition = [&] {
    Laps t;
    bare.decompose();
    t.lap();
    return t.take();
  };
  double vg_lib = 0, vg_bare = 0;
  auto lib_preconditioning = [&] {
    std::copy(x0.begin(), x0.end(), w_lib.begin());
    Laps t;
    layer.load_gradient(exec, wl, no_bias);
    exec.fence();
    t.lap();
    layer.apply(exec, c.damping);
    exec.fence();
    t.lap();
    vg_lib = layer.inner_product(exec);
    t.lap();
    layer.write_back(exec, wl, no_bias, 1.0);
    exec.fence();
    t.lap();
    return t.take();
  };
  auto bare_preconditioning = [&] {
    std::copy(x0.begin(), x0.end(), w_bare.begin());
    Laps t;
    vg_bare = bare.precondition(w_bare.data(), c.damping);
    t.lap();
    return t.take();
  };

  for (int p = 0; p < priming; ++p) {
    fill_random(x, rng);
    fill_random(g, rng);
    lib_factor();
    bare_factor();
  }
  if (c.factor) {
    Row r = new_row("factor update", {"observe_input", "observe_output_grad", "update_factors"});
    measure(c, r, lib_factor, bare_factor);
    finish_row(r);
  }
  checks.push_back({at + "factor A", rel_diff_upper(layer.factor_a(), bare.a(), n), 1e-12});

  if (c.decomposition) {
    Row r = new_row("decomposition", {"decompose(A)", "decompose(G)", "finish_decomposition"});
    measure(c, r, lib_decomposition, bare_decomposition);
    finish_row(r);
  } else {  // preconditioning needs one
    lib_decomposition();
    bare_decomposition();
  }
  {
    auto la =
        Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), layer.decomposition_a()->lambda);
    const std::vector<double> l(la.data(), la.data() + n);
    checks.push_back({at + "eigenvalues of A", rel_diff(l, bare.lambda_a()), 1e-10});
  }

  if (c.preconditioning) {
    Row r = new_row("preconditioning", {"load_gradient", "apply", "inner_product", "write_back"});
    measure(c, r, lib_preconditioning, bare_preconditioning);
    finish_row(r);
    checks.push_back({at + "preconditioned gradient", rel_diff(w_lib, w_bare), 1e-9});
    checks.push_back(
        {at + "KL-clip sum <V, X>", std::abs(vg_lib - vg_bare) / std::abs(vg_bare), 1e-9});
  }

  if (!c.step) return;
  // ---- the whole schedule through the public Preconditioner: every step updates the factors,
  // decomposes and preconditions. No KL clipping and a sum-reduced loss keep the math equal to
  // the three bare phases. While priming, only step 0 decomposes (the first needs one).
  const long first_timed = priming;
  kfac::Preconditioner<double, Exec> pre(kfac::Options{}
                                             .with_factor_decay(c.decay)
                                             .with_damping(c.damping)
                                             .with_kl_clip(0.0)
                                             .with_loss_reduction(kfac::LossReduction::sum)
                                             .with_factor_update_steps(1L)
                                             .with_inv_update_steps([first_timed](long s) {
                                               return s < first_timed ? first_timed - s : 1L;
                                             }));
  pre.register_layer("fc", kfac::Dense(n, n, /*bias=*/false));
  Bare bare_step(n, c.decay);
  auto lib_step = [&] {
    std::copy(x0.begin(), x0.end(), w_lib.begin());
    Laps t;
    pre.observe_input("fc", xv);
    exec.fence();
    t.lap();
    pre.observe_output_grad("fc", gv);
    exec.fence();
    t.lap();
    pre.set_gradient("fc", wl);
    t.lap();
    pre.step();  // fences before returning
    t.lap();
    return t.take();
  };
  auto bare_all = [&] {
    std::copy(x0.begin(), x0.end(), w_bare.begin());
    Laps t;
    bare_step.update_factors(x.data(), g.data(), batch);
    bare_step.decompose();
    bare_step.precondition(w_bare.data(), c.damping);
    t.lap();
    return t.take();
  };
  for (int p = 0; p < priming; ++p) {
    fill_random(x, rng);
    fill_random(g, rng);
    lib_step();
    bare_step.update_factors(x.data(), g.data(), batch);
  }
  Row r =
      new_row("step (all three)", {"observe_input", "observe_output_grad", "set_gradient", "step"});
  r.in_target = false;
  measure(c, r, lib_step, bare_all);
  finish_row(r);
  checks.push_back({at + "step: preconditioned gradient", rel_diff(w_lib, w_bare), 1e-9});
}

// ---------------------------------------------------------------- command line
void usage(const char* argv0) {
  std::printf(
      "usage: %s [--sizes 256,512,1024,2048] [--batch 256] [--threads 2] [--reps N]\n"
      "          [--phases factor,decomposition,preconditioning,step] [--breakdown]\n"
      "  --sizes      square layer sizes n (Dense n -> n, no bias)\n"
      "  --batch      rows of each observation (default 256)\n"
      "  --threads    OpenBLAS threads (default 2)\n"
      "  --reps       timed repetitions per phase after one warm-up (default: enough for\n"
      "               about 6 s per phase, between 5 and 21)\n"
      "  --phases     rows to measure (default: all four); \"step\" is the end-to-end\n"
      "               Preconditioner::step, reported but not part of the target\n"
      "  --breakdown  also print the library time of each call within a phase\n",
      argv0);
}

using bench::split;

bool parse_int(const char* s, int& out) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 1 || v > 1000000) return false;
  out = int(v);
  return true;
}

bool parse(int argc, char** argv, Config& c) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kokkos", 0) == 0) continue;  // Kokkos's own options
    const bool has_value = i + 1 < argc;
    if (a == "--sizes" && has_value) {
      c.sizes.clear();
      for (const auto& item : split(argv[++i])) {
        int v = 0;
        if (!parse_int(item.c_str(), v)) return false;
        c.sizes.push_back(v);
      }
    } else if (a == "--batch" && has_value) {
      if (!parse_int(argv[++i], c.batch)) return false;
    } else if (a == "--threads" && has_value) {
      if (!parse_int(argv[++i], c.threads)) return false;
    } else if (a == "--reps" && has_value) {
      if (!parse_int(argv[++i], c.reps)) return false;
    } else if (a == "--phases" && has_value) {
      c.factor = c.decomposition = c.preconditioning = c.step = false;
      for (const auto& p : split(argv[++i])) {
        if (p == "factor")
          c.factor = true;
        else if (p == "decomposition")
          c.decomposition = true;
        else if (p == "preconditioning")
          c.preconditioning = true;
        else if (p == "step")
          c.step = true;
        else
          return false;
      }
    } else if (a == "--breakdown") {
      c.breakdown = true;
    } else {
      return false;
    }
  }
  return !c.sizes.empty();
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (!parse(argc, argv, c)) {
    usage(argv[0]);
    return 2;
  }
  // Kokkos 3.4 claims bare names such as --threads (wanting --threads=N) and throws on ours:
  // it gets only the --kokkos-* options.
  std::vector<char*> kokkos_args{argv[0]};
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--kokkos", 8) == 0) kokkos_args.push_back(argv[i]);
  int kokkos_argc = int(kokkos_args.size());
  Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_args.data());

  const BlasThreads blas;
  if (blas.set) blas.set(c.threads);
  char date[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M %Z", std::localtime(&now));
  std::printf("kfac benchmark_phases, %s\n", date);
  std::printf("machine: %s, %u hardware threads\n", cpu_model().c_str(),
              std::thread::hardware_concurrency());
  std::printf("kfac execution space: %s; BLAS: %s; BLAS threads: %d%s\n", Exec::name(),
              blas.config ? blas.config() : "not OpenBLAS", blas.get ? blas.get() : -1,
              blas.set ? "" : " (not settable: not OpenBLAS)");
  std::printf(
      "layer: kfac::Dense(n, n, bias=false), Symmetric factors, Eigendecomposition<>, "
      "double; batch %d, decay %g, damping %g\n",
      c.batch, c.decay, c.damping);
  std::printf(
      "times: median of the timed repetitions after 1 warm-up, library and bare "
      "alternating; ratio = library / bare\n\n");
  std::printf("| n | phase | library ms | bare ms | ratio | ratio of minima | reps |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---:|\n");
  std::fflush(stdout);

  std::vector<Row> rows;
  std::vector<Check> checks;
  for (int n : c.sizes) run_size(c, n, rows, checks);

  if (c.breakdown) {
    std::printf(
        "\nLibrary time per call (median ms):\n\n| n | phase | call | ms |\n|---:|---|---|---:|\n");
    for (const auto& r : rows)
      for (std::size_t p = 0; p < r.part_names.size(); ++p)
        std::printf("| %d | %s | %s | %.3f |\n", r.n, r.phase.c_str(), r.part_names[p].c_str(),
                    median(r.lib_parts[p]));
  }

  bool agree = true;
  std::printf("\nLibrary vs bare results (max relative difference):\n");
  for (const auto& k : checks) {
    const bool ok = k.value <= k.tolerance;
    agree = agree && ok;
    std::printf("  %-40s %.2e %s\n", k.what.c_str(), k.value, ok ? "ok" : "MISMATCH");
  }

  std::vector<const Row*> judged, missed;
  for (const auto& r : rows)
    if (r.in_target && r.n >= target_from_n) {
      judged.push_back(&r);
      if (!(r.ratio() <= target_ratio)) missed.push_back(&r);
    }
  std::printf("\n");
  if (judged.empty()) {
    std::printf(
        "target (ratio <= %.2f for every phase at n >= %d): not evaluated, no such size run\n",
        target_ratio, target_from_n);
  } else if (missed.empty()) {
    std::printf("target (ratio <= %.2f for every phase at n >= %d): MET by all %zu phases\n",
                target_ratio, target_from_n, judged.size());
  } else {
    std::printf("target (ratio <= %.2f for every phase at n >= %d): MISSED by %zu of %zu:",
                target_ratio, target_from_n, missed.size(), judged.size());
    for (const auto* r : missed)
      std::printf(" n=%d %s (%.3f);", r->n, r->phase.c_str(), r->ratio());
    std::printf("\n");
  }
  if (!agree) {
    std::printf("library and bare results disagree: the timings above compare different math\n");
    return 1;
  }
  return 0;
}
