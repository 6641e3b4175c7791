#pragma once
/// \file kaisa.hpp
/// \brief KAISA distribution (Pauloski et al. 2022): statistics averaged over all ranks, each
/// decomposable unit computed on one rank and shared within its layer's worker group, and
/// preconditioned gradients sent to the gradient receivers. Gradient-worker fraction 1 is
/// COMM-OPT, 1/world MEM-OPT, values in between HYBRID (Kaisa::grad_worker_fraction).
/// With Kaisa::reduce_to_owner a decomposed factor is summed only to its decomposer (as
/// Osawa et al. 2019 reduce-scatter factors to the ranks that invert them): half the bytes.
///
/// Contract of a distribution policy (see also kfac::Independent): a tag type with
/// `distribution_tag` and a nested `State<Exec, Comm>` the Preconditioner builds, with
/// signature(), check_same(), plan(), holds(), computes(), agree_max(), average(),
/// share_unit() and share_gradient(). The state owns every sub-communicator it makes; the
/// collectives it starts are returned as requests, which the caller keeps in its
/// impl::InFlight until they complete (the state keeps no request).

#include <Kokkos_Core.hpp>
#include <cfloat>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/core/half.hpp"
#include "kfac/core/in_flight.hpp"
#include "kfac/core/options.hpp"
#include "kfac/core/bucketing.hpp"
#include "kfac/distributed/parts.hpp"
#include "kfac/distributed/staging.hpp"
#include "kfac/distributed/work_assignment.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {
/// The communicator can broadcast from a background thread (kfac::MpiComm::thread_multiple).
template <class C, class = void>
struct has_thread_multiple : std::false_type {};
template <class C>
struct has_thread_multiple<C, std::void_t<decltype(std::declval<const C&>().thread_multiple())>> : std::true_type {};
}  // namespace impl

namespace impl {
template <class Exec, class Comm>
class KaisaState;
}  // namespace impl

/// \brief The KAISA distribution policy: an object that holds its settings, e.g.
/// `kfac::Kaisa{}.with_grad_worker_fraction(0.5).with_reduce_to_owner(true)`, passed to the
/// Preconditioner's constructor (every rank must pass the same settings; checked at the first
/// step); without one the Preconditioner uses `Kaisa{}`. kfac 0.2 set them on kfac::Options
/// (same names); since 0.3 this object is their only home.
///
/// | type | name | description | default |
/// |---|---|---|---|
/// | double | grad_worker_fraction | gradient-worker fraction f in [1/world, 1]: 1 = COMM-OPT, 1/world = MEM-OPT, between: HYBRID | 1.0 |
/// | AssignmentCost | assignment_cost | what greedy placement balances: compute (n^3) or memory (n^2) | compute |
/// | bool | colocate_factors | decompose a layer's A and G on the same rank | true |
/// | GroupLayout | group_layout | which KAISA groups are consecutive ranks | contiguous_receivers |
/// | size_t | bucket_bytes | upper bound of one factor-averaging collective's payload | 16 MiB |
/// | bool | reduce_to_owner | sum each decomposed factor only to the rank that decomposes it (halves the factor bytes; save() becomes collective) | false |
/// | bool | split_preconditioning | divide each layer's preconditioning by rows among its gradient workers, then all-gather the rows | false |
/// | CommPrecision | comm_precision | payload type of factor averaging | native |
/// | bool | background_sharing | with Options::decomposition_delay, broadcast a decomposition from the thread that computed it (MPI_THREAD_MULTIPLE, host memory) | true |
/// | bool | overlap_communication | the step's collectives as nonblocking ones overlapped with its computation (the same bits and bytes) | true |
/// | string, Placer | placement | who decomposes which unit and which worker group owns which layer (with_placement(name, placer)); every rank must pass the same name | "" (greedy_placement) |
///
/// A new assignment scheme is a Placer: a function that answers the PlacementProblem (e.g.
/// round-robin owners); the averaging, sharing and gathering stay this policy's.
struct Kaisa {
  using distribution_tag = void;
  static constexpr const char* name = "kaisa";

  double grad_worker_fraction = 1.0;
  AssignmentCost assignment_cost = AssignmentCost::compute;
  bool colocate_factors = true;
  GroupLayout group_layout = GroupLayout::contiguous_receivers;
  std::size_t bucket_bytes = std::size_t(16) << 20;
  bool reduce_to_owner = false;
  bool split_preconditioning = false;
  CommPrecision comm_precision = CommPrecision::native;
  bool background_sharing = true;
  bool overlap_communication = true;
  std::string placement_name;  ///< enters the registration signature ("" for the greedy default)
  Placer placement;            ///< empty: greedy_placement

