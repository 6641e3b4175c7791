// Data-parallel training under mpiexec: P ranks, each on its slice of every global batch, with
// gradients (and K-FAC factors) averaged over the ranks, take the same steps as one process on
// the whole batch, and stay identical to each other.

#include "common/trainer.hpp"
#include "common/world.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using Weights = std::vector<std::vector<float>>;  // every parameter tensor, in order

struct Trace {
  std::vector<double> losses;
  Weights initial, first, last;  // before training, after the first step, after the last
};

Weights weights(nn::Trainer& t) {
  Weights out;
  for (const nn::Param& p : t.network().params()) out.push_back(test::to_host(p.value));
  return out;
}

Trace train(const nn::Dataset& data, const nn::TrainSettings& s, const nn::World& world, int steps) {
  nn::Trainer t(data, s, world);
  Trace out;
  out.initial = weights(t);
  t.start_epoch(0);
  for (int i = 0; i < steps; ++i) {
    out.losses.push_back(t.step(i).mean_loss());
    if (i == 0) out.first = weights(t);
  }
  out.last = weights(t);
  return out;
}

// How far the P-rank weights ended from the one-process weights, relative to how far training
// moved the latter: max over parameter tensors of ||w_P - w_1||_2 / ||w_1 - w_initial||_2.
// Rounding perturbs the steps, so this stays small however it is amplified on single elements;
// a wrong batch split or a rank-dependent shuffle changes the steps themselves (measured 0.66 to
// 1.4 on every case with 3 ranks; a sum in place of the average: 2 on SGD's first step).
double drift(const Weights& together, const Weights& alone, const Weights& initial) {
  double worst = 0.0;
  for (std::size_t k = 0; k < alone.size(); ++k) {
    double apart = 0.0, moved = 0.0;
    for (std::size_t i = 0; i < alone[k].size(); ++i) {
      const double d = double(together[k][i]) - double(alone[k][i]), m = double(alone[k][i]) - double(initial[k][i]);
      apart += d * d;
      moved += m * m;
    }
    const double r = std::sqrt(apart / moved);
    worst = r > worst ? r : worst;
  }
  return worst;
}

// The same measure for the losses: max over steps of |L_P - L_1| relative to the progress the
// one-process loss made, max over steps of |L_1 - L_1(step 0)|. A loss relative to itself is
// not: it falls to 1e-6 on this data (SGD), where rounding alone reached 1.6e-4 of it.
double loss_drift(const std::vector<double>& together, const std::vector<double>& alone) {
  double apart = 0.0, moved = 0.0;
  for (std::size_t i = 0; i < alone.size(); ++i) {
    apart = std::max(apart, std::abs(together[i] - alone[i]));
    moved = std::max(moved, std::abs(alone[i] - alone[0]));
  }
  return apart / moved;
}

}  // namespace

