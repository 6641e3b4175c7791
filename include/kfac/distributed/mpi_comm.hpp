#pragma once
/// \file mpi_comm.hpp
/// \brief MPI communicator policy for distributed K-FAC (KAISA, Pauloski et al. 2022).
///
/// Works on any communicator the user passes (duplicated internally so kfac's traffic never
/// matches the user's). Sums are computed as MPI_Reduce to rank 0 followed by MPI_Bcast, so every
/// rank receives the same bits (an allreduce may round differently on different ranks).
/// Buffers are host pointers. Device buffers are summed through impl::sum_payload: a float32 or
/// bfloat16 payload is converted by kernels in device memory; with `device_aware`, MPI gets the
/// device buffer (native) or the converted device buffer (float32), otherwise a host copy of
/// it; a bfloat16 payload is always reduced in host memory (its MPI_Op is a host function).
///
/// Copies share one duplicated communicator (and byte counter). Sub-communicators are
/// MpiComm::Group objects that free themselves: each distribution policy owns its own, so any
/// number of preconditioners may share one MpiComm.
///
/// No collective waits forever (watchdog.hpp): each is a nonblocking MPI call polled until it
/// completes or with_timeout()'s deadline passes (default 600 s, or `KFAC_COMM_TIMEOUT`
/// seconds); then the waiting rank throws a kfac::Error naming the call, scope() and the
/// ranks that did not arrive.

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kfac/core/comm_precision.hpp"
#include "kfac/distributed/mpi_request.hpp"
#include "kfac/distributed/watchdog.hpp"
#include "kfac/core/hash.hpp"
#include "kfac/core/started.hpp"
#include "kfac/error.hpp"

namespace kfac {

namespace impl {
/// The bfloat16 MPI_Op: a host function, so its buffers must be host memory.
inline void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}
}  // namespace impl

/// \brief MPI communicator policy.
class MpiComm {
  struct State;

 public:
  /// \param comm [in] the communicator kfac works on (duplicated).
  /// \param device_aware [in] MPI reads and writes device memory (CUDA-aware, ROCm-aware MPI): device pointers go to MPI directly.
  /// Collective over `comm` (duplicates it twice: kfac's traffic and the watchdog's questions).
  explicit MpiComm(MPI_Comm comm = MPI_COMM_WORLD, bool device_aware = false)
      : state_(std::make_shared<State>(comm)), device_aware_(device_aware) {}

  /// \brief Deadline of every collective, in seconds (0: none). Default 600, or the
  /// environment's `KFAC_COMM_TIMEOUT`. Shared by the copies of this MpiComm; every rank
  /// should set the same value.
  MpiComm& with_timeout(double seconds) {
    if (!(seconds >= 0) || !std::isfinite(seconds))
      throw Error("", "MpiComm::with_timeout: expected a number of seconds >= 0 (0: no deadline)");
    state_->dog.timeout = seconds;
    return *this;
  }
  double timeout() const { return state_->dog.timeout; }
  /// \brief Names what the caller is doing in a timeout's message, until the Scope ends
  /// (e.g. "Preconditioner::step at step 12"); a nested scope adds to its outer one.
  class Scope {
   public:
    Scope(const MpiComm& c, const std::string& what) : dog_(c.state_->dog), old_(dog_.context) {
      dog_.context = old_.empty() ? what : old_ + ", " + what;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() { dog_.context = std::move(old_); }

   private:
    impl::Watchdog& dog_;
    std::string old_;
  };
  Scope scope(std::string what) const { return Scope(*this, std::move(what)); }
  /// \brief Completes `n` requests of `call` on `on` (this communicator or one of its groups)
  /// under the watchdog: every request kfac waits for is waited for here (Request::wait too).
  void wait(MPI_Request* r, int n, const char* call, MPI_Comm on) const {
    state_->dog.check_usable();
    state_->dog.wait(r, n, call, on);
  }
  /// \brief The next number of a client of this communicator (a Preconditioner): the
  /// per-step agreement compares it, so that two preconditioners stepped in different orders
  /// on different ranks are an error, not a silent mix-up.
  long next_client() const { return state_->clients++; }

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  /// MPI may be handed device memory (the constructor's `device_aware`).
  bool device_aware() const { return device_aware_; }
  /// The name of device_aware() in kfac 0.2.
  [[deprecated("use device_aware()")]] bool cuda_aware() const { return device_aware_; }
  MPI_Comm comm() const { return state_->comm; }
  /// Payload bytes this rank handed to collectives (sums, broadcasts) so far.
  std::size_t bytes_sent() const { return state_->bytes; }
  void reset_bytes() { state_->bytes = 0; }
  /// True when MPI provides MPI_THREAD_MULTIPLE on every rank (agreed when this object was
  /// made): kfac may then broadcast from a background thread (Kaisa::background_sharing).
  bool thread_multiple() const { return state_->multiple; }

