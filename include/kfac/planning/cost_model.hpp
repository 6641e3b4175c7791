#pragma once
/// \file cost_model.hpp
/// \brief Predicts what distributed K-FAC costs per rank — decomposition and preconditioning
/// time, bytes communicated, memory — for given layer shapes, world size and gradient-worker
/// fraction, before anything is allocated.
///
/// The model replays the Preconditioner's own schedule rather than a formula for an idealised
/// one: it builds the same kfac::WorkAssignment (KAISA, Pauloski et al. 2022: greedy
/// longest-processing-time placement of layers on worker groups and of factors on ranks), walks
/// the layers in registration order the way Preconditioner::step() does, and counts bytes the
/// way kfac::MpiComm::bytes_sent() counts them. Consequences of that schedule are therefore in
/// the prediction too: all ranks decompose their factors at once, agree on failures in one
/// allreduce and then broadcast the decompositions layer by layer, so the decomposition phase
/// lasts as long as the most loaded rank plus the broadcasts; but with f < 1 each layer's
/// preconditioned gradient is broadcast right after that layer's GEMMs, in layer order, so the
/// ranks take turns and the preconditioning phase does not shrink with more ranks.
///
/// What is exact and what is modelled:
/// - exact: the assignment, bytes per rank per phase (as MpiComm counts them: a reduce+broadcast
///   sum counts twice its payload on every rank, a broadcast counts its payload once, on its
///   root), the number of factor-averaging collectives, and per-layer memory as
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
#include <utility>
#include <vector>

#include "kfac/core/bucketing.hpp"
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
  /// Bytes as MpiComm::bytes_sent() counts them: per factor update, per decomposition step,
  /// and per step for preconditioned gradients (only when f < 1) and, under
  /// split_preconditioning, this rank's rows in the all-gathers of each pass.
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
  /// Wall time of the decomposition phase of one step: every rank's own decompositions, the
  /// failure vote (an allreduce over all ranks), then the worker-group broadcasts in layer order.
  double decomposition_phase_seconds = 0;
  /// Wall time of the preconditioning phase of one step: GEMMs plus, with f < 1, the
  /// preconditioned-gradient broadcasts to receiver groups, in layer order.
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

