// kfac::CostModel's exact predictions against a distributed run at this world size: bytes per
// phase as MpiComm::bytes_sent() counts them, memory_report() and the assignment, on every rank,
// for COMM-OPT, HYBRID and MEM-OPT, with and without split preconditioning.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/planning/calibration.hpp>
#include <cstring>

#include "cost_model_net.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;

namespace {

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

kfac::Options options() {
  return kfac::Options{}.with_loss_reduction(kfac::LossReduction::sum).with_damping(1e-2).with_inv_update_steps(2);
}
kfac::Kaisa kaisa(double fraction) { return kfac::Kaisa{}.with_grad_worker_fraction(fraction).with_bucket_bytes(256); }

/// `max_message`: MpiComm's largest message (0: its default).
void check(const kfac::Kaisa& k, std::size_t max_message = 0, const kfac::Options& opts = options()) {
  const int rank = world_rank(), size = world_size();
  using Pre = kfac::Preconditioner<double, Host, kfac::MpiComm>;
  kfac::MpiComm comm(MPI_COMM_WORLD);
  if (max_message > 0) comm.with_max_message_bytes(max_message);
  Pre pre(opts, Host(), comm, k);
  register_cost_model_net(pre);
  const auto p = kfac::CostModel(cost_model_net_shapes()).predict(size, opts, k);
  const auto& me = p.ranks[std::size_t(rank)];

  // inv_update_steps 2: step 0 and 2 decompose; every step updates factors.
  Rng rng(17 + rank);
  std::size_t bytes[3];
  for (int s = 0; s < 3; ++s) {
    const CostModelBatch batch(rng);
    batch.feed(pre);
    comm.reset_bytes();
    pre.step();
    bytes[s] = comm.bytes_sent();
  }
  INFO("rank " << rank << " of " << size << ", f = " << k.grad_worker_fraction);
  CHECK(bytes[1] == me.factor_bytes_sent + me.gradient_bytes_sent);
  CHECK(bytes[2] - bytes[1] == me.decomposition_bytes_sent);
  CHECK(bytes[0] == bytes[2]);
  const auto report = pre.memory_report();
  REQUIRE(report.size() == me.memory.size());
  for (std::size_t l = 0; l < report.size(); ++l) {
    INFO("layer " << report[l].name);
    CHECK(report[l].factor_bytes == me.memory[l].factor_bytes);
    CHECK(report[l].decomposition_bytes == me.memory[l].decomposition_bytes);
    CHECK(report[l].workspace_bytes == me.memory[l].workspace_bytes);
  }
  for (std::size_t l = 0; l < report.size(); ++l) {
    CHECK(pre.assignment().worker_group(l) == p.assignment.worker_group(l));
    for (int which = 0; which < 2; ++which) CHECK(pre.assignment().decomposer(l, which) == p.assignment.decomposer(l, which));
  }
}

}  // namespace

TEST_CASE("cost model bytes, memory and assignment equal a distributed run", "[mpi][cost_model]") {
  const int size = world_size();
  SECTION("COMM-OPT") { check(kaisa(1.0)); }
  SECTION("COMM-OPT, A and G apart, precomputed reciprocal") {
    check(kaisa(1.0).with_colocate_factors(false), 0, options().with_precompute_reciprocal(true));
  }
  SECTION("MEM-OPT") { check(kaisa(1.0 / size)); }
  SECTION("reduce-to-owner: MEM-OPT, COMM-OPT with A and G apart, float32 payloads") {
    check(kaisa(1.0 / size).with_reduce_to_owner(true));
    check(kaisa(1.0).with_reduce_to_owner(true).with_colocate_factors(false));
    check(kaisa(1.0).with_reduce_to_owner(true).with_comm_precision(kfac::CommPrecision::float32));
  }
  SECTION("MEM-OPT, memory-balanced placement, bfloat16 payloads") {
    check(kaisa(1.0 / size).with_assignment_cost(kfac::AssignmentCost::memory)
              .with_comm_precision(kfac::CommPrecision::bfloat16));
  }
  SECTION("float32 payloads, skipped layers") {
    check(kaisa(1.0 / size).with_comm_precision(kfac::CommPrecision::float32), 0,
          options().with_skip_layers({"fc2", "batch_norm"}));
  }
  SECTION("split preconditioning: COMM-OPT, MEM-OPT, COMM-OPT with reduce-to-owner and 16-byte messages") {
    check(kaisa(1.0).with_split_preconditioning(true));
    check(kaisa(1.0 / size).with_split_preconditioning(true));
    check(kaisa(1.0).with_split_preconditioning(true).with_reduce_to_owner(true), 16);
  }
  if (size % 2 == 0 && size > 2) {
    SECTION("HYBRID 0.5, split preconditioning") { check(kaisa(0.5).with_split_preconditioning(true)); }
    SECTION("HYBRID 0.5") { check(kaisa(0.5)); }
    SECTION("HYBRID 0.5, reduce-to-owner") { check(kaisa(0.5).with_reduce_to_owner(true)); }
    SECTION("HYBRID 0.5, worker groups of consecutive ranks") {
      check(kaisa(0.5).with_group_layout(kfac::GroupLayout::contiguous_workers).with_colocate_factors(false));
    }
  }
}

TEST_CASE("measured machine figures are the same on every rank", "[mpi][cost_model][calibration]") {
  // Averaged by a reduce and broadcast: every rank predicts with the same bits. With several
  // ranks the broadcasts set latency and bandwidth (no longer the defaults).
  const auto f = kfac::measure_machine_figures(Host(), kfac::MpiComm(MPI_COMM_WORLD), 128, 2);
  const double mine[7] = {f.eigen_seconds_per_n3, f.cholesky_seconds_per_n3, f.gemm_flops, f.float_speedup,
                          f.memory_bandwidth, f.latency, f.bandwidth};
  double root[7];
  std::memcpy(root, mine, sizeof mine);
  MPI_Bcast(root, 7, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  int same = std::memcmp(root, mine, sizeof mine) == 0, all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  CHECK(all == 1);
  for (double v : mine) CHECK(v > 0);
  if (world_size() > 1) {
    CHECK(f.latency != kfac::MachineFigures{}.latency);
    CHECK(f.bandwidth != kfac::MachineFigures{}.bandwidth);
  }
}
