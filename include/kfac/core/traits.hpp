#pragma once
/// \file traits.hpp
/// \brief "Is this an X?" traits, so that a wrong type passed to kfac fails with a readable
/// static_assert instead of a page of template errors.

#include <cstddef>
#include <string>
#include <type_traits>

#include "kfac/core/comm_precision.hpp"

namespace kfac {
namespace impl {
template <class...>
using void_t = void;

template <class T, class = void>
struct is_layer_type : std::false_type {};
template <class T>
struct is_layer_type<T, void_t<decltype(T::is_kronecker), decltype(T::kind),
                               decltype(std::declval<const T&>().weight_rows()),
                               decltype(std::declval<const T&>().weight_cols()),
                               decltype(std::declval<const T&>().describe())>> : std::true_type {};

template <class T, class = void>
struct is_method : std::false_type {};
template <class T>
struct is_method<T, void_t<typename T::method_tag, decltype(T::name)>> : std::true_type {};

template <class T, class = void>
struct is_inversion : std::false_type {};
template <class T>
struct is_inversion<T, void_t<decltype(T::damping_at_apply), decltype(std::declval<const T&>().counts(1)),
                              decltype(std::declval<const T&>().cost(1)), decltype(std::declval<const T&>().settings())>>
    : std::true_type {};

template <class T, class = void>
struct is_communicator : std::false_type {};
template <class T>
struct is_communicator<
    T, void_t<decltype(std::declval<const T&>().rank()), decltype(std::declval<const T&>().size()),
              decltype(std::declval<const T&>().allreduce_max(0L)),
              decltype(std::declval<const T&>().all_equal(std::string())),
              decltype(std::declval<const T&>().sum(nullptr, std::size_t(0), std::size_t(0),
                                                    CommPrecision::native)),
              decltype(std::declval<const T&>().broadcast(nullptr, std::size_t(0), 0)),
              decltype(std::declval<const T&>().split(0))>>
    : std::true_type {};

template <class T, class = void>
struct is_factor_policy : std::false_type {};
template <class T>
struct is_factor_policy<T, void_t<decltype(T::name), decltype(T::is_diagonal), decltype(T::packed)>>
    : std::true_type {};
/// T::is_diagonal for a factor policy, false for anything else (so that a wrong type in the
/// factor slot is reported by the slot's own static_assert, not by a missing member).
template <class T, bool = is_factor_policy<T>::value>
struct factor_is_diagonal : std::false_type {};
template <class T>
struct factor_is_diagonal<T, true> : std::integral_constant<bool, T::is_diagonal> {};

template <class T, class = void>
struct is_distribution : std::false_type {};
template <class T>
struct is_distribution<T, void_t<typename T::distribution_tag>> : std::true_type {};
}  // namespace impl

/// \brief True for layer types (Dense, Conv2d, BatchNorm2d, or one of yours with the same members).
template <class T>
inline constexpr bool is_layer_type_v = impl::is_layer_type<T>::value;
/// \brief True for method objects (KFAC<...>, UnitWiseFisher<...>, or one of yours).
template <class T>
inline constexpr bool is_method_v = impl::is_method<T>::value;
/// \brief True for inversion policies (Eigendecomposition<>, RandomizedEigen<>, Cholesky<>, NewtonSchulz).
template <class T>
inline constexpr bool is_inversion_v = impl::is_inversion<T>::value;
/// \brief True for communicators (SerialComm, MpiComm).
template <class T>
inline constexpr bool is_communicator_v = impl::is_communicator<T>::value;
/// \brief True for factor policies (Symmetric, Full, Diagonal, UnitWise).
template <class T>
inline constexpr bool is_factor_policy_v = impl::is_factor_policy<T>::value;
/// \brief True for distribution policies (Kaisa, Independent).
template <class T>
inline constexpr bool is_distribution_v = impl::is_distribution<T>::value;

}  // namespace kfac
