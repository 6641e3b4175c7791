#pragma once
/// \file ngsgd_block.hpp
/// \brief The NG-SGD block of one Dense or Conv2d layer: two online Fisher estimates (input
/// rows with the bias column, output-gradient rows) and the two-sided Woodbury solve.

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kfac/core/block.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/squared_norm.hpp"
#include "kfac/methods/ngsgd/online_fisher.hpp"

namespace kfac {

/// \brief The settings of one NG-SGD layer, resolved (ranks known). See NGSGD for meanings.
struct NGSGDSettings {
  long rank_in = 0, rank_out = 0, update_period = 4;
  long initial_updates = 11;   ///< the schedule's every-step start (NGSGD sets the layer's interval)
  long init_iterations = 0;    ///< 0: Kaldi's rule (1 when a side's first minibatch has <= rank rows, else 3)
  double symmetry_breaker = 1.1;  ///< first entry of each row of the starting basis
  impl::ngsgd::Recurrence recurrence{};
  std::string describe() const {
    const auto num = impl::number;
    const auto& r = recurrence;
    return "rank_in=" + std::to_string(rank_in) + ",rank_out=" + std::to_string(rank_out) +
           ",period=" + std::to_string(update_period) + ",history=" + num(r.num_samples_history) +
           ",alpha=" + num(r.alpha) + ",epsilon=" + num(r.epsilon) + ",delta=" + num(r.delta) +
           ",initial=" + std::to_string(initial_updates) + ",init_iters=" + std::to_string(init_iterations) +
           ",start=" + num(symmetry_breaker) + ",eta_cap=" + num(r.eta_cap) +
           ",d_floor=" + (r.relative_d_floor ? "relative" : "epsilon");
  }
};

/// \brief NG-SGD state of one layer whose gradient X (out x (in + bias)) is preconditioned as
/// \f$\gamma\, \hat F_{out}^{-1} X \hat F_{in}^{-1}\f$, \f$\gamma = \|X\|_F / \|\hat F_{out}^{-1}
/// X \hat F_{in}^{-1}\|_F\f$ (Kaldi's scale: the step keeps the gradient's norm).
///
/// Each statistics update (NGSGD sets the layer's factor_update_steps to Kaldi's schedule) runs
/// one step of the recurrence of online_fisher.hpp per side; the very first runs Kaldi's
/// initialisation first (special basis, d = rho = epsilon, then init_iterations steps on the
/// first minibatch: Kaldi's 1 when that side has at most rank rows, else 3), then the update. As in Kaldi, a step's gradient is preconditioned with the estimates
/// from before that step's update, so that no minibatch is preconditioned by a Fisher estimate
/// that contains it. The estimates are per rank: checkpoint_state() lists them,
/// averaged_state() is empty, and there are no decomposable units.
/// \tparam LayerType Dense or Conv2d (their observation rows, as for K-FAC).
template <class LayerType, class Scalar, class Exec>
class NGSGDBlock final : public impl::Block<Scalar, Exec> {
  static_assert(LayerType::is_kronecker, "NGSGDBlock needs a Dense or Conv2d layer type");
  using Fisher = impl::ngsgd::OnlineFisher<Scalar, Exec>;
  using RMatrix = typename Fisher::rows_type;
  using SMatrix = impl::Matrix<Scalar, Exec>;
  using SVector = impl::Vector<Scalar, Exec>;

