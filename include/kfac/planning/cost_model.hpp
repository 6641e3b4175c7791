#pragma once
/// \file cost_model.hpp
/// \brief Predicts what distributed K-FAC costs per rank — decomposition and preconditioning
/// time, bytes communicated, memory — for given layer shapes, world size and gradient-worker
/// fraction, before anything is allocated.
///
/// The model replays the Preconditioner's own schedule rather than a formula for an idealised
/// one, and it does not restate any strategy: the distribution policy states its own step on a
/// kfac::CostSheet (its `state_cost` member: who decomposes and applies what, which collectives
/// carry how many bytes among which ranks, in the order they happen), and the model prices each
/// event on the machine and counts bytes the way kfac::MpiComm::bytes_sent() counts them.
/// kfac::Kaisa states KAISA's schedule (Pauloski et al. 2022; distributed/kaisa_cost.hpp), so
/// its consequences are in the prediction too: all ranks decompose their factors at once, agree
/// on failures in one allreduce and then broadcast the decompositions layer by layer, so the
/// decomposition phase lasts as long as the most loaded rank plus the broadcasts; but with f < 1
/// each layer's preconditioned gradient is broadcast right after that layer's GEMMs, in layer
/// order, so the ranks take turns and the preconditioning phase does not shrink with more ranks.
///
/// What is exact and what is modelled:
/// - exact (as far as the policy states its step exactly): the assignment, bytes per rank per
///   phase (as MpiComm counts them: a reduce+broadcast sum counts twice its payload on every
///   rank, a broadcast counts its payload once, on its root), the number of factor-averaging
///   collectives, and per-layer memory as
///   Preconditioner::memory_report() gives it after a step() (no observations pending);
/// - modelled: times. A decomposition costs a measured seconds-per-\f$n^3\f$ constant,
///   preconditioning its GEMM flops over a measured flop rate, a collective over p ranks
///   \f$\lceil\log_2 p\rceil \alpha + \min(\lceil\log_2 p\rceil, 2)\, b / \beta\f$ (binomial tree for
///   short messages, scatter+allgather for long ones, van de Geijn) with latency \f$\alpha\f$ and
///   bandwidth \f$\beta\f$; a collective starts when its last member arrives. Factor
///   computation is modelled when the layers say how many observation rows a step brings
///   (LayerShape::with_observation_rows: the global batch's rows, split evenly over the ranks):
///   a syrk of n(n+1) flops per row and factor at the GEMM rate, plus forming the rows (im2col,
///   transposes: every row value read and written once, at the memory bandwidth). Not
///   modelled: other element-wise kernels (running averages, BatchNorm, KL clipping, gradient
///   copies), transient LAPACK/MPI work arrays.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/distributed/kaisa.hpp"
#include "kfac/distributed/work_assignment.hpp"
#include "kfac/layers/conv2d.hpp"
#include "kfac/layers/dense.hpp"
#include "kfac/core/options.hpp"
#include "kfac/methods/default_method.hpp"

namespace kfac {

/// \brief One layer as the cost model sees it: what the block that register_layer would build
/// says of itself (shapes, buffers, units and their work), read from that very block, so the
/// model restates no method.
///
/// Build it from the same arguments as Preconditioner::register_layer: a layer and a method
/// object (`LayerShape::of(name, layer, method)`, or CostModel::add), or the template
/// arguments of register_layer's second form, with the same defaults:
/// \code
/// std::vector<kfac::LayerShape> net{
///     kfac::LayerShape::of("fc1", kfac::Dense(784, 1024)),
///     kfac::LayerShape::of("conv", kfac::Conv2d(3, 64, 3, 3), kfac::KFAC<kfac::Full>{}),
///     kfac::LayerShape::of("bn", kfac::BatchNorm2d(64))};
/// \endcode
/// `Scalar` is the Preconditioner's: a method's kfac::ScalarPrecision resolves to it.
struct LayerShape {
  std::string name;
  std::string kind;              ///< the layer's kind, "dense", "conv2d", "embedding", ... (matched by skip_layers)
  /// The gradient is g_dim x a_dim (its weight's rows, and columns with the bias); for Kronecker
  /// layers also the sizes of A (a_dim x a_dim) and G (g_dim x g_dim).
  index_t a_dim = 0;
  index_t g_dim = 0;
  index_t channels = 0;          ///< a non-Kronecker layer's weight rows: channels, features, vocabulary (else 0)
  bool kronecker = true;
  bool packed = true;            ///< matrix statistics travel as packed upper triangles (kfac::Symmetric)
  std::size_t factor_scalar = 8;         ///< bytes per value of the averaged statistics
  std::size_t decomposition_scalar = 8;  ///< bytes per value of the decompositions and the preconditioned gradient
  bool units_coupled = false;  ///< decomposing one unit reads the others (pi-damping)
  int split_passes = 0;        ///< passes of a divided apply (Block::split_passes; 0: not divisible)
  /// Rows each of the layer's factor statistics is formed from per factor update, over the
  /// whole global batch (a Dense layer: the batch; a Conv2d: batch x output positions; 0: factor
  /// computation is not modelled). The model splits them evenly over the ranks.
  index_t observation_rows = 0;

