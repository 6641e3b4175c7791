// The linear-algebra entries of linalg/: the team-parallel portable Cholesky inverse bit
// for bit against the former one-thread algorithm (written out below as host loops) and within
// 1e-12 of a dense double inverse (Eigen); the default execution space against Kokkos::Serial;
// LAPACK against portable; shape checks at every entry, leaving the outputs unchanged; the
// workspace kept between calls; and a vendor path added from this file alone (a toy eigh for
// Kokkos::Serial in float), which the entry takes under AutoBackend and not under PortableBackend.
#include <Eigen/Dense>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <kfac/linalg/linalg.hpp>
#include <string>
#include <vector>

#include "reference.hpp"

using namespace kfac_test;
using kfac::impl::Matrix;
using kfac::impl::SolverWorkspace;
using Serial = Kokkos::Serial;
using Exec = Kokkos::DefaultExecutionSpace;

#if defined(KOKKOS_ENABLE_SERIAL)
// A vendor path from outside include/: what a new backend's folder does, here for eigh on
// Kokkos::Serial in float (an explicit specialization, chosen over LAPACK's partial one). It
// reads only the upper triangle of q, as op::Eigh's contract says, solves in double with Eigen
// and counts its calls.
namespace toy_vendor {
int calls = 0;
}
namespace kfac {
namespace impl {
template <>
struct Vendor<op::Eigh, Kokkos::Serial, float> {
  static constexpr bool available = true;
  static void run(const Kokkos::Serial& exec, const Matrix<float, Kokkos::Serial>& q,
                  const Vector<float, Kokkos::Serial>& w, SolverWorkspace<float, Kokkos::Serial>&) {
    exec.fence();
    ++toy_vendor::calls;
    const int n = int(q.extent(0));
    Eigen::MatrixXd upper(n, n);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i <= j; ++i) upper(i, j) = upper(j, i) = double(q(i, j));
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(upper);  // ascending, as LAPACK
    for (int j = 0; j < n; ++j) {
      w(j) = float(solver.eigenvalues()(j));
      for (int i = 0; i < n; ++i) q(i, j) = float(solver.eigenvectors()(i, j));
    }
  }
};
}  // namespace impl
}  // namespace kfac
#endif

namespace {

/// A symmetric positive definite n x n matrix B B^T / n + 0.1 I, in double on the host.
MatrixXd spd(int n, Rng& rng) {
  MatrixXd b(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) b(i, j) = rng.uniform();
  MatrixXd a = b * b.transpose() / double(n);
  for (int i = 0; i < n; ++i) a(i, i) += 0.1;
  return a;
}

/// `a` in Exec's memory, LayoutLeft.
template <class T, class E>
Matrix<T, E> to_view(const MatrixXd& a) {
  Matrix<T, E> v("a", a.rows(), a.cols());
  auto h = Kokkos::create_mirror_view(v);
  for (int i = 0; i < int(a.rows()); ++i)
    for (int j = 0; j < int(a.cols()); ++j) h(i, j) = T(a(i, j));
  Kokkos::deep_copy(v, h);
  return v;
}

template <class V>
std::vector<typename V::non_const_value_type> host_values(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, v);
  return std::vector<typename V::non_const_value_type>(h.data(), h.data() + h.span());
}

