// NG-SGD (Kaldi's online natural gradient): the block's estimates and preconditioned gradients
// against a dense double implementation of the same recurrence written here with Eigen (with
// the former settings, NGSGD::with_legacy_defaults; test_ngsgd_kaldi.cpp checks the defaults
// against a model of Kaldi's code); the
// estimate's convergence on rows of a known covariance; Kaldi's scale; identities; mixed
// registration; settings and NaN checks that leave everything unchanged; checkpoints.
#include <Eigen/Dense>
#include <catch2/catch.hpp>
#include <cmath>
#include <kfac/methods/ngsgd/ngsgd.hpp>
#include <sstream>

#include "helpers.hpp"
#include "kaldi_ngsgd_reference.hpp"

using namespace kfac_test;
using Eigen::VectorXd;
using Dense_ = Eigen::MatrixXd;  // column-major, for the linear algebra of the reference

namespace {

template <class LayerType>
using NgLayer = kfac::NGSGDBlock<LayerType, double, Host>;

// ------------------------------------------------------------------ dense reference
/// F = R^T diag(d) R + rho I, updated as Povey et al. (2014) describe, with dense matrices:
/// T is formed explicitly and Y = R T, where the library never forms a D x D matrix.
struct RefFisher {
  int dim = 0, rank = 0;
  Dense_ r;
  VectorXd d;
  double rho = 0;

  RefFisher(int dim_, int rank_) : dim(dim_), rank(rank_) {}
  void init(double eps) {
    r = Dense_::Zero(rank, dim);
    for (int i = 0; i < rank; ++i) {
      const int count = (dim - 1 - i) / rank + 1;
      for (int j = i; j < dim; j += rank) r(i, j) = 1.0 / std::sqrt(double(count));
    }
    d = VectorXd::Constant(rank, eps);
    rho = eps;
  }
  Dense_ dense() const {
    return r.transpose() * d.asDiagonal() * r + rho * Dense_::Identity(dim, dim);
  }
  Dense_ smoothed(double alpha) const {
    const double beta = rho * (1 + alpha) + alpha * d.sum() / dim;
    return r.transpose() * d.asDiagonal() * r + beta * Dense_::Identity(dim, dim);
  }
  void update(const Dense_& rows, double norm, double samples, const kfac::impl::ngsgd::Recurrence& s) {
    if (rank == 0) return;
    const double eta = 1 - std::exp(-samples / s.num_samples_history);
    const Dense_ t = eta * rows.transpose() * rows / norm + (1 - eta) * dense();
    const Dense_ y = r * t;
    VectorXd c;
    Dense_ u;
    const bool reorth = kaldi_ref::sorted_floored_eig(y * y.transpose(), std::pow(rho * (1 - eta), 2), c, u);
    const VectorXd sc = c.cwiseSqrt();
    double rho1 = (t.trace() - sc.sum()) / (dim - rank);
    d = (sc.array() - rho1).max(s.epsilon).matrix();
    rho = std::max(rho1, std::max(s.epsilon, s.delta * sc.maxCoeff()));
    r = sc.cwiseInverse().asDiagonal() * u.transpose() * y;
    if (reorth) {
      const Dense_ o = r * r.transpose();
      if ((o - Dense_::Identity(rank, rank)).cwiseAbs().maxCoeff() > 1e-3) {
        const Dense_ l = o.llt().matrixL();
        r = l.triangularView<Eigen::Lower>().solve(r);
      }
    }
  }
};

/// The block's protocol on top of RefFisher: Kaldi's initialisation on the first update, and
/// the estimates from before an update for the gradient of that step.
struct RefLayer {
  RefFisher in, out, in_prev, out_prev;
  kfac::NGSGDSettings s;
  bool started = false, updated = false;
  RefLayer(int a, int g, const kfac::NGSGDSettings& s_)
      : in(a, int(s_.rank_in)), out(g, int(s_.rank_out)), in_prev(in), out_prev(out), s(s_) {}
  void update(const Dense_& a_rows, double a_norm, const Dense_& g_rows, double g_norm, double samples) {
    auto both = [&] {
      in.update(a_rows, a_norm, samples, s.recurrence);
      out.update(g_rows, g_norm, samples, s.recurrence);
    };
    if (!started) {
      in.init(s.recurrence.epsilon);
      out.init(s.recurrence.epsilon);
      for (int i = 0; i < 3; ++i) both();
      started = true;
    }
    in_prev = in;
    out_prev = out;
    both();
    updated = true;
  }
  /// gamma F_out^-1 X F_in^-1 (X is out x a), by dense solves.
  Dense_ precondition(const Dense_& x) {
    const RefFisher& fi = updated ? in_prev : in;
    const RefFisher& fo = updated ? out_prev : out;
    updated = false;
    if (s.rank_in == 0 && s.rank_out == 0) return x;
    Dense_ v = x;
    if (s.rank_in > 0) v = fi.smoothed(s.recurrence.alpha).transpose().ldlt().solve(v.transpose()).transpose();
    if (s.rank_out > 0) v = fo.smoothed(s.recurrence.alpha).ldlt().solve(v);
    return v * (x.norm() / v.norm());
  }
};

Dense_ col_major(const MatrixXd& m) { return Dense_(m); }

/// R^T R (the projector on the estimate's subspace) and F from the library's estimate.
template <class Fisher>
RefFisher from_block(const Fisher& f) {
  RefFisher r(int(f.dim()), int(f.rank()));
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), f.basis());
  auto dr = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), f.values());
  r.r = Dense_(r.rank, r.dim);
  for (int i = 0; i < r.rank; ++i)
    for (int j = 0; j < r.dim; ++j) r.r(i, j) = rh(i, j);
  r.d = VectorXd(r.rank);
  for (int i = 0; i < r.rank; ++i) r.d(i) = dr(i);
  r.rho = dr(r.rank);
  return r;
}