 public:
  using base = impl::Block<Scalar, Exec>;
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  /// Throws kfac::Error naming the layer when a setting is out of range.
  NGSGDBlock(std::string name, const LayerType& layer, const NGSGDSettings& s)
      : base(std::move(name), describe(layer, s)), layer_(layer), s_(s), na_(layer.a_dim()), ng_(layer.g_dim()),
        gradient_(layer.weight_rows(), layer.weight_cols(), layer.bias()) {
    gradient_.start_from_x();  // apply() updates V = X in place
    this->use_gradient(gradient_);
    this->use_observations(impl::ObservationPairs(layer));
    check(s_.rank_in >= 0 && s_.rank_in < na_, "rank_in = " + std::to_string(s_.rank_in) +
          ": expected 0 <= rank_in < " + std::to_string(na_) + " (the input dimension, with the bias column)");
    check(s_.rank_out >= 0 && s_.rank_out < ng_, "rank_out = " + std::to_string(s_.rank_out) +
          ": expected 0 <= rank_out < " + std::to_string(ng_) + " (the output dimension)");
    check(s_.update_period >= 1, "update_period = " + std::to_string(s_.update_period) + ": expected >= 1");
    const auto& r = s_.recurrence;
    check(r.num_samples_history > 0 && std::isfinite(r.num_samples_history),
          "num_samples_history = " + std::to_string(r.num_samples_history) + ": expected a finite value > 0");
    check(r.alpha >= 0 && std::isfinite(r.alpha), "alpha = " + std::to_string(r.alpha) + ": expected a finite value >= 0");
    check(r.epsilon > 0 && std::isfinite(r.epsilon), "epsilon = " + std::to_string(r.epsilon) + ": expected a finite value > 0");
    check(r.delta > 0 && r.delta < 1, "delta = " + std::to_string(r.delta) + ": expected a value in (0, 1)");
    check(r.eta_cap > 0 && r.eta_cap <= 1, "eta_cap = " + std::to_string(r.eta_cap) + ": expected a value in (0, 1]");
    check(s_.initial_updates >= 0, "initial_updates = " + std::to_string(s_.initial_updates) + ": expected >= 0");
    check(s_.init_iterations >= 0, "init_iterations = " + std::to_string(s_.init_iterations) +
          ": expected >= 0 (0: Kaldi's 1 or 3)");
    check(s_.symmetry_breaker > 0 && std::isfinite(s_.symmetry_breaker),
          "symmetry_breaker = " + std::to_string(s_.symmetry_breaker) + ": expected a finite value > 0");
    est_in_ = Fisher(na_, index_t(s_.rank_in));
    est_out_ = Fisher(ng_, index_t(s_.rank_out));
  }

  const LayerType& layer() const { return layer_; }
  const NGSGDSettings& settings() const { return s_; }

  /// The description: no units (the estimates are updated in update_statistics); the
  /// checkpoint holds R_in, (d_in, rho_in), R_out, (d_out, rho_out). Planned work:
  /// preconditioning's GEMMs, 4 a g (r_in + r_out) + 2 r_in r_out (a + g) flops (the
  /// estimates' updates, every update_period steps, are not modelled).
  static impl::BlockDescription describe(const LayerType& layer, const NGSGDSettings& s) {
    impl::BlockDescription d;
    d.kind = LayerType::kind;
    d.signature = layer.describe() + "/ngsgd[" + s.describe() + "]/s" + std::to_string(sizeof(Scalar));
    d.settings = s.describe();
    d.rows = layer.weight_rows();
    d.cols = layer.weight_cols();
    d.bias = layer.bias();
    d.checkpoint = Fisher(layer.a_dim(), index_t(s.rank_in)).shapes();
    for (const auto& b : Fisher(layer.g_dim(), index_t(s.rank_out)).shapes()) d.checkpoint.push_back(b);
    // Besides the estimates: their copies from before the last update, and the Woodbury
    // products (P: r_in g, W: r_in r_out, the stacked factors (a + g)(r_in + r_out), the
    // weights r_in + r_out).
    for (const auto& [count, size] : d.checkpoint) d.memory.copies += count * size;
    const std::size_t a = std::size_t(layer.a_dim()), g = std::size_t(layer.g_dim()), ri = std::size_t(s.rank_in),
                      ro = std::size_t(s.rank_out);
    d.memory.workspace = (ri * g + ri * ro + (a + g) * (ri + ro) + ri + ro) * sizeof(Scalar);
    d.plan.apply.gemm_flops = 4.0 * double(a) * double(g) * double(ri + ro) + 2.0 * double(ri) * double(ro) * double(a + g);
    d.plan.apply.scalar = sizeof(Scalar);
    d.plan.statistics_per_row.scalar = sizeof(Scalar);
    return d;
  }

