#pragma once
/// \file stage.hpp
/// \brief The contract between kfac::Pipeline and one module of the host's network (one stage of
/// the FDG pipeline of Zhuang, Wang, Liu, Zhang and Lin 2019, "Fully Decoupled Neural Network
/// Learning Using Delayed Gradients").
///
/// A stage is any type with these members (checked by static_assert, so a missing one is a
/// readable compile error, not a template backtrace):
///
/// | member | meaning |
/// |---|---|
/// | `using scalar_type = float or double;` | the activations' and gradients' scalar |
/// | `int input_features() const` | values per sample that the stage reads (its input is (N, in)) |
/// | `int output_features() const` | values per sample that it writes (its output is (N, out)) |
/// | `tensor forward(long batch, const tensor& input)` | output of `batch`, (N, out); it may keep what its backward needs, keyed by `batch` |
/// | `tensor backward(long batch, const tensor& input, const tensor& output_grad, bool need_input_grad)` | computes its parameter gradients for `batch` from dLoss/d(output) and returns dLoss/d(input), (N, in), or an empty tensor when `need_input_grad` is false (the first stage) |
/// | `void apply_update(long batch)` | applies the parameter gradients of `batch` (the host's optimizer, and optionally a kfac::Preconditioner over the stage's own layers) |
///
/// `tensor` is `kfac::StageTensor<scalar_type>`, a row-major host view (LayoutRight, HostSpace).
/// `input` in backward is the same input that forward received for that batch (the pipeline
/// stashes a copy), so a stage may recompute instead of keeping activations. Views a stage
/// returns must stay valid until its next call. Any exception a stage throws stops the pipeline
/// on every stage with that message (a kfac::Error).

#include <Kokkos_Core.hpp>

#include <type_traits>
#include <utility>

namespace kfac {

/// \brief Activations and gradients exchanged with a stage: (batch, features), row-major, host.
template <class Scalar>
using StageTensor = Kokkos::View<Scalar**, Kokkos::LayoutRight, Kokkos::HostSpace>;

namespace impl {

template <class S, class = void>
struct has_stage_shape : std::false_type {};
template <class S>
struct has_stage_shape<S, std::void_t<typename S::scalar_type, decltype(std::declval<const S&>().input_features()),
                                      decltype(std::declval<const S&>().output_features())>> : std::true_type {};

template <class S, class = void>
struct has_stage_passes : std::false_type {};
template <class S>
struct has_stage_passes<
    S, std::void_t<decltype(StageTensor<typename S::scalar_type>(std::declval<S&>().forward(
                       0L, std::declval<const StageTensor<typename S::scalar_type>&>()))),
                   decltype(StageTensor<typename S::scalar_type>(std::declval<S&>().backward(
                       0L, std::declval<const StageTensor<typename S::scalar_type>&>(),
                       std::declval<const StageTensor<typename S::scalar_type>&>(), true))),
                   decltype(std::declval<S&>().apply_update(0L))>> : std::true_type {};

template <class S>
constexpr void check_stage() {
  static_assert(has_stage_shape<S>::value,
                "kfac::Pipeline: the stage type needs `using scalar_type`, `int input_features() const` and "
                "`int output_features() const` (see kfac/pipeline/stage.hpp)");
  static_assert(has_stage_passes<S>::value,
                "kfac::Pipeline: the stage type needs `forward(long, const StageTensor&)`, "
                "`backward(long, const StageTensor&, const StageTensor&, bool)` returning StageTensor "
                "and `apply_update(long)` (see kfac/pipeline/stage.hpp)");
}

}  // namespace impl
}  // namespace kfac