  /// What the layer's block says of itself: values per averaged buffer, values per buffer of
  /// each decomposable unit, each unit's assignment cost and work, the work of its statistics
  /// and of its preconditioning, and the planned memory indexed [holder][skipped][precompute_reciprocal].
  std::vector<std::size_t> payload_counts;
  /// Values each averaged buffer holds as stored (a symmetric matrix that travels packed: all
  /// \f$n^2\f$), what a strategy that sums the stored buffers themselves sends.
  std::vector<std::size_t> stored_counts;
  std::vector<std::vector<std::size_t>> unit_counts;
  std::vector<impl::UnitCost> unit_costs;
  BlockPlan plan;
  MemoryReport planned[2][2][2];

  /// \tparam Scalar the Preconditioner's Scalar.
  /// \param name [in] the layer's name, as register_layer takes it.
  /// \param layer [in] its shape (kfac::Dense, kfac::Conv2d, kfac::BatchNorm2d, ...), as register_layer takes it.
  /// \param method [in] a method object (kfac::KFAC<...>, kfac::UnitWiseFisher, kfac::NGSGD, or
  /// one of your own), as register_layer takes it.
  template <class Scalar = double, class LayerType, class Method>
  static LayerShape of(std::string name, const LayerType& layer, const Method& method) {
    static_assert(is_method_v<Method>, "kfac::LayerShape::of: the third argument must be a method object");
    LayerShape s;
    s.describe_block(*method.template make_block<Scalar, Kokkos::DefaultHostExecutionSpace>(name, layer));
    s.name = std::move(name);
    s.kind = LayerType::kind;
    if constexpr (!LayerType::is_kronecker) {
      s.kronecker = false;
      s.channels = layer.weight_rows();
    }
    return s;
  }
  /// \tparam LayerType Dense, Conv2d or BatchNorm2d.
  /// \tparam FactorPolicy, InversePolicy, Prec as in Preconditioner::register_layer.
  template <class LayerType, class FactorPolicy = impl::UnsetPolicy,
            class InversePolicy = Eigendecomposition<>, class Prec = Precision<double>>
  static LayerShape of(std::string name, const LayerType& layer) {
    static_assert(impl::is_precision<Prec>::value, "kfac::LayerShape: Prec must be a kfac::Precision<...>");
    static_assert(is_inversion_v<InversePolicy>, "kfac::LayerShape: InversePolicy must be an inversion policy");
    return of(std::move(name), layer, impl::method_for<LayerType, FactorPolicy, InversePolicy, Prec, double>{});
  }

  /// Sets observation_rows (the global batch's rows per factor update).
  LayerShape& with_observation_rows(index_t rows) {
    if (rows < 0) throw Error(name, "cost model: expected observation_rows >= 0");
    observation_rows = rows;
    return *this;
  }

  /// Number of units that need a decomposition (as Block::units()).
  int decomposed_factors() const { return int(unit_counts.size()); }
  /// Factor dimension n of factor `which` (0 = A, 1 = G).
  index_t factor_dim(int which) const { return which == 0 ? a_dim : g_dim; }
  /// Values in one decomposition of unit `which`, per communicated buffer.
  std::vector<std::size_t> decomposition_buffer_counts(int which) const {
    return unit_counts.at(std::size_t(which));
  }
  /// Values each factor-averaging collective carries for this layer, per averaged buffer.
  std::vector<std::size_t> factor_payload_counts() const { return payload_counts; }

 private:
  template <class Block>
  void describe_block(Block& b) {
    bool matrices = false;
    for (const auto& f : b.averaged_state()) {
      payload_counts.push_back(f.payload_count());
      stored_counts.push_back(f.matrix ? std::size_t(f.n) * std::size_t(f.n) : std::size_t(f.n));
      factor_scalar = f.storage.scalar_size;
      matrices = matrices || f.matrix;
      packed = packed && (f.packed || !f.matrix);
    }
    packed = packed && matrices;
    g_dim = b.weight_rows();
    a_dim = b.weight_cols() + (b.has_bias() ? 1 : 0);
    units_coupled = b.units_coupled();
    split_passes = b.split_passes();
    plan = b.plan();
    decomposition_scalar = plan.apply.scalar;
    for (int u = 0; u < b.units(); ++u) {
      unit_costs.push_back(b.unit_cost(u));
      unit_counts.emplace_back();
      for (const auto& sh : b.unit_shapes(u)) unit_counts.back().push_back(sh.first);
    }
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 2; ++k)
        for (int p = 0; p < 2; ++p) planned[h][k][p] = b.planned_memory(h, k, p);
  }
};