  void add_input(const Exec& exec, const tensor_type& x) override {
    const auto e = impl::extents_of(x);
    RMatrix rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::ngsgd::in_rows"), layer_.a_rows(e), na_);
    layer_.fill_a_rows(exec, x, rows);
    obs_in_.add(exec, rows, layer_.a_normalizer(e), e[0]);
  }
  void add_output_grad(const Exec& exec, const tensor_type& g, double scale) override {
    const auto e = impl::extents_of(g);
    RMatrix rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::ngsgd::out_rows"), layer_.g_rows(e), ng_);
    layer_.fill_g_rows(exec, g, scale, rows);
    obs_out_.add(exec, rows, layer_.g_normalizer(e), e[0]);
  }
  /// Overflow: either side's mean squared row above the scalar type's range.
  impl::ObservationCheck check_observations() const override {
    impl::ObservationCheck c;
    const double big = double(std::numeric_limits<Scalar>::max());
    c.overflow = obs_in_.norm > 0 && obs_out_.norm > 0 &&
                 (!(obs_in_.squares / obs_in_.norm <= big) || !(obs_out_.squares / obs_out_.norm <= big));
    if (obs_in_.rows.empty() && obs_out_.rows.empty()) c.problem = "no observations were given";
    else if (obs_in_.rows.empty()) c.problem = "no input was observed";
    else if (obs_out_.rows.empty()) c.problem = "no output gradient was observed";
    else if (obs_in_.samples != obs_out_.samples)
      c.problem = "observed " + std::to_string(long(obs_in_.samples)) + " input samples but " +
                  std::to_string(long(obs_out_.samples)) + " output-gradient samples";
    else if (c.overflow) c.problem = "observations would overflow the scalar type";
    return c;
  }
  void drop_observations() override {
    obs_in_ = Pending{};
    obs_out_ = Pending{};
  }

  /// One step of the recurrence per side (Kaldi's initialisation on the first); `decay` is
  /// not used: the weight of the new minibatch is eta, from num_samples_history.
  void update_statistics(const Exec& exec, double) override {
    const auto& r = s_.recurrence;
    ensure_work();
    if (!this->has_statistics()) {
      est_in_.init_default(exec, r.epsilon, s_.symmetry_breaker);
      est_out_.init_default(exec, r.epsilon, s_.symmetry_breaker);
      for (long i = init_iterations(obs_in_, s_.rank_in); i > 0; --i) step(exec, est_in_, obs_in_);
      for (long i = init_iterations(obs_out_, s_.rank_out); i > 0; --i) step(exec, est_out_, obs_out_);
    }
    est_in_.copy_to(exec, prev_in_);
    est_out_.copy_to(exec, prev_out_);
    frozen_ = true;
    step(exec, est_in_, obs_in_);
    step(exec, est_out_, obs_out_);
    this->set_statistics(true);
    ++updates_;
  }
  /// Empty: averaging orthonormal bases across ranks is meaningless.
  /// R_in, (d_in, rho_in), R_out, (d_out, rho_out).
  std::vector<impl::Buffer> checkpoint_state() override {
    auto v = est_in_.buffers();
    for (const auto& b : est_out_.buffers()) v.push_back(b);
    return v;
  }
  void allocate_state() override {
    est_in_.allocate();
    est_out_.allocate();
    ensure_work();
    this->set_statistics(true);
    frozen_ = false;
  }
  void release_state() override {
    est_in_.release();
    est_out_.release();
    prev_in_.release();
    prev_out_.release();
    this->set_statistics(false);
    frozen_ = false;
  }

