// Conv2d (KFC) factors and preconditioned gradients against naive loops over patches and the
// dense Kronecker solve in double.
#include <cmath>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

struct Spec {
  int c, o, kh, kw, sh, sw, ph, pw, dh, dw;
  bool bias;
  int n, h, w;

  kfac::Conv2d layer() const {
    return kfac::Conv2d(c, o, kh, kw).with_stride(sh, sw).with_padding(ph, pw).with_dilation(dh, dw).with_bias(bias);
  }
  // PyTorch's output-size formula, evaluated in floating point with floor.
  int out_h() const { return int(std::floor(double(h + 2 * ph - dh * (kh - 1) - 1) / sh)) + 1; }
  int out_w() const { return int(std::floor(double(w + 2 * pw - dw * (kw - 1) - 1) / sw)) + 1; }
  int a_dim() const { return c * kh * kw + (bias ? 1 : 0); }
};

/// The patch a_{n,t} at output location (oy, ox): one entry per weight (c, i, j) in the
/// row-major order of the weight (C, kh, kw), zero where the tap falls into the padding.
std::vector<double> patch(const Spec& s, const V4<double>& x, int n, int oy, int ox, int* zeros) {
  std::vector<double> a;
  for (int ch = 0; ch < s.c; ++ch)
    for (int i = 0; i < s.kh; ++i)
      for (int j = 0; j < s.kw; ++j) {
        const int y = oy * s.sh - s.ph + i * s.dh, xx = ox * s.sw - s.pw + j * s.dw;
        const bool inside = y >= 0 && y < s.h && xx >= 0 && xx < s.w;
        if (!inside) ++*zeros;
        a.push_back(inside ? x(n, ch, y, xx) : 0.0);
      }
  if (s.bias) a.push_back(1.0);
  return a;
}

struct Naive {
  MatrixXd a, g;
  int padded_taps = 0;  // taps that fell into the padding
};

/// KFC's A = (1/N) sum_n sum_t a a^T and G = (1/(N T)) sum_n sum_t g g^T, g = scale * dy.
Naive naive_factors(const Spec& s, const V4<double>& x, const V4<double>& dy, double scale) {
  const int ho = s.out_h(), wo = s.out_w(), t = ho * wo;
  Naive r;
  r.a = MatrixXd::Zero(s.a_dim(), s.a_dim());
  r.g = MatrixXd::Zero(s.o, s.o);
  for (int n = 0; n < s.n; ++n)
    for (int oy = 0; oy < ho; ++oy)
      for (int ox = 0; ox < wo; ++ox) {
        const auto a = patch(s, x, n, oy, ox, &r.padded_taps);
        for (int i = 0; i < s.a_dim(); ++i)
          for (int j = 0; j < s.a_dim(); ++j) r.a(i, j) += a[i] * a[j];
        for (int i = 0; i < s.o; ++i)
          for (int j = 0; j < s.o; ++j)
            r.g(i, j) += scale * dy(n, i, oy, ox) * scale * dy(n, j, oy, ox);
      }
  r.a /= s.n;
  r.g /= double(s.n) * t;
  return r;
}

/// The convolution's weight and bias gradient, straight from y = conv(x, W) + b.
void conv_backward(const Spec& s, const V4<double>& x, const V4<double>& dy, const V4<double>& dw,
                   const V1<double>& db) {
  Kokkos::deep_copy(dw, 0.0);
  if (s.bias) Kokkos::deep_copy(db, 0.0);
  for (int n = 0; n < s.n; ++n)
    for (int o = 0; o < s.o; ++o)
      for (int oy = 0; oy < s.out_h(); ++oy)
        for (int ox = 0; ox < s.out_w(); ++ox) {
          if (s.bias) db(o) += dy(n, o, oy, ox);
          for (int ch = 0; ch < s.c; ++ch)
            for (int i = 0; i < s.kh; ++i)
              for (int j = 0; j < s.kw; ++j) {
                const int y = oy * s.sh - s.ph + i * s.dh, xx = ox * s.sw - s.pw + j * s.dw;
                if (y >= 0 && y < s.h && xx >= 0 && xx < s.w) dw(o, ch, i, j) += dy(n, o, oy, ox) * x(n, ch, y, xx);
              }
        }
}