/// The portable inverse as kfac computed it before the team-parallel Cholesky: the factor on
/// one thread, column by column, then one forward and one backward solve per column of the
/// inverse. Column-major result, in T.
template <class T>
std::vector<T> previous_portable_inverse(const MatrixXd& a, T shift) {
  const int n = int(a.rows());
  std::vector<T> l(std::size_t(n) * n), inv(std::size_t(n) * n);
  auto L = [&](int i, int j) -> T& { return l[std::size_t(j) * n + i]; };
  auto I = [&](int i, int j) -> T& { return inv[std::size_t(j) * n + i]; };
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < n; ++i) L(i, j) = T(i <= j ? a(i, j) : a(j, i)) + (i == j ? shift : T(0));
  for (int j = 0; j < n; ++j) {
    T d = L(j, j);
    for (int k = 0; k < j; ++k) d -= L(j, k) * L(j, k);
    REQUIRE(d > T(0));
    d = std::sqrt(d);
    L(j, j) = d;
    for (int i = j + 1; i < n; ++i) {
      T s = L(i, j);
      for (int k = 0; k < j; ++k) s -= L(i, k) * L(j, k);
      L(i, j) = s / d;
    }
  }
  for (int c = 0; c < n; ++c) {
    for (int i = 0; i < n; ++i) {
      T s = T(i == c);
      for (int k = 0; k < i; ++k) s -= L(i, k) * I(k, c);
      I(i, c) = s / L(i, i);
    }
    for (int i = n - 1; i >= 0; --i) {
      T s = I(i, c);
      for (int k = i + 1; k < n; ++k) s -= L(k, i) * I(k, c);
      I(i, c) = s / L(i, i);
    }
  }
  return inv;
}

template <class T>
double rel_err_to(const std::vector<T>& got, const MatrixXd& want) {
  const int n = int(want.rows());
  double num = 0, den = 0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < n; ++i) {
      const double d = double(got[std::size_t(j) * n + i]) - want(i, j);
      num += d * d;
      den += want(i, j) * want(i, j);
    }
  return std::sqrt(num / den);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Runs `f` and returns the kfac::Error's message ("" when nothing was thrown).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const kfac::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEMPLATE_TEST_CASE("portable spd_inverse: team-parallel Cholesky equals the former one-thread result bit for bit",
                   "[linalg][cholesky]", double, float) {
  using T = TestType;
  for (int n : {1, 2, 7, 33, 96}) {
    INFO("n = " << n);
    Rng rng(7 + n);
    const MatrixXd a = spd(n, rng);
    const T shift = T(0.25);
    MatrixXd shifted = a;
    for (int i = 0; i < n; ++i) shifted(i, i) += double(shift);
    const MatrixXd dense_inv = shifted.inverse();
    const auto previous = previous_portable_inverse<T>(a, shift);

    auto f = to_view<T, Serial>(a);
    Matrix<T, Serial> inv("inv", n, n);
    kfac::impl::spd_inverse<kfac::PortableBackend>(Serial{}, f, shift, inv);
    const auto now = host_values(inv);
    CHECK(same_bits(now, previous));
    CHECK(rel_err_to(now, dense_inv) < (sizeof(T) == 8 ? 1e-12 : 1e-4));

    // Kokkos::DefaultExecutionSpace (OpenMP: teams of several threads; CUDA: a block): each
    // entry is summed in the same order, so a host backend gives the same bits. nvcc may fuse
    // multiply-adds, so on a device the result is compared within a tolerance.
    auto fd = to_view<T, Exec>(a);
    Matrix<T, Exec> invd("invd", n, n);
    kfac::impl::spd_inverse<kfac::PortableBackend>(Exec{}, fd, shift, invd);
    const auto on_default = host_values(invd);
    if (kfac::impl::host_accessible_v<Exec>)
      CHECK(same_bits(on_default, previous));
    else
      CHECK(rel_err_to(on_default, dense_inv) < (sizeof(T) == 8 ? 1e-12 : 1e-4));

    // The factor alone at several team sizes: the same bits as at one thread (each entry is
    // summed by one thread in a fixed order, whatever the team size, on every backend).
    Matrix<T, Exec> l1("l1", n, n), lt("lt", n, n);
    Kokkos::deep_copy(invd, fd);
    REQUIRE(kfac::impl::cholesky_lower(Exec{}, invd, l1, 1) == 0);
    const int most = std::min(int(Exec().concurrency()), 4);
    for (int team = 2; team <= most; ++team) {
      INFO("team size " << team);
      REQUIRE(kfac::impl::cholesky_lower(Exec{}, invd, lt, team) == 0);
      CHECK(same_bits(host_values(lt), host_values(l1)));
    }

    // AutoBackend (LAPACK on the host, cuSOLVER on CUDA) agrees with the portable inverse.
    Matrix<T, Exec> inva("inva", n, n);
    kfac::impl::spd_inverse<kfac::AutoBackend>(Exec{}, fd, shift, inva);
    CHECK(rel_err_to(host_values(inva), dense_inv) < (sizeof(T) == 8 ? 1e-12 : 1e-4));
  }
}