  /// V = gamma F_out^-1 X F_in^-1 on the transposed buffers (X^T = V_0 in the gradient
  /// workspace, whose V starts as V_0); `damping` is not used (alpha's smoothing plays its part).
  ///
  /// With F^-1 = beta^-1 (I - R^T E R) per side (the betas cancel in gamma), and P = R_in V_0,
  /// Q = V_0 R_out^T:
  /// \f[ (I - A_{in}) V_0 (I - A_{out}) = V_0 - [R_{in}^T \mid Q E_{out} - R_{in}^T E_{in} P R_{out}^T
  ///      E_{out}] \begin{bmatrix} E_{in} P \\ R_{out} \end{bmatrix}, \f]
  /// so both sides cost two projections of V_0 and one rank-(r_in + r_out) update, instead of a
  /// rank-r_in and a rank-r_out update that each read and write all of V.
  void precondition(const Exec& exec, double, const impl::ApplyPart&) override {
    if (!this->has_statistics() || (s_.rank_in == 0 && s_.rank_out == 0)) return;  // the identity, exactly
    const SMatrix& x = gradient_.x();
    const SMatrix& out = gradient_.v();
    const Fisher& fin = frozen_ ? prev_in_ : est_in_;
    const Fisher& fout = frozen_ ? prev_out_ : est_out_;
    const double alpha = s_.recurrence.alpha;
    const index_t ri = index_t(s_.rank_in), ro = index_t(s_.rank_out);
    const auto all = Kokkos::ALL;
    const auto q = Kokkos::subview(left_, all, Kokkos::make_pair(ri, ri + ro));
    if (ri > 0) {
      impl::ngsgd::woodbury_weights(exec, fin.values(), alpha, na_, e_in_);
      impl::gemm(exec, "N", "N", Scalar(1), fin.basis(), x, Scalar(0), p_in_);  // P
    }
    if (ro > 0) {
      impl::ngsgd::woodbury_weights(exec, fout.values(), alpha, ng_, e_out_);
      impl::gemm(exec, "N", "T", Scalar(1), x, fout.basis(), Scalar(0), q);  // Q
      impl::ngsgd::scale_by(exec, q, e_out_, false);                            // Q E_out
    }
    if (ri > 0 && ro > 0) {  // Q E_out - R_in^T (E_in P R_out^T E_out)
      impl::gemm(exec, "N", "T", Scalar(1), p_in_, fout.basis(), Scalar(0), w_);
      impl::ngsgd::scale_by(exec, w_, e_in_, true);
      impl::ngsgd::scale_by(exec, w_, e_out_, false);
      impl::gemm(exec, "T", "N", Scalar(-1), fin.basis(), w_, Scalar(1), q);
    }
    impl::ngsgd::stack_factors(exec, fin.basis(), p_in_, e_in_, fout.basis(), left_, right_);
    impl::gemm(exec, "N", "N", Scalar(-1), left_, right_, Scalar(1), out);
    const double before = impl::squared_norm(exec, x), after = impl::squared_norm(exec, out);
    last_gamma_ = after > 0 ? std::sqrt(before / after) : 1.0;
    auto v = out;
    const Scalar g = Scalar(last_gamma_);
    Kokkos::parallel_for(
        "kfac::ngsgd::scale_gradient", Kokkos::RangePolicy<Exec>(exec, 0, long(v.span())),
        KOKKOS_LAMBDA(long i) { v.data()[i] *= g; });
    frozen_ = false;  // this step's preconditioning is done: the next one uses the newest estimates
  }
  /// factor_bytes: the two estimates (R in Scalar, d and rho in double); decomposition_bytes:
  /// their copies from before the last update (used on update steps); workspace_bytes: X^T and
  /// V^T (2 a g), the Woodbury products (P: r_in g, W: r_in r_out, the stacked factors
  /// (a + g)(r_in + r_out), the weights r_in + r_out), in Scalar, and the pending observation
  /// rows.
  MemoryReport memory() const override {
    MemoryReport m{this->name(), this->kind(), 0, 0, 0};
    m.factor_bytes = est_in_.bytes() + est_out_.bytes();
    m.decomposition_bytes = prev_in_.bytes() + prev_out_.bytes();
    m.workspace_bytes = gradient_.bytes() + (p_in_.span() + w_.span() + left_.span() + right_.span() +
                                             e_in_.span() + e_out_.span()) * sizeof(Scalar);
    for (const auto* p : {&obs_in_, &obs_out_})
      for (const auto& r : p->rows) m.workspace_bytes += r.span() * sizeof(Scalar);
    return m;
  }
  // ---- read access, for tests and diagnostics
  /// The input-side (0) or output-side (1) estimate, as updated by the last statistics update.
  const Fisher& estimate(int side) const { return side == 0 ? est_in_ : est_out_; }
  /// Kaldi's gamma of the last apply() (1 when the block was the identity).
  double last_scale() const { return last_gamma_; }
  /// Statistics updates since construction (not checkpointed).
  long updates() const { return updates_; }

