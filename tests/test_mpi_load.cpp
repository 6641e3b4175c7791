// Load: 8 ranks oversubscribed, 100 steps of each KAISA strategy (COMM-OPT, HYBRID f = 0.5 and
// 0.25, MEM-OPT) with a checkpoint every 25 steps: no hang (ctest timeout), ranks bit-identical
// at every step, and a run resumed from each checkpoint continues bit for bit.
#include "mpi_harness.hpp"

using namespace kfac_test;
using namespace kfac_test::mpi;

namespace {

const std::vector<Layer> kNet = {{"fc1", 6, 5, false}, {"fc2", 5, 4, false}, {"fc3", 4, 4, false},
                                 {"fc4", 4, 3, false}, {"fc5", 3, 3, false}, {"fc6", 3, 2, false}};
constexpr long kSteps = 100, kEvery = 25, kResumed = 5;

kfac::Options load_options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-3).with_factor_decay(0.95)
      .with_inv_update_steps(4).with_loss_reduction(kfac::LossReduction::sum);
}
kfac::Kaisa load_kaisa(double f) { return kfac::Kaisa{}.with_grad_worker_fraction(f).with_bucket_bytes(512); }

}  // namespace

TEST_CASE("8 ranks, 100 steps of every strategy with periodic checkpoints", "[mpi][load]") {
  const int world = size_of();
  const double t0 = MPI_Wtime();
  for (double f : {1.0, 0.5, 0.25, 1.0 / world}) {
    INFO("grad_worker_fraction " << f << " at " << world << " ranks");
    Pre pre(load_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), load_kaisa(f));
    register_net(pre, kNet);
    std::vector<std::vector<double>> out;
    std::vector<std::string> checkpoints;
    bool ranks_agree = true;
    for (long s = 0; s < kSteps; ++s) {
      if (s > 0 && s % kEvery == 0) checkpoints.push_back(saved(pre));
      out.push_back(step_once(pre, kNet, 13, s, rank_in()));
      ranks_agree = same_everywhere(bytes_of(out.back())) && ranks_agree;
    }
    CHECK(ranks_agree);
    // Resume from each checkpoint (each rank its own file) for kResumed steps.
    bool exact = true, restored = true;
    for (std::size_t c = 0; c < checkpoints.size(); ++c) {
      Pre resumed(load_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), load_kaisa(f));
      register_net(resumed, kNet);
      restored = loaded(resumed, checkpoints[c]) && restored;
      const long first = long(c + 1) * kEvery;
      for (long s = first; s < first + kResumed; ++s)
        exact = bytes_of(step_once(resumed, kNet, 13, s, rank_in())) == bytes_of(out[std::size_t(s)]) && exact;
    }
    CHECK(everywhere(restored));
    CHECK(everywhere(exact));
  }
  if (rank_in() == 0 && std::getenv("KFAC_PRINT_FAULTS"))
    std::printf("[load] %d ranks: %.1f s\n", world, MPI_Wtime() - t0);
}
