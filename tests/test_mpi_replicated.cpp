// A second distribution strategy written outside the library, from this file alone (the
// distribution contract, core/distribution_contract.hpp): every rank decomposes and applies
// every layer itself, and only the factors are averaged, summed over the ranks (reduce +
// broadcast: the same bits everywhere) and divided by their number. It takes the agreement,
// placement and sharing parts from distributed/parts.hpp and writes its averaging and
// signature(). At 1-4 ranks, each rank with its own data: the preconditioned gradients equal
// KAISA's COMM-OPT (which decomposes each factor on one rank and broadcasts it) to 1e-12, the
// ranks' factors agree bit for bit, and only factor sums travel (a decomposing step sends what
// a step that only updates statistics sends; KAISA sends the decompositions too).
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>
#include <kfac/planning/cost_model.hpp>

#include "reference.hpp"

using namespace kfac_test;
using Host = Kokkos::DefaultHostExecutionSpace;

namespace {

/// Every rank decomposes everything; factors averaged by a plain sum over the world.
struct Replicated {
  using distribution_tag = void;
  static constexpr const char* name = "replicated";

  /// States one step to the cost model (kfac::CostSheet), from this file alone: average() sums
  /// every averaged buffer as stored, in full, to every rank (nothing at one rank); every rank
  /// decomposes and applies everything and agrees on failures (WorldAgreement).
  template <class Sheet>
  void state_cost(Sheet& sheet) const {
    for (std::size_t l = 0; l < sheet.layers() && sheet.world() > 1; ++l)
      if (!sheet.skipped(l))
        for (std::size_t count : sheet.layer(l).stored_counts) sheet.sum_factors(count * sheet.layer(l).factor_scalar);
    for (int r = 0; r < sheet.world(); ++r) sheet.compute_everything(r);
    sheet.agree();
  }

  template <class Exec, class Comm>
  class State : public kfac::impl::WorldAgreement<Comm>,
                public kfac::impl::LocalPlacement,
                public kfac::impl::NoDecompositionSharing<kfac::impl::request_of_t<Comm>>,
                public kfac::impl::NoGradientSharing<kfac::impl::request_of_t<Comm>> {
    static_assert(kfac::impl::host_accessible_v<Exec>, "Replicated averages in host memory");

   public:
    using request_type = kfac::impl::request_of_t<Comm>;
    State(const Replicated&, Comm comm) : kfac::impl::WorldAgreement<Comm>(std::move(comm)) {}
    std::string signature(const kfac::Options&) const { return "replicated;"; }

    // Factor averaging, blocking, every factor in full to every rank.
    void average(const Exec& exec, const std::vector<kfac::impl::FactorBuffer>& all, const kfac::Options&) {
      exec.fence();
      const double w = double(this->comm().size());
      for (const auto& f : all) {
        const kfac::impl::Buffer& b = f.storage;
        this->comm().sum(b.data, b.count, b.scalar_size, kfac::CommPrecision::native);
        for (std::size_t i = 0; i < b.count; ++i) {
          if (b.scalar_size == sizeof(double)) static_cast<double*>(b.data)[i] /= w;
          else static_cast<float*>(b.data)[i] = float(static_cast<float*>(b.data)[i] / w);
        }
      }
    }
    kfac::impl::StartedSums<request_type> start_average(const Exec& exec,
                                                        const std::vector<kfac::impl::FactorBuffer>& all,
                                                        const kfac::Options& o) {
      average(exec, all, o);
      return {};
    }
    bool overlaps() const { return false; }
    bool sends_increments(const kfac::Options&, std::size_t) const { return false; }
    double payload_max(const kfac::Options&) const { return HUGE_VAL; }
    int factor_owner(const kfac::Options&, std::size_t, int) const { return -1; }
    void share_factors(const Exec&, const std::vector<kfac::impl::FactorBuffer>&) const {}
  };
};

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

kfac::Options options() {
  return kfac::Options{}.with_loss_reduction(kfac::LossReduction::sum).with_damping(1e-2).with_inv_update_steps(2)
      .with_kl_clip(0.0);
}

template <class Pre>
void register_net(Pre& pre) {
  pre.register_layer("fc1", kfac::Dense(5, 4), kfac::KFAC<kfac::Symmetric>{});
  pre.register_layer("fc2", kfac::Dense(4, 3, false), kfac::KFAC<kfac::Full, kfac::Cholesky<>>{});
  pre.register_layer("fc3", kfac::Dense(3, 2), kfac::KFAC<kfac::Symmetric>{});
}

/// `steps` steps, each rank with its own observations and gradients; returns every
/// preconditioned gradient value and the bytes this rank sent at each step.
template <class Pre>
std::vector<double> run(Pre& pre, kfac::MpiComm& comm, std::vector<std::size_t>& bytes, int steps) {
  Rng rng(41 + unsigned(world_rank()));
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) {
    auto x1 = random_view<double>(6, 5, rng), g1 = random_view<double>(6, 4, rng);
    auto x2 = random_view<double>(6, 4, rng), g2 = random_view<double>(6, 3, rng);
    auto x3 = random_view<double>(6, 3, rng), g3 = random_view<double>(6, 2, rng);
    auto w1 = random_view<double>(4, 5, rng), w2 = random_view<double>(3, 4, rng), w3 = random_view<double>(2, 3, rng);
    auto b1 = random_vector<double>(4, rng), b3 = random_vector<double>(2, rng);
    pre.observe_input("fc1", x1);
    pre.observe_output_grad("fc1", g1);
    pre.observe_input("fc2", x2);
    pre.observe_output_grad("fc2", g2);
    pre.observe_input("fc3", x3);
    pre.observe_output_grad("fc3", g3);
    pre.set_gradient("fc1", w1, b1);
    pre.set_gradient("fc2", w2);
    pre.set_gradient("fc3", w3, b3);
    comm.reset_bytes();
    pre.step();
    bytes.push_back(comm.bytes_sent());
    for (const auto* v : {&w1, &w2, &w3}) out.insert(out.end(), v->data(), v->data() + v->span());
    for (const auto* v : {&b1, &b3}) out.insert(out.end(), v->data(), v->data() + v->span());
  }
  return out;
}

