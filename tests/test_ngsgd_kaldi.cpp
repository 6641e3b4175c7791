// NG-SGD against kaldi_ngsgd_reference.hpp, a model of Kaldi's OnlineNaturalGradient written
// from Kaldi's code: kfac::NGSGD's defaults must give Kaldi's update direction and Kaldi's
// estimates step by step (starting basis, floors, eta cap, initialisation iterations, the
// first-11-calls schedule), also for softmax + cross-entropy output gradients (rows summing to
// 0) over hundreds of updates, where the all-ones direction must not take a rank slot.
#include <catch2/catch.hpp>
#include <cmath>
#include <kfac/methods/ngsgd/ngsgd.hpp>

#include "helpers.hpp"
#include "kaldi_ngsgd_reference.hpp"

using namespace kfac_test;
using kaldi_ref::Mat;
using kaldi_ref::Vec;

namespace {

template <class LayerType>
using NgLayer = kfac::NGSGDBlock<LayerType, double, Host>;

/// R and (d, rho) of one of kfac's estimates, as dense matrices.
template <class Fisher>
void read_estimate(const Fisher& f, Mat& r, Vec& d, double& rho) {
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), f.basis());
  auto dr = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), f.values());
  const int rank = int(f.rank()), dim = int(f.dim());
  r = Mat(rank, dim);
  d = Vec(rank);
  for (int i = 0; i < rank; ++i) {
    for (int j = 0; j < dim; ++j) r(i, j) = rh(i, j);
    d(i) = dr(i);
  }
  rho = dr(rank);
}

double rel(const Mat& a, const Mat& b) { return (a - b).norm() / std::max(b.norm(), 1e-300); }

/// How far kfac's estimate of one side is from the reference's: F = R^T D R + rho I, d, and
/// rho relative to |F|.
template <class Fisher>
double estimate_error(const Fisher& f, const kaldi_ref::OnlineNaturalGradient& k) {
  Mat r;
  Vec d;
  double rho;
  read_estimate(f, r, d, rho);
  const Mat kr = k.basis();
  const int dim = int(r.cols());
  const Mat fk = r.transpose() * d.asDiagonal() * r + rho * Mat::Identity(dim, dim);
  const Mat fr = kr.transpose() * k.d.asDiagonal() * kr + k.rho * Mat::Identity(dim, dim);
  return std::max({rel(fk, fr), rel(d, k.d), std::abs(rho - k.rho) / (k.rho + k.d.maxCoeff())});
}

/// Softmax of random logits minus a one-hot target: rows that sum to 0.
Mat softmax_ce_gradients(int n, int classes, Rng& rng) {
  Mat g(n, classes);
  for (int i = 0; i < n; ++i) {
    Vec z(classes);
    for (int c = 0; c < classes; ++c) z(c) = 2 * rng.uniform();
    const Vec p = (z.array() - z.maxCoeff()).exp().matrix();
    g.row(i) = (p / p.sum()).transpose();
    g(i, int((rng.uniform() + 1) * 0.5 * classes) % classes) -= 1;
  }
  return g;
}

struct Case {
  int in, out, rank_in, rank_out, period, batch, steps;
  double history = 2000;
  bool zero_row_sums = false;  // softmax + cross-entropy output gradients
  int data_rank = 0;           // > 0: inputs of this rank (the floors of d and rho bind)
};

/// What run() saw, the largest over the steps.
struct Departure {
  double direction = 0, estimate = 0;  // relative
  int schedule = 0;                    // steps where kfac's and Kaldi's "update now?" differ
};