double rel(const Dense_& a, const Dense_& b) { return (a - b).norm() / std::max(b.norm(), 1e-300); }

void check_same_estimate(const RefFisher& lib, const RefFisher& ref, double tol) {
  if (ref.rank == 0) return;
  INFO("rank " << ref.rank << " dim " << ref.dim);
  CHECK(rel(lib.dense(), ref.dense()) < tol);
  CHECK(rel(lib.r.transpose() * lib.r, ref.r.transpose() * ref.r) < tol);
  CHECK(rel(lib.r * lib.r.transpose(), Dense_::Identity(ref.rank, ref.rank)) < 1e-3);
  CHECK(rel(lib.d, ref.d) < tol);
  CHECK(std::abs(lib.rho - ref.rho) <= tol * (ref.rho + ref.d.maxCoeff()));  // relative to |F|
}

/// A gradient as the out x (in + bias) matrix.
Dense_ gradient_matrix(const V2<double>& w, const V1<double>& b) { return col_major(grad_with_bias(w, b)); }

// ------------------------------------------------------------------ Dense, step by step
struct DenseCase {
  int in, out;
  bool bias;
  long rank_in, rank_out, period;
  int batch;
  // Of the estimates and of the preconditioned gradient (a smooth function of them: the solve
  // with F, rescaled to the gradient's norm). Batches smaller than the rank leave near-equal
  // d_i, whose basis the rounding of each BLAS kernel picks differently: 1e-7 there. Worst over
  // the Prescott, Sandybridge, Haswell and Zen kernels (OPENBLAS_CORETYPE, 2026-12-06): estimates
  // 1.5e-8 and gradients 1.6e-9 with near-equal d_i, 1.8e-14 and 1.1e-15 otherwise.
  double tol = 1e-9;
  int data_rank = 0;  // > 0: inputs of this rank (the floors of c and rho then bind)
};

