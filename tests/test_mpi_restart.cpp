// Restart after a lost rank: MPI cannot survive a dead rank, so the job restarts on fewer ranks
// from a checkpoint. Inside one 4-rank job: 4 ranks train and save; then the run continues on a
// 4-, a 3- and a 2-rank sub-communicator (MPI_Comm_split; ranks outside wait) from rank 0's
// checkpoint, with the same global batches split over fewer ranks. The factors are global state
// and restore at any world size; decompositions are per-rank state and are recomputed (load()
// returns false). The restarts agree to 1e-12 (the same sums in another order).
#include "mpi_harness.hpp"

#include <algorithm>
#include <cmath>

using namespace kfac_test;
using namespace kfac_test::mpi;

namespace {

const std::vector<Layer> kNet = {{"fc1", 5, 4, false}, {"fc2", 4, 3, false}, {"fc3", 3, 3, false}};
constexpr int kGlobalBatch = 12;  // divisible by 4, 3 and 2
constexpr long kBefore = 5, kAfter = 6;

kfac::Options restart_options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-2).with_factor_decay(0.9)
      .with_inv_update_steps(3).with_loss_reduction(kfac::LossReduction::sum);
}

/// One step on `pre`: this rank's share (rank r of `ranks`) of the global batch of `step`.
std::vector<double> global_step(Pre& pre, long step, int r, int ranks) {
  Grads gr;
  const int per = kGlobalBatch / ranks;
  for (std::size_t i = 0; i < kNet.size(); ++i) {
    const auto o = observations(kNet[i], i, 29, step, 0, kGlobalBatch);
    V2 x("x", per, kNet[i].in), g("g", per, kNet[i].out);
    Kokkos::deep_copy(x, Kokkos::subview(o.first, std::make_pair(r * per, (r + 1) * per), Kokkos::ALL));
    Kokkos::deep_copy(g, Kokkos::subview(o.second, std::make_pair(r * per, (r + 1) * per), Kokkos::ALL));
    pre.observe_input(kNet[i].name, x);
    pre.observe_output_grad(kNet[i].name, g);
    const auto w = gradient(kNet[i], i, 29, step);
    gr.w.push_back(w.first);
    gr.b.push_back(w.second);
    pre.set_gradient(kNet[i].name, w.first, w.second);
  }
  pre.step();
  return gr.flat();
}

template <class M>
std::vector<double> upper(const M& m) {
  std::vector<double> v;
  for (std::size_t i = 0; i < m.extent(0); ++i)
    for (std::size_t j = i; j < m.extent(1); ++j) v.push_back(m(i, j));
  return v;
}
std::vector<double> factors(const Pre& pre) {
  using Block = kfac::KFAC<>::block_type<kfac::Dense, double, Host>;
  std::vector<double> v;
  for (const auto& l : kNet) {
    const auto& b = pre.layer_as<Block>(l.name);
    for (const auto& part : {upper(b.factor_a()), upper(b.factor_g())}) v.insert(v.end(), part.begin(), part.end());
  }
  return v;
}
double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0, s = 0;
  for (std::size_t k = 0; k < b.size(); ++k) {
    d = std::max(d, std::abs(a[k] - b[k]));
    s = std::max(s, std::abs(b[k]));
  }
  return a.size() == b.size() ? d / s : 1.0;
}

}  // namespace

TEST_CASE("a 4-rank checkpoint restarts on 3 and 2 ranks like on 4", "[mpi][checkpoint][restart]") {
  REQUIRE(size_of() == 4);
  const int rank = rank_in();
  // Training at 4 ranks; every rank saves its file; rank 0's is the one a restart finds.
  std::string own, root_file;
  {
    Pre pre(restart_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD));
    register_net(pre, kNet);
    for (long s = 0; s < kBefore; ++s) global_step(pre, s, rank, 4);
    own = saved(pre);
    root_file = from_rank(own, 0);
    // The same job continued: the reference for a same-size restart from each rank's own file.
    std::vector<double> cont;
    for (long s = kBefore; s < kBefore + kAfter; ++s) {
      const auto r = global_step(pre, s, rank, 4);
      cont.insert(cont.end(), r.begin(), r.end());
    }
    Pre same(restart_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD));
    register_net(same, kNet);
    CHECK(everywhere(loaded(same, own)));  // own file, same world: decompositions restored
    std::vector<double> again;
    for (long s = kBefore; s < kBefore + kAfter; ++s) {
      const auto r = global_step(same, s, rank, 4);
      again.insert(again.end(), r.begin(), r.end());
    }
    CHECK(everywhere(bytes_of(again) == bytes_of(cont)));
  }
  // Restarts from rank 0's file on k = 4, 3, 2 ranks (ranks k..3 are the "lost" ones and wait).
  std::vector<double> ref_out, ref_factors;
  for (int k : {4, 3, 2}) {
    INFO("restart at " << k << " ranks");
    MPI_Comm sub = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, rank < k ? 0 : MPI_UNDEFINED, rank, &sub);
    std::vector<double> out, f;
    bool ok = true;
    if (sub != MPI_COMM_NULL) {
      Pre pre(restart_options(), Host{}, kfac::MpiComm(sub));
      register_net(pre, kNet);
      const bool restored = loaded(pre, root_file);
      CHECK(!restored);  // rank 0's decompositions do not fit ranks 1.. (and k != 4)
      CHECK(pre.step_count() == kBefore);
      for (long s = kBefore; s < kBefore + kAfter; ++s) {
        const auto r = global_step(pre, s, rank, k);
        out.insert(out.end(), r.begin(), r.end());
      }
      f = factors(pre);
      ok = same_everywhere(bytes_of(out), sub);
      MPI_Comm_free(&sub);
    }
    CHECK(everywhere(ok));
    if (rank == 0) {
      if (k == 4) {
        ref_out = out;
        ref_factors = f;
      } else {
        INFO("gradients differ by " << rel_diff(out, ref_out) << ", factors by " << rel_diff(f, ref_factors));
        if (std::getenv("KFAC_PRINT_FAULTS"))
          std::printf("[restart] %d ranks vs 4: gradients %.3g, factors %.3g\n", k, rel_diff(out, ref_out), rel_diff(f, ref_factors));
        CHECK(rel_diff(out, ref_out) <= 1e-12);
        CHECK(rel_diff(f, ref_factors) <= 1e-12);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}