  Kaisa& with_grad_worker_fraction(double f) { grad_worker_fraction = f; return *this; }
  Kaisa& with_assignment_cost(AssignmentCost c) { assignment_cost = c; return *this; }
  Kaisa& with_colocate_factors(bool b) { colocate_factors = b; return *this; }
  Kaisa& with_group_layout(GroupLayout g) { group_layout = g; return *this; }
  Kaisa& with_bucket_bytes(std::size_t b) { bucket_bytes = b; return *this; }
  Kaisa& with_reduce_to_owner(bool b) { reduce_to_owner = b; return *this; }
  Kaisa& with_split_preconditioning(bool b) { split_preconditioning = b; return *this; }
  Kaisa& with_comm_precision(CommPrecision p) { comm_precision = p; return *this; }
  Kaisa& with_background_sharing(bool b) { background_sharing = b; return *this; }
  Kaisa& with_overlap_communication(bool b) { overlap_communication = b; return *this; }
  /// Places layers and units with `placer` instead of greedy_placement; `name` identifies it
  /// (ranks with different names refuse the first step, like any other differing setting).
  Kaisa& with_placement(std::string name, Placer placer) {
    if (name.empty() || !placer) throw Error("", "Kaisa::with_placement: expected a name and a placer");
    placement_name = std::move(name);
    placement = std::move(placer);
    return *this;
  }

  /// The per-preconditioner state the policy builds (impl::KaisaState).
  template <class Exec, class Comm>
  using State = impl::KaisaState<Exec, Comm>;

  /// States one step to the cost model (`Sheet` is kfac::CostSheet): the assignment, the
  /// factor-sum buckets, the decompositions and their broadcasts within worker groups, the
  /// gradient workers' applies and the broadcasts to the receivers (defined in kaisa_cost.hpp).
  template <class Sheet>
  void state_cost(Sheet& sheet) const;
};

namespace impl {

/// \brief Kaisa's state on one rank: the assignment, the groups and the collectives; the
/// agreement part (comm, check_same, agree_max, share_message, agreement_size) is every rank's,
/// impl::WorldAgreement.
template <class Exec, class Comm>
class KaisaState : public WorldAgreement<Comm> {
  using WorldAgreement<Comm>::comm_;

 public:
  using memory_space = typename Exec::memory_space;
  using request_type = impl::request_of_t<Comm>;  ///< what a started collective returns
  KaisaState(const Kaisa& settings, Comm comm) : WorldAgreement<Comm>(std::move(comm)), k_(settings) {}
  const Kaisa& settings() const { return k_; }

  /// The settings every rank must share.
  std::string signature(const Options&) const {
    return "kaisa:f=" + std::to_string(k_.grad_worker_fraction) +
           ";c=" + std::to_string(int(k_.assignment_cost)) +
           ";co=" + std::to_string(int(k_.colocate_factors)) + ";g=" + std::to_string(int(k_.group_layout)) +
           ";p=" + std::to_string(int(k_.comm_precision)) + ";o=" + std::to_string(int(k_.reduce_to_owner)) +
           ";sp=" + std::to_string(int(k_.split_preconditioning)) + ";bg=" + std::to_string(int(k_.background_sharing)) +
           ";ov=" + std::to_string(int(k_.overlap_communication)) + ";b=" + std::to_string(k_.bucket_bytes) + ";" +
           (k_.placement_name.empty() ? "" : "pl=" + k_.placement_name + ";");
  }

