// The opt-in adapters: views over raw pointers and Eigen storage without copies, the explicit
// copies for column-major Eigen matrices, Eigen maps over views, and a Preconditioner driven
// through them.
#include <kfac/adapters/eigen.hpp>
#include <kfac/adapters/raw.hpp>
#include <type_traits>
#include <vector>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

using RowMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

std::vector<double> iota(std::size_t n) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.5 * double(i) - 3.0;
  return v;
}

template <class V>
constexpr bool is_const_view = std::is_const<typename V::value_type>::value;

template <class V>
constexpr bool is_unmanaged_row_major_host =
    std::is_same<typename V::array_layout, Kokkos::LayoutRight>::value &&
    std::is_same<typename V::memory_space, Kokkos::HostSpace>::value && !V::traits::is_managed;

}  // namespace

TEST_CASE("from_raw views the memory without copying", "[adapters][raw]") {
  auto buf = iota(2 * 3 * 4 * 5);
  const auto v1 = kfac::adapters::from_raw(buf.data(), 7);
  const auto v2 = kfac::adapters::from_raw(buf.data(), 6, 20);
  const auto v4 = kfac::adapters::from_raw(buf.data(), 2, 3, 4, 5);
  static_assert(is_unmanaged_row_major_host<std::decay_t<decltype(v4)>>, "unmanaged LayoutRight HostSpace");
  static_assert(unsigned(std::decay_t<decltype(v1)>::rank) == 1 && unsigned(std::decay_t<decltype(v2)>::rank) == 2 &&
                    unsigned(std::decay_t<decltype(v4)>::rank) == 4,
                "ranks");
  CHECK(v1.data() == buf.data());
  CHECK(v2.data() == buf.data());
  CHECK(v4.data() == buf.data());
  CHECK(v1.extent(0) == 7);
  CHECK(v2.extent(0) == 6);
  CHECK(v2.extent(1) == 20);
  CHECK(v4.extent(3) == 5);
  CHECK(v1(6) == buf[6]);
  CHECK(v2(4, 13) == buf[4 * 20 + 13]);
  CHECK(v4(1, 2, 3, 4) == buf[((1 * 3 + 2) * 4 + 3) * 5 + 4]);
  v4(1, 0, 2, 1) = 42.0;  // writes land in the caller's memory
  CHECK(buf[((1 * 3 + 0) * 4 + 2) * 5 + 1] == 42.0);

  const std::vector<double>& cbuf = buf;
  const auto c2 = kfac::adapters::from_raw(cbuf.data(), 6, 20);
  static_assert(is_const_view<std::decay_t<decltype(c2)>>, "a const pointer gives a read-only view");
  CHECK(c2.data() == buf.data());
  const auto h2 = kfac::adapters::from_raw<Kokkos::HostSpace>(buf.data(), 3, 40);
  static_assert(std::is_same<typename std::decay_t<decltype(h2)>::memory_space, Kokkos::HostSpace>::value, "space");
  CHECK(h2(2, 39) == buf.back());

  double* null = nullptr;
  CHECK(kfac::adapters::from_raw(null, 0, 3).extent(1) == 3);
  expect_error([&] { kfac::adapters::from_raw(null, 2, 3); }, "", {"null pointer for 6 values"});
}

