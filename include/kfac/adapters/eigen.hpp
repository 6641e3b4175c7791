#pragma once
/// \file eigen.hpp
/// \brief Opt-in adapter between Eigen objects and kfac's Kokkos views (host memory).
///
/// kfac reads observations and writes preconditioned gradients as row-major (LayoutRight)
/// views. Row-major Eigen storage is exactly that, so:
/// - `from_eigen(m)` views a RowMajor `Eigen::Matrix`/`Array`, a `Map` or `Ref` over row-major
///   memory, or any Eigen vector, **without copying**; writes through the view (set_gradient)
///   land in the Eigen object.
/// - A ColMajor matrix (Eigen's default) holds the transpose in that order, so viewing it
///   would silently mean the wrong thing; `from_eigen` refuses it at compile time.
///   `to_row_major_view(m)` makes a row-major **copy** (any Eigen expression), and
///   `copy_back(view, m)` writes a preconditioned copy back into the ColMajor matrix.
/// - `as_eigen(view)` is an `Eigen::Map` over a contiguous host view, without copying.
///
/// - `from_eigen(m, tokens)` views a (batch x tokens, features) row-major matrix as the
///   (batch, tokens, features) observation of a Dense layer over sequences.
///
/// \code
/// using RowMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// RowMatrix x(batch, in), dw(out, in);
/// Eigen::VectorXd db(out);
/// pre.observe_input("fc", kfac::adapters::from_eigen(x));
/// pre.set_gradient("fc", kfac::adapters::from_eigen(dw), kfac::adapters::from_eigen(db));
/// pre.step();  // dw and db now hold the preconditioned gradient
///
/// Eigen::MatrixXd cm(out, in);                      // column-major
/// auto tmp = kfac::adapters::to_row_major_view(cm); // copy
/// pre.set_gradient("fc2", tmp);
/// pre.step();
/// kfac::adapters::copy_back(tmp, cm);               // copy
/// \endcode

#include <Eigen/Core>
#include <Kokkos_Core.hpp>
#include <string>
#include <type_traits>
#include <utility>

#include "kfac/adapters/raw.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {
template <class T>
struct dependent_false : std::false_type {};

inline std::string eigen_shape(long rows, long cols) {
  return "(" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
}
}  // namespace impl

namespace adapters {

/// \brief A view over the storage of an Eigen object, without copying.
///
/// Vectors (compile-time one row or one column) give a rank-1 view, matrices a rank-2
/// row-major view. The view is const when the object is (a const reference, a
/// `Map<const ...>`), and it is valid as long as the object's storage is.
/// \param m [in] a RowMajor matrix or array, a Map/Ref/Block over row-major storage, or a
///        vector; contiguous (throws kfac::Error for a row-major block narrower than its
///        matrix or a strided Map).
template <class E>
auto from_eigen(E&& m) {
  using D = std::remove_cv_t<std::remove_reference_t<E>>;
  static_assert(std::is_base_of<Eigen::DenseBase<D>, D>::value,
                "kfac::adapters::from_eigen: expected an Eigen matrix, array, Map, Ref or Block");
  static_assert(bool(D::Flags & Eigen::DirectAccessBit),
                "kfac::adapters::from_eigen: this Eigen expression has no storage to view; "
                "evaluate it into a RowMajor matrix first");
  static_assert(!std::is_rvalue_reference<E&&>::value ||
                    !std::is_base_of<Eigen::PlainObjectBase<D>, D>::value,
                "kfac::adapters::from_eigen: the view would outlive this temporary matrix");
  static_assert(bool(D::IsVectorAtCompileTime) || bool(D::IsRowMajor),
                "kfac::adapters::from_eigen: a column-major matrix stores its transpose in "
                "row-major order; use to_row_major_view (a copy) and copy_back");
  using T = std::remove_pointer_t<decltype(m.data())>;  // const for read-only objects
  if constexpr (bool(D::IsVectorAtCompileTime)) {
    if (m.innerStride() != 1)
      throw Error("", "adapters::from_eigen: the vector is strided (inner stride " +
                          std::to_string(long(m.innerStride())) + "); kfac needs contiguous memory");
    return unmanaged_view<T*>(m.data(), std::size_t(m.size()));
  } else {
    if (m.innerStride() != 1 || (m.rows() > 1 && m.outerStride() != m.cols()))
      throw Error("", "adapters::from_eigen: the " + impl::eigen_shape(long(m.rows()), long(m.cols())) +
                          " matrix is not contiguous (row stride " + std::to_string(long(m.outerStride())) +
                          "); copy it with to_row_major_view");
    return unmanaged_view<T**>(m.data(), std::size_t(m.rows()), std::size_t(m.cols()));
  }
}

/// \brief A (batch x tokens, features) row-major matrix, rows grouped by sample, as the
/// (batch, tokens, features) view a Dense layer over sequences observes, without copying.
/// \param m [in] as for from_eigen(m), a matrix
/// \param tokens [in] tokens per sample, >= 1, dividing m.rows() (throws kfac::Error otherwise)
template <class E>
auto from_eigen(E&& m, long tokens) {
  auto v = from_eigen(std::forward<E>(m));
  static_assert(decltype(v)::rank == 2, "kfac::adapters::from_eigen(m, tokens): expected a matrix, not a vector");
  if (tokens < 1 || long(v.extent(0)) % tokens != 0)
    throw Error("", "adapters::from_eigen: " + std::to_string(tokens) + " tokens per sample do not divide the " +
                        impl::eigen_shape(long(v.extent(0)), long(v.extent(1))) + " matrix's rows");
  using T = typename decltype(v)::value_type;
  return unmanaged_view<T***>(v.data(), std::size_t(long(v.extent(0)) / tokens), std::size_t(tokens), v.extent(1));
}

/// \brief A row-major **copy** of any Eigen matrix expression, e.g. a ColMajor matrix, as a
/// managed host view. Hand it to kfac, then copy_back() when kfac wrote into it.
template <class D>
Kokkos::View<typename D::Scalar**, Kokkos::LayoutRight, Kokkos::HostSpace> to_row_major_view(
    const Eigen::DenseBase<D>& m) {
  Kokkos::View<typename D::Scalar**, Kokkos::LayoutRight, Kokkos::HostSpace> v(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "kfac::adapters::row_major_copy"),
      std::size_t(m.rows()), std::size_t(m.cols()));
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j) v(i, j) = m.derived().coeff(i, j);
  return v;
}