struct Data {
  V4<double> x, dy, dw;
  V1<double> db;
};

Data make_data(const Spec& s, unsigned seed) {
  Rng rng(seed);
  Data d{random_view4<double>(s.n, s.c, s.h, s.w, rng), random_view4<double>(s.n, s.o, s.out_h(), s.out_w(), rng),
         V4<double>("dw", s.o, s.c, s.kh, s.kw), V1<double>("db", s.bias ? s.o : 0)};
  conv_backward(s, d.x, d.dy, d.dw, d.db);
  return d;
}

/// One K-FAC step on conv layer "c"; the gradient in `d` is preconditioned in place.
template <class Factor>
void run_step(Pre& pre, const Spec& s, Data& d) {
  pre.register_layer<kfac::Conv2d, Factor>("c", s.layer());
  pre.observe_input("c", d.x);
  pre.observe_output_grad("c", d.dy);
  pre.set_gradient("c", d.dw, d.db);
  pre.step();
}

const Spec kSpecs[] = {
    // c  o kh kw sh sw ph pw dh dw bias  n  h  w
    {2, 3, 3, 3, 1, 1, 1, 1, 1, 1, true, 2, 5, 4},   // "same" padding: every border patch has zeros
    {1, 2, 2, 3, 2, 1, 0, 1, 1, 2, false, 3, 6, 7},  // non-square kernel, stride, dilation, no bias
    {3, 2, 3, 2, 2, 2, 2, 0, 2, 1, true, 2, 7, 5},   // non-square, padding > 1 with dilation
    {2, 4, 1, 1, 2, 2, 0, 0, 1, 1, false, 2, 5, 5},  // 1x1 kernel, stride 2
    {2, 2, 3, 3, 3, 3, 1, 1, 1, 1, true, 2, 4, 4},   // stride equal to the kernel, padded
};

}  // namespace

TEST_CASE("the naive patches give the convolution's weight gradient", "[conv2d][reference]") {
  // Guards the reference itself: sum_t g_t a_t^T must be [dW | db] for the patch order used.
  for (const Spec& s : kSpecs) {
    Data d = make_data(s, 7);
    MatrixXd sum = MatrixXd::Zero(s.o, s.a_dim());
    int zeros = 0;
    for (int n = 0; n < s.n; ++n)
      for (int oy = 0; oy < s.out_h(); ++oy)
        for (int ox = 0; ox < s.out_w(); ++ox) {
          const auto a = patch(s, d.x, n, oy, ox, &zeros);
          for (int o = 0; o < s.o; ++o)
            for (int j = 0; j < s.a_dim(); ++j) sum(o, j) += d.dy(n, o, oy, ox) * a[j];
        }
    CHECK(rel_err(sum, grad_with_bias(d.dw, d.db)) < 1e-14);
  }
}

TEST_CASE("Conv2d factors equal the naive loop over patches", "[conv2d][factors]") {
  int case_index = 0;
  for (const Spec& s : kSpecs) {
    INFO("spec " << case_index++);
    Data d = make_data(s, 11 + case_index);
    const Naive ref = naive_factors(s, d.x, d.dy, 1.0);
    Pre pre(plain_options());
    run_step<kfac::Symmetric>(pre, s, d);
    const auto& layer = pre.layer_as<KLayer<kfac::Conv2d>>("c");
    REQUIRE(layer.factor_a().extent(0) == std::size_t(s.a_dim()));
    REQUIRE(layer.factor_g().extent(0) == std::size_t(s.o));
    CHECK(rel_err(symmetric_from_upper(layer.factor_a()), ref.a) < 1e-13);
    CHECK(rel_err(symmetric_from_upper(layer.factor_g()), ref.g) < 1e-13);
  }
  // The padded specs really exercise zero taps.
  Data d0 = make_data(kSpecs[0], 1);
  CHECK(naive_factors(kSpecs[0], d0.x, d0.dy, 1.0).padded_taps > 0);
}