  double allreduce_sum(double v) const {
    double r = 0;
    allreduce(&v, &r, 1, MPI_DOUBLE, MPI_SUM);
    return r;
  }
  long allreduce_max(long v) const {
    long r = 0;
    allreduce(&v, &r, 1, MPI_LONG, MPI_MAX);
    return r;
  }
  /// Element-wise max over ranks of `n` values, in place (one collective).
  void allreduce_max(long* v, int n) const { allreduce(MPI_IN_PLACE, v, n, MPI_LONG, MPI_MAX); }
  /// `s` of rank `root`, on every rank (two broadcasts: length, bytes).
  std::string broadcast_string(const std::string& s, int root) const { return bcast_string(s, root, state_->comm); }
  class Group;
  /// allreduce_max() within `group`.
  void allreduce_max(long* v, int n, const Group& group) const;
  /// broadcast_string() within `group`, from its member `root`.
  std::string broadcast_string(const std::string& s, int root, const Group& group) const;
  /// \brief Largest message handed to one MPI call; larger sums and broadcasts go in pieces,
  /// so buffers of 2 GiB and more (whose counts overflow MPI's int) work. Default 1 GiB.
  MpiComm& with_max_message_bytes(std::size_t bytes) {
    if (bytes < 16) throw Error("", "MpiComm: max_message_bytes must be at least 16");
    state_->max_message = bytes;
    return *this;
  }
  std::size_t max_message_bytes() const { return state_->max_message; }
  /// MPI calls made by sums and broadcasts so far (pieces counted one by one).
  std::size_t messages() const { return state_->messages; }
  /// Nonblocking collectives started so far (start_sum, start_broadcast, start_all_gather;
  /// each call once, whatever its pieces).
  std::size_t nonblocking_started() const { return state_->started; }
  /// True on every rank when every rank passed the same string (one collective, a hash).
  bool all_equal(const std::string& s) const {
    const std::uint64_t h = impl::fnv1a(s);
    unsigned long long v[2] = {h, ~h}, r[2] = {0, 0};
    allreduce(v, r, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX);
    return r[0] == ~r[1];  // max == min
  }