TEST_CASE("from_eigen views row-major storage without copying", "[adapters][eigen]") {
  RowMatrix m = RowMatrix::Random(4, 3);
  auto vm = kfac::adapters::from_eigen(m);
  static_assert(is_unmanaged_row_major_host<decltype(vm)>, "unmanaged LayoutRight HostSpace");
  CHECK(vm.data() == m.data());
  CHECK(vm.extent(0) == 4);
  CHECK(vm.extent(1) == 3);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) CHECK(vm(i, j) == m(i, j));
  vm(2, 1) = 7.0;
  CHECK(m(2, 1) == 7.0);

  const RowMatrix& cm = m;
  const auto vc = kfac::adapters::from_eigen(cm);
  static_assert(is_const_view<std::decay_t<decltype(vc)>>, "const matrix, const view");

  std::vector<double> buf = iota(12);
  const auto vmap = kfac::adapters::from_eigen(Eigen::Map<RowMatrix>(buf.data(), 3, 4));
  CHECK(vmap.data() == buf.data());
  CHECK(vmap(2, 3) == buf[11]);
  const auto vcmap = kfac::adapters::from_eigen(Eigen::Map<const RowMatrix>(buf.data(), 2, 6));
  static_assert(is_const_view<std::decay_t<decltype(vcmap)>>, "Map<const> gives a const view");
  CHECK(vcmap(1, 5) == buf[11]);

  Eigen::VectorXd v = Eigen::VectorXd::Random(5);
  const auto vv = kfac::adapters::from_eigen(v);
  static_assert(unsigned(std::decay_t<decltype(vv)>::rank) == 1, "vectors give rank 1");
  CHECK(vv.data() == v.data());
  CHECK(vv(4) == v(4));
  Eigen::RowVectorXd rv = Eigen::RowVectorXd::Random(3);
  CHECK(kfac::adapters::from_eigen(rv).data() == rv.data());

  Eigen::Array<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> arr(2, 2);
  arr << 1, 2, 3, 4;
  CHECK(kfac::adapters::from_eigen(arr)(1, 0) == 3.0);

  // Whole rows of a row-major matrix are contiguous; a column block is not.
  const auto rows = kfac::adapters::from_eigen(m.middleRows(1, 2));
  CHECK(rows.data() == m.data() + 3);
  CHECK(rows(1, 2) == m(2, 2));
  expect_error([&] { kfac::adapters::from_eigen(m.leftCols(2)); }, "", {"not contiguous"});
  Eigen::Map<Eigen::VectorXd, 0, Eigen::InnerStride<2>> strided(buf.data(), 6);
  expect_error([&] { kfac::adapters::from_eigen(strided); }, "", {"strided"});
}

TEST_CASE("column-major Eigen matrices go through explicit copies", "[adapters][eigen]") {
  Eigen::MatrixXd m = Eigen::MatrixXd::Random(3, 4);  // ColMajor
  auto v = kfac::adapters::to_row_major_view(m);
  static_assert(std::is_same<typename decltype(v)::array_layout, Kokkos::LayoutRight>::value, "row-major copy");
  CHECK(v.data() != m.data());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) CHECK(v(i, j) == m(i, j));
  v(1, 2) = 9.0;
  CHECK(m(1, 2) != 9.0);  // a copy
  kfac::adapters::copy_back(v, m);
  CHECK(m(1, 2) == 9.0);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) CHECK(m(i, j) == v(i, j));
  // Any expression can be copied; copies go back into blocks and vectors too.
  const auto t = kfac::adapters::to_row_major_view(m.transpose() * 2.0);
  CHECK(t.extent(0) == 4);
  CHECK(t(2, 1) == 2.0 * m(1, 2));
  Eigen::VectorXd vec(3);
  kfac::adapters::copy_back(kfac::adapters::from_raw(v.data(), 3), vec);
  CHECK(vec(2) == v(0, 2));
  kfac::adapters::copy_back(V2<double>("z", 2, 2), m.topLeftCorner(2, 2));
  CHECK(m(1, 1) == 0.0);
  expect_error([&] { kfac::adapters::copy_back(v, vec); }, "", {"shape (3, 4)", "shape (3, 1)"});
}