void run_dense_case(const DenseCase& c, int steps) {
  Pre pre(plain_options());
  auto method = kfac::NGSGD{}.with_rank_in(c.rank_in).with_rank_out(c.rank_out).with_update_period(c.period)
                    .with_num_samples_history(300).with_legacy_defaults();
  pre.register_layer("fc", kfac::Dense(c.in, c.out, c.bias), method);
  const auto& blk = pre.layer_as<NgLayer<kfac::Dense>>("fc");
  RefLayer ref(c.in + c.bias, c.out, blk.settings());
  Rng rng(17 + c.in * 7 + c.rank_in);
  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    DenseBatch b(c.in, c.out, c.bias, c.batch, rng);
    if (c.data_rank > 0) {
      const MatrixXd low = to_eigen(random_view<double>(c.batch, c.data_rank, rng)) *
                           to_eigen(random_view<double>(c.data_rank, c.in, rng));
      for (int i = 0; i < c.batch; ++i)
        for (int j = 0; j < c.in; ++j) b.x(i, j) = low(i, j);
    }
    REQUIRE(pre.wants_observations("fc") == (step % c.period == 0));
    if (pre.wants_observations("fc")) {
      pre.observe_input("fc", b.x);
      pre.observe_output_grad("fc", b.g);
      Dense_ a = Dense_::Ones(c.batch, c.in + c.bias);
      a.leftCols(c.in) = col_major(to_eigen(b.x));
      ref.update(a, c.batch, col_major(to_eigen(b.g)), c.batch, c.batch);
    }
    const Dense_ x = gradient_matrix(b.w, b.b);
    pre.set_gradient("fc", b.w, b.b);
    pre.step();
    const Dense_ expect = ref.precondition(x);
    CHECK(rel(gradient_matrix(b.w, b.b), expect) < c.tol);
    check_same_estimate(from_block(blk.estimate(0)), ref.in, c.tol);
    check_same_estimate(from_block(blk.estimate(1)), ref.out, c.tol);
  }
  CHECK(blk.updates() == (steps + c.period - 1) / c.period);
}

}  // namespace

TEST_CASE("NG-SGD Dense equals the dense reference step by step", "[ngsgd][reference]") {
  // ranks from 1 to close to the dimension, periods 1, 2, 3, with and without bias, batches
  // smaller and larger than the rank
  run_dense_case({7, 5, true, 3, 2, 1, 6}, 10);
  run_dense_case({12, 9, true, 5, 4, 2, 16}, 12);
  run_dense_case({6, 8, false, 1, 7, 3, 4, 1e-7}, 10);
  run_dense_case({10, 4, true, 0, 2, 1, 8}, 6);   // input side the identity
  run_dense_case({10, 6, true, 4, 0, 2, 8}, 6);   // output side the identity
  run_dense_case({9, 6, true, 8, 5, 1, 3, 1e-7}, 8);   // rank close to the dimension, tiny batch
  run_dense_case({8, 5, false, 5, 2, 1, 12, 1e-7, 2}, 8);  // inputs of rank 2 < rank 5: floors bind
}

TEST_CASE("NG-SGD defaults follow Kaldi's", "[ngsgd][settings]") {
  const auto s = kfac::NGSGD{}.settings_for(kfac::Dense(784, 256));
  CHECK(s.rank_in == 20);
  CHECK(s.rank_out == 80);
  CHECK(s.update_period == 4);
  CHECK(s.recurrence.num_samples_history == 2000);
  CHECK(s.recurrence.alpha == 4);
  CHECK(s.recurrence.epsilon == 1e-10);
  CHECK(s.recurrence.delta == 5e-4);
  CHECK(s.recurrence.eta_cap == 0.9);
  CHECK(s.recurrence.relative_d_floor);
  CHECK(s.initial_updates == 11);
  CHECK(s.init_iterations == 0);  // Kaldi's rule: 1 or 3
  CHECK(s.symmetry_breaker == 1.1);
  const auto legacy = kfac::NGSGD{}.with_legacy_defaults().settings_for(kfac::Dense(784, 256));
  CHECK(legacy.recurrence.eta_cap == 1);
  CHECK(!legacy.recurrence.relative_d_floor);
  CHECK(legacy.initial_updates == 0);
  CHECK(legacy.init_iterations == 3);
  CHECK(legacy.symmetry_breaker == 1);
  const auto small = kfac::NGSGD{}.settings_for(kfac::Dense(9, 30));
  CHECK(small.rank_in == 5);   // (9 + 1) / 2
  CHECK(small.rank_out == 15); // (30 + 1) / 2
  const auto one = kfac::NGSGD{}.settings_for(kfac::Dense(1, 1, false));
  CHECK(one.rank_in == 0);
  CHECK(one.rank_out == 0);
  const auto conv = kfac::NGSGD{}.settings_for(kfac::Conv2d(3, 16, 3, 3));
  CHECK(conv.rank_in == 14);  // (27 + 1) / 2
  CHECK(conv.rank_out == 8);
}