  /// Collective: assigns layers to worker groups and units to ranks, and (once) makes the
  /// worker and receiver groups. `costs[l]` has one entry per unit of layer l (none for
  /// skipped and closed-form layers).
  void plan(const Options&, const std::vector<std::vector<impl::UnitCost>>& costs) {
    const Kaisa& o = k_;
    std::vector<std::vector<double>> c(costs.size());
    for (std::size_t l = 0; l < costs.size(); ++l)
      for (const auto& u : costs[l])
        c[l].push_back(o.assignment_cost == AssignmentCost::memory ? u.memory : u.flops);
    units_.clear();
    for (const auto& u : costs) units_.push_back(int(u.size()));
    assignment_ = WorkAssignment(comm_.size(), o.grad_worker_fraction, c, o.colocate_factors, o.group_layout, o.placement);
    if (!groups_made_ && comm_.size() > 1) {
      worker_ = comm_.split(assignment_.worker_group_of(comm_.rank()));
      receiver_ = comm_.split(assignment_.receiver_group_of(comm_.rank()));
      if constexpr (impl::has_nonblocking<Comm>::value) sums_group_ = comm_.duplicate();
      groups_made_ = true;
    }
    overlap_ = false;
    if constexpr (impl::has_nonblocking<Comm>::value)
      overlap_ = o.overlap_communication && comm_.size() > 1 && (impl::host_accessible_v<Exec> || comm_.device_aware());
  }
  /// Kaisa::overlap_communication applies to gradient broadcasts and all-gathers (set by plan()).
  bool overlaps() const { return overlap_; }
  /// ... and to factor sums: host memory only (the payload conversions and the sums of a
  /// bucket run where MPI can read them without a staging copy).
  bool overlaps_sums() const { return overlap_ && impl::host_accessible_v<Exec>; }
  const WorkAssignment& assignment() const { return assignment_; }

  /// This rank holds layer l's decompositions and preconditions it (closed forms: everyone).
  bool holds(std::size_t l) const {
    return units_.at(l) == 0 || assignment_.is_grad_worker(l, comm_.rank());
  }
  bool computes(std::size_t l, int u) const { return assignment_.decomposer(l, u) == comm_.rank(); }