TEST_CASE("as_eigen maps a view without copying", "[adapters][eigen]") {
  Rng rng(2);
  const auto r = random_view<double>(3, 5, rng);
  auto mr = kfac::adapters::as_eigen(r);
  static_assert(int(decltype(mr)::IsRowMajor) == 1, "LayoutRight maps RowMajor");
  CHECK(mr.data() == r.data());
  CHECK(mr.rows() == 3);
  CHECK(mr.cols() == 5);
  CHECK(mr(2, 4) == r(2, 4));
  mr(0, 1) = 5.0;
  CHECK(r(0, 1) == 5.0);

  Kokkos::View<double**, Kokkos::LayoutLeft, Kokkos::HostSpace> l("l", 3, 2);
  l(2, 1) = 4.0;
  const auto ml = kfac::adapters::as_eigen(l);
  static_assert(int(std::decay_t<decltype(ml)>::IsRowMajor) == 0, "LayoutLeft maps ColMajor");
  CHECK(ml(2, 1) == 4.0);
  CHECK(ml.data() == l.data());

  const auto v = random_vector<double>(4, rng);
  CHECK(kfac::adapters::as_eigen(v).data() == v.data());
  CHECK(kfac::adapters::as_eigen(v)(3) == v(3));

  const auto w = random_view4<double>(2, 3, 2, 2, rng);  // (O, C, kh, kw)
  const auto mw = kfac::adapters::as_eigen(w);
  CHECK(mw.rows() == 2);
  CHECK(mw.cols() == 12);
  CHECK(mw(1, 2 * 4 + 1 * 2 + 0) == w(1, 2, 1, 0));

  Kokkos::View<const double**, Kokkos::LayoutRight, Kokkos::HostSpace> c = r;
  const auto mc = kfac::adapters::as_eigen(c);
  static_assert(std::is_const<std::remove_pointer_t<decltype(mc.data())>>::value, "const views map read-only");
  CHECK(mc(1, 1) == r(1, 1));
  expect_error([&] { kfac::adapters::as_eigen(Kokkos::subview(r, Kokkos::ALL, 1)); }, "", {"not contiguous"});
}

TEST_CASE("a Preconditioner driven through raw pointers equals one driven by views", "[adapters][raw]") {
  // Dense "fc" (5 -> 3, bias), Conv2d "conv" (2 -> 3, 3x3, padding 1, bias) on 4x4 images,
  // BatchNorm2d "bn" (3 channels) on (N, 3, 4, 4); two steps, KL clipping on.
  const auto options = kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-2).with_factor_decay(0.8).with_inv_update_steps(1);
  Pre by_view(options), by_raw(options);
  for (Pre* p : {&by_view, &by_raw}) {
    p->register_layer<kfac::Dense>("fc", kfac::Dense(5, 3));
    p->register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1));
    p->register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(3));
  }
  Rng rng(6);
  const int n = 4;
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s);
    // The views' data, copied into plain buffers the raw path owns.
    const auto fc_x = random_view<double>(n, 5, rng), fc_g = random_view<double>(n, 3, rng);
    const auto fc_w = random_view<double>(3, 5, rng);
    const auto fc_b = random_vector<double>(3, rng);
    const auto cx = random_view4<double>(n, 2, 4, 4, rng), cg = random_view4<double>(n, 3, 4, 4, rng);
    const auto cw = random_view4<double>(3, 2, 3, 3, rng);
    const auto cb = random_vector<double>(3, rng);
    const auto bx = random_view4<double>(n, 3, 4, 4, rng), bg = random_view4<double>(n, 3, 4, 4, rng);
    const auto dgamma = random_vector<double>(3, rng), dbeta = random_vector<double>(3, rng);
    auto buffer = [](const auto& v) { return std::vector<double>(v.data(), v.data() + v.span()); };
    const auto r_fc_x = buffer(fc_x), r_fc_g = buffer(fc_g), r_cx = buffer(cx), r_cg = buffer(cg),
               r_bx = buffer(bx), r_bg = buffer(bg);
    auto r_fc_w = buffer(fc_w), r_fc_b = buffer(fc_b), r_cw = buffer(cw), r_cb = buffer(cb),
         r_dgamma = buffer(dgamma), r_dbeta = buffer(dbeta);

    by_view.observe_input("fc", fc_x);
    by_view.observe_output_grad("fc", fc_g);
    by_view.set_gradient("fc", fc_w, fc_b);
    by_view.observe_input("conv", cx);
    by_view.observe_output_grad("conv", cg);
    by_view.set_gradient("conv", cw, cb);
    by_view.observe_input("bn", bx);
    by_view.observe_output_grad("bn", bg);
    by_view.set_gradient("bn", dgamma, dbeta);
    by_view.step();

    using kfac::adapters::from_raw;
    by_raw.observe_input("fc", from_raw(r_fc_x.data(), n, 5));
    by_raw.observe_output_grad("fc", from_raw(r_fc_g.data(), n, 3));
    by_raw.set_gradient("fc", from_raw(r_fc_w.data(), 3, 5), from_raw(r_fc_b.data(), 3));
    by_raw.observe_input("conv", from_raw(r_cx.data(), n, 2, 4, 4));
    by_raw.observe_output_grad("conv", from_raw(r_cg.data(), n, 3, 4, 4));
    by_raw.set_gradient("conv", from_raw(r_cw.data(), 3, 2, 3, 3), from_raw(r_cb.data(), 3));
    by_raw.observe_input("bn", from_raw(r_bx.data(), n, 3, 4, 4));
    by_raw.observe_output_grad("bn", from_raw(r_bg.data(), n, 3, 4, 4));
    by_raw.set_gradient("bn", from_raw(r_dgamma.data(), 3), from_raw(r_dbeta.data(), 3));
    by_raw.step();

    CHECK(r_fc_w == buffer(fc_w));
    CHECK(r_fc_b == buffer(fc_b));
    CHECK(r_cw == buffer(cw));
    CHECK(r_cb == buffer(cb));
    CHECK(r_dgamma == buffer(dgamma));
    CHECK(r_dbeta == buffer(dbeta));
    CHECK(by_raw.last_kl_scale() == by_view.last_kl_scale());
  }
}

