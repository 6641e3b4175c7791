#pragma once
/// \file calibration.hpp
/// \brief Measures kfac::MachineFigures on the machine that runs, through the same calls the
/// library makes (KokkosBlas GEMM, the decomposition backends, deep copies, the communicator's
/// broadcasts), so that kfac::CostModel's predictions hold for the cores and ranks at hand
/// instead of the one-core defaults.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

#include "kfac/core/comm_precision.hpp"
#include "kfac/error.hpp"
#include "kfac/linalg/eigh.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/spd_inverse.hpp"
#include "kfac/linalg/symmetric.hpp"
#include "kfac/planning/cost_model.hpp"

namespace kfac {

/// \brief Collective over `comm`: times, on every rank at once (so that the figures include
/// the ranks' contention for cores and memory), an n x n symmetric eigendecomposition and SPD
/// inverse (impl::eigh / impl::spd_inverse with AutoBackend: LAPACK, cuSOLVER or portable), an
/// n x n GEMM in double and in float, and a 32 MiB device copy; with several ranks, broadcasts
/// of 8 bytes and 8 MiB from rank 0 (the latency and bandwidth kfac's collectives see). Each
/// time is the median of `reps` runs after one warm-up, averaged over the ranks by a
/// reduce-and-broadcast, so every rank returns the same figures bit for bit. Takes about
/// 12 n^3 / gemm_flops + 6 eigendecompositions: about 1.5 s for n = 1024 on one core here.
/// Figures it does not measure (Newton-Schulz iterations) keep MachineFigures' defaults.
/// \param exec [in] the execution space kfac runs on.
/// \param comm [in] kfac::SerialComm or kfac::MpiComm.
/// \param n [in] the matrix size (>= 64).
/// \param reps [in] timed runs of each operation (>= 1).
template <class Exec, class Comm>
MachineFigures measure_machine_figures(const Exec& exec, const Comm& comm, int n = 1024, int reps = 3) {
  if (n < 64 || reps < 1) throw Error("", "measure_machine_figures: expected n >= 64 and reps >= 1");
  using Clock = std::chrono::steady_clock;
  using M = impl::Matrix<double, Exec>;
  const auto median_of = [&](auto&& op) {
    std::vector<double> t;
    for (int r = 0; r <= reps; ++r) {
      exec.fence();
      const auto t0 = Clock::now();
      op();
      exec.fence();
      if (r > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());  // run 0 warms up
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const auto mean_over_ranks = [&](double v) {
    comm.sum(&v, 1, sizeof(double), CommPrecision::native);
    return v / double(comm.size());
  };

  // A well-conditioned SPD matrix: (R^T R) / 2n + I from a deterministic R.
  M r(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::calibration::r"), 2 * n, n);
  M spd("kfac::calibration::spd", n, n), out("kfac::calibration::out", n, n);
  impl::Vector<double, Exec> w("kfac::calibration::w", n);
  const int rows = 2 * n;
  Kokkos::parallel_for(
      "kfac::calibration::fill", Kokkos::RangePolicy<Exec>(exec, 0, rows), KOKKOS_LAMBDA(int i) {
        for (int j = 0; j < n; ++j)  // unsigned: no overflow for any n
          r(i, j) = double((unsigned(i) * 7919u + unsigned(j) * 104729u) % 2003u) / 1001.0 - 1.0;
      });
  impl::gemm(exec, "T", "N", 1.0 / double(rows), r, r, 0.0, spd);
  impl::add_diagonal(exec, spd, 1.0);
  impl::SolverWorkspace<double, Exec> ws;
  const double n3 = double(n) * n * n;

  MachineFigures f;
  f.eigen_seconds_per_n3 = mean_over_ranks(median_of([&] { impl::eigh<AutoBackend>(exec, spd, out, w, ws); })) / n3;
  f.cholesky_seconds_per_n3 =
      mean_over_ranks(median_of([&] { impl::spd_inverse<AutoBackend>(exec, spd, 0.0, out, ws); })) / n3;
  const double dgemm = median_of([&] { impl::gemm(exec, "N", "N", 1.0, spd, spd, 0.0, out); });
  f.gemm_flops = mean_over_ranks(2.0 * n3 / dgemm);
  {
    impl::Matrix<float, Exec> a("kfac::calibration::af", n, n), b("kfac::calibration::bf", n, n),
        c("kfac::calibration::cf", n, n);
    Kokkos::deep_copy(exec, a, 0.5f);
    Kokkos::deep_copy(exec, b, 0.25f);
    const double sgemm = median_of([&] { impl::gemm(exec, "N", "N", 1.0f, a, b, 0.0f, c); });
    f.float_speedup = mean_over_ranks(dgemm / sgemm);
  }
  {  // a streaming copy of 32 MiB: bytes read + written per second
    Kokkos::View<double*, typename Exec::memory_space> from("kfac::calibration::from", std::size_t(4) << 20),
        to("kfac::calibration::to", std::size_t(4) << 20);
    const double t = median_of([&] { Kokkos::deep_copy(exec, to, from); });
    f.memory_bandwidth = mean_over_ranks(2.0 * double(from.size() * sizeof(double)) / t);
  }
  if (comm.size() > 1) {  // rank 0's broadcasts, timed on rank 0 and shared
    std::vector<char> buf(std::size_t(8) << 20);
    const auto broadcast_seconds = [&](std::size_t bytes) {
      std::vector<double> t;
      for (int k = 0; k < 5 * reps; ++k) {
        double one = 0;
        comm.broadcast(&one, sizeof one, 0);  // line the ranks up
        const auto t0 = Clock::now();
        comm.broadcast(buf.data(), bytes, 0);
        comm.broadcast(&one, sizeof one, comm.size() - 1);  // the last rank has it too
        t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::sort(t.begin(), t.end());
      double v = t[t.size() / 2];
      comm.broadcast(&v, sizeof v, 0);
      return v;
    };
    const double small = broadcast_seconds(8) / 2;  // two small broadcasts in that time
    f.latency = small;
    f.bandwidth = double(buf.size()) / std::max(broadcast_seconds(buf.size()) - small, 1e-9);
  }
  return f;
}

}  // namespace kfac