  /// True when a reduced-precision payload narrower than `scalar_size` is in use: the
  /// statistics then travel as increments (FactorBuffer::base).
  bool sends_increments(const Options&, std::size_t scalar_size) const {
    const Kaisa& o = k_;
    if (comm_.size() == 1) return false;
    return o.comm_precision == CommPrecision::bfloat16 ||
           (o.comm_precision == CommPrecision::float32 && scalar_size == 8);
  }
  /// Largest statistic the payload can carry: the payload type's range when it is narrower
  /// than the statistics (bfloat16, or float32 for double statistics), else unlimited.
  double payload_max(const Options&) const {
    const Kaisa& o = k_;
    if (comm_.size() == 1 || o.comm_precision == CommPrecision::native) return HUGE_VAL;
    return o.comm_precision == CommPrecision::bfloat16 ? 3.3895313892515355e38 : double(FLT_MAX);
  }
  /// The rank that needs unit u of layer l's averaged factor: its decomposer under
  /// reduce_to_owner, else -1 (every rank).
  int factor_owner(const Options&, std::size_t l, int u) const {
    return k_.reduce_to_owner && comm_.size() > 1 ? assignment_.decomposer(l, u) : -1;
  }
  /// Averages the buffers in buckets of at most bucket_bytes, per scalar size (binary16, then
  /// float, then double), symmetric factors as packed triangles: those of every rank (owner
  /// -1) over all ranks, bit-identical on every rank; then, owner by owner in rank order, the others to their
  /// owner only. The order depends only on the assignment, so every rank takes part in the
  /// same collectives (impl::factor_buckets; the cost model replays the same function).
  /// kfac::Half factors travel as float (as bfloat16 increments with that payload) and are
  /// rounded back once, after the average; they are always summed to every rank.
  void average(const Exec& exec, const std::vector<impl::FactorBuffer>& all, const Options& o) {
    if (comm_.size() == 1) return;
    for (const auto& b : buckets_of(all)) sum_bucket(exec, all, b, k_.comm_precision);
    (void)o;
  }
  /// \brief average() as nonblocking collectives (overlaps_sums(); else average() itself,
  /// and nothing is returned): the same buckets, payloads, reduce-to-0-and-broadcast and
  /// owners, so the same bits and bytes, on a duplicate of the communicator made by plan().
  /// Every bucket is packed now into its own part of one staging buffer. Returns the sums,
  /// one per bucket in start order, and their write-back, which writes the averages into the
  /// factors once every sum is complete (impl::InFlight::complete_sums runs it); until then
  /// the buffers must be neither read nor written.
  impl::StartedSums<request_type> start_average(const Exec& exec, const std::vector<impl::FactorBuffer>& all,
                                                const Options& options) {
    impl::StartedSums<request_type> started;
    if (!overlaps_sums()) {
      average(exec, all, options);
      return started;
    }
    if constexpr (impl::has_nonblocking<Comm>::value) {
      const CommPrecision payload = k_.comm_precision;
      Flight f{all, buckets_of(all), {}, payload};
      std::size_t total = 0;
      for (const auto& b : f.buckets) {  // each bucket: its flat values, then its payload
        const std::size_t n = impl::bucket_count(b.bucket), flat = impl::flat_scalar_size(b.scalar_size);
        f.offsets.push_back(total);
        total += round_up(n * flat) + round_up(n * impl::payload_size(payload, flat));
      }
      if (flight_staging_.extent(0) < total)
        flight_staging_ = Kokkos::View<char*, memory_space>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::comm::in_flight"), total);
      for (std::size_t i = 0; i < f.buckets.size(); ++i) {
        const auto& b = f.buckets[i];
        void* flat = flight_staging_.data() + f.offsets[i];
        transfer_bucket(exec, all, b, flat, true);
        const std::size_t flat_size = impl::flat_scalar_size(b.scalar_size), n = impl::bucket_count(b.bucket);
        if (!impl::payload_is_native(payload, flat_size))
          impl::pack_payload(exec, flat, n, flat_size, payload, payload_of(f, i));
      }
      exec.fence();  // MPI reads the packed buckets
      for (std::size_t i = 0; i < f.buckets.size(); ++i) {
        const auto& b = f.buckets[i];
        const std::size_t flat_size = impl::flat_scalar_size(b.scalar_size);
        const bool native = impl::payload_is_native(payload, flat_size);
        started.sums.push_back(comm_.start_sum(native ? flight_staging_.data() + f.offsets[i] : payload_of(f, i),
                                               impl::bucket_count(b.bucket), flat_size, payload, b.owner, sums_group_));
      }
      started.write_back = [this, exec, f = std::move(f)] { write_averages(exec, f); };
    }
    return started;
  }
  /// Collective: every rank gets each owned factor's average from its owner (before a
  /// checkpoint or a new assignment), so that every copy is the global factor again.
  void share_factors(const Exec& exec, const std::vector<impl::FactorBuffer>& all) const {
    if (comm_.size() == 1) return;
    exec.fence();
    for (const auto& f : all)
      if (f.owner >= 0)
        impl::on_host<Exec>(comm_, f.storage.data, f.storage.bytes(),
                            [&](void* p) { comm_.broadcast(p, f.storage.bytes(), f.owner); });
  }
  /// Shares layer l's unit u from its decomposer with the rest of the worker group.
  /// With overlaps(), started here and returned (else complete on return).
  std::vector<request_type> share_unit(std::size_t l, int u, const std::vector<impl::Buffer>& buffers) {
    std::vector<request_type> started;
    if (comm_.size() == 1) return started;
    const int root = assignment_.receiver_group_of(assignment_.decomposer(l, u));  // index in its worker group
    for (const auto& b : buffers) {
      if constexpr (impl::has_nonblocking<Comm>::value) {
        if (overlap_) {
          started.push_back(comm_.start_broadcast(b.data, b.bytes(), root, worker_));
          continue;
        }
      }
      broadcast(b, root, worker_);
    }
    return started;
  }
  /// Kaisa::background_sharing applies: several ranks, host memory, and a communicator
  /// with MPI_THREAD_MULTIPLE on every rank (the same answer on every rank).
  bool shares_in_background(const Options&) const {
    bool on = false;
    if constexpr (impl::has_thread_multiple<Comm>::value && impl::host_accessible_v<Exec>)
      on = k_.background_sharing && comm_.size() > 1 && comm_.thread_multiple();
    return on;
  }
  /// A function that shares layer l's units from a background thread, within a duplicate of
  /// the worker group made for layer l (collectively over the group, the first time), each
  /// from the root share_unit uses. Everything it needs is copied in now: the thread reads
  /// no state of this object.
  impl::BackgroundSharer background_sharer(std::size_t l) {
    impl::BackgroundSharer sharer;
    if constexpr (impl::has_thread_multiple<Comm>::value) {
      if (background_.size() <= l) background_.resize(l + 1);
      if (!background_[l]) background_[l] = std::make_unique<typename Comm::group_type>(comm_.duplicate(worker_));
      std::vector<int> roots;
      for (int u = 0; u < units_.at(l); ++u) roots.push_back(assignment_.receiver_group_of(assignment_.decomposer(l, u)));
      const auto* group = background_[l].get();
      const std::size_t max_message = comm_.max_message_bytes();
      const double timeout = comm_.timeout();
      sharer = [group, roots, max_message, timeout](int u, const std::vector<impl::Buffer>& buffers) {
        std::pair<std::size_t, std::size_t> sent{0, 0};
        for (const auto& b : buffers) {
          const auto s =
              Comm::broadcast_polling(b.data, b.bytes(), roots.at(std::size_t(u)), *group, max_message, timeout);
          sent.first += s.first;
          sent.second += s.second;
        }
        return sent;
      };
    }
    (void)l;
    return sharer;
  }
  /// Counts what a background sharer sent, on the calling thread (bytes_sent() is exact at
  /// the step that swaps the decomposition in).
  void count_background(std::pair<std::size_t, std::size_t> sent) {
    if constexpr (impl::has_thread_multiple<Comm>::value) comm_.count_sent(sent);
    else (void)sent;
  }
  /// Sends layer l's preconditioned gradient from its worker group to the receivers.
  /// With overlaps(), started here and returned (else complete on return).
  request_type share_gradient(std::size_t l, const impl::Buffer& b) {
    if (units_.at(l) == 0 || assignment_.grad_workers() == comm_.size()) return {};
    if constexpr (impl::has_nonblocking<Comm>::value)
      if (overlap_) return comm_.start_broadcast(b.data, b.bytes(), assignment_.worker_group(l), receiver_);
    broadcast(b, assignment_.worker_group(l), receiver_);
    return {};
  }
  /// True when some layer's gradient travels (a fence is needed before the broadcasts).
  bool shares_gradients() const { return assignment_.grad_workers() != comm_.size(); }
  /// Split preconditioning: the ranks that divide layer l's preconditioning among them, its
  /// worker group under Kaisa::split_preconditioning (every rank under COMM-OPT), else 1.
  int split_parts(const Options&, std::size_t l) const {
    return k_.split_preconditioning && comm_.size() > 1 && units_.at(l) > 0 ? assignment_.grad_workers() : 1;
  }
  /// This rank's part of a divided layer: its index in the layer's worker group.
  int split_part(std::size_t) const { return assignment_.receiver_group_of(comm_.rank()); }
  /// Collective over layer l's worker group: every member gets the others' row blocks
  /// (impl::row_block) of `b`, a matrix of `rows` rows stored row after row. With
  /// overlaps(), started here and returned (else complete on return).
  request_type gather_rows(std::size_t /*l: every worker group has grad_workers() members*/, const impl::Buffer& b,
                   index_t rows) {
    const int parts = assignment_.grad_workers();
    const std::size_t row_bytes = rows > 0 ? b.bytes() / std::size_t(rows) : 0;
    std::vector<std::size_t> bytes;
    for (int k = 0; k < parts; ++k) {
      const auto r = impl::row_block(rows, k, parts);
      bytes.push_back(std::size_t(r.second - r.first) * row_bytes);
    }
    if constexpr (impl::has_nonblocking<Comm>::value)
      if (overlap_) return comm_.start_all_gather(b.data, bytes, worker_);
    impl::on_host<Exec>(comm_, b.data, b.bytes(), [&](void* p) { comm_.all_gather(p, bytes, worker_); });
    return {};
  }