/// \brief Machine figures the time predictions use, per rank.
///
/// | type | name | description | default (measured here) |
/// |---|---|---|---|
/// | double | eigen_seconds_per_n3 | LAPACK dsyevd time / \f$n^3\f$ | 2.3e-10 |
/// | double | cholesky_seconds_per_n3 | LAPACK dpotrf + dpotri time / \f$n^3\f$ | 3.4e-11 |
/// | double | gemm_flops | double GEMM rate, flop/s | 4.2e10 |
/// | double | bandwidth | bytes/s of one point-to-point link | 3.9e9 |
/// | double | latency | seconds per message hop | 3.5e-7 |
/// | double | memory_bandwidth | bytes/s of a streaming copy (read + written) on one rank | 2.4e10 |
/// | double | float_speedup | how much faster float arithmetic runs than double | 2.0 |
/// | int | newton_schulz_iterations | iterations assumed for an iterative solver (Work::iteration_flops; kfac::NewtonSchulz: 4 n^3 flops each) | 30 |
///
/// The defaults were measured on the 2-core AMD EPYC (Zen 3, KVM) development machine with one
/// OpenBLAS thread per rank (OPENBLAS_NUM_THREADS=1), n = 1024, and OpenMPI 4.1.4 over shared
/// memory between two ranks (`mpiexec -n 2 bench_distributed --calibrate`, docs/distributed.md). They are
/// figures of that machine, not of a cluster: pass your own for planning elsewhere.
struct MachineFigures {
  double eigen_seconds_per_n3 = 2.3e-10;
  double cholesky_seconds_per_n3 = 3.4e-11;
  double gemm_flops = 4.2e10;
  double bandwidth = 3.9e9;
  double latency = 3.5e-7;
  double memory_bandwidth = 2.4e10;
  double float_speedup = 2.0;
  int newton_schulz_iterations = 30;

  MachineFigures& with_eigen_seconds_per_n3(double v) { eigen_seconds_per_n3 = v; return *this; }
  MachineFigures& with_cholesky_seconds_per_n3(double v) { cholesky_seconds_per_n3 = v; return *this; }
  MachineFigures& with_gemm_flops(double v) { gemm_flops = v; return *this; }
  MachineFigures& with_bandwidth(double v) { bandwidth = v; return *this; }
  MachineFigures& with_latency(double v) { latency = v; return *this; }
  MachineFigures& with_memory_bandwidth(double v) { memory_bandwidth = v; return *this; }
  MachineFigures& with_float_speedup(double v) { float_speedup = v; return *this; }
  MachineFigures& with_newton_schulz_iterations(int v) { newton_schulz_iterations = v; return *this; }

  /// Seconds `w` takes here: each kind of work at its rate, the arithmetic at float_speedup
  /// when w.scalar < 8 (reduced precision computes in float), element-wise bytes at
  /// memory_bandwidth.
  double seconds(const Work& w) const {
    const double scale = w.scalar < 8 ? 1.0 / float_speedup : 1.0;
    return scale * (w.eigh_n3 * eigen_seconds_per_n3 + w.factorization_n3 * cholesky_seconds_per_n3 +
                    (w.gemm_flops + newton_schulz_iterations * w.iteration_flops) / gemm_flops) +
           w.stream_bytes / memory_bandwidth;
  }
  /// Seconds to decompose unit `u` of `layer`, as the unit states its work.
  double decomposition_seconds(const LayerShape& layer, int u) const {
    return seconds(layer.unit_costs.at(std::size_t(u)).work);
  }
  /// Seconds to form `layer`'s statistics from `rows` observation rows, as its block states the
  /// work per row (K-FAC: forming the rows, then one syrk per factor; BatchNorm and NG-SGD:
  /// not modelled).
  double factor_seconds(const LayerShape& layer, index_t rows) const {
    return seconds(layer.plan.statistics_per_row.times(double(rows)));
  }
  /// Seconds to precondition `layer`'s gradient once, as its block states the work (K-FAC's
  /// eigendecomposition: 4 GEMMs; explicit inverses: 2; closed forms: not modelled).
  double preconditioning_seconds(const LayerShape& layer) const { return seconds(layer.plan.apply); }
  /// Seconds of the element-wise passes over `layer`'s g x a gradient that every rank makes at
  /// every step, whatever the strategy: loading it (read, write), writing the preconditioned
  /// gradient back (read, write) and, with KL clipping, the inner product (two reads), at
  /// memory_bandwidth in the decomposition's scalar. Closed forms of other layers than Kronecker
  /// ones are modelled only when their apply states its element-wise work (a Parameter's
  /// diagonal Fisher); BatchNorm, LayerNorm and an Embedding with a diagonal G are not.
  double gradient_pass_seconds(const LayerShape& layer, bool kl_clip) const {
    if (!layer.kronecker && layer.decomposed_factors() == 0 && layer.plan.apply.stream_bytes == 0) return 0.0;
    const double values = double(layer.g_dim) * double(layer.a_dim);
    return (kl_clip ? 6.0 : 4.0) * values * double(layer.decomposition_scalar) / memory_bandwidth;
  }
  /// Seconds of one broadcast (or one reduce) of `bytes` among `ranks` ranks.
  double collective_seconds(std::size_t bytes, int ranks) const {
    if (ranks <= 1) return 0.0;
    const double hops = std::ceil(std::log2(double(ranks)));
    return hops * latency + std::min(hops, 2.0) * double(bytes) / bandwidth;
  }
  /// Seconds of one all-gather of `bytes` in all among `ranks` ranks: every rank receives the
  /// others' parts.
  double all_gather_seconds(std::size_t bytes, int ranks) const {
    if (ranks <= 1) return 0.0;
    return std::ceil(std::log2(double(ranks))) * latency + double(ranks - 1) / ranks * double(bytes) / bandwidth;
  }
  /// Seconds of one allreduce (a reduce and a broadcast) of `bytes` among `ranks` ranks.
  double allreduce_seconds(std::size_t bytes, int ranks) const { return 2 * collective_seconds(bytes, ranks); }
};

