// The toy Shampoo (toy_shampoo.hpp) under MPI: every rank hands the same gradients (as after a
// data-parallel allreduce), and every rank's result equals a single process's, whichever ranks
// decompose its units and precondition its layers.
#include <mpi.h>

#include <kfac/distributed/mpi_comm.hpp>

#include "shampoo_data.hpp"

using namespace kfac_test;

TEST_CASE("Shampoo under MPI equals a single process on every rank", "[mpi][shampoo][toy]") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::vector<ShampooSpec> net = {{"s", 5, 3, true, true}, {"fc", 3, 2, true, false}, {"t", 4, 6, false, true}};
  for (double fraction : {1.0, 1.0 / world}) {
    for (bool owner : {false, true}) {
      INFO("grad_worker_fraction " << fraction << ", reduce_to_owner " << owner << " at " << world << " ranks");
      const auto o = plain_options(0.05).with_factor_decay(0.9).with_inv_update_steps(3);
      const auto k = kfac::Kaisa{}.with_grad_worker_fraction(fraction).with_reduce_to_owner(owner);
      kfac::Preconditioner<double, Host, kfac::MpiComm> pre(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD), k);
      // one rank: the only valid fraction is 1
      Pre single(o, Host{}, kfac::SerialComm{}, kfac::Kaisa(k).with_grad_worker_fraction(1.0));
      register_layers(pre, net);
      register_layers(single, net);
      bool close = true;
      for (long step = 0; step < 12; ++step) {
        const auto got = step_at(pre, net, step), want = step_at(single, net, step);
        for (std::size_t l = 0; l < net.size(); ++l) close = close && close_to(got[l], want[l], 1e-10);
      }
      int mine = close, all = 0;
      MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
      CHECK(all == 1);
    }
  }
}