 private:
  /// The factor-averaging collectives of `all` (impl::factor_buckets: the cost model replays it).
  std::vector<impl::FactorBucket> buckets_of(const std::vector<impl::FactorBuffer>& all) const {
    const Kaisa& o = k_;
    std::vector<std::size_t> counts, sizes;
    std::vector<int> owners;
    for (const auto& f : all) {
      counts.push_back(f.payload_count());
      sizes.push_back(f.storage.scalar_size);
      owners.push_back(f.owner);
    }
    return impl::factor_buckets(counts, sizes, owners, o.bucket_bytes);
  }
  void sum_bucket(const Exec& exec, const std::vector<impl::FactorBuffer>& all, const impl::FactorBucket& b,
                  CommPrecision payload) {
    const std::size_t count = impl::bucket_count(b.bucket), flat_size = impl::flat_scalar_size(b.scalar_size);
    if (staging_.extent(0) < count * flat_size)
      staging_ = Kokkos::View<char*, memory_space>("kfac::comm::staging", count * flat_size);
    transfer_bucket(exec, all, b, staging_.data(), true);
    impl::sum_payload(exec, comm_, staging_.data(), count, flat_size, payload, payload_, b.owner);
    if (b.owner >= 0 && b.owner != comm_.rank()) return;  // reduce-to-owner: only the owner reads the sum
    transfer_bucket(exec, all, b, staging_.data(), false);
  }
  /// `pack`: the factors of bucket `b` (pieces index b.items, which index `all`) into `flat`,
  /// in the bucket's flat type (kfac::Half as float), as increments over their bases when
  /// summed to every rank; else the average (the sum in `flat` over the world size) back
  /// into them.
  void transfer_bucket(const Exec& exec, const std::vector<impl::FactorBuffer>& all, const impl::FactorBucket& b,
                       void* flat, bool pack) const {
    if (b.scalar_size == 2) transfer_typed<float, Half>(exec, all, b, flat, pack);
    else if (b.scalar_size == 4) transfer_typed<float, float>(exec, all, b, flat, pack);
    else transfer_typed<double, double>(exec, all, b, flat, pack);
  }
  template <class T, class S>
  void transfer_typed(const Exec& exec, const std::vector<impl::FactorBuffer>& all, const impl::FactorBucket& b,
                      void* flat_data, bool pack) const {
    Kokkos::View<T*, memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>> flat(static_cast<T*>(flat_data),
                                                                                 impl::bucket_count(b.bucket));
    const T scale = pack ? T(1) : T(1) / T(comm_.size());
    std::size_t off = 0;
    for (const auto& p : b.bucket) {
      const auto& f = all[b.items[p.item]];
      const S* base = pack && b.owner >= 0 ? nullptr : static_cast<const S*>(f.base);
      impl::transfer_factor<Exec, T, S>(exec, f, flat, off, pack, scale, base);
      off += p.count;
    }
  }
  static std::size_t round_up(std::size_t bytes) { return (bytes + 63) / 64 * 64; }
  /// What the write-back of started sums needs to know of them (start_average).
  struct Flight {
    std::vector<impl::FactorBuffer> items;
    std::vector<impl::FactorBucket> buckets;
    std::vector<std::size_t> offsets;  // of each bucket in flight_staging_
    CommPrecision payload = CommPrecision::native;
  };
  /// The payload part of in-flight bucket i (after its flat values).
  void* payload_of(const Flight& f, std::size_t i) const {
    const auto& b = f.buckets[i];
    return flight_staging_.data() + f.offsets[i] +
           round_up(impl::bucket_count(b.bucket) * impl::flat_scalar_size(b.scalar_size));
  }
  /// Writes the averages of the sums start_average() started back into their factors, as
  /// average() does, once every one of them is complete.
  void write_averages(const Exec& exec, const Flight& f) const {
    for (std::size_t i = 0; i < f.buckets.size(); ++i) {
      const auto& b = f.buckets[i];
      if (b.owner >= 0 && b.owner != comm_.rank()) continue;  // reduce-to-owner: only the owner reads the sum
      void* flat = flight_staging_.data() + f.offsets[i];
      const std::size_t flat_size = impl::flat_scalar_size(b.scalar_size), n = impl::bucket_count(b.bucket);
      if (!impl::payload_is_native(f.payload, flat_size))
        impl::unpack_payload(exec, payload_of(f, i), n, flat_size, f.payload, flat);
      transfer_bucket(exec, f.items, b, flat, false);
    }
    exec.fence();
  }
  void broadcast(const impl::Buffer& b, int root, const typename Comm::group_type& g) {
    impl::on_host<Exec>(comm_, b.data, b.bytes(),
                        [&](void* p) { comm_.broadcast(p, b.bytes(), root, g); });
  }

  Kaisa k_;
  WorkAssignment assignment_;
  std::vector<int> units_;
  bool groups_made_ = false;
  typename Comm::group_type worker_{}, receiver_{};
  std::vector<std::unique_ptr<typename Comm::group_type>> background_;  // per layer: a duplicate of worker_
  Kokkos::View<char*, memory_space> staging_;
  Kokkos::View<char*, memory_space> payload_;  // a bucket converted to a float32 or bfloat16 payload
  bool overlap_ = false;
  Kokkos::View<char*, memory_space> flight_staging_;  // the started sums' buckets (their memory, not their work)
  typename Comm::group_type sums_group_{};  // a duplicate of the communicator, for the sums in flight
};

}  // namespace impl

}  // namespace kfac

#include "kfac/distributed/kaisa_cost.hpp"  // Kaisa::state_cost
