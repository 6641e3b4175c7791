// The installed kfac::eigen target: Eigen matrices preconditioned through the Eigen adapter.
#include <Eigen/Core>
#include <cstdio>
#include <kfac/adapters/eigen.hpp>
#include <kfac/kfac.hpp>

int main(int argc, char* argv[]) {
  Kokkos::initialize(argc, argv);
  int rc = 1;
  {
    using RowMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    // Eigen memory is host memory: the preconditioner runs in the host execution space.
    kfac::Preconditioner<double, Kokkos::DefaultHostExecutionSpace> pre(kfac::Options{}.with_kl_clip(0.0));
    pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2, false));
    RowMatrix x = RowMatrix::Constant(4, 3, 1.0), g = RowMatrix::Constant(4, 2, 0.5);
    RowMatrix w = RowMatrix::Constant(2, 3, 1.0);
    pre.observe_input("fc", kfac::adapters::from_eigen(x));
    pre.observe_output_grad("fc", kfac::adapters::from_eigen(g));
    pre.set_gradient("fc", kfac::adapters::from_eigen(w));
    pre.step();  // writes through the view into w
    std::printf("consumer_eigen: preconditioned w(0,0) = %g\n", w(0, 0));
    rc = (w(0, 0) != 1.0 && w(0, 0) == w(0, 0)) ? 0 : 1;
  }
  Kokkos::finalize();
  return rc;
}