/// Feeds the same rows to kfac (NGSGD's defaults but for the case's ranks, period and history,
/// then `tweak`) and to the reference, every step, and measures how far kfac's direction,
/// estimates and schedule are from Kaldi's. `after` sees the kfac block and the reference.
Departure run(const Case& c, const std::function<kfac::NGSGD(kfac::NGSGD)>& tweak = {},
              const std::function<void(const NgLayer<kfac::Dense>&, const kaldi_ref::AffineComponent&)>& after = {}) {
  Pre pre(plain_options());
  kfac::NGSGD method = kfac::NGSGD{}.with_rank_in(c.rank_in).with_rank_out(c.rank_out).with_update_period(c.period)
                           .with_num_samples_history(c.history);
  if (tweak) method = tweak(method);
  pre.register_layer("fc", kfac::Dense(c.in, c.out), method);
  const auto& blk = pre.layer_as<NgLayer<kfac::Dense>>("fc");
  kaldi_ref::AffineComponent ref(c.rank_in, c.rank_out, c.period, c.history);
  Rng rng(40 + c.in + 3 * c.batch);
  Departure dep;
  for (int step = 0; step < c.steps; ++step) {
    INFO("step " << step);
    Mat x = to_eigen(random_view<double>(c.batch, c.in, rng));
    if (c.data_rank > 0)
      x = to_eigen(random_view<double>(c.batch, c.data_rank, rng)) * to_eigen(random_view<double>(c.data_rank, c.in, rng));
    const Mat g = c.zero_row_sums ? softmax_ce_gradients(c.batch, c.out, rng) : Mat(to_eigen(random_view<double>(c.batch, c.out, rng)));
    Mat xa = Mat::Ones(c.batch, c.in + 1);
    xa.leftCols(c.in) = x;
    const Mat grad = g.transpose() * xa;  // the layer's gradient, out x (in + 1)
    V2<double> xv("x", c.batch, c.in), gv("g", c.batch, c.out), wv("w", c.out, c.in);
    V1<double> bv("b", c.out);
    for (int i = 0; i < c.batch; ++i) {
      for (int j = 0; j < c.in; ++j) xv(i, j) = x(i, j);
      for (int j = 0; j < c.out; ++j) gv(i, j) = g(i, j);
    }
    for (int i = 0; i < c.out; ++i) {
      for (int j = 0; j < c.in; ++j) wv(i, j) = grad(i, j);
      bv(i) = grad(i, c.in);
    }
    const bool kaldi_updates = ref.in.t == 0 || ref.in.updating();
    dep.schedule += pre.wants_observations("fc") != kaldi_updates;
    if (pre.wants_observations("fc")) {
      pre.observe_input("fc", xv);
      pre.observe_output_grad("fc", gv);
    }
    pre.set_gradient("fc", wv, bv);
    pre.step();
    const Mat want = ref.direction(xa, g);
    const Mat got = grad_with_bias(wv, bv);
    dep.direction = std::max(dep.direction, rel(got / got.norm(), want / want.norm()));
    dep.estimate = std::max({dep.estimate, estimate_error(blk.estimate(0), ref.in), estimate_error(blk.estimate(1), ref.out)});
  }
  if (after) after(blk, ref);
  return dep;
}

void check_follows_kaldi(const Departure& d, double tol) {
  CHECK(d.direction < tol);
  CHECK(d.estimate < tol);
  CHECK(d.schedule == 0);
}

const Case cases[] = {
    // batch > rank (three initialisation iterations), Kaldi's update_period 4 over the
    // first-11 schedule and beyond
    {12, 9, 5, 4, 4, 16, 30},
    // batch <= rank on the input side (one initialisation iteration), period 1
    {10, 7, 6, 3, 1, 5, 12},
    // a short history: eta = 1 - exp(-40/10) is capped at 0.9
    {8, 6, 3, 2, 2, 40, 16, 10.0},
    // inputs of rank 2 < rank 5: the relative floor of d binds
    {8, 5, 5, 2, 1, 12, 10, 2000, false, 2},
};

}  // namespace

TEST_CASE("NG-SGD's defaults give Kaldi's direction and estimates step by step", "[ngsgd][kaldi]") {
  for (const Case& c : cases) {
    const Departure d = run(c);
    INFO("case in " << c.in << " batch " << c.batch << ": direction " << d.direction << ", estimates " << d.estimate);
    check_follows_kaldi(d, 1e-9);
  }
}

// Each of the former choices, alone, departs from Kaldi in the case that exercises it (so the
// test above would see each of them).
TEST_CASE("NG-SGD: each former choice alone departs from Kaldi's code", "[ngsgd][kaldi][legacy]") {
  using T = std::function<kfac::NGSGD(kfac::NGSGD)>;
  const std::pair<const char*, T> former[] = {
      {"equal-entries start", [](kfac::NGSGD m) { return m.with_symmetry_breaker(1); }},
      {"steps 0, P, 2P", [](kfac::NGSGD m) { return m.with_initial_updates(0); }},
      {"three initialisation iterations", [](kfac::NGSGD m) { return m.with_init_iterations(3); }},
      {"no cap on eta", [](kfac::NGSGD m) { return m.with_eta_cap(1); }},
      {"d floored at epsilon", [](kfac::NGSGD m) { return m.with_relative_d_floor(false); }},
  };
  const int exercised[] = {0, 0, 1, 2, 3};  // the case of each
  for (int k = 0; k < 5; ++k) {
    const Departure d = run(cases[exercised[k]], former[k].second);
    INFO(former[k].first << ": direction " << d.direction << ", estimates " << d.estimate << ", schedule " << d.schedule);
    CHECK(std::max(d.direction, d.estimate) + d.schedule > 1e-6);
  }
  const Departure all = run(cases[0], [](kfac::NGSGD m) { return m.with_legacy_defaults(); });
  CHECK(all.schedule > 0);
  CHECK(all.direction > 1e-3);
}