TEST_CASE("a Preconditioner driven through Eigen objects equals one driven by views", "[adapters][eigen]") {
  // Dense "fc" (4 -> 3, bias) fed RowMajor matrices and a VectorXd bias without copies, and
  // Dense "cm" (3 -> 2, no bias) whose ColMajor weight gradient goes through copies.
  const auto options = kfac::Options{}.with_damping(1e-2).with_kl_clip(0.0);
  Pre by_view(options), by_eigen(options);
  for (Pre* p : {&by_view, &by_eigen}) {
    p->register_layer<kfac::Dense>("fc", kfac::Dense(4, 3));
    p->register_layer<kfac::Dense>("cm", kfac::Dense(3, 2, false));
  }
  Rng rng(8);
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s);
    DenseBatch fc(4, 3, true, 5, rng), cm(3, 2, false, 5, rng);
    RowMatrix x = to_eigen(fc.x), g = to_eigen(fc.g), w = to_eigen(fc.w);
    Eigen::VectorXd b(3);
    for (int i = 0; i < 3; ++i) b(i) = fc.b(i);
    const RowMatrix cm_x = to_eigen(cm.x), cm_g = to_eigen(cm.g);
    Eigen::MatrixXd cm_w = to_eigen(cm.w);  // column-major

    fc.feed(by_view, "fc");
    cm.feed(by_view, "cm");
    by_view.step();

    using kfac::adapters::from_eigen;
    by_eigen.observe_input("fc", from_eigen(x));
    by_eigen.observe_output_grad("fc", from_eigen(g));
    by_eigen.set_gradient("fc", from_eigen(w), from_eigen(b));
    by_eigen.observe_input("cm", from_eigen(cm_x));
    by_eigen.observe_output_grad("cm", from_eigen(cm_g));
    auto cm_w_rows = kfac::adapters::to_row_major_view(cm_w);
    by_eigen.set_gradient("cm", cm_w_rows);
    by_eigen.step();
    kfac::adapters::copy_back(cm_w_rows, cm_w);

    CHECK(w == to_eigen(fc.w));
    for (int i = 0; i < 3; ++i) CHECK(b(i) == fc.b(i));
    CHECK(cm_w == to_eigen(cm.w));
    CHECK(kfac::adapters::as_eigen(fc.w) == w);
  }
}

TEST_CASE("from_raw and from_eigen view (batch, tokens, features) without copying", "[dense][tokens][adapters]") {
  std::vector<double> raw(2 * 3 * 4, 1.0);
  const auto v = kfac::adapters::from_raw(raw.data(), 2, 3, 4);
  CHECK(v.extent(0) == 2);
  CHECK(v.extent(1) == 3);
  CHECK(v.data() == raw.data());
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m(6, 4);
  const auto e = kfac::adapters::from_eigen(m, 3);
  CHECK(e.extent(0) == 2);
  CHECK(e.extent(1) == 3);
  CHECK(e.extent(2) == 4);
  CHECK(e.data() == m.data());
  expect_error([&] { kfac::adapters::from_eigen(m, 4); }, "", {"4 tokens per sample do not divide", "(6, 4)"});
}
