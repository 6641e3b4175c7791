#pragma once
// Independent dense references in double, with Eigen, for the tests.
#include <Eigen/Dense>
#include <Kokkos_Core.hpp>
#include <cstdint>
#include <vector>

namespace kfac_test {

using MatrixXd = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Deterministic uniform(-1, 1) numbers.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double uniform() {
    s_ ^= s_ << 13; s_ ^= s_ >> 7; s_ ^= s_ << 17;
    return double(s_ >> 11) / double(1ull << 53) * 2.0 - 1.0;
  }
 private:
  std::uint64_t s_;
};

template <class T>
Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace> random_view(int r, int c, Rng& rng,
                                                                     double scale = 1.0) {
  Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace> v("rand", r, c);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) v(i, j) = T(scale * rng.uniform());
  return v;
}
template <class T>
Kokkos::View<T*, Kokkos::LayoutRight, Kokkos::HostSpace> random_vector(int n, Rng& rng) {
  Kokkos::View<T*, Kokkos::LayoutRight, Kokkos::HostSpace> v("randv", n);
  for (int i = 0; i < n; ++i) v(i) = T(rng.uniform());
  return v;
}
template <class T>
Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::HostSpace> random_view4(int a, int b, int c, int d,
                                                                        Rng& rng) {
  Kokkos::View<T****, Kokkos::LayoutRight, Kokkos::HostSpace> v("rand4", a, b, c, d);
  for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = T(rng.uniform());
  return v;
}

template <class V>
MatrixXd to_eigen(const V& v) {
  MatrixXd m(v.extent(0), v.extent(1));
  for (int i = 0; i < int(v.extent(0)); ++i)
    for (int j = 0; j < int(v.extent(1)); ++j) m(i, j) = double(v(i, j));
  return m;
}

/// Kronecker product in double.
inline MatrixXd kron(const MatrixXd& a, const MatrixXd& b) {
  MatrixXd k(a.rows() * b.rows(), a.cols() * b.cols());
  for (int i = 0; i < a.rows(); ++i)
    for (int j = 0; j < a.cols(); ++j) k.block(i * b.rows(), j * b.cols(), b.rows(), b.cols()) = a(i, j) * b;
  return k;
}

/// mat((G kron A + damping I)^{-1} vec(X)), vec row-major, through the explicit dense matrix.
inline MatrixXd dense_kronecker_solve(const MatrixXd& a, const MatrixXd& g, const MatrixXd& x,
                                      double damping) {
  const MatrixXd k = kron(g, a) + damping * MatrixXd::Identity(g.rows() * a.rows(), g.rows() * a.rows());
  Eigen::VectorXd vx(x.size());
  for (int i = 0; i < x.rows(); ++i)
    for (int j = 0; j < x.cols(); ++j) vx(i * x.cols() + j) = x(i, j);
  const Eigen::VectorXd v = k.ldlt().solve(vx);
  MatrixXd out(x.rows(), x.cols());
  for (int i = 0; i < x.rows(); ++i)
    for (int j = 0; j < x.cols(); ++j) out(i, j) = v(i * x.cols() + j);
  return out;
}

inline double rel_err(const MatrixXd& a, const MatrixXd& b) { return (a - b).norm() / b.norm(); }

}  // namespace kfac_test