/// \brief What one rank does and holds.
struct RankCost {
  int rank = 0;
  /// Sum of the assignment costs (UnitCost::flops: \f$n^3\f$ for K-FAC's exact decompositions)
  /// of the units this rank decomposes (WorkAssignment::rank_load with AssignmentCost::compute).
  double decomposition_n3 = 0;
  /// Compute time of this rank's own decompositions, per decomposition step.
  double decomposition_seconds = 0;
  /// Compute time of the GEMMs this rank runs to precondition its layers, per step.
  double preconditioning_seconds = 0;
  /// Compute time of this rank's factor statistics (syrks of its share of the observation
  /// rows), per factor update; 0 when no layer gives LayerShape::observation_rows.
  double factor_seconds = 0;
  /// Bytes as MpiComm::bytes_sent() counts them: per factor update (CostSheet::sum_factors), per
  /// decomposition step (share_decomposition) and per step for preconditioned gradients
  /// (share_gradient, and this rank's parts of gather_gradient).
  std::size_t factor_bytes_sent = 0;
  std::size_t decomposition_bytes_sent = 0;
  std::size_t gradient_bytes_sent = 0;
  /// Per layer, what Preconditioner::memory_report() returns on this rank after a step().
  std::vector<MemoryReport> memory;
  /// The Preconditioner's staging buffer for factor averaging (not in memory_report()).
  std::size_t staging_bytes = 0;

  std::size_t memory_bytes() const {
    std::size_t t = 0;
    for (const auto& m : memory) t += m.total();
    return t;
  }
  std::size_t factor_memory() const { return sum_of(&MemoryReport::factor_bytes); }
  std::size_t decomposition_memory() const { return sum_of(&MemoryReport::decomposition_bytes); }
  std::size_t workspace_memory() const { return sum_of(&MemoryReport::workspace_bytes); }
  /// Mean bytes per step with a factor update every `factor_interval` steps and a
  /// decomposition every `inv_interval` steps.
  double bytes_per_step(double factor_interval, double inv_interval) const {
    return double(factor_bytes_sent) / factor_interval +
           double(decomposition_bytes_sent) / inv_interval + double(gradient_bytes_sent);
  }

 private:
  std::size_t sum_of(std::size_t MemoryReport::*field) const {
    std::size_t t = 0;
    for (const auto& m : memory) t += m.*field;
    return t;
  }
};

/// \brief The model's answer for one world size and set of options.
struct CostPrediction {
  int world = 1;
  WorkAssignment assignment;
  std::vector<RankCost> ranks;
  /// Sum collectives (buckets) per factor update, and their modelled time.
  std::size_t factor_collectives = 0;
  double factor_comm_seconds = 0;
  /// Factor computation per factor update (RankCost::factor_seconds, the same on every rank).
  double factor_compute_seconds = 0;
  /// Wall time of the decomposition phase of one step as the policy states it (KAISA: every
  /// rank's own decompositions, the failure vote, then the worker-group broadcasts in layer order).
  double decomposition_phase_seconds = 0;
  /// Wall time of the preconditioning phase of one step: GEMMs plus what the policy sends
  /// (KAISA with f < 1: the preconditioned-gradient broadcasts to receiver groups, in layer order).
  double preconditioning_phase_seconds = 0;
  /// Per step on every rank: the element-wise passes over every layer's gradient (load,
  /// KL-clip inner product, write-back; MachineFigures::gradient_pass_seconds), which no
  /// strategy divides.
  double gradient_pass_seconds = 0;
  /// Factor and decomposition intervals at step 0 of the options the prediction was made for.
  long factor_interval = 1, inv_interval = 1;

