/// \file randomized_eigen.cpp
/// \brief Decomposition and preconditioning time of kfac::RandomizedEigen at several ranks
/// against kfac::Eigendecomposition, on one square bias-free Dense(n, n) layer, in one run,
/// printed as ratios (exact / randomized: the speed-up), with the preconditioned gradient's
/// relative distance from the exact one.
///
/// Usage: bench_randomized_eigen [--sizes 1024,2048] [--ranks 64,128,256] [--batch 256]
///                               [--oversampling 16] [--power-iterations 1] [--reps 5] [--threads 1]
///                               [--clock cpu|wall] [--decay s]
///
/// Observations are uniform in [-1, 1] with feature j scaled by (1 + j)^-s (`--decay s`, default
/// 0): s = 0 gives factors with a flat spectrum, far from any low rank (the eigensolver's worst
/// case too); s = 1 a spectrum decaying like 1/j^2, as trained layers' factors decay.
/// Every layer sees the same observations (enough batches to make A and G full rank, as
/// benchmark_phases primes them). "decomposition" is decompose(A) + decompose(G) +
/// finish_decomposition; the randomized layers are timed on warm decompositions (the steady
/// state: after the first, each starts from the last basis), their first, cold one is printed
/// apart. "preconditioning" is load_gradient + apply + inner_product + write_back. Medians of
/// `--reps` repetitions after one warm-up, on Kokkos' default host space, timed by the calling
/// thread's CPU clock (`--clock cpu`, the default: with one BLAS thread that is the whole cost,
/// and other processes on shared cores do not inflate it) or the wall clock.

#include <Kokkos_Core.hpp>
#include <kfac/kfac.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
template <class Inverse>
using Layer = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, Inverse, kfac::DoublePrecision, double, Exec>;
using Tensor = Layer<kfac::Eigendecomposition<>>::tensor_type;
using Gradient = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

struct Config {
  std::vector<int> sizes{1024, 2048}, ranks{64, 128, 256};
  int batch = 256, oversampling = 16, power_iterations = 1, reps = 5, threads = 1;
  bool cpu_clock = true;
  double decay_power = 0;
  double decay = 0.95, damping = 1e-3;
};

/// Times of one layer: decomposition (warm) and preconditioning medians, the first (cold)
/// decomposition, and the preconditioned gradient.
struct Times {
  double decomposition = 0, cold = 0, preconditioning = 0;
  std::vector<double> result;
};

template <class Inverse>
Times measure(const Config& c, int n, const Inverse& inverse, const std::vector<std::vector<double>>& batches,
              const std::vector<double>& x0) {
  const Exec exec;
  Layer<Inverse> layer("fc", kfac::Dense(n, n, false), inverse);
  for (std::size_t b = 0; b + 1 < batches.size(); b += 2) {
    const Tensor xt(const_cast<double*>(batches[b].data()), c.batch, n, 1, 1);
    const Tensor gt(const_cast<double*>(batches[b + 1].data()), c.batch, n, 1, 1);
    layer.observe_input(exec, xt);
    layer.observe_output_grad(exec, gt, 1.0);
    layer.update_statistics(exec, c.decay);
    layer.clear_observations();
  }
  layer.allocate_units();
  auto decompose = [&] {
    const double t0 = bench::now_ms(c.cpu_clock);
    layer.decompose(exec, 0, c.damping);
    layer.decompose(exec, 1, c.damping);
    layer.finish_decomposition(exec, c.damping, false);
    exec.fence();
    return bench::now_ms(c.cpu_clock) - t0;
  };
  std::vector<double> w(x0.size());
  const Gradient wg(w.data(), n, n);
  auto precondition = [&] {
    std::copy(x0.begin(), x0.end(), w.begin());
    const double t0 = bench::now_ms(c.cpu_clock);
    layer.load_gradient(exec, wg, {});
    layer.apply(exec, c.damping);
    layer.inner_product(exec);
    layer.write_back(exec, wg, {}, 1.0);
    exec.fence();
    return bench::now_ms(c.cpu_clock) - t0;
  };
  Times t;
  t.cold = decompose();
  std::vector<double> dec, pre;
  precondition();
  for (int r = 0; r < c.reps; ++r) {
    dec.push_back(decompose());
    pre.push_back(precondition());
  }
  t.decomposition = bench::median(dec);
  t.preconditioning = bench::median(pre);
  t.result = w;
  return t;
}

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    s += b[i] * b[i];
  }
  return std::sqrt(d / s);
}