// ------------------------------------------------------------------ Conv2d
TEST_CASE("NG-SGD Conv2d equals the dense reference step by step", "[ngsgd][reference][conv2d]") {
  const int n = 3, c = 2, o = 4, h = 5, w = 5, k = 3;  // stride 1, padding 1: 5 x 5 outputs
  Pre pre(plain_options());
  pre.register_layer("conv", kfac::Conv2d(c, o, k, k).with_padding(1, 1),
                     kfac::NGSGD{}.with_rank_in(6).with_rank_out(2).with_update_period(2).with_num_samples_history(50)
                         .with_legacy_defaults());
  const auto& blk = pre.layer_as<NgLayer<kfac::Conv2d>>("conv");
  RefLayer ref(c * k * k + 1, o, blk.settings());
  Rng rng(5);
  for (int step = 0; step < 7; ++step) {
    INFO("step " << step);
    auto x = random_view4<double>(n, c, h, w, rng);
    auto g = random_view4<double>(n, o, h, w, rng);
    auto wg = random_view4<double>(o, c, k, k, rng);
    auto bg = random_vector<double>(o, rng);
    if (pre.wants_observations("conv")) {
      pre.observe_input("conv", x);
      pre.observe_output_grad("conv", g);
      // im2col written out: patch column c*9 + i*3 + j, then the bias 1; padding 1
      Dense_ a = Dense_::Zero(n * h * w, c * k * k + 1), gr(n * h * w, o);
      for (int s = 0; s < n; ++s)
        for (int oy = 0; oy < h; ++oy)
          for (int ox = 0; ox < w; ++ox) {
            const int row = (s * h + oy) * w + ox;
            for (int ch = 0; ch < c; ++ch)
              for (int i = 0; i < k; ++i)
                for (int j = 0; j < k; ++j) {
                  const int y = oy - 1 + i, xx = ox - 1 + j;
                  if (y >= 0 && y < h && xx >= 0 && xx < w) a(row, ch * k * k + i * k + j) = x(s, ch, y, xx);
                }
            a(row, c * k * k) = 1;
            for (int ch = 0; ch < o; ++ch) gr(row, ch) = g(s, ch, oy, ox);
          }
      ref.update(a, n, gr, double(n) * h * w, n);
    }
    Dense_ xm(o, c * k * k + 1);
    for (int oc = 0; oc < o; ++oc) {
      for (int col = 0; col < c * k * k; ++col) xm(oc, col) = wg.data()[oc * c * k * k + col];
      xm(oc, c * k * k) = bg(oc);
    }
    pre.set_gradient("conv", wg, bg);
    pre.step();
    const Dense_ expect = ref.precondition(xm);
    Dense_ got(o, c * k * k + 1);
    for (int oc = 0; oc < o; ++oc) {
      for (int col = 0; col < c * k * k; ++col) got(oc, col) = wg.data()[oc * c * k * k + col];
      got(oc, c * k * k) = bg(oc);
    }
    CHECK(rel(got, expect) < 1e-9);
    check_same_estimate(from_block(blk.estimate(0)), ref.in, 1e-9);
    check_same_estimate(from_block(blk.estimate(1)), ref.out, 1e-9);
  }
}