TEST_CASE("Conv2d factors in closed form for a padded all-ones image", "[conv2d][factors]") {
  // One channel, 3x3 kernel, padding 1, 4x4 image of ones: tap (i, j) sees the image at
  // (4 - |i - 1|) (4 - |j - 1|) of the 16 locations, the bias at all 16; G of constant
  // output gradients 2 is 4.
  const Spec s{1, 1, 3, 3, 1, 1, 1, 1, 1, 1, true, 3, 4, 4};
  V4<double> x("x", s.n, 1, 4, 4), dy("dy", s.n, 1, 4, 4), dw("dw", 1, 1, 3, 3);
  V1<double> db("db", 1);
  Kokkos::deep_copy(x, 1.0);
  Kokkos::deep_copy(dy, 2.0);
  Pre pre(plain_options());
  pre.register_layer<kfac::Conv2d, kfac::Full>("c", s.layer());
  pre.observe_input("c", x);
  pre.observe_output_grad("c", dy);
  pre.set_gradient("c", dw, db);
  pre.step();
  const auto& layer = pre.layer_as<KLayer<kfac::Conv2d, kfac::Full>>("c");
  const auto a = layer.factor_a();
  for (int p = 0; p < 9; ++p) {
    const int i = p / 3, j = p % 3;
    const double seen = (4 - std::abs(i - 1)) * (4 - std::abs(j - 1));
    CHECK(a(p, p) == seen);
    CHECK(a(p, 9) == seen);
    CHECK(a(9, p) == seen);
  }
  // Tap (0,0) needs oy, ox >= 1 and tap (2,2) needs oy, ox <= 2: both at 2 * 2 locations.
  CHECK(a(0, 8) == 4.0);
  CHECK(a(9, 9) == 16.0);
  CHECK(layer.factor_g()(0, 0) == 4.0);
}

TEST_CASE("Conv2d with a mean-reduced loss scales output gradients by the batch", "[conv2d][factors]") {
  const Spec s = kSpecs[2];
  Data d = make_data(s, 3);
  const Naive ref = naive_factors(s, d.x, d.dy, double(s.n));
  Pre pre(plain_options().with_loss_reduction(kfac::LossReduction::mean));
  run_step<kfac::Symmetric>(pre, s, d);
  const auto& layer = pre.layer_as<KLayer<kfac::Conv2d>>("c");
  CHECK(rel_err(symmetric_from_upper(layer.factor_a()), ref.a) < 1e-13);
  CHECK(rel_err(symmetric_from_upper(layer.factor_g()), ref.g) < 1e-13);
}

TEST_CASE("Conv2d micro-batches in one step average like one batch", "[conv2d][factors]") {
  const Spec s = kSpecs[0];
  Data d = make_data(s, 5);
  const Naive ref = naive_factors(s, d.x, d.dy, 1.0);
  // Split sample 0 and sample 1 into separate observations.
  Pre pre(plain_options());
  pre.register_layer<kfac::Conv2d>("c", s.layer());
  for (int n = 0; n < s.n; ++n) {
    V4<double> x1("x1", 1, s.c, s.h, s.w), dy1("dy1", 1, s.o, s.out_h(), s.out_w());
    Kokkos::deep_copy(x1, Kokkos::subview(d.x, std::make_pair(n, n + 1), Kokkos::ALL, Kokkos::ALL, Kokkos::ALL));
    Kokkos::deep_copy(dy1, Kokkos::subview(d.dy, std::make_pair(n, n + 1), Kokkos::ALL, Kokkos::ALL, Kokkos::ALL));
    pre.observe_input("c", x1);
    pre.observe_output_grad("c", dy1);
  }
  pre.set_gradient("c", d.dw, d.db);
  pre.step();
  const auto& layer = pre.layer_as<KLayer<kfac::Conv2d>>("c");
  CHECK(rel_err(symmetric_from_upper(layer.factor_a()), ref.a) < 1e-13);
  CHECK(rel_err(symmetric_from_upper(layer.factor_g()), ref.g) < 1e-13);
}

