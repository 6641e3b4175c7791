#pragma once
/// \file mpi_request.hpp
/// \brief The requests of MpiComm's nonblocking collectives (start_broadcast,
/// start_all_gather, start_sum): move-only handles over MPI requests that test() advances and
/// wait() completes under the communicator's watchdog. impl::InFlight keeps them while they are
/// in flight.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "kfac/distributed/watchdog.hpp"

namespace kfac {
class MpiComm;

namespace impl {

/// Calls f(first, n) for the pieces of `count` values, `per` at a time (MPI's counts are ints).
template <class F>
void for_each_piece(std::size_t count, std::size_t per, F&& f) {
  for (std::size_t first = 0; first < count; first += per) f(first, int(std::min(per, count - first)));
}

/// How a sum's values travel (MpiComm::sum_type).
struct SumType {
  std::size_t size = 1;
  MPI_Datatype type = MPI_BYTE;
  MPI_Op op = MPI_SUM;
};

/// \brief A started collective of MpiComm (move-only). test() advances it, wait() completes it;
/// the buffers it was started on must stay untouched until then. It holds only what has
/// started: a sum's broadcast, which starts after its reduce, is held by whoever keeps the
/// sum (impl::StartedSum, impl::StartedCollectives). A default-constructed request is complete.
class MpiRequest {
 public:
  MpiRequest() = default;
  MpiRequest(MpiRequest&& o) noexcept { take(o); }
  MpiRequest& operator=(MpiRequest&& o) noexcept {
    if (this != &o) take(o);
    return *this;
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;
  /// Completes the request at once if it is not yet complete: a request must never be left
  /// behind, or the next collective on its group would not match.
  ~MpiRequest() {
    if (requests_.empty()) return;
    if (dog_->broken()) {  // the communicator is unusable: waiting would only time out again
      abandon();
      return;
    }
    try {
      wait();
    } catch (...) {  // timed out while another error unwinds: the communicator is unusable
    }
  }
  /// True when everything is complete.
  bool test() {
    int done = 1;
    if (!requests_.empty()) check_mpi(MPI_Testall(int(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) requests_.clear();
    return done != 0;
  }
  /// Completes the request under the watchdog's deadline.
  void wait() {
    if (requests_.empty()) return;
    if (dog_->broken()) {
      abandon();
      dog_->check_usable();
    }
    try {
      dog_->wait(requests_.data(), int(requests_.size()), call_, comm_, layout());
    } catch (...) {  // abandoned by the watchdog, with the layout MPI may still read
      requests_.clear();
      throw;
    }
    requests_.clear();
  }

 private:
  friend class kfac::MpiComm;
  /// An empty request of collective `call` on `c`, completed under `dog`.
  MpiRequest(std::shared_ptr<Watchdog> dog, const char* call, MPI_Comm c) : dog_(std::move(dog)), call_(call), comm_(c) {}
  /// A new MPI request slot.
  MPI_Request* add() {
    requests_.emplace_back();
    return &requests_.back();
  }
  /// Keeps an MPI_Iallgatherv's counts and offsets, which MPI reads until it completes.
  std::pair<const int*, const int*> keep_layout(std::vector<int> counts, std::vector<int> offsets) {
    counts_ = std::move(counts);
    offsets_ = std::move(offsets);
    return {counts_.data(), offsets_.data()};
  }
  /// The counts and offsets of an MPI_Iallgatherv, moved (their storage stays where MPI reads it)
  /// into an owner the watchdog keeps if the requests are abandoned.
  std::shared_ptr<void> layout() {
    return std::make_shared<std::pair<std::vector<int>, std::vector<int>>>(std::move(counts_), std::move(offsets_));
  }
  /// Leaves the requests to a late peer (impl::Abandoned), with the layout MPI may still read.
  void abandon() {
    if (!requests_.empty()) dog_->abandon(requests_.data(), int(requests_.size()), layout());
    requests_.clear();
  }
  void take(MpiRequest& o) noexcept {
    requests_ = std::move(o.requests_);
    counts_ = std::move(o.counts_);
    offsets_ = std::move(o.offsets_);
    dog_ = std::move(o.dog_);
    call_ = o.call_;
    comm_ = o.comm_;
    o.requests_.clear();
  }
  std::vector<MPI_Request> requests_;
  std::vector<int> counts_, offsets_;  ///< MPI_Iallgatherv reads them until it completes
  std::shared_ptr<Watchdog> dog_;  ///< the communicator's (shares its owner's lifetime)
  const char* call_ = "";
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace impl
}  // namespace kfac
