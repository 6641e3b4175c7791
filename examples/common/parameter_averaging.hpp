#pragma once
/// \file parameter_averaging.hpp
/// \brief Periodic parameter averaging (Povey, Zhang & Khudanpur 2014): each rank trains on its
/// own shard of the training set with its own batches, and every N steps the parameters (and,
/// if asked, the SGD momentum buffers) are replaced by their mean over the ranks with
/// kfac::ParameterAverager. Also measures what the synchronous mode's GradientAverager sends per
/// step, so that both modes' traffic can be printed from the communicator's own byte counts.

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dataset.hpp"
#include "common/kfac_glue.hpp"  // KFAC_EXAMPLES_HAVE_KFAC and the kfac headers
#include "common/network.hpp"
#include "common/world.hpp"

namespace nn {

/// \brief Rank `rank`'s contiguous share of `data`: samples [rank n / P, (rank + 1) n / P).
/// The Fashion-MNIST files are already shuffled, so contiguous shards are balanced enough.
inline Dataset shard(const Dataset& data, int rank, int ranks) {
  if (ranks == 1) return data;
  const int n = data.size(), begin = int(long(n) * rank / ranks), end = int(long(n) * (rank + 1) / ranks);
  const Tensor& im = data.images;
  Dataset out;
  out.num_classes = data.num_classes;
  out.images = Tensor("nn::shard::images", end - begin, im.extent(1), im.extent(2), im.extent(3));
  out.labels = Labels("nn::shard::labels", end - begin);
  const auto range = std::make_pair(begin, end);
  Kokkos::deep_copy(out.images, Kokkos::subview(im, range, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL));
  Kokkos::deep_copy(out.labels, Kokkos::subview(data.labels, range));
  return out;
}

#if KFAC_EXAMPLES_HAVE_KFAC

/// \brief A kfac::ParameterAverager over a network's parameters (and optionally momentum
/// buffers) on the ranks of a World: kfac::SerialComm on one process (the identity), MpiComm otherwise.
class ParameterAveraging {
 public:
  /// \param momentum [in] buffers averaged with the parameters; empty: parameters only
  ParameterAveraging(const std::vector<Param>& params, const std::vector<Vector>& momentum, long every,
                     const World& world) {
    if (every < 1) throw std::invalid_argument("--average-every must be >= 1");
#if KFAC_EXAMPLES_HAVE_MPI
    if (world.size() > 1)
      mpi_ = std::make_unique<kfac::ParameterAverager<kfac::MpiComm, ExecSpace>>(kfac::MpiComm(world.comm()), every);
#endif
    if (world.size() > 1 && !mpi_) throw std::runtime_error("parameter averaging needs kfac built with MPI");
    if (!mpi_) serial_ = std::make_unique<kfac::ParameterAverager<kfac::SerialComm, ExecSpace>>(kfac::SerialComm{}, every);
    with_averager([&](auto& a) {
      for (const Param& p : params) a.add(p.value);
      for (const Vector& v : momentum) a.add(v);
    });
  }

  /// \brief After 0-based step `step`: averages when step + 1 is a multiple of N.
  bool after_step(long step) {
    bool did = false;
    with_averager([&](auto& a) { did = a.maybe_average(step); });
    return did;
  }
  void average_now() {
    with_averager([&](auto& a) { a.average(); });
  }
  std::size_t bytes_sent() const { return mpi_ ? mpi_->bytes_sent() : serial_->bytes_sent(); }
  long averages() const { return mpi_ ? mpi_->averages() : serial_->averages(); }
  long every() const { return mpi_ ? mpi_->every() : serial_->every(); }

 private:
  template <class F>
  void with_averager(F&& f) {
    if (mpi_)
      f(*mpi_);
    else
      f(*serial_);
  }
  std::unique_ptr<kfac::ParameterAverager<kfac::SerialComm, ExecSpace>> serial_;
#if KFAC_EXAMPLES_HAVE_MPI
  std::unique_ptr<kfac::ParameterAverager<kfac::MpiComm, ExecSpace>> mpi_;
#else
  struct None {
    std::size_t bytes_sent() const { return 0; }
    long averages() const { return 0; }
    long every() const { return 1; }
  };
  std::unique_ptr<None> mpi_;
#endif
};

/// \brief Bytes one GradientAverager::average() of `net`'s gradients hands to MpiComm on this
/// rank (collective; measured once on scratch buffers of the same sizes, so training is not
/// touched). 0 on one process.
inline std::size_t gradient_bytes_per_step(const Network& net, const World& world) {
#if KFAC_EXAMPLES_HAVE_MPI
  if (world.size() == 1) return 0;
  kfac::MpiComm comm(world.comm());
  kfac::GradientAverager<kfac::MpiComm, ExecSpace> probe(comm);
  std::vector<Vector> scratch;
  for (const Param& p : net.params()) scratch.emplace_back("nn::probe::" + p.name, p.grad.extent(0));
  for (const Vector& v : scratch) probe.add(v);
  probe.average();
  return comm.bytes_sent();
#else
  (void)net;
  (void)world;
  return 0;
#endif
}

#else

class ParameterAveraging {
 public:
  ParameterAveraging(const std::vector<Param>&, const std::vector<Vector>&, long, const World&) {
    throw std::runtime_error("parameter averaging needs kfac (KFAC_EXAMPLES_WITHOUT_KFAC)");
  }
  bool after_step(long) { return false; }
  void average_now() {}
  std::size_t bytes_sent() const { return 0; }
  long averages() const { return 0; }
  long every() const { return 1; }
};
inline std::size_t gradient_bytes_per_step(const Network&, const World&) { return 0; }

#endif

}  // namespace nn
