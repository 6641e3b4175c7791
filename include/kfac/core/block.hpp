#pragma once
/// \file block.hpp
/// \brief The per-layer block interface every method implements, and the description of a block
/// that the core, the distribution, checkpoints and the cost model read.
#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "kfac/core/buffer.hpp"
#include "kfac/core/gradient_workspace.hpp"
#include "kfac/core/observations.hpp"
#include "kfac/error.hpp"
#include "kfac/linalg/common.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief Memory held by one layer, in bytes.
struct MemoryReport {
  std::string name;
  std::string kind;
  std::size_t factor_bytes = 0;         ///< running factors A and G (or the unit-wise blocks)
  std::size_t decomposition_bytes = 0;  ///< eigenvectors/eigenvalues or inverses
  std::size_t workspace_bytes = 0;      ///< gradient buffers and pending observations
  std::size_t total() const { return factor_bytes + decomposition_bytes + workspace_bytes; }
};


/// \brief What a computation runs, in the kinds of work kfac::MachineFigures prices: a method
/// states its own work (per decomposable unit, per preconditioning, per observation row) and
/// the cost model multiplies it by the machine's rates, so no method is restated in the planner.
struct Work {
  double eigh_n3 = 0;            ///< symmetric eigendecompositions (LAPACK syevd): sum of n^3
  double factorization_n3 = 0;   ///< Cholesky factorizations and their inverses (potrf + potri): sum of n^3
  double gemm_flops = 0;         ///< matrix products (GEMM, SYRK), in flops
  double iteration_flops = 0;    ///< GEMM flops of one iteration of an iterative solver (Newton-Schulz)
  double stream_bytes = 0;       ///< bytes read and written by element-wise passes
  std::size_t scalar = 8;        ///< bytes of the arithmetic's scalar (4: float rates apply)
  /// This work done `times` times (e.g. per observation row times the rows).
  Work times(double times) const {
    Work w = *this;
    w.eigh_n3 *= times;
    w.factorization_n3 *= times;
    w.gemm_flops *= times;
    w.iteration_flops *= times;
    w.stream_bytes *= times;
    return w;
  }
};

/// \brief The work of a block's step besides its units' decompositions (Block::plan).
struct BlockPlan {
  Work statistics_per_row;  ///< forming the statistics, per observation row of a factor update
  Work apply;               ///< preconditioning the whole gradient once
};

