// The proof that a new assignment scheme needs no library change: round-robin owners
// (round_robin_placement.hpp) through kfac::Kaisa::with_placement, at 1-4 ranks. The runtime
// places units where the scheme says, the preconditioned gradients equal those of the greedy
// default bit for bit (the same factors decomposed on other ranks), the cost model prices the
// scheme (bytes and assignment equal the run's), and ranks that name different schemes refuse
// the first step together.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/planning/cost_model.hpp>

#include "cost_model_net.hpp"
#include "round_robin_placement.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;
using Pre = kfac::Preconditioner<double, Host, kfac::MpiComm>;

namespace {

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

kfac::Options options() {
  return kfac::Options{}.with_loss_reduction(kfac::LossReduction::sum).with_damping(1e-2).with_inv_update_steps(2);
}

/// Three steps of the cost-model net; returns every preconditioned gradient value, and the
/// bytes of a decomposing step (step 2) and of a non-decomposing one (step 1).
std::vector<double> run(Pre& pre, kfac::MpiComm& comm, std::size_t bytes[2]) {
  Rng rng(23);  // the same data on every rank: the result must not depend on the placement
  std::vector<double> out;
  for (int s = 0; s < 3; ++s) {
    const CostModelBatch batch(rng);
    batch.feed(pre);
    comm.reset_bytes();
    pre.step();
    if (s > 0) bytes[s - 1] = comm.bytes_sent();
    for (const auto* v : {&batch.w1, &batch.w2, &batch.w3, &batch.w5, &batch.w6})
      out.insert(out.end(), v->data(), v->data() + v->span());
  }
  return out;
}

}  // namespace

TEST_CASE("round-robin owners: a placement written outside the library", "[mpi][placement]") {
  const int rank = world_rank(), size = world_size();
  for (double f : {1.0, 1.0 / size}) {
    INFO("grad_worker_fraction " << f << " at " << size << " ranks");
    const auto policy = kfac::Kaisa{}.with_grad_worker_fraction(f).with_colocate_factors(false).with_placement("round_robin", round_robin);
    kfac::MpiComm comm_rr(MPI_COMM_WORLD), comm_greedy(MPI_COMM_WORLD);
    Pre rr(options(), Host(), comm_rr, policy);
    Pre greedy(options(), Host(), comm_greedy, kfac::Kaisa{}.with_grad_worker_fraction(f).with_colocate_factors(false));
    register_cost_model_net(rr);
    register_cost_model_net(greedy);
    std::size_t b_rr[2], b_greedy[2];
    const auto a = run(rr, comm_rr, b_rr), b = run(greedy, comm_greedy, b_greedy);
    REQUIRE(a.size() == b.size());
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);

    // The units sit where the scheme says: the k-th unit over all layers on member k mod gw.
    const auto& w = rr.assignment();
    int next = 0;
    bool round = true;
    for (std::size_t l = 0; l < w.layers(); ++l) {
      round = round && w.worker_group(l) == int(l % std::size_t(w.worker_groups()));
      for (int u = 0; w.decomposer(l, u) >= 0; ++u)
        round = round && w.decomposer(l, u) == w.rank_of(w.worker_group(l), next++ % w.grad_workers());
    }
    CHECK(round);
    CHECK(next > 0);

    // The cost model prices the scheme: the same assignment, and the bytes this rank sent.
    kfac::CostModel model(cost_model_net_shapes());
    const auto p = model.predict(size, options(), policy);
    for (std::size_t l = 0; l < w.layers(); ++l)
      for (int u = 0; u < 2; ++u) CHECK(p.assignment.decomposer(l, u) == w.decomposer(l, u));
    const auto& me = p.ranks[std::size_t(rank)];
    CHECK(b_rr[0] == me.factor_bytes_sent + me.gradient_bytes_sent);
    CHECK(b_rr[1] - b_rr[0] == me.decomposition_bytes_sent);
  }
}

TEST_CASE("a placement that leaves its groups, or differs between ranks, is refused", "[mpi][placement][errors]") {
  const int size = world_size();
  kfac::MpiComm comm(MPI_COMM_WORLD);
  // Every unit on rank 0, at MEM-OPT: outside the worker group of every layer not on group 0.
  const auto all_on_zero = [](const kfac::PlacementProblem& p) {
    kfac::Placement out = round_robin(p);
    for (auto& d : out.decomposer)
      for (auto& r : d) r = 0;
    return out;
  };
  if (size > 1) {
    Pre bad(options(), Host(), comm, kfac::Kaisa{}.with_grad_worker_fraction(1.0 / size).with_placement("zero", all_on_zero));
    register_cost_model_net(bad);
    Rng rng(3);
    const CostModelBatch batch(rng);
    batch.feed(bad);
    CHECK_THROWS_WITH(bad.step(), Catch::Contains("is not a member of its worker group"));
  }
  CHECK_THROWS_WITH(kfac::Kaisa{}.with_placement("", round_robin), Catch::Contains("expected a name and a placer"));
  // Ranks naming different schemes refuse together (the registration signature).
  Pre mixed(options(), Host(), comm,
            world_rank() == 0 ? kfac::Kaisa{}.with_placement("round_robin", round_robin) : kfac::Kaisa{});
  register_cost_model_net(mixed);
  Rng rng(4);
  const CostModelBatch batch(rng);
  batch.feed(mixed);
  if (size > 1) CHECK_THROWS_WITH(mixed.step(), Catch::Contains("ranks registered different"));
  else CHECK_NOTHROW(mixed.step());
}