  /// \brief Sum over ranks into every rank's host buffer, bit-identical everywhere (reduce +
  /// broadcast). A float32 or bfloat16 payload is converted on the host here
  /// (impl::pack_payload_host: the conversion of the payload kernels); buffers in device
  /// memory go through impl::sum_payload (distributed/payload.hpp), which converts them by
  /// kernels where they live. With `device_aware`, `data` may be device memory for a native payload.
  /// With `root` >= 0 only that rank receives the sum (one MPI_Reduce; the others' buffers are
  /// left as they were, or rounded to the payload type).
  void sum(void* data, std::size_t count, std::size_t scalar_size, CommPrecision payload, int root = -1) const {
    if (count == 0 || size() == 1) return;
    if (impl::payload_is_native(payload, scalar_size)) {
      reduce_bcast(data, count, sum_type(payload, scalar_size), root);
      return;
    }
    std::vector<char> tmp(count * impl::payload_size(payload, scalar_size));
    impl::pack_payload_host(data, count, scalar_size, payload, tmp.data());
    sum_converted(tmp.data(), count, payload, root);
    impl::unpack_payload_host(tmp.data(), count, scalar_size, payload, data);
  }
  /// \brief Sum over ranks of a payload already converted (float32: `count` floats; bfloat16:
  /// `count` bfloat16 bit patterns, summed pairwise in float), in place, bit-identical everywhere.
  /// bfloat16 payloads must be in host memory (the reduction is a host MPI_Op); a float32 one
  /// may be device memory when the communicator is `device_aware`.
  void sum_converted(void* payload_data, std::size_t count, CommPrecision payload, int root = -1) const {
    if (payload == CommPrecision::native) throw Error("", "MpiComm::sum_converted: a native payload needs sum()");
    if (count == 0 || size() == 1) return;
    reduce_bcast(payload_data, count, sum_type(payload, 8), root);
  }

  /// \brief A sub-communicator; frees itself (move-only).
  class Group {
   public:
    Group() = default;
    explicit Group(MPI_Comm c) : comm_(c) {}
    Group(Group&& o) noexcept : comm_(o.comm_) { o.comm_ = MPI_COMM_NULL; }
    Group& operator=(Group&& o) noexcept {
      if (this != &o) { release(); comm_ = o.comm_; o.comm_ = MPI_COMM_NULL; }
      return *this;
    }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;
    ~Group() { release(); }
    MPI_Comm comm() const { return comm_; }

   private:
    void release() {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (comm_ != MPI_COMM_NULL && !finalized && !impl::Abandoned::instance().any()) MPI_Comm_free(&comm_);
      comm_ = MPI_COMM_NULL;
    }
    MPI_Comm comm_ = MPI_COMM_NULL;
  };
  using group_type = Group;

  /// Collective: the ranks that pass the same `color` form one group (rank order kept).
  Group split(int color) const {
    barrier("MPI_Comm_split");  // MPI has no nonblocking split: every rank arrives first
    MPI_Comm c;
    check(MPI_Comm_split(state_->comm, color, rank(), &c), "MPI_Comm_split");
    return Group(c);
  }
  /// Collective over `group`: a duplicate of it, for collectives made from another thread
  /// (two threads must never run collectives on the same communicator).
  Group duplicate(const Group& group) const { return Group(dup(group.comm())); }
  /// \brief From a background thread (needs thread_multiple()): broadcasts raw bytes from group
  /// rank `root_index` within `group`, in pieces of at most `max_message` bytes, each an
  /// MPI_Ibcast polled by impl::poll_requests with sleeps from 20 us doubling up to 1 ms (a blocking
  /// broadcast would keep a core busy while it waits for the root), each within `timeout`
  /// seconds (0: none; then a kfac::Error). Touches no counter; returns {bytes this rank sent as
  /// the root, MPI calls}, for count_sent() on the calling thread.
  static std::pair<std::size_t, std::size_t> broadcast_polling(void* data, std::size_t bytes, int root_index,
                                                               const Group& group, std::size_t max_message,
                                                               double timeout = 0) {
    int gsize = 1, grank = 0;
    MPI_Comm_size(group.comm(), &gsize);
    if (gsize == 1 || bytes == 0) return {0, 0};
    MPI_Comm_rank(group.comm(), &grank);
    auto* p = static_cast<char*>(data);
    std::size_t calls = 0;
    for (std::size_t off = 0; off < bytes; off += max_message, ++calls) {
      MPI_Request r;
      check(MPI_Ibcast(p + off, int(std::min(max_message, bytes - off)), MPI_BYTE, root_index, group.comm(), &r),
            "MPI_Ibcast");
      // No busy polling: this thread runs beside the step's computation.
      const double late = impl::poll_requests(&r, 1, "MPI_Ibcast", timeout, impl::PollPace{0.0, 1000, 1}, [] {});
      if (late >= 0) impl::Abandoned::instance().keep(std::make_shared<MPI_Request>(r), std::max(1.0, timeout), "a background broadcast timed out");
      if (late >= 0)
        throw Error("", "MpiComm: a background broadcast of a decomposition (MPI_Ibcast from group rank " +
                            std::to_string(root_index) + ") did not complete within " + std::to_string(timeout) +
                            " s; kfac's collectives cannot be used any more: end the job, e.g. with MPI_Abort");
    }
    return {grank == root_index ? bytes : 0, calls};
  }
  /// Adds what broadcast_polling() returned to bytes_sent() and messages().
  void count_sent(std::pair<std::size_t, std::size_t> sent) const {
    state_->bytes += sent.first;
    state_->messages += sent.second;
  }
  /// Nonblocking collectives started by start_broadcast(), start_all_gather() and start_sum()
  /// (distributed/mpi_request.hpp).
  using Request = impl::MpiRequest;
  using SumType = impl::SumType;
  using request_type = Request;