// ------------------------------------------------------------------ convergence
// Rows x = U diag(sqrt(lambda)) z + sigma n (z, n standard normal): covariance
// Sigma = U diag(lambda) U^T + sigma^2 I with lambda = (16, 9, 4, 1), sigma^2 = 0.04, D = 30.
// After K = 200 updates of 100 rows (20000 samples, 10 histories of 2000), the rank-4
// estimate satisfies: sin of the largest principal angle between span(R^T) and span(U) below
// 0.05; each d_i + rho within 10% of lambda_i + sigma^2; rho within 5% of sigma^2. Measured:
// sin 0.013, d + rho = (16.48, 8.97, 4.10, 1.05), rho = 0.04004 (the sampling error of an
// average over ~2000 samples is a few percent).
TEST_CASE("NG-SGD estimate converges to a low-rank-plus-noise covariance", "[ngsgd][convergence]") {
  const int dim = 30, rank = 4, batch = 100, updates = 200;
  const double lambda[rank] = {16, 9, 4, 1}, sigma2 = 0.04;
  Rng rng(99);
  auto normal = [&] {  // Box-Muller from the uniform(-1, 1) generator
    const double u1 = 0.5 * (rng.uniform() + 1) * (1 - 1e-12) + 1e-12, u2 = 0.5 * (rng.uniform() + 1);
    return std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
  };
  Dense_ u(dim, rank);
  for (int i = 0; i < dim; ++i)
    for (int j = 0; j < rank; ++j) u(i, j) = normal();
  u = Eigen::HouseholderQR<Dense_>(u).householderQ() * Dense_::Identity(dim, rank);

  Pre pre(plain_options());
  // a Dense layer without bias whose input rows are the synthetic rows
  pre.register_layer("fc", kfac::Dense(dim, 2, false), kfac::NGSGD{}.with_rank_in(rank).with_rank_out(1).with_update_period(1));
  const auto& blk = pre.layer_as<NgLayer<kfac::Dense>>("fc");
  for (int t = 0; t < updates; ++t) {
    V2<double> x("x", batch, dim), g("g", batch, 2), w("w", 2, dim);
    for (int s = 0; s < batch; ++s) {
      VectorXd z(rank);
      for (int j = 0; j < rank; ++j) z(j) = std::sqrt(lambda[j]) * normal();
      const VectorXd row = u * z;
      for (int i = 0; i < dim; ++i) x(s, i) = row(i) + std::sqrt(sigma2) * normal();
      g(s, 0) = normal();
      g(s, 1) = normal();
    }
    pre.observe_input("fc", x);
    pre.observe_output_grad("fc", g);
    pre.set_gradient("fc", w);
    pre.step();
  }
  const RefFisher f = from_block(blk.estimate(0));
  // principal angles: singular values of U^T Q, Q an orthonormal basis of span(R^T)
  const Dense_ q = Eigen::HouseholderQR<Dense_>(f.r.transpose()).householderQ() * Dense_::Identity(dim, rank);
  const VectorXd cosines = Eigen::JacobiSVD<Dense_>(u.transpose() * q).singularValues();
  const double sin_max = std::sqrt(std::max(0.0, 1 - cosines.minCoeff() * cosines.minCoeff()));
  INFO("sin(largest angle) = " << sin_max << ", d = " << f.d.transpose() << ", rho = " << f.rho);
  CHECK(sin_max < 0.05);
  for (int i = 0; i < rank; ++i) CHECK(std::abs(f.d(i) + f.rho - (lambda[i] + sigma2)) < 0.10 * (lambda[i] + sigma2));
  CHECK(std::abs(f.rho - sigma2) < 0.05 * sigma2);
}