TEST_CASE("portable spd_inverse reports the column where the matrix stops being positive definite",
          "[linalg][cholesky][errors]") {
  // diag(1, 1, -1, 1): the third pivot is negative
  MatrixXd a = MatrixXd::Identity(4, 4);
  a(2, 2) = -1;
  auto f = to_view<double, Exec>(a);
  Matrix<double, Exec> inv("inv", 4, 4);
  const std::string portable =
      error_of([&] { kfac::impl::spd_inverse<kfac::PortableBackend>(Exec{}, f, 0.0, inv); });
  CHECK(portable.find("broke down at column 3") != std::string::npos);
  const std::string vendor = error_of([&] { kfac::impl::spd_inverse<kfac::AutoBackend>(Exec{}, f, 0.0, inv); });
  CHECK(vendor.find("broke down at column 3") != std::string::npos);
}

TEST_CASE("the workspace is kept between decompositions of the same size", "[linalg][workspace]") {
  Rng rng(3);
  const MatrixXd a = spd(12, rng), b = spd(12, rng), c = spd(5, rng);
  SolverWorkspace<double, Exec> ws;
  Matrix<double, Exec> inv("inv", 12, 12), q("q", 12, 12);
  kfac::impl::Vector<double, Exec> w("w", 12);
  kfac::impl::spd_inverse<kfac::PortableBackend>(Exec{}, to_view<double, Exec>(a), 0.5, inv, ws);
  const double* scratch = ws.scratch.data();
  REQUIRE(scratch != nullptr);
  kfac::impl::spd_inverse<kfac::PortableBackend>(Exec{}, to_view<double, Exec>(b), 0.5, inv, ws);
  CHECK(ws.scratch.data() == scratch);
  kfac::impl::eigh<kfac::PortableBackend>(Exec{}, to_view<double, Exec>(b), q, w, ws);
  CHECK(ws.scratch.data() == scratch);
  // the second inverse is b's, not a's: the kept scratch held nothing over
  MatrixXd bs = b;
  for (int i = 0; i < 12; ++i) bs(i, i) += 0.5;
  CHECK(rel_err_to(host_values(inv), MatrixXd(bs.inverse())) < 1e-12);
  Matrix<double, Exec> inv5("inv5", 5, 5);
  kfac::impl::spd_inverse<kfac::PortableBackend>(Exec{}, to_view<double, Exec>(c), 0.5, inv5, ws);
  CHECK(ws.scratch.extent(0) == 5);
}

