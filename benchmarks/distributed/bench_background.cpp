/// \file bench_background.cpp
/// \brief What Kaisa::background_sharing saves at the step that swaps a deferred
/// decomposition in (Options::decomposition_delay): the broadcasts of the decompositions, which
/// the thread that computed them has already made while the host was busy with other work.
///
/// Every rank runs the same COMM-OPT preconditioner of `--layers` Dense(W, W) layers (float,
/// eigendecompositions, factors every step, a decomposition every `--inv-every` steps swapped in
/// `--delay` steps later) on its own random batch, with `--host-ms` ms of busy host work between
/// steps standing in for the forward and backward passes. Sharing off and on alternate in
/// `--rounds` rounds of `--steps` steps each (fresh preconditioners, the same data), so drift
/// hits both alike. Each step starts after an MPI_Barrier and lasts as long as the slowest
/// rank's step(). Printed per setting: the median step() time of swap steps, launch steps and
/// plain steps, and the swap steps' ratio on / off.
///
/// Usage: mpiexec -n 2 bench_background [--width 1024] [--layers 2] [--batch 64] [--steps 24]
///          [--inv-every 4] [--delay 3] [--host-ms 60] [--rounds 2]
/// Needs MPI_THREAD_MULTIPLE (asked for here); without it both settings share at the swap step,
/// and it says so.

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>

#include "../bench_util.hpp"

namespace {

using Host = Kokkos::DefaultHostExecutionSpace;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>;

struct Args {
  int width = 1024, layers = 2, batch = 64, steps = 24, inv_every = 4, delay = 3, rounds = 2;
  double host_ms = 60;
};

double wall_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Busy host work for `ms` milliseconds (a core kept busy, as a forward and backward pass would).
double host_work(double ms) {
  const double end = wall_ms() + ms;
  double acc = 1.0;
  while (wall_ms() < end)
    for (int i = 0; i < 10000; ++i) acc = acc * 1.0000001 + 1e-9;
  return acc;
}

/// Median step() times (max over ranks) of swap, launch and plain steps.
struct Times {
  std::vector<double> swap, launch, plain;
};

void run(const Args& a, bool background, Times& t, double& sink) {
  const int rank = [] { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }();
  const auto o = kfac::Options{}
                     .with_kl_clip(1e-3)
                     .with_damping(1e-3)
                     .with_factor_update_steps(1)
                     .with_inv_update_steps(a.inv_every)
                     .with_decomposition_delay(a.delay);
  kfac::Preconditioner<float, Host, kfac::MpiComm> pre(o, Host(), kfac::MpiComm(MPI_COMM_WORLD),
                                                       kfac::Kaisa{}.with_background_sharing(background));
  for (int l = 0; l < a.layers; ++l)
    pre.register_layer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>>("fc" + std::to_string(l),
                                                                                  kfac::Dense(a.width, a.width));
  std::mt19937 gen(17u + unsigned(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](V2 v) { for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = normal(gen); };
  V2 x("x", a.batch, a.width), g("g", a.batch, a.width);
  // Each layer its own gradient buffers: set_gradient refuses two layers handed the same memory.
  std::vector<V2> ws;
  std::vector<Kokkos::View<float*, Kokkos::HostSpace>> bs;
  for (int l = 0; l < a.layers; ++l) {
    ws.emplace_back("w", a.width, a.width);
    bs.emplace_back("b", a.width);
  }
  for (int s = 0; s < a.steps; ++s) {
    sink += host_work(a.host_ms);
    for (int l = 0; l < a.layers; ++l) {
      const std::string name = "fc" + std::to_string(l);
      fill(x);
      fill(g);
      fill(ws[l]);
      pre.observe_input(name, x);
      pre.observe_output_grad(name, g);
      pre.set_gradient(name, ws[l], bs[l]);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = wall_ms();
    pre.step();
    double ms = wall_ms() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &ms, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (s < a.inv_every) continue;  // the first decomposition runs at once
    if (s % a.inv_every == a.delay % a.inv_every) t.swap.push_back(ms);
    else if (s % a.inv_every == 0) t.launch.push_back(ms);
    else t.plain.push_back(ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  Kokkos::initialize(argc, argv);
  int status = 0;
  {
    Args a;
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      if (i + 1 >= argc) { std::fprintf(stderr, "bench_background: missing value after %s\n", k.c_str()); status = 2; break; }
      const char* v = argv[++i];
      if (k == "--width") a.width = std::atoi(v);
      else if (k == "--layers") a.layers = std::atoi(v);
      else if (k == "--batch") a.batch = std::atoi(v);
      else if (k == "--steps") a.steps = std::atoi(v);
      else if (k == "--inv-every") a.inv_every = std::atoi(v);
      else if (k == "--delay") a.delay = std::atoi(v);
      else if (k == "--host-ms") a.host_ms = std::atof(v);
      else if (k == "--rounds") a.rounds = std::atoi(v);
      else { std::fprintf(stderr, "bench_background: unknown option %s\n", k.c_str()); status = 2; break; }
    }
    if (status == 0 && (a.delay < 1 || a.delay >= a.inv_every)) {
      std::fprintf(stderr, "bench_background: --delay must be in [1, --inv-every)\n");
      status = 2;
    }
    if (status == 0) {
      int rank = 0, size = 1;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      const bool threads = kfac::MpiComm(MPI_COMM_WORLD).thread_multiple();
      Times t[2];
      double sink = 0;
      for (int r = 0; r < a.rounds; ++r)
        for (int bg : {0, 1}) run(a, bg == 1, t[bg], sink);
      if (rank == 0) {
        std::printf("# %d ranks, %d x Dense(%d, %d), float, eigen every %d steps, delay %d, batch %d, host work %.0f ms, "
                    "%d rounds x %d steps; MPI_THREAD_MULTIPLE: %s%s\n",
                    size, a.layers, a.width, a.width, a.inv_every, a.delay, a.batch, a.host_ms, a.rounds, a.steps,
                    threads ? "yes" : "no", threads ? "" : " (both settings share at the swap step)");
        std::printf("| background_sharing | swap steps (ms) | launch steps (ms) | plain steps (ms) | swap steps timed |\n");
        std::printf("|---|---:|---:|---:|---:|\n");
        for (int bg : {0, 1})
          std::printf("| %s | %.1f | %.1f | %.1f | %zu |\n", bg ? "on" : "off", bench::median(t[bg].swap),
                      bench::median(t[bg].launch), bench::median(t[bg].plain), t[bg].swap.size());
        std::printf("swap step on / off: %.2f\n", bench::median(t[1].swap) / bench::median(t[0].swap));
      }
      if (sink == 0.5) std::printf("\n");  // keeps the host work
    }
  }
  Kokkos::finalize();
  MPI_Finalize();
  return status;
}
