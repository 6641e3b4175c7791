// Self-tuning K-FAC on several ranks: every rank has its own batch, the products are summed over
// the ranks through kfac::MpiComm, and alpha, mu, lambda come out the same bits on every rank and
// equal (to rounding) to one process holding every rank's batch. A refusal on one rank is a
// refusal on every rank, with nothing changed anywhere.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>

#include "adaptive_net.hpp"
#include "mpi_harness.hpp"

using namespace kfac_test::adaptive;
using kfac_test::mpi::bytes_of;
using kfac_test::mpi::everywhere;
using kfac_test::mpi::rank_in;
using kfac_test::mpi::same_everywhere;
using kfac_test::mpi::size_of;
using HostExec = Kokkos::DefaultHostExecutionSpace;

namespace {

constexpr int kRows = 6;

/// The rows of ranks [first, last) one after another (a rank's batch: seed 500 + rank).
Batch rows_of(int first, int last) {
  Batch all(kRows * (last - first), 5, 4, 1);
  for (int r = first; r < last; ++r) {
    const Batch b(kRows, 5, 4, 500 + std::uint64_t(r));
    for (int i = 0; i < kRows; ++i) {
      for (int j = 0; j < 5; ++j) all.x((r - first) * kRows + i, j) = b.x(i, j);
      all.y[std::size_t((r - first) * kRows + i)] = b.y[std::size_t(i)];
    }
  }
  return all;
}

/// Three solves and damping updates of a tuner on the given rows, with the gradient of every
/// rank's rows (the data-parallel host's averaged gradient) and a proposal P = g scaled by a
/// fixed pattern. Returns alpha, mu, predicted and lambda of every solve.
template <class Comm>
std::vector<double> run(kfac::SelfTuning<double, HostExec, Comm>& tune, Net& net, const Batch& mine,
                        const Batch& everyone) {
  std::vector<double> out;
  for (int step = 0; step < 3; ++step) {
    net.backward(everyone);  // the averaged gradient
    const double before = net.loss_at(mine);
    tune.capture_gradient();
    for (const auto& part : net.grads())
      for (std::size_t i = 0; i < part.second; ++i) part.first[i] *= 1.0 + 0.25 * double(i % 3);
    M z("z", std::size_t(mine.n()), 4);
    Kokkos::deep_copy(z, net.forward(mine.x));
    kfac::OutputProducts<double, HostExec> prod;
    prod.outputs = z;
    const M jp = net.jvp(mine.x, Net::flat(net.grads()));
    prod.along_proposal = jp;
    M ju;
    if (tune.needs_previous_product()) {
      Flat u0;
      for (const char* name : {"W1", "b1", "W2", "b2"}) {
        const auto v = tune.previous_update(name);
        u0.insert(u0.end(), v.data(), v.data() + v.size());
      }
      ju = net.jvp(mine.x, u0);
      prod.along_previous = ju;
    }
    const auto st = tune.solve(prod);
    Flat theta = Net::flat(net.params());
    const Flat u = Net::flat(net.grads());
    for (std::size_t i = 0; i < theta.size(); ++i) theta[i] -= u[i];
    Net::assign(net.params(), theta);
    const auto upd = tune.update_damping(before, net.loss_at(mine));
    out.insert(out.end(), {st.alpha, st.mu, st.predicted, upd.rho, upd.damping});
  }
  return out;
}

template <class Comm>
void register_net(kfac::SelfTuning<double, HostExec, Comm>& tune, Net& net) {
  tune.add_parameter("W1", net.dW1);
  tune.add_parameter("b1", net.db1);
  tune.add_parameter("W2", net.dW2);
  tune.add_parameter("b2", net.db2);
}

const kfac::Adaptive settings = kfac::Adaptive{}.with_initial_damping(0.3).with_update_interval(1);

}  // namespace

TEST_CASE("alpha, mu and lambda are the same bits on every rank, and those of one process", "[adaptive][mpi]") {
  const int rank = rank_in(), world = size_of();
  Net net(5, 6, 4, 41);
  kfac::SelfTuning<double, HostExec, kfac::MpiComm> tune(settings, HostExec{}, kfac::MpiComm(MPI_COMM_WORLD));
  register_net(tune, net);
  const std::vector<double> got = run(tune, net, rows_of(rank, rank + 1), rows_of(0, world));
  CHECK(same_everywhere(bytes_of(got)));
  CHECK(same_everywhere(bytes_of(Net::flat(net.params()))));

  Net alone(5, 6, 4, 41);
  kfac::SelfTuning<double, HostExec> one(settings);
  register_net(one, alone);
  const Batch all = rows_of(0, world);
  const std::vector<double> want = run(one, alone, all, all);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("value " << i << " (alpha, mu, M, rho, lambda per solve)");
    CHECK(got[i] == Approx(want[i]).epsilon(1e-9).margin(1e-13));
  }
}

TEST_CASE("A refusal on one rank is a refusal on every rank, and changes nothing", "[adaptive][mpi]") {
  const int rank = rank_in(), world = size_of();
  Net net(5, 6, 4, 43);
  kfac::SelfTuning<double, HostExec, kfac::MpiComm> tune(settings, HostExec{}, kfac::MpiComm(MPI_COMM_WORLD));
  register_net(tune, net);
  const Batch mine = rows_of(rank, rank + 1), all = rows_of(0, world);
  run(tune, net, mine, all);
  const double lambda = tune.lambda();
  const std::string previous = bytes_of(Flat(tune.previous_update("W1").data(),
                                             tune.previous_update("W1").data() + tune.previous_update("W1").size()));
  net.backward(all);
  tune.capture_gradient();
  M z("z", std::size_t(mine.n()), 4);
  Kokkos::deep_copy(z, net.forward(mine.x));
  const M jp = net.jvp(mine.x, Net::flat(net.grads()));
  kfac::OutputProducts<double, HostExec> prod;
  prod.outputs = z;
  prod.along_proposal = jp;
  prod.along_previous = jp;
  if (rank == world - 1) prod.along_previous = {};  // the last rank forgets it
  std::string message;
  try {
    tune.solve(prod);
  } catch (const kfac::Error& e) {
    message = e.what();
  }
  CHECK(everywhere(message.find("OutputProducts::along_previous is missing") != std::string::npos));
  if (world > 1) CHECK(message.find("on rank " + std::to_string(world - 1)) != std::string::npos);
  CHECK(same_everywhere(message));
  CHECK(everywhere(tune.lambda() == lambda));
  CHECK(everywhere(tune.solves() == 3));
  CHECK(everywhere(bytes_of(Flat(tune.previous_update("W1").data(),
                                 tune.previous_update("W1").data() + tune.previous_update("W1").size())) == previous));
  // Checkpoints: the same state loads everywhere; a rank handed another state makes every rank refuse.
  std::stringstream saved;
  tune.save(saved);
  std::string state = saved.str();
  if (world > 1 && rank == 0) {
    Net other(5, 6, 4, 44);
    kfac::SelfTuning<double, HostExec> elsewhere(settings);
    register_net(elsewhere, other);
    std::stringstream s;
    elsewhere.save(s);
    state = s.str();
  }
  std::stringstream in(state);
  std::string refused;
  try {
    tune.load(in);
  } catch (const kfac::Error& e) {
    refused = e.what();
  }
  if (world > 1) CHECK(everywhere(refused.find("different states") != std::string::npos));
  if (world == 1) CHECK(refused.empty());
  CHECK(everywhere(tune.solves() == 3));
}