namespace impl {

/// What one decomposable unit (K-FAC: factor A or G) costs: the greedy work assignment
/// balances `flops` (AssignmentCost::compute) or `memory` (AssignmentCost::memory), in the
/// relative units n^3 and n^2; `work` is what decomposing it runs, for the cost model's times.
struct UnitCost {
  double flops = 0;
  double memory = 0;
  Work work{};
};

/// One decomposable unit of a block (K-FAC: the factor A or G): what decomposing it costs and
/// the shapes of the buffers that carry it (Block::unit_buffers) between ranks.
struct Unit {
  UnitCost cost;
  std::vector<BufferShape> shapes;
  std::string name;  ///< how errors name it (K-FAC: "A", "G"); empty: "unit <index>"
};

/// One statistics buffer the replica group averages, as it travels: an n x n matrix (whole or
/// as its packed upper triangle) or a flat vector of n values (FactorBuffer).
struct AveragedShape {
  index_t n = 0;
  bool matrix = false;
  bool packed = false;
};

/// What a block holds after a step besides its statistics (the checkpoint's shapes) and its
/// units' buffers, in bytes: Block::planned_memory adds them up, so that the cost model plans
/// memory from the description without building buffers, and no block restates the sum.
struct MemoryPlan {
  std::size_t registered = 0;        ///< workspace held from registration on, skipped or not (BatchNorm's sums)
  std::size_t workspace = 0;         ///< workspace kept between steps besides the gradient's (pending observations)
  std::size_t holder_workspace = 0;  ///< workspace only a rank holding the decompositions keeps (K-FAC's intermediate)
  std::size_t precomputed = 0;       ///< decomposition bytes a precomputed product adds on a holder (K-FAC's reciprocal)
  std::size_t copies = 0;            ///< decomposition bytes outside the units, on every rank (NG-SGD's previous estimates)
};

/// Which rows of V an apply computes: all of them (the default), or pass `pass` of a divided
/// apply (BlockDescription::split_passes), rows [first, last) of its output (possibly empty).
struct ApplyPart {
  int pass = -1;
  index_t first = 0, last = 0;
  bool whole() const { return pass < 0; }
};

/// What a block's pending observations allow (Block::check_observations): the default, a
/// block that takes no observations, allows an update.
struct ObservationCheck {
  std::string problem;    ///< empty when they can form a statistics update, otherwise why not
  bool overflow = false;  ///< they would overflow the statistics' type
  /// The largest value their statistics can reach (K-FAC: the larger new factor's trace); a
  /// reduced-precision payload is checked against it. 0: not known.
  double scale = 0;
};

/// \brief What one decomposable unit holds and does (K-FAC: the factorization of A or of G).
/// A block owns its units as members and hands them to Block::use_units when built, in the
/// order of its description's units; the core reaches them through Block's allocate_units,
/// decompose(u), unit_buffers(u) and release_units.
template <class Exec>
class UnitState {
 public:
  virtual ~UnitState() = default;
  /// Frees the unit's buffers.
  virtual void release() = 0;
  /// Computes the unit from its block's statistics, allocating it when absent. `attempt` >= 1
  /// is a retry of a failed call with the raised damping: a unit whose decomposition does not
  /// depend on the damping changes the problem then (K-FAC's eigendecomposition solves F +
  /// damping I), so that a retry is not the same computation.
  virtual void decompose(const Exec& exec, double damping, int attempt) = 0;
  /// Views of its buffers, allocated when absent, in the shapes of the description's unit:
  /// what distribution shares and a checkpoint holds (and what a receiver allocates to
  /// receive into).
  virtual std::vector<Buffer> buffers() = 0;
};

/// A setting's value as the settings descriptions spell it: every digit of a double (%.17g).
inline std::string number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

/// \brief What a block is, fixed when it is built: its method's constructor fills it, and the
/// core, the distribution, checkpoints and the cost model read it instead of asking the block.
struct BlockDescription {
  const char* kind = "";  ///< the layer kind Options::skip_layers matches
  /// Layer type, shape, method, its settings and precision: equal on every rank that
  /// registered the same layer (the registration agreement compares it).
  std::string signature;
  /// Every setting of the method by name ("name=value,..."; empty when the signature holds them
  /// all): the step's agreement compares them across ranks and names one that differs. Kept
  /// apart from the signature, which checkpoints hold and compare as kfac 0.1 wrote it.
  std::string settings;
  index_t rows = 0, cols = 0;  ///< the weight gradient's shape
  bool bias = false;
  std::vector<BufferShape> checkpoint;  ///< the shapes of checkpoint_state()'s buffers
  /// What the replica group averages after each statistics update: the first averaged.size()
  /// buffers of checkpoint_state(), as they travel (K-FAC: A and G; NG-SGD: none).
  std::vector<AveragedShape> averaged;
  std::vector<Unit> units;              ///< decomposable units (closed forms: none)
  /// True when decomposing one unit reads the other units' statistics (K-FAC's pi-damping
  /// reads both factors' traces): reduce-to-owner then keeps them on one rank or on all.
  bool units_coupled = false;
  /// True when decompose(), after prepare_decomposition(), may run on a second host thread
  /// while the first launches other kernels (Options::decomposition_delay): it launches only
  /// range kernels and copies on a Kokkos::Serial space and calls LAPACK.
  bool decomposes_off_thread = false;
  /// Passes of a divided apply (0: not divisible; closed forms, BatchNorm, NG-SGD). Pass k
  /// computes rows [r0, r1) of its output in preconditioned(); the ranks sharing the layer
  /// gather every pass's rows before pass k + 1 starts, and the last pass's output is V.
  int split_passes = 0;
  /// Output rows of a divided apply (K-FAC: the weight gradient's rows g); row i is values
  /// [i c, (i + 1) c) of preconditioned(), c = its count / split_rows.
  index_t split_rows = 0;
  /// The work of forming the statistics and of preconditioning, for the cost model (default:
  /// neither is modelled).
  BlockPlan plan;
  /// The bytes held besides the statistics, the units and the gradient (Block::planned_memory).
  MemoryPlan memory;
};

/// \brief The per-layer unit a Preconditioner holds: one registered layer under one method.
///
/// Contract (every method's block implements all of it; none needs stubs):
/// - description: a value given to the constructor (BlockDescription): kind, signature,
///   gradient shape, checkpoint shapes, what is averaged, the decomposable units with their
///   costs, the split of the apply, the planned work and memory; the accessors below,
///   averaged_state() and planned_memory() read it directly;
/// - observations: the block hands the layer's checks to use_observations() when built; the
///   core asks check_input/check_output_grad why an observation is refused (empty when valid;
///   the pairing of a step's inputs and gradients is checked there, ObservationPairs), then
///   observe_* passes it to the block's add_* and counts it. Pending observations become
///   statistics only in update_statistics(), and stay pending until clear_observations()
///   (which calls the block's drop_observations), so a step that fails can be retried;
/// - statistics from the gradient (Shampoo-like methods): observe_gradient(w, b) is called on
///   each statistics-update step, just before update_statistics(), with this step's (validated)
///   gradient. What it takes is pending like an observation, and a retried step calls it again:
///   the new call replaces what the failed attempt took (never adds to it). Default: nothing;
/// - state: checkpoint_state() is what a checkpoint must hold to resume, as views of the
///   block's own buffers; its first buffers (BlockDescription::averaged) are what the replica
///   group averages after each statistics update (averaged_state(); K-FAC: the running
///   factors), the others state that must never be averaged (a method's private subspaces);
/// - decomposable units (BlockDescription::units, K-FAC: A and G; closed forms: none): values
///   with their behaviour (UnitState), handed to use_units() when built; each is computed on
///   one rank by decompose(u), shared as unit_buffers(u), and finish_decomposition() runs once
///   all are in place;
/// - statistics presence: the block calls set_statistics() when its statistics appear or go
///   (update_statistics, allocate_state, release_state); has_statistics() reads it;
/// - preconditioning: the block hands its GradientWorkspace to use_gradient() when built, and
///   its precondition() reads X and writes V there (the whole of V, or under a divided apply,
///   BlockDescription::split_passes, one pass's rows, which the layer's holders compute in
///   parts and gather); load_gradient, inner_product (for KL clipping), preconditioned() (the
///   buffer shared with gradient receivers) and write_back are the workspace's, written once.
/// Virtual calls happen on the host, once per layer and phase; the kernels inside are templates.
template <class Scalar, class Exec>
class Block {
 public:
  using tensor_type = Tensor4<Scalar, Exec>;
  using grad_matrix = GradMatrix<Scalar, Exec>;
  using grad_vector = GradVector<Scalar, Exec>;