  /// Mean modelled seconds per step: factor computation (where the layers give observation
  /// rows) and averaging per factor update, decompositions, preconditioning and the gradient
  /// passes.
  double step_seconds() const {
    return (factor_compute_seconds + factor_comm_seconds) / double(factor_interval) +
           decomposition_phase_seconds / double(inv_interval) + preconditioning_phase_seconds + gradient_pass_seconds;
  }
  std::size_t max_memory_bytes() const {
    return std::size_t(max_of([](const RankCost& r) { return double(r.memory_bytes()); }));
  }
  double max_bytes_per_step() const {
    return max_of([&](const RankCost& r) { return r.bytes_per_step(double(factor_interval), double(inv_interval)); });
  }
  double max_decomposition_seconds() const {
    return max_of([](const RankCost& r) { return r.decomposition_seconds; });
  }

 private:
  template <class F>
  double max_of(F f) const {
    double m = 0;
    for (const auto& r : ranks) m = std::max(m, f(r));
    return m;
  }
};

class CostModel;

/// \brief One step of a distribution strategy as its policy states it to the cost model: the
/// policy reads the world and the layers and records what each rank computes and what travels,
/// in the order it happens; the sheet prices every event on the machine (kfac::MachineFigures),
/// keeps a clock per rank and counts bytes as kfac::MpiComm::bytes_sent() counts them.
///
/// A distribution policy (the object passed as the Preconditioner's fourth argument) states its
/// cost with a const member template, so that distributed/ never includes planning/:
/// \code
/// struct Replicated {  // every rank decomposes and applies everything; factors summed to all
///   template <class Sheet>
///   void state_cost(Sheet& sheet) const {
///     for (std::size_t l = 0; l < sheet.layers(); ++l)
///       if (!sheet.skipped(l) && sheet.world() > 1)
///         for (std::size_t count : sheet.layer(l).stored_counts)
///           sheet.sum_factors(count * sheet.layer(l).factor_scalar);
///     for (int r = 0; r < sheet.world(); ++r) sheet.compute_everything(r);
///     sheet.agree();
///   }
/// };
/// \endcode
///
/// Events fall in three phases, each timed on its own clocks that start at 0 (so the policy
/// may state them phase by phase): factor averaging, once per factor update (sum_factors); the
/// decomposition phase, once per decomposition step (decompose, agree, share_decomposition);
/// the preconditioning phase, every step (precondition, precondition_rows, gather_gradient,
/// share_gradient). A collective starts when the last of its members arrives. What is not the
/// policy's is the model's: forming the statistics (every rank forms its share of the
/// observation rows), the gradient passes, and each layer's memory (LayerShape::planned, as a
/// holder where hold() says so).
class CostSheet {
 public:
  /// \name What the policy reads
  ///@{
  int world() const { return p_.world; }
  std::size_t layers() const { return layers_.size(); }
  /// Layer `l` in registration order.
  const LayerShape& layer(std::size_t l) const { return layers_.at(check_layer(l)); }
  /// Options::skip_layers names layer `l` or its kind: no rank averages, decomposes or applies it.
  bool skipped(std::size_t l) const { return skip_.at(check_layer(l)); }
  const Options& options() const { return options_; }
  ///@}

  /// \name Who does what
  ///@{
  /// Records the strategy's work assignment (CostPrediction::assignment; empty when none is stated).
  void assign(WorkAssignment a) { p_.assignment = std::move(a); }
  /// Whether `rank` keeps layer `l`'s decompositions, which sets its planned memory (every rank
  /// keeps every layer unless told otherwise).
  void hold(int rank, std::size_t l, bool held) { held_[check_rank(rank)][check_layer(l)] = held; }
  ///@}

  /// \name Factor averaging, per factor update
  ///@{
  /// One sum of `bytes` from every rank to `owner` (-1: to every rank, a reduce and a broadcast,
  /// counted twice on every rank; else one reduce, counted once), staged in a buffer of
  /// `staging_bytes` on every rank (RankCost::staging_bytes keeps the largest).
  void sum_factors(std::size_t bytes, int owner = -1, std::size_t staging_bytes = 0) {
    if (owner != -1) check_rank(owner);
    const bool everyone = owner < 0;
    for (auto& r : p_.ranks) {
      r.factor_bytes_sent += (everyone ? 2 : 1) * bytes;
      r.staging_bytes = std::max(r.staging_bytes, staging_bytes);
    }
    p_.factor_comm_seconds +=
        everyone ? machine_.allreduce_seconds(bytes, world()) : machine_.collective_seconds(bytes, world());
    ++p_.factor_collectives;
  }
  ///@}

