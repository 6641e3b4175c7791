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
/// the buffers it was started on must stay untouched until then. A sum to every rank is a
/// reduce to rank 0 and then a broadcast from it (the bits of MpiComm::sum): its broadcast is
/// started by the first test() or wait() that finds the reduce complete, so sums started on one
/// group must be advanced in the order they were started, the same on every rank
/// (impl::InFlight enforces it). A default-constructed request is complete.
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
    if (requests_.empty() && !pending_bcast_) return;
    if (dog_->broken()) {  // the communicator is unusable: waiting would only time out again
      abandon();
      return;
    }
    try {
      wait();
    } catch (...) {  // timed out while another error unwinds: the communicator is unusable
    }
  }
  /// True when everything is complete; starts a sum's broadcast once its reduce is complete
  /// (`may_start`: false keeps it back, for the ordering above).
  bool test(bool may_start = true) {
    int done = 1;
    if (!requests_.empty()) check_mpi(MPI_Testall(int(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (!done) return false;
    requests_.clear();
    if (pending_bcast_ && may_start) start_pending();
    return requests_.empty() && !pending_bcast_;
  }
  /// True while a sum to every rank has not started its broadcast.
  bool holds_back() const { return pending_bcast_; }
  /// Completes the request (and a sum's broadcast) under the watchdog's deadline.
  void wait() {
    if ((!requests_.empty() || pending_bcast_) && dog_->broken()) {
      abandon();
      dog_->check_usable();
    }
    for (;;) {
      if (!requests_.empty()) {
        try {
          dog_->wait(requests_.data(), int(requests_.size()), call_, comm_, layout());
        } catch (...) {  // abandoned by the watchdog, with the layout MPI may still read
          requests_.clear();
          pending_bcast_ = false;
          throw;
        }
      }
      requests_.clear();
      if (!pending_bcast_) return;
      start_pending();
    }
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
  /// The broadcast of a sum to every rank, started once the reduce is complete.
  void broadcast_after(void* data, std::size_t count, std::size_t per, const SumType& t) {
    pending_bcast_ = true;
    data_ = data;
    count_ = count;
    per_ = per;
    type_ = t;
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
    pending_bcast_ = false;
  }
  void start_pending() {
    pending_bcast_ = false;
    auto* p = static_cast<char*>(data_);
    for_each_piece(count_, per_, [&](std::size_t first, int n) {
      check_mpi(MPI_Ibcast(p + first * type_.size, n, type_.type, 0, comm_, add()), "MPI_Ibcast");
    });
  }
  void take(MpiRequest& o) noexcept {
    requests_ = std::move(o.requests_);
    counts_ = std::move(o.counts_);
    offsets_ = std::move(o.offsets_);
    pending_bcast_ = o.pending_bcast_;
    data_ = o.data_;
    dog_ = std::move(o.dog_);
    call_ = o.call_;
    count_ = o.count_;
    per_ = o.per_;
    type_ = o.type_;
    comm_ = o.comm_;
    o.requests_.clear();
    o.pending_bcast_ = false;
  }
  std::vector<MPI_Request> requests_;
  std::vector<int> counts_, offsets_;  ///< MPI_Iallgatherv reads them until it completes
  bool pending_bcast_ = false;         ///< a sum to every rank: the broadcast is still to start
  void* data_ = nullptr;
  std::shared_ptr<Watchdog> dog_;  ///< the communicator's (shares its owner's lifetime)
  const char* call_ = "";
  std::size_t count_ = 0, per_ = 1;
  SumType type_;
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace impl
}  // namespace kfac