TEST_CASE("linear-algebra entries check shapes and leave their outputs unchanged", "[linalg][errors]") {
  Matrix<double, Exec> sq("sq", 4, 4), wide("wide", 4, 5), out("out", 4, 4), out3("out3", 3, 3);
  Kokkos::deep_copy(sq, 1.0);
  Kokkos::deep_copy(out, 7.0);
  Kokkos::deep_copy(out3, 7.0);
  kfac::impl::Vector<double, Exec> w3("w3", 3);
  Kokkos::deep_copy(w3, 7.0);
  auto unchanged = [](const auto& v) {
    for (double x : host_values(v))
      if (x != 7.0) return false;
    return true;
  };
  auto expect = [](const std::string& msg, const char* entry) {
    INFO(msg);
    CHECK(msg.find(std::string("linalg::") + entry) != std::string::npos);
  };
  using kfac::AutoBackend;
  using kfac::PortableBackend;
  expect(error_of([&] { kfac::impl::spd_inverse<PortableBackend>(Exec{}, wide, 0.1, out); }), "spd_inverse");
  expect(error_of([&] { kfac::impl::spd_inverse<AutoBackend>(Exec{}, sq, 0.1, out3); }), "spd_inverse");
  CHECK(unchanged(out));
  CHECK(unchanged(out3));
  expect(error_of([&] { kfac::impl::eigh<AutoBackend>(Exec{}, wide, out, w3); }), "eigh");
  expect(error_of([&] { kfac::impl::eigh<PortableBackend>(Exec{}, sq, out, w3); }), "eigh");  // w too short
  CHECK(unchanged(out));
  CHECK(unchanged(w3));
  expect(error_of([&] { kfac::impl::newton_schulz_inverse(Exec{}, sq, 0.1, out3); }), "newton_schulz_inverse");
  CHECK(unchanged(out3));
  expect(error_of([&] { kfac::impl::gemm(Exec{}, "N", "N", 1.0, wide, wide, 0.0, out); }), "gemm");  // 4x5 * 4x5
  expect(error_of([&] { kfac::impl::gemm(Exec{}, "N", "T", 1.0, wide, wide, 0.0, out3); }), "gemm");  // C 3x3
  CHECK(unchanged(out));
  CHECK(unchanged(out3));
  expect(error_of([&] { kfac::impl::syrk_t_upper(Exec{}, 1.0, wide, 0.0, out); }), "syrk");  // R 4x5: C 5x5
  CHECK(unchanged(out));
  // the shapes that fit pass: 4x5 * (4x5)^T is 4x4
  CHECK(error_of([&] { kfac::impl::gemm(Exec{}, "N", "T", 1.0, wide, wide, 0.0, out); }).empty());
  CHECK(host_values(out)[0] == 0.0);  // wide is zero
}

#if defined(KOKKOS_ENABLE_SERIAL)
TEST_CASE("a vendor path added outside include/ serves eigh under AutoBackend only", "[linalg][vendor]") {
  static_assert(kfac::impl::vendor_path_v<kfac::impl::op::Eigh, Serial, float>, "the toy vendor is visible");
  static_assert(!kfac::impl::vendor_path_v<kfac::impl::op::Eigh, Serial, float, kfac::PortableBackend>,
                "PortableBackend never takes a vendor path");
  Rng rng(5);
  const int n = 9;
  const MatrixXd a = spd(n, rng);
  // The lower triangle is NaN: the entry hands the vendor the upper triangle only.
  MatrixXd poisoned = a;
  for (int j = 0; j < n; ++j)
    for (int i = j + 1; i < n; ++i) poisoned(i, j) = std::numeric_limits<double>::quiet_NaN();
  const Matrix<float, Serial> f = to_view<float, Serial>(poisoned);
  Matrix<float, Serial> q("q", n, n), qp("qp", n, n);
  kfac::impl::Vector<float, Serial> w("w", n), wp("wp", n);
  toy_vendor::calls = 0;
  kfac::impl::eigh<kfac::AutoBackend>(Serial{}, f, q, w);
  CHECK(toy_vendor::calls == 1);
  kfac::impl::eigh<kfac::PortableBackend>(Serial{}, f, qp, wp);
  CHECK(toy_vendor::calls == 1);
  // Both decompose a: Q diag(w) Q^T within float round-off of it, eigenvalues ascending and equal.
  const Eigen::SelfAdjointEigenSolver<MatrixXd> reference(a);
  for (const auto* pair : {&q, &qp}) {
    const auto& qv = *pair;
    const auto& wv = pair == &q ? w : wp;
    MatrixXd qd(n, n), rebuilt;
    Eigen::VectorXd wd(n);
    for (int j = 0; j < n; ++j) {
      wd(j) = double(wv(j));
      for (int i = 0; i < n; ++i) qd(i, j) = double(qv(i, j));
    }
    rebuilt = qd * wd.asDiagonal() * qd.transpose();
    CHECK((rebuilt - a).norm() / a.norm() < 1e-5);
    CHECK((wd - reference.eigenvalues()).cwiseAbs().maxCoeff() / reference.eigenvalues().maxCoeff() < 1e-5);
  }
}
#endif
