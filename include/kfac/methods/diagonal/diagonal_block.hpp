#pragma once
/// \file diagonal_block.hpp
/// \brief The closed-form block of a Kronecker layer whose factors are kept as their diagonals
/// (`kfac::KFAC<kfac::Diagonal>`): no decomposition, each entry of the gradient divided by its
/// damped diagonal Fisher value.

#include <string>
#include <utility>

#include "kfac/methods/kfac/kronecker_statistics.hpp"

namespace kfac {

/// \brief Diagonal K-FAC of one Dense or Conv2d layer: the running diag(A) and diag(G)
/// (KroneckerStatistics with kfac::Diagonal) and
/// \f$V_{ij} = X_{ij} / (G_{ii} A_{jj} + \gamma)\f$, the damped inverse of diag(G) ⊗ diag(A).
/// No units: nothing is decomposed, distributed or checkpointed beyond the two diagonals.
/// \tparam LayerType Dense or Conv2d.
/// \tparam Prec Precision<Factor, Decomposition>.
/// \tparam Scalar the host framework's type of observations and gradients.
/// \tparam Exec the Kokkos execution space.
template <class LayerType, class Prec, class Scalar, class Exec>
class DiagonalBlock final : public impl::KroneckerStatistics<LayerType, Diagonal, Prec, Scalar, Exec> {
  using statistics = impl::KroneckerStatistics<LayerType, Diagonal, Prec, Scalar, Exec>;
  using typename statistics::C;
  using typename statistics::D;
  using typename statistics::F;

 public:
  DiagonalBlock(std::string name, const LayerType& layer) : statistics(std::move(name), layer, describe(layer)) {}

  /// The statistics' description (KroneckerStatistics::describe_statistics) with no units and
  /// an element-wise apply (not modelled).
  static impl::BlockDescription describe(const LayerType& layer) {
    impl::BlockDescription d = statistics::describe_statistics(layer);
    d.signature = layer.describe() + "/" + Diagonal::name + "/closed_form" + statistics::precision_signature();
    return d;
  }

  void precondition(const Exec& exec, double damping, const impl::ApplyPart&) override {
    auto out = this->gradient_.v();
    auto x = this->gradient_.x();
    auto a = this->a_;
    auto g = this->g_;
    const D d = D(damping);
    Kokkos::parallel_for(
        "kfac::layer::diagonal_solve", impl::ColumnMajorRange<Exec>(exec, {0, 0}, {this->na_, this->ng_}),
        KOKKOS_LAMBDA(int j, int i) { out(j, i) = x(j, i) / (D(g(i, 0)) * D(a(j, 0)) + d); });
  }
  /// Bytes this process holds, with a = a_dim, g = g_dim: factor_bytes (a + g) sizeof(Factor),
  /// 0 before the first factor update; no decomposition; workspace_bytes 2 g a
  /// sizeof(Decomposition) once a gradient was loaded, plus the pending diagonals (a + g) of
  /// the observations from the layer's first observation on.
  MemoryReport memory() const override { return this->statistics_memory(); }
};

}  // namespace kfac