/// \brief Predicts per-rank costs of distributed K-FAC for a fixed list of layers.
///
/// The layer list must be in registration order (placement ties and the layer-by-layer
/// schedule depend on it). The distribution's settings come from a kfac::Kaisa policy object
/// (grad_worker_fraction, assignment_cost, colocate_factors, group_layout, placement,
/// bucket_bytes, reduce_to_owner, split_preconditioning, comm_precision), or from Options as a
/// Preconditioner built without one reads them; Options supply precompute_reciprocal,
/// skip_layers, kl_clip and the intervals at step 0.
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
  /// \param policy [in] the kfac::Kaisa policy object, with default Options.
  CostPrediction predict(int world, const Kaisa& policy) const { return predict(world, Options{}, policy); }
  /// \param world [in] number of ranks.
  /// \param options [in] the Preconditioner's options (numerics and schedule).
  /// \param policy [in] the kfac::Kaisa policy object passed to the Preconditioner (its
  ///        placement included), with `options` holding the rest.
  CostPrediction predict(int world, const Options& options, const Kaisa& policy) const {
    if (world < 1) throw Error("", "cost model: expected world >= 1");
    const StepValues v = StepValues::at(options, 0);
    CostPrediction p;
    p.world = world;
    p.factor_interval = v.factor_update_steps;
    p.inv_interval = v.inv_update_steps;
    const std::size_t n = layers_.size();
    std::vector<bool> skip(n);
    std::vector<std::vector<double>> costs(n);
    for (std::size_t l = 0; l < n; ++l) {
      skip[l] = skipped(layers_[l], options);
      if (!skip[l])
        for (const auto& u : layers_[l].unit_costs)
          costs[l].push_back(policy.assignment_cost == AssignmentCost::memory ? u.memory : u.flops);
    }
    p.assignment = WorkAssignment(world, policy.grad_worker_fraction, costs, policy.colocate_factors,
                                  policy.group_layout, policy.placement);
    const WorkAssignment& a = p.assignment;

    p.ranks.resize(std::size_t(world));
    for (int r = 0; r < world; ++r) {
      auto& rc = p.ranks[std::size_t(r)];
      rc.rank = r;
      for (std::size_t l = 0; l < n; ++l) rc.memory.push_back(memory(layers_[l], skip[l], options,
                                                                     !skip[l] && a.is_grad_worker(l, r)));
    }
    // Factor computation: every rank forms the same share of the global batch's rows (data
    // parallel, rounded up), so every rank takes the same time.
    for (std::size_t l = 0; l < n; ++l) {
      const index_t rows = layers_[l].observation_rows;
      if (!skip[l] && rows > 0) p.factor_compute_seconds += machine_.factor_seconds(layers_[l], (rows + world - 1) / world);
    }
    for (auto& rc : p.ranks) rc.factor_seconds = p.factor_compute_seconds;
    factor_averaging(p, skip, policy);

    decomposition_phase(p, skip);
    preconditioning_phase(p, skip, policy);
    for (std::size_t l = 0; l < n; ++l)
      if (!skip[l]) p.gradient_pass_seconds += machine_.gradient_pass_seconds(layers_[l], v.kl_clip > 0);
    return p;
  }

  /// Shorthand: default options and KAISA with gradient-worker fraction `fraction`.
  CostPrediction predict(int world, double fraction) const {
    return predict(world, Options{}, Kaisa{}.with_grad_worker_fraction(fraction));
  }

 private:
  /// The decomposition phase of `p` (its assignment made): each rank's decompositions, the
  /// agreement on failures and the broadcasts within worker groups.
  void decomposition_phase(CostPrediction& p, const std::vector<bool>& skip) const {
    const std::size_t n = layers_.size();
    const int world = p.world;
    const WorkAssignment& a = p.assignment;
    const int gw = a.grad_workers();
    // Decomposition phase, replaying Preconditioner::decompose: every rank first runs its own
    // decompositions, then all ranks agree on failures (one allreduce of a long), then the
    // buffers are broadcast within worker groups in layer order.
    std::vector<double> clock(std::size_t(world), 0.0);
    for (std::size_t l = 0; l < n; ++l) {
      const LayerShape& s = layers_[l];
      if (skip[l]) continue;
      for (int which = 0; which < s.decomposed_factors(); ++which) {
        auto& rc = p.ranks[std::size_t(a.decomposer(l, which))];
        const double t = machine_.decomposition_seconds(s, which);
        rc.decomposition_n3 += s.unit_costs[std::size_t(which)].flops;
        rc.decomposition_seconds += t;
        clock[std::size_t(a.decomposer(l, which))] += t;
      }
    }
    if (world > 1) {
      std::vector<int> all(static_cast<std::size_t>(world));
      for (int r = 0; r < world; ++r) all[std::size_t(r)] = r;
      collective(clock, all, machine_.allreduce_seconds(sizeof(long), world));
    }
    for (std::size_t l = 0; l < n; ++l) {
      const LayerShape& s = layers_[l];
      if (skip[l] || s.decomposed_factors() == 0 || gw == 1) continue;  // one-rank groups send nothing
      std::vector<int> group;
      for (int j = 0; j < gw; ++j) group.push_back(a.rank_of(a.worker_group(l), j));
      for (int which = 0; which < s.decomposed_factors(); ++which)
        for (std::size_t count : s.decomposition_buffer_counts(which)) {
          const std::size_t bytes = count * s.decomposition_scalar;
          p.ranks[std::size_t(a.decomposer(l, which))].decomposition_bytes_sent += bytes;
          collective(clock, group, machine_.collective_seconds(bytes, gw));
        }
    }
    p.decomposition_phase_seconds = *std::max_element(clock.begin(), clock.end());
  }

  /// The preconditioning phase of `p`: every rank's applies (split or whole), the all-gathers
  /// of split preconditioning and the receiver groups' broadcasts.
  void preconditioning_phase(CostPrediction& p, const std::vector<bool>& skip, const Kaisa& policy) const {
    const std::size_t n = layers_.size();
    const int world = p.world;
    const WorkAssignment& a = p.assignment;
    const int gw = a.grad_workers();
    // Preconditioning phase, replaying Preconditioner::precondition: every rank preconditions
    // all of its layers (with split_preconditioning its rows of them, pass by pass, each pass
    // followed by the all-gathers in layer order), then the receiver broadcasts follow in
    // layer order.
    std::vector<double> clock(std::size_t(world), 0.0);
    std::vector<int> passes(n, 0);  // of the divided applies (0: whole)
    for (std::size_t l = 0; l < n; ++l)
      if (!skip[l] && policy.split_preconditioning && world > 1 && gw > 1 && layers_[l].decomposed_factors() > 0)
        passes[l] = layers_[l].split_passes;
    const int most = passes.empty() ? 1 : std::max(1, *std::max_element(passes.begin(), passes.end()));
    for (std::size_t l = 0; l < n; ++l) {  // layers without units: every rank applies its own (NG-SGD)
      if (skip[l] || layers_[l].decomposed_factors() > 0) continue;
      const double t = machine_.preconditioning_seconds(layers_[l]);
      for (int r = 0; r < world; ++r) {
        p.ranks[std::size_t(r)].preconditioning_seconds += t;
        clock[std::size_t(r)] += t;
      }
    }
    for (int pass = 0; pass < most; ++pass) {
      for (std::size_t l = 0; l < n; ++l) {
        const LayerShape& s = layers_[l];
        if (skip[l] || s.decomposed_factors() == 0) continue;  // local layers: above
        if (passes[l] == 0 ? pass > 0 : pass >= passes[l]) continue;
        const double t = machine_.preconditioning_seconds(s) / double(std::max(1, passes[l]));
        for (int j = 0; j < gw; ++j) {
          const std::size_t r = std::size_t(a.rank_of(a.worker_group(l), j));
          const auto rows = impl::row_block(s.g_dim, j, gw);
          const double mine = passes[l] == 0 ? t : t * double(rows.second - rows.first) / double(s.g_dim);
          p.ranks[r].preconditioning_seconds += mine;
          clock[r] += mine;
        }
      }
      for (std::size_t l = 0; l < n; ++l) {
        if (pass >= passes[l]) continue;
        const LayerShape& s = layers_[l];
        const std::size_t row_bytes = std::size_t(s.a_dim) * s.decomposition_scalar;
        std::vector<int> group;
        for (int j = 0; j < gw; ++j) {
          group.push_back(a.rank_of(a.worker_group(l), j));
          const auto rows = impl::row_block(s.g_dim, j, gw);
          p.ranks[std::size_t(group.back())].gradient_bytes_sent += std::size_t(rows.second - rows.first) * row_bytes;
        }
        collective(clock, group, machine_.all_gather_seconds(std::size_t(s.g_dim) * row_bytes, gw));
      }
    }
    for (std::size_t l = 0; l < n && gw < world; ++l) {
      const LayerShape& s = layers_[l];
      if (skip[l] || s.decomposed_factors() == 0) continue;
      const std::size_t bytes = std::size_t(s.g_dim) * std::size_t(s.a_dim) * s.decomposition_scalar;
      for (int j = 0; j < gw; ++j) {  // receiver group j: member j of every worker group
        std::vector<int> group;
        for (int k = 0; k < a.worker_groups(); ++k) group.push_back(a.rank_of(k, j));
        p.ranks[std::size_t(a.rank_of(a.worker_group(l), j))].gradient_bytes_sent += bytes;
        collective(clock, group, machine_.collective_seconds(bytes, world / gw));
      }
    }
    p.preconditioning_phase_seconds = *std::max_element(clock.begin(), clock.end());
  }

  static bool skipped(const LayerShape& s, const Options& o) {
    for (const auto& k : o.skip_layers)
      if (k == s.name || k == s.kind) return true;
    return false;
  }
  /// The layer's planned memory after a step(), as its block computes it.
  static MemoryReport memory(const LayerShape& s, bool skip, const Options& o, bool worker) {
    MemoryReport r = s.planned[worker][skip][o.precompute_reciprocal];
    r.name = s.name;
    return r;
  }

  /// Replays the factor averaging of kfac::Kaisa: the collectives of impl::factor_buckets
  /// (per storage type: binary16, which travels as float, float, double; with reduce_to_owner, each decomposed factor summed only
  /// to its decomposer: one MPI_Reduce, counted once, instead of a reduce and a broadcast).
  void factor_averaging(CostPrediction& p, const std::vector<bool>& skip, const Kaisa& o) const {
    if (p.world == 1) return;
    std::size_t sent = 0, staging = 0;
    std::vector<std::size_t> counts, sizes;
    std::vector<int> owners;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (skip[l]) continue;
      const auto c = layers_[l].factor_payload_counts();
      const bool units = layers_[l].decomposed_factors() > 0 && int(c.size()) == layers_[l].decomposed_factors();
      std::vector<int> decomposers;
      for (std::size_t k = 0; k < c.size(); ++k) {
        counts.push_back(c[k]);
        sizes.push_back(layers_[l].factor_scalar);
        decomposers.push_back(units && o.reduce_to_owner ? p.assignment.decomposer(l, int(k)) : -1);
      }
      for (int r : impl::factor_owners_of(decomposers, units && o.reduce_to_owner, layers_[l].units_coupled,
                                          layers_[l].factor_scalar))
        owners.push_back(r);
    }
    for (const auto& b : impl::factor_buckets(counts, sizes, owners, o.bucket_bytes)) {
      const std::size_t size = impl::flat_scalar_size(b.scalar_size);  // the flat buffer's scalar
      const std::size_t payload = o.comm_precision == CommPrecision::native    ? size
                                  : o.comm_precision == CommPrecision::float32 ? 4
                                                                               : 2;
      const std::size_t count = impl::bucket_count(b.bucket);
      const bool everyone = b.owner < 0;
      sent += (everyone ? 2 : 1) * count * payload;
      staging = std::max(staging, count * size);
      p.factor_comm_seconds += everyone ? machine_.allreduce_seconds(count * payload, p.world)
                                        : machine_.collective_seconds(count * payload, p.world);
      ++p.factor_collectives;
    }
    for (auto& r : p.ranks) {
      r.factor_bytes_sent = sent;
      r.staging_bytes = staging;
    }
  }

  /// A blocking collective among `group`: it starts when the last member arrives.
  static void collective(std::vector<double>& clock, const std::vector<int>& group, double t) {
    double start = 0;
    for (int r : group) start = std::max(start, clock[std::size_t(r)]);
    for (int r : group) clock[std::size_t(r)] = start + t;
  }

  std::vector<LayerShape> layers_;
  MachineFigures machine_;
};

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