/// \brief Copies a host view back into an Eigen object of the same shape (**a copy**):
/// rank 2 into a matrix, rank 1 into a vector. Throws kfac::Error on a shape mismatch.
/// \param v [in] a host-accessible rank-1 or rank-2 view
/// \param m [out] a matrix, or a writable Map/Block (may be a temporary expression).
template <class V, class E>
void copy_back(const V& v, E&& m) {
  static_assert(Kokkos::is_view<V>::value, "kfac::adapters::copy_back: expected a Kokkos view");
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename V::memory_space>::accessible,
                "kfac::adapters::copy_back: the view must be host-accessible");
  static_assert(unsigned(V::rank) == 1 || unsigned(V::rank) == 2,
                "kfac::adapters::copy_back: expected a rank-1 or rank-2 view");
  const long rows = long(v.extent(0)), cols = unsigned(V::rank) == 2 ? long(v.extent(1)) : 1;
  if (long(m.rows()) != rows || long(m.cols()) != cols)
    throw Error("", "adapters::copy_back: view of shape " + impl::eigen_shape(rows, cols) +
                        " into an Eigen object of shape " +
                        impl::eigen_shape(long(m.rows()), long(m.cols())));
  for (long i = 0; i < rows; ++i)
    for (long j = 0; j < cols; ++j) {
      if constexpr (unsigned(V::rank) == 2)
        m(i, j) = v(i, j);
      else
        m(i, j) = v(i);
    }
}

/// \brief An `Eigen::Map` over a contiguous host view, without copying: rank 1 as a column
/// vector, rank 2 RowMajor for LayoutRight and ColMajor for LayoutLeft, rank 4 LayoutRight
/// (e.g. a Conv2d weight gradient (O, C, kh, kw)) as the RowMajor (O, C kh kw) matrix.
/// Const views give read-only maps. Throws kfac::Error for a non-contiguous view.
template <class V>
auto as_eigen(const V& v) {
  static_assert(Kokkos::is_view<V>::value, "kfac::adapters::as_eigen: expected a Kokkos view");
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename V::memory_space>::accessible,
                "kfac::adapters::as_eigen: Eigen maps host memory; the view must be host-accessible");
  using T = typename V::value_type;
  using S = typename V::non_const_value_type;
  using Layout = typename V::array_layout;
  constexpr unsigned rank = unsigned(V::rank);
  if (!v.span_is_contiguous())
    throw Error("", "adapters::as_eigen: the view '" + std::string(v.label()) + "' is not contiguous");
  if constexpr (rank == 1) {
    using M = std::conditional_t<std::is_const<T>::value, const Eigen::Matrix<S, Eigen::Dynamic, 1>,
                                 Eigen::Matrix<S, Eigen::Dynamic, 1>>;
    return Eigen::Map<M>(v.data(), Eigen::Index(v.extent(0)));
  } else if constexpr (rank == 2 && (std::is_same<Layout, Kokkos::LayoutRight>::value ||
                                     std::is_same<Layout, Kokkos::LayoutLeft>::value)) {
    constexpr int order = std::is_same<Layout, Kokkos::LayoutRight>::value ? Eigen::RowMajor : Eigen::ColMajor;
    using P = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, order>;
    using M = std::conditional_t<std::is_const<T>::value, const P, P>;
    return Eigen::Map<M>(v.data(), Eigen::Index(v.extent(0)), Eigen::Index(v.extent(1)));
  } else if constexpr (rank == 4 && std::is_same<Layout, Kokkos::LayoutRight>::value) {
    using P = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using M = std::conditional_t<std::is_const<T>::value, const P, P>;
    return Eigen::Map<M>(v.data(), Eigen::Index(v.extent(0)),
                         Eigen::Index(v.extent(1) * v.extent(2) * v.extent(3)));
  } else {
    static_assert(impl::dependent_false<V>::value,
                  "kfac::adapters::as_eigen: expected rank 1, rank 2 LayoutRight/LayoutLeft, or "
                  "rank 4 LayoutRight");
  }
}

}  // namespace adapters
}  // namespace kfac