  /// \brief Started point-to-point transfers within `group` (MPI_Isend / MPI_Irecv of raw bytes,
  /// in pieces of at most max_message_bytes, which MPI delivers in order), completed by their
  /// Request; bytes_sent() and messages() count the sends.
  Request start_send(const void* data, std::size_t bytes, int to, int tag, const Group& group) const {
    Request r = request("MPI_Isend", group.comm());
    const auto* p = static_cast<const char*>(data);
    const std::size_t per = state_->max_message;
    state_->bytes += bytes;
    state_->messages += (bytes + per - 1) / per;
    impl::for_each_piece(bytes, per, [&](std::size_t off, int n) {
      check(MPI_Isend(p + off, n, MPI_BYTE, to, tag, group.comm(), r.add()), "MPI_Isend");
    });
    return r;
  }
  Request start_recv(void* data, std::size_t bytes, int from, int tag, const Group& group) const {
    Request r = request("MPI_Irecv", group.comm());
    auto* p = static_cast<char*>(data);
    impl::for_each_piece(bytes, state_->max_message, [&](std::size_t off, int n) {
      check(MPI_Irecv(p + off, n, MPI_BYTE, from, tag, group.comm(), r.add()), "MPI_Irecv");
    });
    return r;
  }
  /// Started element-wise max of `n` values of `in` into `out` within `group` (MPI_Iallreduce).
  Request start_max(const long* in, long* out, int n, const Group& group) const {
    Request r = request("MPI_Iallreduce (max)", group.comm());
    check(MPI_Iallreduce(in, out, n, MPI_LONG, MPI_MAX, group.comm(), r.add()), "MPI_Iallreduce");
    return r;
  }