 private:
  /// Pending observation rows of one side, with what the recurrence needs about them.
  struct Pending {
    std::vector<RMatrix> rows;
    double norm = 0, squares = 0, samples = 0;
    long row_count = 0;
    void add(const Exec& exec, const RMatrix& r, double n, long batch) {
      rows.push_back(r);
      row_count += long(r.extent(0));
      norm += n;
      squares += impl::squared_norm(exec, r);
      samples += double(batch);
    }
  };

  void check(bool ok, const std::string& what) const {
    if (!ok) throw Error(this->name(), "NGSGD: " + what);
  }
  void step(const Exec& exec, Fisher& f, const Pending& p) const {
    f.update(exec, p.rows, p.norm, p.squares, p.samples, s_.recurrence);
  }
  /// Kaldi's Init(): one iteration when the first minibatch has at most `rank` rows (it then
  /// spans the rows' subspace already), else three.
  long init_iterations(const Pending& p, long rank) const {
    if (s_.init_iterations > 0) return s_.init_iterations;
    return p.row_count <= rank ? 1 : 3;
  }
  /// The Woodbury products' buffers, allocated with the statistics (every rank that has them
  /// may precondition) and kept.
  void ensure_work() {
    if (e_in_.extent(0) != 0 || left_.extent(0) != 0) return;
    p_in_ = SMatrix("kfac::ngsgd::p_in", s_.rank_in, ng_);
    w_ = SMatrix("kfac::ngsgd::w", s_.rank_in, s_.rank_out);
    left_ = SMatrix("kfac::ngsgd::left", na_, s_.rank_in + s_.rank_out);
    right_ = SMatrix("kfac::ngsgd::right", s_.rank_in + s_.rank_out, ng_);
    e_in_ = SVector("kfac::ngsgd::e_in", s_.rank_in);
    e_out_ = SVector("kfac::ngsgd::e_out", s_.rank_out);
  }

  LayerType layer_;
  NGSGDSettings s_;
  index_t na_, ng_;
  Pending obs_in_, obs_out_;
  Fisher est_in_, est_out_, prev_in_, prev_out_;
  bool frozen_ = false;
  long updates_ = 0;
  double last_gamma_ = 1.0;
  // X^T and V^T, (a x g) column-major: the memory order of the caller's row-major (g x a)
  // gradient, so loading and storing are contiguous copies.
  impl::GradientWorkspace<Scalar, Scalar, Exec> gradient_;
  SMatrix p_in_, w_, left_, right_;
  SVector e_in_, e_out_;
};

/// The former name (blocks were called layers until 2026-12), kept for code written against it.
template <class LayerType, class Scalar, class Exec>
using NGSGDLayer = NGSGDBlock<LayerType, Scalar, Exec>;

}  // namespace kfac