  /// \name Decomposition phase, per decomposition step
  ///@{
  /// `rank` decomposes unit `unit` of layer `l` (its stated work, LayerShape::unit_costs).
  void decompose(int rank, std::size_t l, int unit) {
    const LayerShape& s = layer(l);
    if (unit < 0 || unit >= s.decomposed_factors()) throw Error(s.name, "cost sheet: no unit " + std::to_string(unit));
    auto& rc = p_.ranks[check_rank(rank)];
    const double t = machine_.decomposition_seconds(s, unit);
    rc.decomposition_n3 += s.unit_costs[std::size_t(unit)].flops;
    rc.decomposition_seconds += t;
    decomposition_clock_[std::size_t(rank)] += t;
  }
  /// Every rank agrees on failures: one allreduce of a long (not counted in bytes).
  void agree() {
    std::vector<int> all(static_cast<std::size_t>(world()));
    for (int r = 0; r < world(); ++r) all[std::size_t(r)] = r;
    collective(decomposition_clock_, all, machine_.allreduce_seconds(sizeof(long), world()));
  }
  /// `root` broadcasts `bytes` of a decomposition to `group` (root included).
  void share_decomposition(const std::vector<int>& group, int root, std::size_t bytes) {
    p_.ranks[check_member(group, root)].decomposition_bytes_sent += bytes;
    collective(decomposition_clock_, group, machine_.collective_seconds(bytes, int(group.size())));
  }
  ///@}

  /// \name Preconditioning phase, per step
  ///@{
  /// `rank` applies layer `l`'s whole preconditioning.
  void precondition(int rank, std::size_t l) { apply(rank, machine_.preconditioning_seconds(layer(l))); }
  /// `rank` computes `rows` of layer `l`'s g_dim gradient rows in one of `passes` passes of a
  /// divided apply (LayerShape::split_passes).
  void precondition_rows(int rank, std::size_t l, index_t rows, int passes) {
    const LayerShape& s = layer(l);
    const double t = machine_.preconditioning_seconds(s) / double(std::max(1, passes));
    apply(rank, t * double(rows) / double(s.g_dim));
  }
  /// `group` all-gathers its parts: member j sends `parts[j]` bytes.
  void gather_gradient(const std::vector<int>& group, const std::vector<std::size_t>& parts) {
    if (parts.size() != group.size()) throw Error("", "cost sheet: gather_gradient expects one part per member");
    std::size_t total = 0;
    for (std::size_t j = 0; j < group.size(); ++j) {
      p_.ranks[check_rank(group[j])].gradient_bytes_sent += parts[j];
      total += parts[j];
    }
    collective(preconditioning_clock_, group, machine_.all_gather_seconds(total, int(group.size())));
  }
  /// `root` broadcasts `bytes` of a preconditioned gradient to `group` (root included).
  void share_gradient(const std::vector<int>& group, int root, std::size_t bytes) {
    p_.ranks[check_member(group, root)].gradient_bytes_sent += bytes;
    collective(preconditioning_clock_, group, machine_.collective_seconds(bytes, int(group.size())));
  }
  ///@}

  /// `rank` decomposes every unit of every layer not skipped and applies every such layer
  /// itself, in layer order: a strategy without placement (kfac::Independent, or one that only
  /// averages the factors).
  void compute_everything(int rank) {
    for (std::size_t l = 0; l < layers(); ++l) {
      if (skipped(l)) continue;
      for (int u = 0; u < layer(l).decomposed_factors(); ++u) decompose(rank, l, u);
      precondition(rank, l);
    }
  }

 private:
  friend class CostModel;
  CostSheet(const std::vector<LayerShape>& layers, int world, const Options& options, const MachineFigures& machine);
  CostPrediction finish() &&;

  void apply(int rank, double seconds) {
    p_.ranks[check_rank(rank)].preconditioning_seconds += seconds;
    preconditioning_clock_[std::size_t(rank)] += seconds;
  }
  std::size_t check_rank(int rank) const {
    if (rank < 0 || rank >= world())
      throw Error("", "cost sheet: rank " + std::to_string(rank) + " is outside the world of " +
                          std::to_string(world()));
    return std::size_t(rank);
  }
  std::size_t check_layer(std::size_t l) const {
    if (l >= layers_.size()) throw Error("", "cost sheet: no layer " + std::to_string(l));
    return l;
  }
  std::size_t check_member(const std::vector<int>& group, int root) const {
    for (int r : group) check_rank(r);
    if (std::find(group.begin(), group.end(), root) == group.end())
      throw Error("", "cost sheet: the sending rank " + std::to_string(root) + " is not in its group");
    return std::size_t(root);
  }
  /// A blocking collective among `group`: it starts when the last member arrives.
  static void collective(std::vector<double>& clock, const std::vector<int>& group, double t) {
    double start = 0;
    for (int r : group) start = std::max(start, clock[std::size_t(r)]);
    for (int r : group) clock[std::size_t(r)] = start + t;
  }

