#pragma once
/// \file serial_comm.hpp
/// \brief The single-process communicator: every collective is the identity.

#include <cstddef>
#include <string>
#include <vector>

#include "kfac/core/comm_precision.hpp"

namespace kfac {

/// \brief Communicator policy for one process. Same interface as kfac::MpiComm, so a
/// single-rank build is complete without MPI.
class SerialComm {
 public:
  int rank() const { return 0; }
  int size() const { return 1; }
  /// Bytes this rank has sent through collectives (always 0 here).
  std::size_t bytes_sent() const { return 0; }
  /// Sum over ranks of a host value.
  double allreduce_sum(double v) const { return v; }
  long allreduce_max(long v) const { return v; }
  void allreduce_max(long*, int) const {}
  std::string broadcast_string(const std::string& s, int) const { return s; }
  /// True when every rank passed the same string (registration consistency check).
  bool all_equal(const std::string&) const { return true; }
  bool device_aware() const { return true; }
  void sum(void*, std::size_t, std::size_t, CommPrecision, int = -1) const {}
  /// A sub-communicator of one process.
  struct Group {};
  using group_type = Group;
  Group split(int) const { return {}; }
  void broadcast(void*, std::size_t, int, const Group&) const {}
  void broadcast(void*, std::size_t, int) const {}
  /// Every member's part is already in place.
  void all_gather(void*, const std::vector<std::size_t>&, const Group&) const {}
};

}  // namespace kfac
