#pragma once
// kfac::python::TorchDistComm: a kfac communicator over a torch.distributed process group (gloo on
// CPU; NCCL has the same interface), for the Python package. It meets the communicator contract
// of kfac/distributed/serial_comm.hpp with blocking collectives only (no request_type: KAISA then
// uses its blocking forms). Sums are a reduce to rank 0 and a broadcast from it, so every rank
// holds the same bits. split() creates its groups with torch.distributed.new_group (a Python
// call, collective over all ranks in the same order), so it needs the GIL, which the package's
// calls hold.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kfac {
namespace python {

class TorchDistComm {
 public:
  using PG = c10::intrusive_ptr<c10d::ProcessGroup>;

  /// \brief One member group, or the world: the process group and its members' global ranks.
  struct Group {
    PG pg;
  };
  using group_type = Group;

  explicit TorchDistComm(PG pg) : state_(std::make_shared<State>()) { state_->pg = std::move(pg); }

  int rank() const { return int(state_->pg->getRank()); }
  int size() const { return int(state_->pg->getSize()); }
  std::size_t bytes_sent() const { return state_->bytes; }
  bool device_aware() const { return true; }  // host memory only here: nothing to stage

  double allreduce_sum(double v) const {
    at::Tensor t = torch::full({1}, v, at::kDouble);
    sum_tensor(t, -1, state_->pg);
    return t.item<double>();
  }
  long allreduce_max(long v) const {
    allreduce_max(&v, 1);
    return v;
  }
  void allreduce_max(long* v, int n) const {
    static_assert(sizeof(long) == sizeof(int64_t), "kfac: long is 64 bits here");
    if (n == 0 || size() == 1) return;
    std::vector<at::Tensor> t{torch::from_blob(v, {n}, at::kLong)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    state_->pg->allreduce(t, o)->wait();
  }
  std::string broadcast_string(const std::string& s, int root) const {
    int64_t n = int64_t(s.size());
    broadcast(&n, sizeof(n), root);
    std::string r = rank() == root ? s : std::string(std::size_t(n), '\0');
    if (n > 0) broadcast(&r[0], std::size_t(n), root);
    return r;
  }
  /// True on every rank when every rank passed the same string (one collective: the max and
  /// the min of a hash, the min as the max of its complement).
  bool all_equal(const std::string& s) const {
    const std::uint64_t h = impl::fnv1a(s), top = std::uint64_t(1) << 63;
    long v[2] = {long(h ^ top), long(~h ^ top)};  // order-preserving map to signed
    allreduce_max(v, 2);
    return (std::uint64_t(v[0]) ^ top) == ~(std::uint64_t(v[1]) ^ top);
  }

  /// \brief Sum over ranks in place (root < 0: on every rank; else on `root` only, the others'
  /// buffers left as they were). Native payloads only.
  void sum(void* data, std::size_t count, std::size_t scalar_size, CommPrecision payload, int root = -1) const {
    if (count == 0 || size() == 1) return;
    if (!impl::payload_is_native(payload, scalar_size))
      throw Error("", "the torch.distributed communicator sums native payloads only (Kaisa::comm_precision = native)");
    at::Tensor t = torch::from_blob(data, {int64_t(count)}, scalar_size == 8 ? at::kDouble : at::kFloat);
    state_->bytes += count * scalar_size;
    sum_tensor(t, root, state_->pg);
  }

  /// Collective: the ranks passing the same `color` form one group (rank order kept).
  Group split(int color) const {
    std::vector<long> colors(std::size_t(size()), -1);
    colors[std::size_t(rank())] = color;
    allreduce_max(colors.data(), size());
    std::vector<long> distinct = colors;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    pybind11::gil_scoped_acquire gil;
    pybind11::object new_group = pybind11::module_::import("torch.distributed").attr("new_group");
    Group mine;
    for (long c : distinct) {  // every rank creates every group, in the same order
      std::vector<int> ranks;
      for (int r = 0; r < size(); ++r)
        if (colors[std::size_t(r)] == c) ranks.push_back(r);
      pybind11::object g = new_group(ranks);
      if (c == color) mine.pg = g.cast<PG>();
    }
    return mine;
  }
  void broadcast(void* data, std::size_t bytes, int root_index, const Group& group) const {
    bcast(data, bytes, root_index, group.pg);
  }
  void broadcast(void* data, std::size_t bytes, int root) const { bcast(data, bytes, root, state_->pg); }
  /// Member k of `group` holds bytes[k] bytes at offset bytes[0] + ... + bytes[k - 1]; every
  /// member ends with all of them (one broadcast per member).
  void all_gather(void* data, const std::vector<std::size_t>& bytes, const Group& group) const {
    auto* p = static_cast<char*>(data);
    std::size_t off = 0;
    for (std::size_t k = 0; k < bytes.size(); off += bytes[k], ++k) bcast(p + off, bytes[k], int(k), group.pg);
  }

 private:
  struct State {
    PG pg;
    std::size_t bytes = 0;
  };

  void bcast(void* data, std::size_t bytes, int root, const PG& pg) const {
    if (bytes == 0 || pg->getSize() == 1) return;
    if (pg->getRank() == root) state_->bytes += bytes;
    std::vector<at::Tensor> t{torch::from_blob(data, {int64_t(bytes)}, at::kByte)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    pg->broadcast(t, o)->wait();
  }
  static void sum_tensor(at::Tensor& t, int root, const PG& pg) {
    // Reduce to one rank, then (root < 0) broadcast: the same bits everywhere.
    const int to = root < 0 ? 0 : root;
    std::vector<at::Tensor> v{pg->getRank() == to ? t : t.clone()};
    c10d::ReduceOptions r;
    r.rootRank = to;
    pg->reduce(v, r)->wait();
    if (root >= 0) return;
    std::vector<at::Tensor> b{t};
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    pg->broadcast(b, o)->wait();
  }

  std::shared_ptr<State> state_;
};

}  // namespace python
}  // namespace kfac