  const std::vector<LayerShape>& layers_;
  const Options& options_;
  const MachineFigures& machine_;
  std::vector<bool> skip_;
  std::vector<std::vector<bool>> held_;  ///< [rank][layer]
  std::vector<double> decomposition_clock_, preconditioning_clock_;
  CostPrediction p_;
};

namespace impl {
/// The policy states its cost to the cost model (`policy.state_cost(sheet)` compiles).
template <class Policy, class = void>
struct states_cost : std::false_type {};
template <class Policy>
struct states_cost<Policy, std::void_t<decltype(std::declval<const Policy&>().state_cost(std::declval<CostSheet&>()))>>
    : std::true_type {};
}  // namespace impl

/// \brief Predicts per-rank costs of distributed K-FAC for a fixed list of layers.
///
/// The layer list must be in registration order (placement ties and the layer-by-layer
/// schedule depend on it). The distribution policy states its own step (kfac::CostSheet): what
/// kfac::Kaisa, kfac::Independent or a strategy of your own computes where and sends; the model
/// prices it on the machine. Options supply precompute_reciprocal, skip_layers, kl_clip and the
/// intervals at step 0.
class CostModel {
 public:
  /// An empty model: describe the layers with add(), in registration order.
  explicit CostModel(MachineFigures machine = MachineFigures{}) : machine_(machine) {}
  explicit CostModel(std::vector<LayerShape> layers, MachineFigures machine = MachineFigures{})
      : machine_(machine) {
    for (auto& l : layers) add(std::move(l));
  }

  /// \brief Describes the layer that `pre.register_layer(name, layer, method)` registers on a
  /// Preconditioner whose Scalar is `Scalar`: the same block, built and asked, so a method,
  /// yours included, is priced by what it states of itself. Returns the layer's description (valid until the next add())
  /// (e.g. to set LayerShape::with_observation_rows).
  template <class Scalar = double, class LayerType, class Method>
  LayerShape& add(std::string name, const LayerType& layer, const Method& method) {
    return add(LayerShape::of<Scalar>(std::move(name), layer, method));
  }
  /// Appends a described layer; throws kfac::Error for a name already described or shapes
  /// that no block has.
  LayerShape& add(LayerShape l) {
    if (l.kronecker && (l.a_dim < 1 || l.g_dim < 1)) throw Error(l.name, "cost model: expected a_dim >= 1 and g_dim >= 1");
    if (!l.kronecker && l.channels < 1) throw Error(l.name, "cost model: expected channels >= 1");
    if ((l.factor_scalar != 2 && l.factor_scalar != 4 && l.factor_scalar != 8) ||
        (l.decomposition_scalar != 4 && l.decomposition_scalar != 8))
      throw Error(l.name, "cost model: factor scalar sizes must be 2 (kfac::Half), 4 (float) or "
                          "8 (double), decomposition sizes 4 or 8");
    for (const auto& k : layers_)
      if (k.name == l.name) throw Error(l.name, "cost model: a layer of this name was already added");
    layers_.push_back(std::move(l));
    return layers_.back();
  }
  /// The description of layer `name`; throws kfac::Error when there is none.
  LayerShape& layer(const std::string& name) {
    for (auto& k : layers_)
      if (k.name == name) return k;
    throw Error(name, "cost model: no layer of this name was added");
  }

  const std::vector<LayerShape>& layers() const { return layers_; }
  const MachineFigures& machine() const { return machine_; }

  /// \param world [in] number of ranks.
  /// \param options [in] the Preconditioner's options, with KAISA's default settings.
  CostPrediction predict(int world, const Options& options = Options{}) const {
    return predict(world, options, Kaisa{});
  }
  /// \param world [in] number of ranks.
  /// \param policy [in] the distribution policy object (kfac::Kaisa, kfac::Independent, ...), with
  ///        default Options.
  template <class Policy, class = std::enable_if_t<impl::is_distribution<Policy>::value>>
  CostPrediction predict(int world, const Policy& policy) const {
    return predict(world, Options{}, policy);
  }
  /// \tparam Policy a distribution policy with `template <class Sheet> void state_cost(Sheet&) const`.
  /// \param world [in] number of ranks.
  /// \param options [in] the Preconditioner's options (numerics and schedule).
  /// \param policy [in] the distribution policy object passed to the Preconditioner (for
  ///        kfac::Kaisa, its placement included): it states its step on a kfac::CostSheet.
  template <class Policy>
  CostPrediction predict(int world, const Options& options, const Policy& policy) const {
    static_assert(impl::states_cost<Policy>::value,
                  "kfac::CostModel::predict: the distribution policy needs a member "
                  "`template <class Sheet> void state_cost(Sheet& sheet) const` (see kfac::CostSheet)");
    if constexpr (impl::states_cost<Policy>::value) {
      if (world < 1) throw Error("", "cost model: expected world >= 1");
      CostSheet sheet(layers_, world, options, machine_);
      policy.state_cost(sheet);
      return std::move(sheet).finish();
    } else {
      return CostPrediction{};
    }
  }