bool same_on_every_rank(const std::vector<double>& v) {
  std::vector<double> root(v);
  MPI_Bcast(root.data(), int(root.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  int mine = std::memcmp(root.data(), v.data(), v.size() * sizeof(double)) == 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

}  // namespace

TEST_CASE("a strategy written in a test: every rank decomposes, only factors averaged", "[mpi][distribution]") {
  const int size = world_size();
  kfac::MpiComm comm_r(MPI_COMM_WORLD), comm_k(MPI_COMM_WORLD);
  kfac::Preconditioner<double, Host, kfac::MpiComm, Replicated> replicated(options(), Host(), comm_r);
  kfac::Preconditioner<double, Host, kfac::MpiComm> kaisa(options(), Host(), comm_k);  // COMM-OPT
  register_net(replicated);
  register_net(kaisa);
  std::vector<std::size_t> bytes_r, bytes_k;
  const int steps = 6;  // decompositions at steps 0, 2, 4
  const auto a = run(replicated, comm_r, bytes_r, steps), b = run(kaisa, comm_k, bytes_k, steps);
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (std::abs(b[i]) + 1e-300));
  INFO("rank " << world_rank() << " of " << size << ": largest relative difference from KAISA " << worst);
  CHECK(worst < 1e-12);
  // Each rank preconditions its own gradients with the same decompositions: the factors (and so
  // every decomposition) are the same bits on every rank.
  std::vector<double> factors;
  for (const char* name : {"fc1", "fc3"}) {
    const auto& l = replicated.template layer_as<kfac::KFAC<kfac::Symmetric>::block_type<kfac::Dense, double, Host>>(name);
    for (const auto* f : {&l.factor_a(), &l.factor_g()}) factors.insert(factors.end(), f->data(), f->data() + f->span());
  }
  CHECK(same_on_every_rank(factors));
  // Only factor sums travel: a decomposing step (2, 4) sends what a statistics-only step (1, 3) sends.
  CHECK(bytes_r[2] == bytes_r[1]);
  CHECK(bytes_r[4] == bytes_r[3]);
  if (size > 1) {
    CHECK(bytes_r[1] > 0);
    // KAISA broadcasts the decompositions at steps that decompose (from the ranks that computed
    // them: summed over the ranks, since one may compute none).
    unsigned long long k[2] = {bytes_k[1], bytes_k[2]}, all[2];
    MPI_Allreduce(k, all, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    CHECK(all[1] > all[0]);
  }
  CHECK(replicated.assignment().world() == 1);  // LocalPlacement: a one-rank plan on every rank
}

namespace {

/// register_net's target for a cost model: each layer described as register_layer registers it.
struct Described {
  kfac::CostModel& model;
  template <class Layer, class Method>
  void register_layer(std::string name, const Layer& layer, const Method& method) {
    model.add(std::move(name), layer, method);
  }
};

}  // namespace

TEST_CASE("the test's strategy states its own cost: the bytes it predicts are the bytes sent", "[mpi][cost_model]") {
  const int size = world_size();
  kfac::MpiComm comm(MPI_COMM_WORLD);
  kfac::Preconditioner<double, Host, kfac::MpiComm, Replicated> pre(options(), Host(), comm);
  register_net(pre);
  kfac::CostModel model;
  Described described{model};
  register_net(described);
  std::vector<std::size_t> bytes;
  run(pre, comm, bytes, 3);  // step 1 updates statistics only, step 2 also decomposes
  const auto p = model.predict(size, options(), Replicated{});
  const kfac::RankCost& mine = p.ranks.at(std::size_t(world_rank()));
  CHECK(p.factor_collectives == (size > 1 ? 6u : 0u));  // one sum per factor, A and G of 3 layers
  CHECK(mine.decomposition_bytes_sent + mine.gradient_bytes_sent == 0);
  CHECK(bytes[1] == mine.factor_bytes_sent);
  CHECK(bytes[2] == mine.factor_bytes_sent);
  if (size > 1) CHECK(mine.factor_bytes_sent > 0);
  // Every rank decomposes and applies everything, as under kfac::Independent.
  const auto alone = model.predict(size, options(), kfac::Independent{});
  CHECK(mine.decomposition_seconds == alone.ranks[0].decomposition_seconds);
  CHECK(mine.preconditioning_seconds == alone.ranks[0].preconditioning_seconds);
}