  Block(std::string name, BlockDescription description)
      : name_(std::move(name)), description_(std::move(description)) {}
  virtual ~Block() = default;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  const std::string& name() const { return name_; }
  /// What this block is (identity, gradient shape, units, split, planned work): fixed when built.
  const BlockDescription& description() const { return description_; }
  const char* kind() const { return description_.kind; }
  const std::string& signature() const { return description_.signature; }
  const std::string& settings() const { return description_.settings; }
  index_t weight_rows() const { return description_.rows; }
  index_t weight_cols() const { return description_.cols; }
  bool has_bias() const { return description_.bias; }
  const std::vector<BufferShape>& checkpoint_shapes() const { return description_.checkpoint; }
  /// Bytes of checkpoint_state(), from its shapes: what a rank holds of the statistics.
  std::size_t checkpoint_bytes() const {
    std::size_t bytes = 0;
    for (const auto& [count, size] : description_.checkpoint) bytes += count * size;
    return bytes;
  }
  /// Decomposable units (K-FAC: A and G; closed forms: none).
  int units() const { return int(description_.units.size()); }
  bool units_coupled() const { return description_.units_coupled; }
  const UnitCost& unit_cost(int u) const { return description_.units[std::size_t(u)].cost; }
  const std::vector<BufferShape>& unit_shapes(int u) const { return description_.units[std::size_t(u)].shapes; }
  bool decomposes_off_thread() const { return description_.decomposes_off_thread; }
  int split_passes() const { return description_.split_passes; }
  index_t split_rows() const { return description_.split_rows; }
  const BlockPlan& plan() const { return description_.plan; }

