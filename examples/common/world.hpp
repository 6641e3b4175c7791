#pragma once
/// \file world.hpp
/// \brief The processes of a data-parallel run: one process without MPI, the ranks of an MPI
/// communicator with it (`mpiexec -n P fashion_mnist ...`).
///
/// Data parallelism in the examples: every rank holds the whole training set and draws the same
/// shuffled global batch; rank r trains on its r-th slice of it, gradients are averaged over the
/// ranks (kfac::GradientAverager, in kfac_glue.hpp), so every rank takes the same step on the
/// same weights, and K-FAC averages its factors over the ranks. BatchNorm normalizes with its
/// local slice's statistics (no synchronized BatchNorm).

#if defined(KFAC_HAVE_MPI)
#include <mpi.h>
#define KFAC_EXAMPLES_HAVE_MPI 1
#else
#define KFAC_EXAMPLES_HAVE_MPI 0
#endif

#include <vector>

namespace nn {

class World {
 public:
  /// \brief One process.
  World() = default;
#if KFAC_EXAMPLES_HAVE_MPI
  /// \brief The ranks of `comm` (kept, not duplicated: it must outlive this World).
  explicit World(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm, &rank_);
    MPI_Comm_size(comm, &size_);
  }
  MPI_Comm comm() const { return comm_; }
#endif

  int rank() const { return rank_; }
  int size() const { return size_; }

  /// \brief Replaces each value by its sum over the ranks (the same on every rank).
  void sum(std::vector<double>& v) const {
#if KFAC_EXAMPLES_HAVE_MPI
    if (size_ > 1) MPI_Allreduce(MPI_IN_PLACE, v.data(), int(v.size()), MPI_DOUBLE, MPI_SUM, comm_);
#else
    (void)v;
#endif
  }

  void barrier() const {
#if KFAC_EXAMPLES_HAVE_MPI
    if (size_ > 1) MPI_Barrier(comm_);
#endif
  }

 private:
  int rank_ = 0, size_ = 1;
#if KFAC_EXAMPLES_HAVE_MPI
  MPI_Comm comm_ = MPI_COMM_SELF;
#endif
};

}  // namespace nn
