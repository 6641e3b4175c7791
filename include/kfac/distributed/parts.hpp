#pragma once
/// \file parts.hpp
/// \brief Default parts of a distribution policy's state (the contract of
/// core/distribution_contract.hpp), to derive from for the parts a strategy does not vary:
/// kfac::Independent is all of them, KAISA's state takes WorldAgreement; a strategy that, say,
/// only averages factors derives from WorldAgreement, LocalPlacement, NoDecompositionSharing and
/// NoGradientSharing and writes its averaging and signature() (tests/test_mpi_replicated.cpp).

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/buffer.hpp"
#include "kfac/core/options.hpp"
#include "kfac/distributed/work_assignment.hpp"

namespace kfac {
namespace impl {

/// Agreement among this rank alone: nothing is compared with other ranks (the ranks may
/// register different layers).
template <class Comm>
class LocalAgreement {
 public:
  explicit LocalAgreement(Comm comm) : comm_(std::move(comm)) {}
  const Comm& comm() const { return comm_; }
  bool check_same(const std::string&) const { return true; }
  long agree_max(long v) const { return v; }
  void agree_max(long*, int) const {}
  std::string share_message(const std::string& s, int) const { return s; }
  int agreement_size() const { return 1; }

 protected:
  Comm comm_;
};

/// Agreement among every rank of the communicator: the registration compared, the step's
/// verdicts combined by one allreduce, and messages broadcast from the rank that knows them.
template <class Comm>
class WorldAgreement {
 public:
  explicit WorldAgreement(Comm comm) : comm_(std::move(comm)) {}
  const Comm& comm() const { return comm_; }
  bool check_same(const std::string& sig) const { return comm_.all_equal(sig); }
  long agree_max(long v) const { return comm_.allreduce_max(v); }
  void agree_max(long* v, int n) const { comm_.allreduce_max(v, n); }
  std::string share_message(const std::string& s, int root) const { return comm_.broadcast_string(s, root); }
  int agreement_size() const { return comm_.size(); }

 protected:
  Comm comm_;
};

/// This rank holds and decomposes every layer (a one-rank assignment).
class LocalPlacement {
 public:
  void plan(const Options&, const std::vector<std::vector<UnitCost>>& costs) {
    std::vector<std::vector<double>> c(costs.size());
    for (std::size_t l = 0; l < costs.size(); ++l) c[l].assign(costs[l].size(), 0.0);
    assignment_ = WorkAssignment(1, 1.0, c, true);
  }
  const WorkAssignment& assignment() const { return assignment_; }
  bool holds(std::size_t) const { return true; }
  bool computes(std::size_t, int) const { return true; }

 private:
  WorkAssignment assignment_;
};

/// Statistics stay this rank's own: nothing is averaged, sent or overlapped.
template <class Exec, class Request>
class NoFactorAveraging {
 public:
  void average(const Exec&, const std::vector<FactorBuffer>&, const Options&) {}
  StartedSums<Request> start_average(const Exec&, const std::vector<FactorBuffer>&, const Options&) { return {}; }
  bool overlaps() const { return false; }
  bool sends_increments(const Options&, std::size_t) const { return false; }
  double payload_max(const Options&) const { return HUGE_VAL; }
  int factor_owner(const Options&, std::size_t, int) const { return -1; }
  void share_factors(const Exec&, const std::vector<FactorBuffer>&) const {}
};

/// Every rank that holds a layer computes all of its units: nothing to share.
template <class Request>
class NoDecompositionSharing {
 public:
  std::vector<Request> share_unit(std::size_t, int, const std::vector<Buffer>&) { return {}; }
  bool shares_in_background(const Options&) const { return false; }
  BackgroundSharer background_sharer(std::size_t) { return {}; }
  void count_background(std::pair<std::size_t, std::size_t>) {}
};

/// Every rank preconditions every layer itself, whole: no gradient travels.
template <class Request>
class NoGradientSharing {
 public:
  Request share_gradient(std::size_t, const Buffer&) { return {}; }
  bool shares_gradients() const { return false; }
  int split_parts(const Options&, std::size_t) const { return 1; }
  int split_part(std::size_t) const { return 0; }
  Request gather_rows(std::size_t, const Buffer&, index_t) { return {}; }
};

}  // namespace impl
}  // namespace kfac