  /// Why an input (output gradient) of extents `e` would be refused now: the layer's check, and
  /// the check against the observation it pairs with. Empty when valid.
  std::string check_input(const Extents& e) const { return observations().check_input(e); }
  std::string check_output_grad(const Extents& e) const { return observations().check_output_grad(e); }
  /// Passes a checked observation, handed in as a view of rank `rank`, to the block
  /// (add_input), then counts it.
  void observe_input(const Exec& exec, const tensor_type& x, int rank = 4) {
    add_input(exec, x);
    pairs_.add_input(extents_of(x, rank));
  }
  void observe_output_grad(const Exec& exec, const tensor_type& g, double scale, int rank = 4) {
    add_output_grad(exec, g, scale);
    pairs_.add_output_grad(extents_of(g, rank));
  }
  void clear_observations() {
    drop_observations();
    pairs_.clear();
  }
  /// This step's observations so far (counts; a block's add_* sees those before the new one).
  const ObservationPairs& observations() const {
    if (!pairs_.has_checks())
      throw Error(name_, "the block was built without its layer's checks (Block::use_observations)");
    return pairs_;
  }
  // What the block does with observations. The defaults describe a method that takes none (its
  // statistics come from the gradient, observe_gradient): it then overrides only the third.
  virtual void add_input(const Exec&, const tensor_type&) {}
  virtual void add_output_grad(const Exec&, const tensor_type&, double /*scale*/) {}
  /// Frees what the pending observations hold (the pairing is the base's).
  virtual void drop_observations() = 0;
  /// Whether the pending observations can form a statistics update, and how large it can be.
  virtual ObservationCheck check_observations() const { return {}; }
  std::string observations_problem() const { return check_observations().problem; }
  bool observations_overflow() const { return check_observations().overflow; }
  double observations_scale() const { return check_observations().scale; }
  /// Statistics from the gradient: called on statistics-update steps, before
  /// update_statistics(), with the gradient set for this step; replaces (not adds to) what an
  /// earlier call of the same step took, so a failed step can be retried (see the contract).
  virtual void observe_gradient(const Exec&, const grad_matrix&, const grad_vector&) {}

  /// Folds the pending observations into the running statistics (kept pending, see above).
  virtual void update_statistics(const Exec& exec, double decay) = 0;
  /// Before the first update_statistics() under InitialFactors::identity: statistics that are
  /// running averages of Kronecker factors start at the identity (and exist from then on);
  /// other blocks keep none, and their first update starts from the batch.
  virtual void start_statistics_at_identity(const Exec&) {}
  /// True once statistics exist (updated, or allocated to restore into), until released.
  bool has_statistics() const { return statistics_present_; }
  /// What the replica group averages: the first buffers of checkpoint_state(), as the
  /// description's `averaged` shapes say they travel.
  std::vector<FactorBuffer> averaged_state() {
    const auto& shapes = description_.averaged;
    auto state = checkpoint_state();
    if (state.size() < shapes.size())
      throw Error(name_, "the block describes " + std::to_string(shapes.size()) + " averaged buffer(s) but its checkpoint state has " +
                             std::to_string(state.size()));
    std::vector<FactorBuffer> averaged;
    for (std::size_t k = 0; k < shapes.size(); ++k) averaged.push_back({state[k], shapes[k].n, shapes[k].matrix, shapes[k].packed});
    return averaged;
  }
  virtual std::vector<Buffer> checkpoint_state() = 0;
  /// Allocates the checkpoint state (to restore into it) and marks the statistics present.
  virtual void allocate_state() = 0;
  /// Frees the statistics and marks them absent.
  virtual void release_state() = 0;

  void allocate_units() {
    for (auto* unit : units_) unit->buffers();
  }
  /// Frees the decompositions and the buffers only their holder needs (default: the units).
  virtual void release_units() {
    for (auto* unit : units_) unit->release();
  }
  /// Computes unit u from the statistics (UnitState::decompose).
  void decompose(const Exec& exec, int u, double damping, int attempt = 0) { unit(u).decompose(exec, damping, attempt); }
  std::vector<Buffer> unit_buffers(int u) { return unit(u).buffers(); }
  /// Computes on the calling thread what decompose() reads besides the statistics (K-FAC: the
  /// pi of pi-damping, from the factors' traces), once per decomposition of the layer.
  virtual void prepare_decomposition(const Exec&) {}
  /// Called once every unit is in place (computed here or received).
  virtual void finish_decomposition(const Exec&, double, bool) {}