TEST_CASE("P ranks train like one process on the whole batch, and agree bit for bit", "[data_parallel]") {
  const nn::World world(MPI_COMM_WORLD);
  const int p = world.size();
  const nn::Dataset data = test::synthetic(96 * 12, 41);
  struct Case {
    nn::OptimizerKind kind;
    std::string inverse;  // K-FAC only
    double tolerance;     // on drift() after the first step and after the last, and on loss_drift()
    bool recipe = false;  // --recipe large-batch: the learning rate (and K-FAC's settings) scheduled
  };
  // P ranks sum the gradients and factors in another order than one process, so the weights
  // differ by float rounding only; how much depends on the BLAS kernel (OpenBLAS picks its GEMM
  // by CPU). The tolerances are about 5x the worst drift measured over np 2, 3 and 4 with the
  // Haswell, Zen, SkylakeX and Cooperlake kernels (OPENBLAS_CORETYPE), first or last of 10 steps:
  //   sgd 5.5e-7, adam 3.9e-4, kfac eigen 4.0e-4, kfac cholesky 1.1e-3.
  // The losses' loss_drift() stays far below the weights' drift(): worst over np 2, 3 and 4 with
  // the Prescott, Sandybridge, Haswell and Zen kernels (2026-12-06), sgd 1.2e-7, adam 9.2e-7,
  // kfac eigen 1.0e-6, cholesky 6.0e-6, randomized 1.0e-4 (SkylakeX, reported: 1.3e-4), so the
  // same tolerance holds it with 25x or more to spare.
  // Adam's is all in single weights whose gradient is rounding noise near its eps (1e-8): there
  // g / (|g| + eps) changes by 15% with the summation order. K-FAC's comes from the damped float
  // inverses of badly conditioned factors (tests/test_mpi_distributed.cpp checks the Cholesky
  // path over MPI in double to 1e-10). A per-element relative check is not meaningful here: it
  // measured up to 6e-3 for Adam and 3e-3 for K-FAC on near-zero weights, depending on the kernel.
  std::vector<Case> cases{{nn::OptimizerKind::sgd, "", 3e-6}, {nn::OptimizerKind::adam, "", 2e-3}};
  if (KFAC_EXAMPLES_HAVE_KFAC) {
    cases.push_back({nn::OptimizerKind::kfac, "eigen", 2e-3});
    cases.push_back({nn::OptimizerKind::kfac, "cholesky", 5e-3});
    // The demo's MLP default (RandomizedEigen rank 32, factored damping, distribution chosen by
    // the cost model). Keeping the top k of l Ritz values is not continuous where values near
    // the k-th are nearly equal (the running factors start from a multiple of the identity), so
    // float rounding in the sums can keep another subspace: the P-rank run is then not "the
    // one-process run plus rounding" but a neighbouring run, and only the drift measures, not a
    // loss-by-loss relative match, compare it. First-step drift measured up to 0.016 (4 ranks,
    // every kernel above; 0.03-0.05 at ranks 128-512, 0.12 with the eigen form of damping), and
    // with SkylakeX kernels the last loss moved by 3.4e-4 of itself (2.3035715 vs 2.3027972),
    // against the O(1) of a wrong split or average. tests/test_mpi_distributed.cpp checks the
    // low-rank path over MPI in double to 1e-10.
    cases.push_back({nn::OptimizerKind::kfac, "randomized", 5e-2});
    cases.push_back({nn::OptimizerKind::sgd, "", 3e-6, true});
    cases.push_back({nn::OptimizerKind::kfac, "eigen", 2e-3, true});
  }
  for (const Case& c : cases) {
    DYNAMIC_SECTION(nn::to_string(c.kind) << " " << c.inverse << (c.recipe ? " large-batch" : "") << " on " << p << " ranks") {
      nn::TrainSettings s;
      s.model = "mlp";  // no BatchNorm: its per-rank statistics would differ from the whole batch's
      s.optimizer = c.kind;
      if (!c.inverse.empty()) s.kfac.inverse = c.inverse;
      s.batch = 96;  // divisible by 1 to 4 ranks
      s.seed = 9;
      s.kfac.factor_update_steps = 2;
      s.kfac.inv_update_steps = 4;
      if (c.recipe) {  // 12 steps per epoch, one epoch: warm-up, decay, damping and intervals all move
        s.recipe.name = "large-batch";
        s.epochs = 1;
      }
      const int steps = 10;
      const Trace together = train(data, s, world, steps);
      const Trace alone = train(data, s, nn::World(), steps);
      REQUIRE(together.losses.size() == alone.losses.size());
      CHECK(loss_drift(together.losses, alone.losses) < c.tolerance);
      const bool same_start = together.initial == alone.initial;  // the same seed
      REQUIRE(same_start);
      // The first step is where a wrong split or average shows before anything amplifies it.
      CHECK(drift(together.first, alone.first, alone.initial) < c.tolerance);
      CHECK(drift(together.last, alone.last, alone.initial) < c.tolerance);
      // Every rank holds the same weights, bit for bit.
      int differ = 0, any = 0;
      for (const std::vector<float>& w : together.last) {
        std::vector<float> root = w;
        MPI_Bcast(root.data(), int(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
        differ |= root != w ? 1 : 0;
      }
      MPI_Allreduce(&differ, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      CHECK(any == 0);
      // The loss fell: the run trained.
      CHECK(together.losses.back() < together.losses.front());
    }
  }
}

TEST_CASE("a batch that does not split evenly over the ranks is refused", "[data_parallel]") {
  const nn::World world(MPI_COMM_WORLD);
  if (world.size() == 1) return;  // every batch splits over one rank
  nn::TrainSettings s;
  s.batch = 96 * world.size() + 1;
  const nn::Dataset data = test::synthetic(1000, 3);
  CHECK_THROWS_WITH(nn::Trainer(data, s, world), Catch::Contains("must split evenly"));
}
