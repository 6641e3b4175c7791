#pragma once
/// \file started.hpp
/// \brief Started collectives and what is still to start after them (a sum's broadcast), in
/// start order, until they are completed: impl::StartedCollectives, which every holder of
/// started work keeps them in (impl::InFlight for a Preconditioner, impl::Pipeline for its
/// stages' transfers), and the types a distribution and a communicator hand it
/// (impl::StartedSum, impl::StartedSums). The ordering rule is in in_flight.hpp's description.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

namespace kfac {
namespace impl {

/// What a started collective is, and so which completion waits for it.
enum class Started {
  sum,       ///< a bucket of factor sums (completed together, then written back)
  gradient,  ///< a preconditioned gradient's broadcast or a divided layer's all-gather
  unit,      ///< a decomposed unit's broadcast within its layer's worker group
  transfer,  ///< a pipeline stage's message or status (impl::Pipeline)
};

/// A started factor sum (kfac::MpiComm::start_sum): its reduce and, for a sum to every rank,
/// the broadcast to start once the reduce is complete (null: none). The broadcast is not
/// started by whoever made it: StartedCollectives starts it, in start order on every rank.
template <class Request>
struct StartedSum {
  Request reduce;
  std::function<Request()> broadcast;
};
/// What a distribution's start_average() returns: its sums, one per bucket in start order,
/// and what writes the averages back once every one is complete (null: nothing to write).
template <class Request>
struct StartedSums {
  std::vector<StartedSum<Request>> sums;
  std::function<void()> write_back;
};

/// \brief Started collectives, in start order, until they are completed (see the file's
/// description): each with its kind, its layer, its request and, for a sum to every rank, the
/// broadcast still to start. Destroyed with work left (a step that threw), it starts what is
/// still to start, so that no rank leaves unmatched a broadcast the others have started; the
/// requests then complete themselves (or are left to a broken communicator's watchdog).
/// \tparam Request `test()` (true when complete; advances it), `wait()`; a
/// default-constructed one is complete.
template <class Request>
class StartedCollectives {
 public:
  StartedCollectives() = default;
  StartedCollectives(const StartedCollectives&) = delete;
  StartedCollectives& operator=(const StartedCollectives&) = delete;
  ~StartedCollectives() {
    for (auto& s : started_) {
      if (!s.broadcast) continue;
      try {
        s.request.wait();
        s.request = std::exchange(s.broadcast, nullptr)();
      } catch (...) {  // the communicator is unusable: its watchdog has the requests
      }
    }
  }

  /// Keeps a started collective until it is completed.
  void add(Started kind, std::size_t layer, Request r) { started_.push_back({kind, layer, std::move(r), nullptr}); }
  void add(Started kind, std::size_t layer, std::vector<Request> rs) {
    for (auto& r : rs) add(kind, layer, std::move(r));
  }
  /// Keeps a started factor sum, with the broadcast it starts once its reduce is complete.
  void add(StartedSum<Request> s) {
    started_.push_back({Started::sum, 0, std::move(s.reduce), std::move(s.broadcast)});
  }
  /// Advances every started collective (MPI moves data only inside its calls), in the order
  /// they were started; a sum starts its broadcast only after the sums before it have.
  void progress() {
    bool may_start = true;
    for (auto& s : started_) {
      const bool done = s.request.test();
      if (s.broadcast && done && may_start) s.request = std::exchange(s.broadcast, nullptr)();
      may_start = may_start && !s.broadcast;
    }
  }
  /// Waits for the started collectives that `which(kind, layer)` selects, in the order they
  /// were started (a sum: its reduce, then its broadcast), and forgets them.
  template <class Which>
  void complete_where(Which which) {
    for (auto& s : started_) {
      if (s.done || !which(s.kind, s.layer)) continue;
      s.request.wait();
      if (s.broadcast) {
        s.request = std::exchange(s.broadcast, nullptr)();
        s.request.wait();
      }
      s.done = true;
    }
    started_.erase(std::remove_if(started_.begin(), started_.end(), [](const Item& s) { return s.done; }),
                   started_.end());
  }
  /// Waits for every started collective, in start order (a pipeline step's transfers).
  void complete_all() {
    complete_where([](Started, std::size_t) { return true; });
  }

 private:
  struct Item {
    Started kind;
    std::size_t layer;
    Request request;
    std::function<Request()> broadcast;  ///< a sum's, still to start
    bool done = false;
  };
  std::vector<Item> started_;  ///< in start order
};

}  // namespace impl
}  // namespace kfac
