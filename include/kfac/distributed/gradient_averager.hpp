#pragma once
/// \file gradient_averager.hpp
/// \brief Data-parallel gradient averaging for codes without a framework's DDP.

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kfac/core/agreement.hpp"
#include "kfac/core/block.hpp"
#include "kfac/distributed/bucketed_sum.hpp"
#include "kfac/core/comm_precision.hpp"
#include "kfac/error.hpp"

namespace kfac {
/// \brief Averages a fixed set of gradient views over ranks, in place, in buckets of at most
/// `bucket_bytes` (one collective per bucket). The result is bit-identical on every rank.
///
/// Register the views once with add(); call average() after every backward pass. Views must be
/// contiguous, of float or double, in memory that `Exec` can access. Buckets are packed and
/// unpacked by kernels on `Exec` into a staging view in its memory space; a communicator that
/// cannot read that memory (MpiComm without `device_aware`) gets a host copy of the packed bucket.
/// \tparam Comm SerialComm or MpiComm.
/// \tparam Exec the execution space whose memory holds the gradients (the host's by default;
///         `Kokkos::DefaultExecutionSpace` for device views).
template <class Comm, class Exec = Kokkos::DefaultHostExecutionSpace>
class GradientAverager {
 public:
  using execution_space = Exec;
  using memory_space = typename Exec::memory_space;

  explicit GradientAverager(Comm comm, std::size_t bucket_bytes = std::size_t(16) << 20)
      : comm_(std::move(comm)), bucket_bytes_(bucket_bytes) {
    if (bucket_bytes_ < 8) throw Error("", "GradientAverager: bucket_bytes must be at least 8");
  }

  template <class View>
  void add(const View& v) {
    buffers_.push_back(impl::averaged_buffer_of<Exec>(v, "GradientAverager"));
    checked_ = false;
  }

  /// \brief Collective: replaces every registered gradient by its mean over ranks. The first
  /// call after an add() checks (one collective more) that every rank registered the same
  /// views; on a mismatch every rank throws the same kfac::Error and nothing moves.
  void average() {
    [[maybe_unused]] const auto scope = impl::comm_scope(comm_, "GradientAverager::average");
    collectives_ = 0;
    if (comm_.size() == 1) return;
    if (!checked_) {
      ++collectives_;
      impl::check_same_buffers(comm_, buffers_, "GradientAverager", "gradient");
      checked_ = true;
    }
    average_typed<float>();
    average_typed<double>();
  }
  /// Collectives used by the last average().
  std::size_t collectives() const { return collectives_; }

 private:
  template <class T>
  void average_typed() {
    collectives_ += impl::bucketed_sum<T>(Exec{}, comm_, buffers_, bucket_bytes_, T(1), T(1) / T(comm_.size()), staging_);
  }

  Comm comm_;
  std::size_t bucket_bytes_;
  std::vector<impl::Buffer> buffers_;
  std::size_t collectives_ = 0;
  bool checked_ = false;
  Kokkos::View<char*, memory_space> staging_;
};

}  // namespace kfac