// ------------------------------------------------------------------ scale and identity
TEST_CASE("NG-SGD keeps the gradient's Frobenius norm", "[ngsgd][scale]") {
  Pre pre(plain_options());
  pre.register_layer("fc", kfac::Dense(11, 7), kfac::NGSGD{}.with_update_period(1));
  Rng rng(3);
  for (int step = 0; step < 5; ++step) {
    DenseBatch b(11, 7, true, 9, rng);
    const double before = gradient_matrix(b.w, b.b).norm();
    b.feed(pre, "fc");
    pre.step();
    const Dense_ after = gradient_matrix(b.w, b.b);
    CHECK(std::abs(after.norm() - before) <= 1e-13 * before);
    CHECK(pre.layer_as<NgLayer<kfac::Dense>>("fc").last_scale() > 1);  // F^-1 shrinks, gamma restores
  }
}

TEST_CASE("NG-SGD with rank 0 on both sides returns the gradient unchanged", "[ngsgd][identity]") {
  Pre pre(plain_options());
  pre.register_layer("fc", kfac::Dense(6, 4), kfac::NGSGD{}.with_rank(0).with_update_period(1));
  pre.register_layer("one", kfac::Dense(1, 1, false), kfac::NGSGD{});  // defaults: rank 0, 0
  Rng rng(8);
  for (int step = 0; step < 3; ++step) {
    DenseBatch b(6, 4, true, 5, rng), c(1, 1, false, 5, rng);
    const auto w0 = clone(b.w), c0 = clone(c.w);
    const auto b0 = clone(b.b);
    b.feed(pre, "fc");
    if (pre.wants_observations("one")) c.feed(pre, "one"); else pre.set_gradient("one", c.w);
    pre.step();
    CHECK(same_bits(b.w, w0));
    CHECK(same_bits(b.b, b0));
    CHECK(same_bits(c.w, c0));
  }
}

// ------------------------------------------------------------------ state views
TEST_CASE("NG-SGD state is per rank: checkpointed, never averaged, no units", "[ngsgd][state]") {
  Pre pre(plain_options());
  pre.register_layer("fc", kfac::Dense(5, 3), kfac::NGSGD{}.with_rank_in(2).with_rank_out(1));
  Rng rng(4);
  DenseBatch b(5, 3, true, 8, rng);
  b.feed(pre, "fc");
  pre.step();
  auto& blk = const_cast<kfac::impl::Block<double, Host>&>(pre.layer("fc"));
  CHECK(blk.averaged_state().empty());
  CHECK(blk.units() == 0);
  const auto state = blk.checkpoint_state();
  const auto shapes = blk.checkpoint_shapes();
  REQUIRE(state.size() == 4);
  REQUIRE(shapes.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) CHECK(state[i].count == shapes[i].first);
  CHECK(state[0].count == 2 * 6);  // R_in
  CHECK(state[1].count == 3);      // d_in, rho_in
  CHECK(state[2].count == 1 * 3);  // R_out
  CHECK(state[3].count == 2);
  const auto m = blk.memory(), p = blk.planned_memory(true, false, false);
  CHECK(m.factor_bytes == p.factor_bytes);
  CHECK(m.decomposition_bytes == p.decomposition_bytes);
  CHECK(m.workspace_bytes == p.workspace_bytes);
}

namespace {
std::string saved(const Pre& pre) {
  std::ostringstream os;
  pre.save(os);
  return os.str();
}
}  // namespace