  /// Collective: a duplicate of the whole communicator (for nonblocking sums that must not
  /// interleave with the blocking collectives made meanwhile).
  Group duplicate() const { return Group(dup(state_->comm)); }
  /// The nonblocking form of broadcast(): the same pieces, bytes and message counts.
  Request start_broadcast(void* data, std::size_t bytes, int root_index, const Group& group) const {
    Request r = request("MPI_Ibcast", group.comm());
    post_broadcast(r, data, bytes, root_index, group.comm());
    return r;
  }
  /// The nonblocking form of all_gather() (MPI_Iallgatherv; one broadcast per member, in
  /// pieces, beyond max_message_bytes): the same bytes and message counts.
  Request start_all_gather(void* data, const std::vector<std::size_t>& bytes, const Group& group) const {
    Request r = request("MPI_Iallgatherv", group.comm());
    const GatherPlan g = plan_gather(bytes, group.comm());
    auto* p = static_cast<char*>(data);
    if (g.members == 1) return r;
    if (g.in_pieces) {
      std::size_t off = 0;
      for (int k = 0; k < g.members; off += bytes[std::size_t(k)], ++k)
        post_broadcast(r, p + off, bytes[std::size_t(k)], k, group.comm());
      return r;
    }
    const auto layout = r.keep_layout(g.counts, g.offsets);
    count_gather(bytes, g);
    check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p, layout.first, layout.second, MPI_BYTE,
                          group.comm(), r.add()),
          "MPI_Iallgatherv");
    return r;
  }
  /// \brief The nonblocking form of sum() for a payload already in its travelling type
  /// (`scalar_size` bytes of the factor's own type when native, else float32 floats or
  /// bfloat16 bits), on `group` (a duplicate()): the same reduce to rank 0 (or to `root`) and
  /// broadcast, in the same pieces, so the same bits, bytes and message counts. Starts the
  /// reduce; a sum to every rank (`root` < 0) also returns its broadcast, to be started once
  /// the reduce is complete, in start order on every rank (impl::StartedCollectives does).
  impl::StartedSum<Request> start_sum(void* data, std::size_t count, std::size_t scalar_size, CommPrecision payload,
                                      int root, const Group& group) const {
    impl::StartedSum<Request> sum{request("MPI_Ireduce (sum)", group.comm()), nullptr};
    Request& r = sum.reduce;
    if (count == 0 || size() == 1) return sum;
    const SumType t = sum_type(payload, scalar_size);
    const bool everyone = root < 0;
    const int to = everyone ? 0 : root;
    const std::size_t per = count_sum(count, t, everyone);
    auto* p = static_cast<char*>(data);
    impl::for_each_piece(count, per, [&](std::size_t first, int n) {
      void* at = p + first * t.size;
      if (rank() == to)
        check(MPI_Ireduce(MPI_IN_PLACE, at, n, t.type, t.op, to, group.comm(), r.add()), "MPI_Ireduce");
      else
        check(MPI_Ireduce(at, nullptr, n, t.type, t.op, to, group.comm(), r.add()), "MPI_Ireduce");
    });
    if (everyone)
      sum.broadcast = [self = *this, p, count, per, t, c = group.comm()] {
        Request b(std::shared_ptr<impl::Watchdog>(self.state_, &self.state_->dog), "MPI_Ibcast (sum)", c);
        impl::for_each_piece(count, per, [&](std::size_t first, int n) {
          check(MPI_Ibcast(p + first * t.size, n, t.type, 0, c, b.add()), "MPI_Ibcast");
        });
        return b;
      };
    return sum;
  }

  /// Broadcasts raw bytes from group rank `root_index` within `group`.
  void broadcast(void* data, std::size_t bytes, int root_index, const Group& group) const {
    bcast(data, bytes, root_index, group.comm());
  }
  /// Broadcasts raw bytes from `root` to every rank.
  void broadcast(void* data, std::size_t bytes, int root) const {
    bcast(data, bytes, root, state_->comm);
  }
  /// all_gather() over the whole communicator.
  void all_gather(void* data, const std::vector<std::size_t>& bytes) const { gather(data, bytes, state_->comm); }
  /// \brief In place, within `group`: member k (in group rank order) holds `bytes[k]` bytes
  /// at offset bytes[0] + ... + bytes[k - 1] of `data`, and every member ends with all of them
  /// (one MPI_Allgatherv; one broadcast per member, in pieces, when the whole exceeds
  /// max_message_bytes). bytes_sent() counts this rank's own part.
  void all_gather(void* data, const std::vector<std::size_t>& bytes, const Group& group) const {
    gather(data, bytes, group.comm());
  }

 private:
  void gather(void* data, const std::vector<std::size_t>& bytes, MPI_Comm c) const {
    state_->dog.check_usable();
    GatherPlan g = plan_gather(bytes, c);
    auto* p = static_cast<char*>(data);
    if (g.members == 1) return;
    if (g.in_pieces) {
      std::size_t off = 0;
      for (int k = 0; k < g.members; off += bytes[std::size_t(k)], ++k) bcast(p + off, bytes[std::size_t(k)], k, c);
      return;
    }
    count_gather(bytes, g);
    MPI_Request r;
    check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p, g.counts.data(), g.offsets.data(), MPI_BYTE, c, &r),
          "MPI_Iallgatherv");
    state_->dog.wait(&r, 1, "MPI_Allgatherv", c);
  }

  struct State {
    explicit State(MPI_Comm user) {
      int init = 0;
      MPI_Initialized(&init);
      if (!init) throw Error("", "MpiComm: MPI is not initialized (call MPI_Init first)");
      if (user == MPI_COMM_NULL) throw Error("", "MpiComm: the communicator is MPI_COMM_NULL");
      comm = idup(user, dog, "MPI_Comm_idup (MpiComm's constructor)");
      dog.comm = comm;
      dog.watch = idup(user, dog, "MPI_Comm_idup (MpiComm's constructor)");  // answers once complete
      MPI_Request r;
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &size);
      MPI_Op_create(&impl::bf16_sum, 1, &bf16_op);
      int provided = MPI_THREAD_SINGLE;
      MPI_Query_thread(&provided);
      auto all = std::make_shared<int>(provided == MPI_THREAD_MULTIPLE ? 1 : 0);  // kept if abandoned
      check(MPI_Iallreduce(MPI_IN_PLACE, all.get(), 1, MPI_INT, MPI_MIN, comm, &r), "MPI_Iallreduce");
      dog.wait(&r, 1, "MPI_Allreduce (MpiComm's constructor)", comm, all);
      multiple = *all == 1;
    }
    ~State() {
      int finalized = 0;
      MPI_Finalized(&finalized);
      // After a timeout a late peer may still complete a collective on these: keep them.
      if (finalized || impl::Abandoned::instance().any()) return;
      MPI_Op_free(&bf16_op);
      if (dog.watch != MPI_COMM_NULL) MPI_Comm_free(&dog.watch);
      if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
    }
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Op bf16_op = MPI_OP_NULL;
    int rank = 0, size = 1;
    bool multiple = false;
    impl::Watchdog dog;
    long clients = 0;
    std::size_t bytes = 0, messages = 0, started = 0;
    std::size_t max_message = std::size_t(1) << 30;
  };
  /// How all_gather() and start_all_gather() move `bytes` within `group`.
  struct GatherPlan {
    int members = 1, rank = 0;
    bool in_pieces = false;  ///< one broadcast per member, in pieces (beyond max_message_bytes)
    std::vector<int> counts, offsets;
  };
  GatherPlan plan_gather(const std::vector<std::size_t>& bytes, MPI_Comm c) const {
    GatherPlan g;
    MPI_Comm_size(c, &g.members);
    if (g.members == 1) return g;
    if (bytes.size() != std::size_t(g.members))
      throw Error("", "MpiComm::all_gather: expected " + std::to_string(g.members) + " counts, one per group member, got " +
                          std::to_string(bytes.size()));
    MPI_Comm_rank(c, &g.rank);
    std::size_t total = 0;
    for (std::size_t b : bytes) total += b;
    g.in_pieces = total > state_->max_message;
    for (std::size_t k = 0, off = 0; !g.in_pieces && k < bytes.size(); off += bytes[k], ++k) {
      g.counts.push_back(int(bytes[k]));
      g.offsets.push_back(int(off));
    }
    return g;
  }
  /// bytes_sent() counts this rank's own part of a gather, messages() one call.
  void count_gather(const std::vector<std::size_t>& bytes, const GatherPlan& g) const {
    state_->bytes += bytes[std::size_t(g.rank)];
    ++state_->messages;
  }
  static void check(int rc, const char* what) { impl::check_mpi(rc, what); }
  /// MPI_Allreduce as MPI_Iallreduce under the watchdog (on kfac's communicator, or `c`), in
  /// a staging copy that the watchdog keeps if a late peer leaves it pending (the callers' values
  /// are a few longs on their stack).
  void allreduce(const void* in, void* out, int n, MPI_Datatype type, MPI_Op op, MPI_Comm c = MPI_COMM_NULL) const {
    state_->dog.check_usable();
    if (c == MPI_COMM_NULL) c = state_->comm;
    int size = 0;
    MPI_Type_size(type, &size);
    const std::size_t bytes = std::size_t(n) * std::size_t(size);
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(in == MPI_IN_PLACE ? out : in),
                                                      static_cast<const char*>(in == MPI_IN_PLACE ? out : in) + bytes);
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, staged->data(), n, type, op, c, &r), "MPI_Iallreduce");
    state_->dog.wait(&r, 1, "MPI_Allreduce", c, staged);
    std::memcpy(out, staged->data(), bytes);
  }
  /// `s` of member `root` of `c` on every member (two broadcasts: length, bytes).
  std::string bcast_string(const std::string& s, int root, MPI_Comm c) const {
    std::uint64_t n = s.size();
    bcast(&n, sizeof(n), root, c);
    int me = 0;
    MPI_Comm_rank(c, &me);
    std::string r = me == root ? s : std::string(std::size_t(n), '\0');
    if (n > 0) bcast(&r[0], std::size_t(n), root, c);
    return r;
  }
  /// Every rank has arrived (MPI_Ibarrier under the watchdog), before a call MPI has only in
  /// blocking form.
  void barrier(const char* before) const {
    state_->dog.check_usable();
    MPI_Request r;
    check(MPI_Ibarrier(state_->comm, &r), "MPI_Ibarrier");
    state_->dog.wait(&r, 1, before, state_->comm);
  }
  MPI_Comm dup(MPI_Comm of) const {
    state_->dog.check_usable();
    return idup(of, state_->dog, "MPI_Comm_dup");
  }
  /// MPI_Comm_idup under `dog`. The new handle is written where MPI may still write it after
  /// a timeout (a late peer completes the duplication): kept until the program ends then.
  static MPI_Comm idup(MPI_Comm of, impl::Watchdog& dog, const char* call) {
    auto out = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    MPI_Request r;
    check(MPI_Comm_idup(of, out.get(), &r), "MPI_Comm_idup");
    dog.wait(&r, 1, call, of, out);
    return *out;
  }
  /// An empty Request of collective `call` on `c`, counted as started.
  Request request(const char* call, MPI_Comm c) const {
    state_->dog.check_usable();
    ++state_->started;
    return Request(std::shared_ptr<impl::Watchdog>(state_, &state_->dog), call, c);
  }
  /// Broadcasts of up to 64 KiB (lengths, messages) go through a staging copy that the watchdog
  /// keeps if a late peer leaves them pending; larger ones (a preconditioner's statistics and
  /// decompositions) use the caller's memory.
  void bcast(void* data, std::size_t bytes, int root_index, MPI_Comm c) const {
    state_->dog.check_usable();
    auto* p = static_cast<char*>(data);
    const std::size_t per = count_broadcast(bytes, root_index, c);
    if (per == 0) return;
    const bool small = bytes <= (std::size_t(1) << 16);
    auto staged = small ? std::make_shared<std::vector<char>>(p, p + bytes) : nullptr;
    char* at = small ? staged->data() : p;
    impl::for_each_piece(bytes, per, [&](std::size_t off, int n) {
      MPI_Request r;
      check(MPI_Ibcast(at + off, n, MPI_BYTE, root_index, c, &r), "MPI_Ibcast");
      state_->dog.wait(&r, 1, "MPI_Bcast", c, staged);
    });
    if (small) std::memcpy(p, staged->data(), bytes);
  }
  /// bcast() as MPI_Ibcast requests added to `r`.
  void post_broadcast(Request& r, void* data, std::size_t bytes, int root_index, MPI_Comm c) const {
    auto* p = static_cast<char*>(data);
    const std::size_t per = count_broadcast(bytes, root_index, c);
    if (per == 0) return;
    impl::for_each_piece(bytes, per, [&](std::size_t off, int n) {
      check(MPI_Ibcast(p + off, n, MPI_BYTE, root_index, c, r.add()), "MPI_Ibcast");
    });
  }
  /// Reduce to rank 0 and broadcast (`root` < 0), or only reduce to `root`, in pieces of at
  /// most max_message bytes.
  void reduce_bcast(void* data, std::size_t count, const SumType& t, int root) const {
    const bool everyone = root < 0;
    const int to = everyone ? 0 : root;
    auto* p = static_cast<char*>(data);
    state_->dog.check_usable();
    impl::for_each_piece(count, count_sum(count, t, everyone), [&](std::size_t first, int n) {
      void* at = p + first * t.size;
      MPI_Request r;
      if (rank() == to)
        check(MPI_Ireduce(MPI_IN_PLACE, at, n, t.type, t.op, to, state_->comm, &r), "MPI_Ireduce");
      else
        check(MPI_Ireduce(at, nullptr, n, t.type, t.op, to, state_->comm, &r), "MPI_Ireduce");
      state_->dog.wait(&r, 1, "MPI_Reduce (sum)", state_->comm);
      if (!everyone) return;
      check(MPI_Ibcast(at, n, t.type, 0, state_->comm, &r), "MPI_Ibcast");
      state_->dog.wait(&r, 1, "MPI_Bcast (sum)", state_->comm);
    });
  }
  /// How a sum's values travel: native (the factor's own type), float32 or bfloat16 (bits,
  /// summed by the bf16 MPI_Op).
  SumType sum_type(CommPrecision payload, std::size_t scalar_size) const {
    if (impl::payload_is_native(payload, scalar_size)) return {scalar_size, scalar_size == 8 ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM};
    if (payload == CommPrecision::float32) return {4, MPI_FLOAT, MPI_SUM};
    return {2, MPI_UINT16_T, state_->bf16_op};
  }
  /// Counts a sum of `count` values in bytes_sent() (one reduce contribution, plus one
  /// broadcast share for `everyone`) and messages() (per piece); returns the values per piece.
  std::size_t count_sum(std::size_t count, const SumType& t, bool everyone) const {
    const std::size_t per = std::max<std::size_t>(1, state_->max_message / t.size);
    state_->bytes += (everyone ? 2 : 1) * count * t.size;
    state_->messages += (everyone ? 2 : 1) * ((count + per - 1) / per);
    return per;
  }
  /// Counts a broadcast of `bytes` within `c` (bytes on its root, one message per piece);
  /// returns the bytes per piece, or 0 when nothing travels (one member, no bytes).
  std::size_t count_broadcast(std::size_t bytes, int root_index, MPI_Comm c) const {
    int gsize = 1, grank = 0;
    MPI_Comm_size(c, &gsize);
    if (gsize == 1 || bytes == 0) return 0;
    MPI_Comm_rank(c, &grank);
    if (grank == root_index) state_->bytes += bytes;
    const std::size_t per = state_->max_message;
    state_->messages += (bytes + per - 1) / per;
    return per;
  }

  std::shared_ptr<State> state_;
  bool device_aware_ = false;
};

inline void MpiComm::allreduce_max(long* v, int n, const Group& group) const {
  allreduce(MPI_IN_PLACE, v, n, MPI_LONG, MPI_MAX, group.comm());
}
inline std::string MpiComm::broadcast_string(const std::string& s, int root, const Group& group) const {
  return bcast_string(s, root, group.comm());
}

}  // namespace kfac