bool parse_list(const char* s, std::vector<int>& out) {
  out.clear();
  for (const auto& item : bench::split(s)) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || v < 1) return false;
    out.push_back(int(v));
  }
  return true;
}

bool parse(int argc, char** argv, Config& c) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kokkos", 0) == 0) continue;
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (a == "--sizes") {
      if (!parse_list(v, c.sizes)) return false;
    } else if (a == "--decay") {
      char* end = nullptr;
      c.decay_power = std::strtod(v, &end);
      if (*end || !(c.decay_power >= 0)) return false;
    } else if (a == "--clock") {
      if (std::strcmp(v, "cpu") != 0 && std::strcmp(v, "wall") != 0) return false;
      c.cpu_clock = std::strcmp(v, "cpu") == 0;
    } else if (a == "--ranks") {
      if (!parse_list(v, c.ranks)) return false;
    } else if (a == "--batch" || a == "--reps" || a == "--threads" || a == "--oversampling" || a == "--power-iterations") {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (*end || n < 0) return false;
      int& slot = a == "--batch" ? c.batch : a == "--reps" ? c.reps : a == "--threads" ? c.threads
                                              : a == "--oversampling" ? c.oversampling : c.power_iterations;
      slot = int(n);
    } else {
      return false;
    }
  }
  return c.batch > 0 && c.reps > 0 && c.threads > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (!parse(argc, argv, c)) {
    std::fprintf(stderr,
                 "usage: %s [--sizes 1024,2048] [--ranks 64,128,256] [--batch 256] [--oversampling 16]\n"
                 "          [--power-iterations 1] [--reps 5] [--threads 1] [--clock cpu|wall] [--decay s]\n",
                 argv[0]);
    return 2;
  }
  std::vector<char*> kokkos_args{argv[0]};  // Kokkos 3.4 would claim --threads
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--kokkos", 8) == 0) kokkos_args.push_back(argv[i]);
  int kokkos_argc = int(kokkos_args.size());
  Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_args.data());
  if (openblas_set_num_threads) openblas_set_num_threads(c.threads);
  std::printf("kfac bench_randomized_eigen: Dense(n, n) no bias, Symmetric, double, %s; batch %d, damping %g,\n"
              "features scaled by (1 + j)^-%g, oversampling %d, power iterations %d, BLAS threads %d, median of %d (%s clock)\n\n",
              Exec::name(), c.batch, c.damping, c.decay_power, c.oversampling, c.power_iterations, c.threads, c.reps,
              c.cpu_clock ? "thread CPU" : "wall");
  std::printf("| n | policy | decomposition ms | exact / this | first (cold) ms | preconditioning ms | exact / this | "
              "distance from exact |\n|---:|---|---:|---:|---:|---:|---:|---:|\n");
  for (const int n : c.sizes) {
    std::mt19937_64 rng(4242u + unsigned(n));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    const int priming = (n + c.batch - 1) / c.batch + 1;
    std::vector<std::vector<double>> batches(2 * std::size_t(priming), std::vector<double>(std::size_t(c.batch) * n));
    for (auto& b : batches)
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = u(rng) * std::pow(1.0 + double(i % std::size_t(n)), -c.decay_power);
    std::vector<double> x0(std::size_t(n) * n);
    for (auto& v : x0) v = u(rng);
    const Times exact = measure(c, n, kfac::Eigendecomposition<>{}, batches, x0);
    std::printf("| %d | eigen | %.1f | 1 | %.1f | %.2f | 1 | 0 |\n", n, exact.decomposition, exact.cold,
                exact.preconditioning);
    std::fflush(stdout);
    for (const int r : c.ranks) {
      const auto policy = kfac::RandomizedEigen<>{}.with_rank(r).with_oversampling(c.oversampling).with_power_iterations(
          c.power_iterations);
      const Times t = measure(c, n, policy, batches, x0);
      std::printf("| %d | rank %d | %.1f | %.2f | %.1f | %.2f | %.2f | %.3g |\n", n, r, t.decomposition,
                  exact.decomposition / t.decomposition, t.cold, t.preconditioning,
                  exact.preconditioning / t.preconditioning, rel_diff(t.result, exact.result));
      std::fflush(stdout);
    }
  }
  return 0;
}