  /// Shorthand: default options and KAISA with gradient-worker fraction `fraction`.
  CostPrediction predict(int world, double fraction) const {
    return predict(world, Options{}, Kaisa{}.with_grad_worker_fraction(fraction));
  }

 private:
  std::vector<LayerShape> layers_;
  MachineFigures machine_;
};

/// The prediction's frame: every rank, the skipped layers, and each rank's statistics, formed
/// from the same share of the global batch's rows (data parallel, rounded up).
inline CostSheet::CostSheet(const std::vector<LayerShape>& layers, int world, const Options& options,
                            const MachineFigures& machine)
    : layers_(layers), options_(options), machine_(machine),
      held_(std::size_t(world), std::vector<bool>(layers.size(), true)),
      decomposition_clock_(std::size_t(world), 0.0), preconditioning_clock_(std::size_t(world), 0.0) {
  const StepValues v = StepValues::at(options, 0);
  p_.world = world;
  p_.factor_interval = v.factor_update_steps;
  p_.inv_interval = v.inv_update_steps;
  for (const auto& s : layers) {
    bool skip = false;
    for (const auto& k : options.skip_layers) skip = skip || k == s.name || k == s.kind;
    skip_.push_back(skip);
    if (!skip && s.observation_rows > 0)
      p_.factor_compute_seconds += machine.factor_seconds(s, (s.observation_rows + world - 1) / world);
  }
  p_.ranks.resize(std::size_t(world));
  for (int r = 0; r < world; ++r) {
    p_.ranks[std::size_t(r)].rank = r;
    p_.ranks[std::size_t(r)].factor_seconds = p_.factor_compute_seconds;
  }
}

/// The phases' wall times (their last clocks), every rank's memory (LayerShape::planned, as a
/// holder where the policy said so) and the gradient passes, which no strategy divides.
inline CostPrediction CostSheet::finish() && {
  p_.decomposition_phase_seconds = *std::max_element(decomposition_clock_.begin(), decomposition_clock_.end());
  p_.preconditioning_phase_seconds = *std::max_element(preconditioning_clock_.begin(), preconditioning_clock_.end());
  for (auto& rc : p_.ranks)
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const bool holder = !skip_[l] && held_[std::size_t(rc.rank)][l];
      MemoryReport m = layers_[l].planned[holder][skip_[l]][options_.precompute_reciprocal];
      m.name = layers_[l].name;
      rc.memory.push_back(std::move(m));
    }
  for (std::size_t l = 0; l < layers_.size(); ++l)
    if (!skip_[l]) p_.gradient_pass_seconds += machine_.gradient_pass_seconds(layers_[l], options_.kl_clip(0) > 0);
  return std::move(p_);
}

/// \brief Reference layer lists for planning.
namespace shapes {

/// \brief ResNet-50 (He et al. 2016; torchvision's v1.5 with the stride on the 3x3 conv —
/// strides do not change factor shapes) for 224x224 ImageNet: 53 bias-free convolutions, each
/// followed by a BatchNorm2d, and the 2048 -> 1000 classifier, in forward order. 25,557,032
/// parameters. With `batch_norm = false` the 53 BatchNorm layers are left out.
inline std::vector<LayerShape> resnet50(bool batch_norm = true) {
  std::vector<LayerShape> v;
  auto conv = [&](const std::string& name, index_t c, index_t o, index_t k) {
    v.push_back(LayerShape::of(name, Conv2d(c, o, k, k).with_bias(false)));
    if (batch_norm) v.push_back(LayerShape::of(name + ".bn", BatchNorm2d(o)));
  };
  conv("conv1", 3, 64, 7);
  const index_t blocks[4] = {3, 4, 6, 3};
  index_t in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const index_t width = index_t(64) << stage, out = 4 * width;
    for (index_t b = 0; b < blocks[stage]; ++b) {
      const std::string p = "layer" + std::to_string(stage + 1) + "." + std::to_string(b) + ".";
      conv(p + "conv1", in, width, 1);
      conv(p + "conv2", width, width, 3);
      conv(p + "conv3", width, out, 1);
      if (b == 0) conv(p + "downsample", in, out, 1);
      in = out;
    }
  }
  v.push_back(LayerShape::of("fc", Dense(2048, 1000)));
  return v;
}

}  // namespace shapes
}  // namespace kfac