TEST_CASE("NG-SGD checkpoints round-trip bit-exactly and resume identically", "[ngsgd][checkpoint]") {
  auto method = kfac::NGSGD{}.with_rank_in(3).with_rank_out(2).with_update_period(2);
  Pre a(plain_options()), b(plain_options());
  a.register_layer("fc", kfac::Dense(7, 5), method);
  b.register_layer("fc", kfac::Dense(7, 5), method);
  Rng rng(21);
  for (int step = 0; step < 5; ++step) {
    DenseBatch d(7, 5, true, 6, rng);
    if (a.wants_observations()) d.feed(a, "fc"); else a.set_gradient("fc", d.w, d.b);
    a.step();
  }
  std::istringstream is(saved(a));
  b.load(is);
  CHECK(saved(b) == saved(a));
  for (int step = 0; step < 5; ++step) {
    DenseBatch d(7, 5, true, 6, rng), e = d.twin();
    REQUIRE(a.wants_observations() == b.wants_observations());
    if (a.wants_observations()) { d.feed(a, "fc"); e.feed(b, "fc"); }
    else { a.set_gradient("fc", d.w, d.b); b.set_gradient("fc", e.w, e.b); }
    a.step();
    b.step();
    CHECK(same_bits(d.w, e.w));
    CHECK(same_bits(d.b, e.b));
  }
  CHECK(saved(b) == saved(a));
}

// ------------------------------------------------------------------ mixed registration
TEST_CASE("NG-SGD, K-FAC and BatchNorm's unit-wise Fisher in one preconditioner", "[ngsgd][mixed]") {
  const auto ng = kfac::NGSGD{}.with_rank_in(3).with_rank_out(2).with_update_period(3);
  Pre mixed(plain_options()), ng_only(plain_options()), kfac_only(plain_options()), bn_only(plain_options());
  mixed.register_layer("fc1", kfac::Dense(6, 5), ng);
  mixed.register_layer("fc2", kfac::Dense(5, 4), kfac::KFAC<>{});
  mixed.register_layer("bn", kfac::BatchNorm2d(3), kfac::UnitWiseFisher<>{});
  ng_only.register_layer("fc1", kfac::Dense(6, 5), ng);
  kfac_only.register_layer("fc2", kfac::Dense(5, 4), kfac::KFAC<>{});
  bn_only.register_layer("bn", kfac::BatchNorm2d(3), kfac::UnitWiseFisher<>{});
  Rng rng(31);
  for (int step = 0; step < 7; ++step) {
    INFO("step " << step);
    DenseBatch d1(6, 5, true, 8, rng), d2(5, 4, true, 8, rng);
    auto xb = random_view4<double>(8, 3, 2, 2, rng), gb = random_view4<double>(8, 3, 2, 2, rng);
    auto gam = random_vector<double>(3, rng), bet = random_vector<double>(3, rng);
    DenseBatch e1 = d1.twin(), e2 = d2.twin();
    auto gam2 = clone(gam), bet2 = clone(bet);
    CHECK(mixed.wants_observations("fc1") == (step <= 10 || (step - 10) % 3 == 0));
    CHECK(mixed.wants_observations("fc2"));
    if (mixed.wants_observations("fc1")) { d1.feed(mixed, "fc1"); e1.feed(ng_only, "fc1"); }
    else { mixed.set_gradient("fc1", d1.w, d1.b); ng_only.set_gradient("fc1", e1.w, e1.b); }
    d2.feed(mixed, "fc2");
    e2.feed(kfac_only, "fc2");
    mixed.observe_input("bn", xb);
    mixed.observe_output_grad("bn", gb);
    mixed.set_gradient("bn", gam, bet);
    bn_only.observe_input("bn", xb);
    bn_only.observe_output_grad("bn", gb);
    bn_only.set_gradient("bn", gam2, bet2);
    mixed.step();
    ng_only.step();
    kfac_only.step();
    bn_only.step();
    CHECK(same_bits(d1.w, e1.w));
    CHECK(same_bits(d2.w, e2.w));
    CHECK(same_bits(gam, gam2));
    CHECK(same_bits(bet, bet2));
  }
}

