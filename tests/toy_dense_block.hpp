#pragma once
// What the toy methods of the tests (toy_method.hpp, toy_shampoo.hpp) share for a Dense layer:
// its identity and shape checks, and its gradient workspace in double: X and V are c x g
// column-major, which is the g x c row-major gradient (the bias as the last column when the
// layer has one) that the toys compute with on the host.
#include <Kokkos_Core.hpp>
#include <string>

#include <kfac/kfac.hpp>

namespace kfac_test {

template <class Scalar, class Exec>
class DenseToyBlock : public kfac::impl::Block<Scalar, Exec> {
  using base = kfac::impl::Block<Scalar, Exec>;
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Exec::memory_space>::accessible,
                "the toy methods compute on the host");

 public:
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using Mat = Kokkos::View<double**, Kokkos::LayoutRight, typename Exec::memory_space>;

  /// `d`: the toy's description; the gradient's shape is filled in here.
  DenseToyBlock(std::string name, const kfac::Dense& layer, kfac::impl::BlockDescription d)
      : base(std::move(name), with_shape(std::move(d), layer)), layer_(layer), g_(int(layer.out())),
        c_(int(layer.in()) + (layer.bias() ? 1 : 0)), workspace_(layer.out(), layer.in(), layer.bias()) {
    this->use_gradient(workspace_);
    this->use_observations(kfac::impl::ObservationPairs(layer));
  }

  static kfac::impl::BlockDescription with_shape(kfac::impl::BlockDescription d, const kfac::Dense& layer) {
    d.rows = layer.out();
    d.cols = layer.in();
    d.bias = layer.bias();
    return d;
  }

 protected:
  /// to = [w b] (g x c).
  void copy_gradient(const grad_matrix& w, const grad_vector& b, const Mat& to) const {
    for (int i = 0; i < g_; ++i) {
      for (int j = 0; j < int(layer_.in()); ++j) to(i, j) = double(w(i, j));
      if (layer_.bias()) to(i, c_ - 1) = double(b(i));
    }
  }

  kfac::Dense layer_;
  int g_, c_;  ///< the gradient matrix's rows and columns
  /// X (load_gradient) and V (the toy's apply writes it): g x c row-major, seen from the host.
  kfac::impl::GradientWorkspace<double, Scalar, Exec> workspace_;
};

}  // namespace kfac_test