  /// X = [w b]^T into the block's gradient workspace.
  void load_gradient(const Exec& exec, const grad_matrix& w, const grad_vector& b) { gradient().load(exec, w, b); }
  /// V = preconditioned X, into the workspace's V: the rows `part` names (all of them unless
  /// the description divides the apply, split_passes > 0).
  virtual void precondition(const Exec& exec, double damping, const ApplyPart& part) = 0;
  /// The whole of V.
  void apply(const Exec& exec, double damping) { precondition(exec, damping, ApplyPart{}); }
  /// Split preconditioning (Kaisa::split_preconditioning; BlockDescription::split_passes > 0):
  /// pass `pass` of a divided apply, rows [r0, r1) (possibly empty) of its output.
  void apply_rows(const Exec& exec, double damping, int pass, index_t r0, index_t r1) {
    if (pass < 0 || pass >= description_.split_passes)
      throw Error(name_, "pass " + std::to_string(pass) + " of a divided apply, but the block's apply has " +
                             std::to_string(description_.split_passes) + " pass(es)");
    precondition(exec, damping, ApplyPart{pass, r0, r1});
  }
  /// sum(V .* X), for KL clipping.
  double inner_product(const Exec& exec) const { return gradient().inner_product(exec); }
  /// V as a flat buffer: what gradient receivers get.
  Buffer preconditioned() { return gradient().output(); }
  /// Writes nu * V back into (w, b).
  void write_back(const Exec& exec, const grad_matrix& w, const grad_vector& b, double nu) const {
    gradient().store(exec, w, b, nu);
  }
  virtual MemoryReport memory() const = 0;
  /// What memory() will report after a step (buffers kept between steps included), from the
  /// description without allocating: on a rank that holds the decompositions or not, for a
  /// skipped layer or not, with a precomputed product or not. The cost model reads this.
  MemoryReport planned_memory(bool holder, bool skipped, bool precompute) const {
    const MemoryPlan& m = description_.memory;
    MemoryReport r{name_, kind(), 0, 0, m.registered};
    if (skipped) return r;
    r.factor_bytes = checkpoint_bytes();
    r.decomposition_bytes = m.copies;
    if (holder) {
      for (const auto& unit : description_.units)
        for (const auto& [count, size] : unit.shapes) r.decomposition_bytes += count * size;
      if (precompute) r.decomposition_bytes += m.precomputed;
    }
    r.workspace_bytes += gradient().planned_bytes() + m.workspace + (holder ? m.holder_workspace : 0);
    return r;
  }

  /// Kept for readers of the first API (statistics were called factors).
  bool has_factors() const { return has_statistics(); }

 protected:
  /// The block's gradient workspace, a member of the block that outlives this base's use of it.
  void use_gradient(GradientBuffers<Scalar, Exec>& workspace) { gradient_ = &workspace; }
  void set_statistics(bool present) { statistics_present_ = present; }
  /// The layer's observation checks and the pairing rule (ObservationPairs(layer, order)).
  void use_observations(ObservationPairs pairs) { pairs_ = std::move(pairs); }
  /// The block's units (members of the block), one per description unit, in its order.
  void use_units(std::vector<UnitState<Exec>*> units) {
    if (units.size() != description_.units.size())
      throw Error(name_, "the block describes " + std::to_string(description_.units.size()) + " unit(s) but hands " +
                             std::to_string(units.size()) + " to use_units");
    units_ = std::move(units);
  }

 private:
  UnitState<Exec>& unit(int u) const {
    if (u < 0 || std::size_t(u) >= units_.size())
      throw Error(name_, "unit " + std::to_string(u) + " does not exist (the block has " + std::to_string(units_.size()) +
                             " unit(s) in use)");
    return *units_[std::size_t(u)];
  }

  GradientBuffers<Scalar, Exec>& gradient() const {
    if (!gradient_) throw Error(name_, "the block was built without a gradient workspace (Block::use_gradient)");
    return *gradient_;
  }

  std::string name_;
  BlockDescription description_;
  GradientBuffers<Scalar, Exec>* gradient_ = nullptr;
  std::vector<UnitState<Exec>*> units_;
  ObservationPairs pairs_;
  bool statistics_present_ = false;
};

/// Rows [first, second) of `rows` that part `part` of `parts` computes under split
/// preconditioning: contiguous blocks, sizes differing by at most one, in part order.
inline std::pair<index_t, index_t> row_block(index_t rows, int part, int parts) {
  const auto at = [&](int k) { return index_t((long long)rows * k / parts); };
  return {at(part), at(part + 1)};
}

}  // namespace impl
}  // namespace kfac