// ------------------------------------------------------------------ bad input
TEST_CASE("NG-SGD bad settings are refused at registration, naming the layer", "[ngsgd][errors]") {
  Pre pre(plain_options());
  pre.register_layer("ok", kfac::Dense(4, 3), kfac::NGSGD{});
  const auto before = pre.layer_names();
  auto refused = [&](const kfac::NGSGD& m, const std::vector<std::string>& parts) {
    expect_error([&] { pre.register_layer("bad", kfac::Dense(4, 3), m); }, "bad", parts);
    CHECK(pre.layer_names() == before);
  };
  refused(kfac::NGSGD{}.with_rank_in(5), {"rank_in = 5", "< 5"});  // in + bias = 5
  refused(kfac::NGSGD{}.with_rank_in(-1), {"rank_in = -1"});
  refused(kfac::NGSGD{}.with_rank_out(3), {"rank_out = 3", "< 3"});
  refused(kfac::NGSGD{}.with_rank_out(-2), {"rank_out = -2"});
  refused(kfac::NGSGD{}.with_update_period(0), {"update_period = 0"});
  refused(kfac::NGSGD{}.with_num_samples_history(0), {"num_samples_history"});
  refused(kfac::NGSGD{}.with_num_samples_history(-5), {"num_samples_history"});
  refused(kfac::NGSGD{}.with_alpha(-0.5), {"alpha"});
  refused(kfac::NGSGD{}.with_epsilon(0), {"epsilon"});
  refused(kfac::NGSGD{}.with_delta(1.5), {"delta"});
  refused(kfac::NGSGD{}.with_eta_cap(0), {"eta_cap = 0"});
  refused(kfac::NGSGD{}.with_eta_cap(1.5), {"eta_cap = 1.5"});
  refused(kfac::NGSGD{}.with_initial_updates(-1), {"initial_updates = -1"});
  refused(kfac::NGSGD{}.with_init_iterations(-2), {"init_iterations = -2"});
  refused(kfac::NGSGD{}.with_symmetry_breaker(0), {"symmetry_breaker = 0"});
  refused(kfac::NGSGD{}.with_symmetry_breaker(std::nan("")), {"symmetry_breaker"});
  expect_error([&] { pre.register_layer("badconv", kfac::Conv2d(2, 3, 3, 3), kfac::NGSGD{}.with_rank_in(19)); },
               "badconv", {"rank_in = 19", "< 19"});
  pre.register_layer("bad", kfac::Dense(4, 3), kfac::NGSGD{}.with_rank_in(4));  // the name is still free
}

TEST_CASE("NG-SGD: NaN observations leave the state unchanged under each policy", "[ngsgd][errors][nan]") {
  for (auto policy : {kfac::NonFinitePolicy::raise, kfac::NonFinitePolicy::skip}) {
    Pre pre(plain_options().with_nonfinite_policy(policy));
    pre.register_layer("fc", kfac::Dense(5, 4), kfac::NGSGD{}.with_update_period(1));
    Rng rng(12);
    DenseBatch good(5, 4, true, 6, rng);
    good.feed(pre, "fc");
    pre.step();
    const std::string state = saved(pre);
    DenseBatch bad(5, 4, true, 6, rng);
    const auto w0 = clone(bad.w);
    bad.x(2, 3) = std::nan("");
    if (policy == kfac::NonFinitePolicy::raise) {
      expect_error([&] { pre.observe_input("fc", bad.x); }, "fc", {"NaN"});
      CHECK(saved(pre) == state);
    } else {
      bad.feed(pre, "fc");
      pre.step();
      CHECK(pre.skipped_steps() == 1);
      CHECK(same_bits(bad.w, w0));  // the gradient is left as given
      // the step counter moved on; the estimates did not
      std::istringstream is(state);
      Pre twin(plain_options().with_nonfinite_policy(policy));
      twin.register_layer("fc", kfac::Dense(5, 4), kfac::NGSGD{}.with_update_period(1));
      twin.load(is);
      const auto& s1 = pre.layer_as<NgLayer<kfac::Dense>>("fc");
      const auto& s2 = twin.layer_as<NgLayer<kfac::Dense>>("fc");
      for (int side = 0; side < 2; ++side) {
        CHECK(same_bits(s1.estimate(side).basis(), s2.estimate(side).basis()));
        CHECK(same_bits(s1.estimate(side).values(), s2.estimate(side).values()));
      }
    }
  }
}