TEST_CASE("preconditioned conv gradient equals the dense Kronecker solve", "[conv2d][precondition]") {
  const double damping = 3e-2;
  int case_index = 0;
  for (const Spec& s : kSpecs) {
    INFO("spec " << case_index++);
    Data d = make_data(s, 21 + case_index);
    const Naive ref = naive_factors(s, d.x, d.dy, 1.0);
    const MatrixXd expect = dense_kronecker_solve(ref.a, ref.g, grad_with_bias(d.dw, d.db), damping);
    Pre pre(plain_options(damping));
    run_step<kfac::Symmetric>(pre, s, d);  // d.dw (O, C, kh, kw) and d.db now preconditioned
    const MatrixXd got = grad_with_bias(d.dw, d.db);
    INFO("relative error " << rel_err(got, expect));
    CHECK(rel_err(got, expect) < 1e-10);
  }
}

TEST_CASE("Symmetric and Full conv factors agree bit for bit", "[conv2d][symmetric][full]") {
  for (const Spec& s : {kSpecs[0], kSpecs[2]}) {
    Data ds = make_data(s, 31), df = make_data(s, 31);
    Pre ps(plain_options()), pf(plain_options());
    run_step<kfac::Symmetric>(ps, s, ds);
    run_step<kfac::Full>(pf, s, df);
    const auto& ls = ps.layer_as<KLayer<kfac::Conv2d, kfac::Symmetric>>("c");
    const auto& lf = pf.layer_as<KLayer<kfac::Conv2d, kfac::Full>>("c");
    for (const auto& pair : {std::make_pair(ls.factor_a(), lf.factor_a()), std::make_pair(ls.factor_g(), lf.factor_g())}) {
      const auto& fs = pair.first;
      const auto& ff = pair.second;
      const int n = int(fs.extent(0));
      int upper_diff = 0, asymmetric = 0;
      for (int i = 0; i < n; ++i)
        for (int j = i; j < n; ++j) {
          upper_diff += fs(i, j) != ff(i, j);
          asymmetric += ff(j, i) != ff(i, j);
        }
      CHECK(upper_diff == 0);
      CHECK(asymmetric == 0);  // Full holds the whole matrix
    }
    CHECK(same_bits(ds.dw, df.dw));
    CHECK(same_bits(ds.db, df.db));
  }
}

TEST_CASE("Diagonal conv factors are the diagonals and precondition in closed form", "[conv2d][diagonal]") {
  const double damping = 5e-2;
  for (const Spec& s : {kSpecs[0], kSpecs[1]}) {
    Data d = make_data(s, 41);
    const Naive ref = naive_factors(s, d.x, d.dy, 1.0);
    const MatrixXd x = grad_with_bias(d.dw, d.db);
    Pre pre(plain_options(damping));
    run_step<kfac::Diagonal>(pre, s, d);
    const auto& layer = pre.layer_as<KLayer<kfac::Conv2d, kfac::Diagonal>>("c");
    const auto a = layer.factor_a();
    const auto g = layer.factor_g();
    REQUIRE(a.extent(0) == std::size_t(s.a_dim()));
    REQUIRE(a.extent(1) == 1);
    REQUIRE(g.extent(0) == std::size_t(s.o));
    REQUIRE(g.extent(1) == 1);
    for (int j = 0; j < s.a_dim(); ++j) CHECK(a(j, 0) == Approx(ref.a(j, j)).epsilon(1e-13));
    for (int i = 0; i < s.o; ++i) CHECK(g(i, 0) == Approx(ref.g(i, i)).epsilon(1e-13));
    MatrixXd expect(x.rows(), x.cols());
    for (int i = 0; i < x.rows(); ++i)
      for (int j = 0; j < x.cols(); ++j) expect(i, j) = x(i, j) / (ref.g(i, i) * ref.a(j, j) + damping);
    CHECK(rel_err(grad_with_bias(d.dw, d.db), expect) < 1e-13);
  }
}

