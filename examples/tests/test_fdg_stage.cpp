// nn::MlpStage in kfac::Pipeline under mpiexec: the MLP split over the ranks and trained by
// synchronous model-parallel back-propagation takes, bit for bit, the steps of the whole MLP as
// one stage on one rank, with SGD and with per-stage K-FAC (each stage preconditioning its own
// layers; KL clipping off, since it couples layers); FDG is deterministic given the seed and,
// with its delayed gradients, differs from back-propagation.

#include "common/cross_entropy.hpp"
#include "common/mlp_stage.hpp"
#include "common/rng.hpp"

#include <kfac/pipeline/pipeline.hpp>

#include <catch2/catch.hpp>
#include <mpi.h>

#include <string>
#include <vector>

namespace {

const std::vector<int> kWidths = {20, 16, 12, 8, 5};
constexpr int kBatch = 16;
constexpr long kBatches = 6;

int rank_of() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int size_of() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }
bool everywhere(bool b) {
  int v = b ? 1 : 0, r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return r == 1;
}

/// Inputs on the host (what the pipeline exchanges), labels in nn::ExecSpace's memory.
struct Data {
  std::vector<nn::MlpStage::HostMatrix> x;
  std::vector<nn::Labels> y;
  Data() {
    nn::SplitMix64 rng(42);
    for (long b = 0; b < kBatches; ++b) {
      nn::MlpStage::HostMatrix xb("x", kBatch, kWidths.front());
      auto yb = Kokkos::create_mirror_view(nn::Labels("y", kBatch));
      for (std::size_t i = 0; i < xb.size(); ++i) xb.data()[i] = float(rng.uniform(-1.0, 1.0));
      for (int i = 0; i < kBatch; ++i) yb(i) = int(rng.next() % std::uint64_t(kWidths.back()));
      x.push_back(xb);
      y.push_back(Kokkos::create_mirror_view_and_copy(nn::MemSpace(), yb));
    }
  }
};

/// Layers [first, last) of stage k of K: 4 layers split 4 | 2 + 2 | 1 + 2 + 1.
std::pair<int, int> cut(int k, int stages) {
  static const std::vector<std::vector<int>> cuts = {{0, 4}, {0, 2, 4}, {0, 1, 3, 4}};
  return {cuts[stages - 1][k], cuts[stages - 1][k + 1]};
}

/// Trains 2 epochs; returns the whole MLP's parameters on rank 0 (gathered from the stages).
std::vector<float> train(int stages, kfac::PipelineSchedule schedule, bool with_kfac, double beta = 1.0) {
  const int rank = rank_of();
  const auto c = cut(rank < stages ? rank : 0, stages);
  nn::MlpStage stage(kWidths, c.first, c.second, 7, nn::SgdOptions{}.with_lr(0.05).with_momentum(0.9));
  if (with_kfac) {
    nn::KfacSettings s;
    s.lr = 0.05;
    s.kl_clip = 0;  // off: KL clipping scales every layer of a preconditioner by one factor
    s.damping = 0.3;
    s.factor_update_steps = 2;
    s.inv_update_steps = 3;
    s.inverse = "cholesky";
    stage.enable_kfac(s);
  }
  kfac::Pipeline<nn::MlpStage> pipe(kfac::MpiComm(MPI_COMM_WORLD), stage,
                                    kfac::PipelineOptions{}.with_stages(stages).with_batch_size(kBatch)
                                        .with_beta(beta).with_schedule(schedule));
  const Data data;  // the same batches on every call (seeded)
  nn::SoftmaxCrossEntropy xent;
  for (int e = 0; e < 2; ++e)
    pipe.train(kBatches, [&](long b) { return data.x[b]; },
               [&](long b, const nn::MlpStage::HostMatrix& out) {
                 const nn::Matrix dev = Kokkos::create_mirror_view_and_copy(nn::MemSpace(), out);
                 xent.forward_backward(nn::as_tensor(dev), data.y[b]);
                 return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), nn::as_matrix(xent.grad()));
               });
  std::vector<float> mine = rank < stages ? stage.parameters() : std::vector<float>();
  if (rank == 0) {
    for (int k = 1; k < stages; ++k) {
      int n = 0;
      MPI_Recv(&n, 1, MPI_INT, k, 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      std::vector<float> p(static_cast<std::size_t>(n));
      MPI_Recv(p.data(), n, MPI_FLOAT, k, 6, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      mine.insert(mine.end(), p.begin(), p.end());
    }
  } else if (rank < stages) {
    const int n = int(mine.size());
    MPI_Send(&n, 1, MPI_INT, 0, 5, MPI_COMM_WORLD);
    MPI_Send(mine.data(), n, MPI_FLOAT, 0, 6, MPI_COMM_WORLD);
  }
  return mine;
}

}  // namespace

TEST_CASE("synchronous model parallelism is the one-rank MLP, bit for bit, with SGD and per-stage K-FAC",
          "[examples][pipeline]") {
  const int stages = std::min(3, size_of());
  std::vector<std::vector<float>> results;
  for (bool with_kfac : {false, true}) {
    INFO((with_kfac ? "K-FAC" : "SGD") << ", " << stages << " stages");
    const auto whole = train(1, kfac::PipelineSchedule::fdg, with_kfac);
    const auto split = train(stages, kfac::PipelineSchedule::synchronous, with_kfac);
    CHECK(everywhere(rank_of() != 0 || (whole.size() == split.size() && whole == split)));
    if (rank_of() == 0) CHECK(!whole.empty());
    results.push_back(split);
  }
  CHECK(everywhere(rank_of() != 0 || results[0] != results[1]));  // K-FAC did precondition
}

TEST_CASE("FDG with MlpStage is deterministic and differs from back-propagation", "[examples][pipeline]") {
  const int stages = std::min(3, size_of());
  for (bool with_kfac : {false, true}) {
    const auto a = train(stages, kfac::PipelineSchedule::fdg, with_kfac, 0.5);
    const auto b = train(stages, kfac::PipelineSchedule::fdg, with_kfac, 0.5);
    const auto bp = train(stages, kfac::PipelineSchedule::synchronous, with_kfac);
    CHECK(everywhere(rank_of() != 0 || (a == b && a != bp && a.size() == bp.size())));
  }
}