TEST_CASE("NG-SGD: zero-row-sum output gradients keep the all-ones direction out of the estimate",
          "[ngsgd][kaldi][zero_row_sum]") {
  const int classes = 10;
  const Case c{12, classes, 6, 5, 1, 32, 300, 2000, true};
  const auto share_of_ones = [&](const NgLayer<kfac::Dense>& blk, const kaldi_ref::AffineComponent& ref) {
        Mat r;
        Vec d;
        double rho;
        read_estimate(blk.estimate(1), r, d, rho);
        const Vec ones = Vec::Ones(classes) / std::sqrt(double(classes));
        const double inside = (r * ones).squaredNorm();         // kfac: share of 1 in span(R^T)
        const double inside_ref = (ref.out.basis() * ones).squaredNorm();
        INFO("share of the all-ones direction in the output-side subspace: kfac " << inside << ", Kaldi " << inside_ref);
        CHECK(inside_ref < 1e-8);
        CHECK(inside < 1e-8);
      };
  check_follows_kaldi(run(c, {}, share_of_ones), 1e-7);
  // the equal-entries start keeps 1 in the subspace: a rank slot for a direction of no variance
  run(c, [](kfac::NGSGD m) { return m.with_symmetry_breaker(1); },
      [&](const NgLayer<kfac::Dense>& blk, const kaldi_ref::AffineComponent&) {
        Mat r;
        Vec d;
        double rho;
        read_estimate(blk.estimate(1), r, d, rho);
        CHECK((r * Vec::Ones(classes)).squaredNorm() / classes > 0.99);
      });
}

// The repair of a basis that lost its orthonormality: Cholesky when L^{-1} stays below 100,
// else Gram-Schmidt (Kaldi's ReorthogonalizeRt1), on kfac's OnlineFisher directly.
TEST_CASE("NG-SGD basis repair: Cholesky, and Gram-Schmidt when L^-1 reaches 100", "[ngsgd][kaldi][reorthogonalize]") {
  using Fisher = kfac::impl::ngsgd::OnlineFisher<double, Host>;
  const int rank = 3, dim = 7;
  Rng rng(6);
  const Mat base = to_eigen(random_view<double>(rank, dim, rng));
  auto repaired = [&](const Mat& start, int expect_kind) {
    Fisher f(dim, rank);
    f.allocate();
    auto h = Kokkos::create_mirror_view(f.basis());
    for (int i = 0; i < rank; ++i)
      for (int j = 0; j < dim; ++j) h(i, j) = start(i, j);
    Kokkos::deep_copy(f.basis(), h);
    CHECK(f.orthonormalize(Host()) == expect_kind);
    Mat r;
    Vec d;
    double rho;
    read_estimate(f, r, d, rho);
    CHECK(rel(r * r.transpose(), Mat::Identity(rank, rank)) < 1e-12);
    return r;
  };
  // mildly non-orthonormal rows: L^{-1} R with L L^T = R R^T
  Mat mild = kaldi_ref::OnlineNaturalGradient::gram_schmidt(base);
  mild.row(1) += 0.05 * mild.row(0);
  const Mat l = Eigen::LLT<Mat>(mild * mild.transpose()).matrixL();
  CHECK(rel(repaired(mild, 1), l.triangularView<Eigen::Lower>().solve(mild)) < 1e-12);
  // nearly dependent rows: L^{-1} has entries of ~1e6, so Gram-Schmidt
  Mat close = base;
  close.row(2) = base.row(1) + 1e-6 * base.row(0).reverse();
  CHECK(rel(repaired(close, 2), kaldi_ref::OnlineNaturalGradient::gram_schmidt(close)) < 1e-6);
  // already orthonormal to 1e-3: left alone
  const Mat ortho = kaldi_ref::OnlineNaturalGradient::gram_schmidt(base);
  CHECK(rel(repaired(ortho, 0), ortho) == 0);
}

TEST_CASE("NG-SGD updates on each of the first 11 steps, then every update_period", "[ngsgd][kaldi][schedule]") {
  for (long period : {1L, 3L, 4L}) {
    Pre pre(plain_options());
    pre.register_layer("fc", kfac::Dense(6, 4), kfac::NGSGD{}.with_update_period(period));
    Rng rng(2);
    kaldi_ref::OnlineNaturalGradient k;
    k.update_period = int(period);
    for (long step = 0; step < 40; ++step) {
      INFO("period " << period << " step " << step);
      const bool kaldi = k.t == 0 || k.updating();  // Kaldi's Updating(), t_ counting calls
      CHECK(pre.wants_observations("fc") == kaldi);
      CHECK(pre.wants_observations("fc") == (step <= 10 || (step - 10) % period == 0));
      ++k.t;
      DenseBatch b(6, 4, true, 8, rng);
      if (pre.wants_observations("fc")) b.feed(pre, "fc"); else pre.set_gradient("fc", b.w, b.b);
      pre.step();
    }
    CHECK(pre.layer_as<NgLayer<kfac::Dense>>("fc").updates() == 11 + 29 / period);
  }
}