TEST_CASE("kfac-pytorch's conventions: its conv scaling, factors from the identity, damping on each factor",
          "[conv2d][factors][kfac_pytorch]") {
  // kfac-pytorch divides every row (patch with its bias 1, output gradient) by T and each Gram
  // sum by its N T rows: A = A_KFC / T^3, G = G_KFC / T^2. Its running averages start at I, and
  // INVERSE inverts F + damping I for each factor.
  const Spec s = kSpecs[0];
  const int t = s.out_h() * s.out_w();
  const double decay = 0.5, damping = 3e-2;
  using Chol = kfac::Cholesky<>;
  using Method = kfac::KFAC<kfac::Symmetric, Chol, kfac::DoublePrecision>;
  Pre pre(plain_options(damping).with_factor_decay(decay).with_inv_update_steps(1L).with_initial_factors(
      kfac::InitialFactors::identity));
  pre.register_layer("c", s.layer().with_factor_scaling(kfac::Conv2d::FactorScaling::kfac_pytorch),
                     Method{Chol{}.with_pi_damping(false).with_damping_on_each_factor(true)});
  MatrixXd a = MatrixXd::Identity(s.a_dim(), s.a_dim()), g = MatrixXd::Identity(s.o, s.o);
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    Data d = make_data(s, 41 + step);
    const Naive kfc = naive_factors(s, d.x, d.dy, 1.0);
    a = decay * a + (1 - decay) * kfc.a / (double(t) * t * t);
    g = decay * g + (1 - decay) * kfc.g / (double(t) * t);
    const MatrixXd ia = MatrixXd::Identity(s.a_dim(), s.a_dim()), ig = MatrixXd::Identity(s.o, s.o);
    const MatrixXd expect = (g + damping * ig).inverse() * grad_with_bias(d.dw, d.db) * (a + damping * ia).inverse();
    pre.observe_input("c", d.x);
    pre.observe_output_grad("c", d.dy);
    pre.set_gradient("c", d.dw, d.db);
    pre.step();
    const auto& layer = pre.layer_as<KLayer<kfac::Conv2d, kfac::Symmetric, Chol>>("c");
    CHECK(rel_err(symmetric_from_upper(layer.factor_a()), a) < 1e-13);
    CHECK(rel_err(symmetric_from_upper(layer.factor_g()), g) < 1e-13);
    CHECK(rel_err(grad_with_bias(d.dw, d.db), expect) < 1e-10);
  }
  CHECK(s.layer().with_factor_scaling(kfac::Conv2d::FactorScaling::kfac_pytorch).describe() ==
        s.layer().describe().substr(0, s.layer().describe().size() - 1) + ",scaling=kfac_pytorch)");
  CHECK(Chol{}.with_damping_on_each_factor(true).settings() == "pi,each");
  // Decay 1 keeps factors that start at I there (kfac-pytorch allows it); from the batch it is refused.
  Pre frozen(plain_options().with_factor_decay(1.0).with_initial_factors(kfac::InitialFactors::identity));
  frozen.register_layer<kfac::Conv2d, kfac::Symmetric>("c", s.layer());
  Data d = make_data(s, 45);
  frozen.observe_input("c", d.x);
  frozen.observe_output_grad("c", d.dy);
  frozen.set_gradient("c", d.dw, d.db);
  frozen.step();
  const auto& kept = frozen.layer_as<KLayer<kfac::Conv2d>>("c");
  CHECK(symmetric_from_upper(kept.factor_a()) == MatrixXd::Identity(s.a_dim(), s.a_dim()));
  CHECK_THROWS_WITH(Pre(plain_options().with_factor_decay(1.0)),
                    Catch::Contains("factor_decay = 1.000000 at step 0: expected a value in [0, 1)"));
}
