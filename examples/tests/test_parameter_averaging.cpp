// Periodic parameter averaging under mpiexec: every rank trains on its own shard, and right after
// each average all ranks hold bit-identical parameters (and differ in between); on one process
// the averaging mode is the ordinary run, bit for bit.

#include <mpi.h>

#include <catch2/catch.hpp>
#include <vector>

#include "common/trainer.hpp"
#include "common/world.hpp"
#include "helpers.hpp"

#if KFAC_EXAMPLES_HAVE_KFAC
namespace {

using Weights = std::vector<std::vector<float>>;

Weights weights(nn::Trainer& t) {
  Weights out;
  for (const nn::Param& p : t.network().params()) out.push_back(test::to_host(p.value));
  return out;
}

/// 1 if some rank's weights differ from rank 0's (the same on every rank).
int ranks_differ(const Weights& w) {
  int differ = 0, any = 0;
  for (const std::vector<float>& v : w) {
    std::vector<float> root = v;
    MPI_Bcast(root.data(), int(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    differ |= root != v ? 1 : 0;
  }
  MPI_Allreduce(&differ, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}

}  // namespace

TEST_CASE("after every average all ranks hold the same parameters, bit for bit", "[averaging]") {
  const nn::World world(MPI_COMM_WORLD);
  const int p = world.size();
  const nn::Dataset data = test::synthetic(96 * 8, 43);
  for (nn::OptimizerKind kind : {nn::OptimizerKind::sgd, nn::OptimizerKind::ngsgd})
    for (bool momentum : {false, true}) {
      DYNAMIC_SECTION(nn::to_string(kind) << (momentum ? " with momentum" : "") << " on " << p << " ranks") {
        nn::TrainSettings s;
        s.optimizer = kind;
        s.batch = 96;
        s.seed = 11;
        s.average_every = 3;
        s.average_momentum = momentum;
        s.ngsgd.update_period = 2;
        nn::Trainer t(data, s, world);
        t.start_epoch(0);
        REQUIRE(t.steps_per_epoch() == 8);
        REQUIRE(t.batch_size() == 96);
        std::size_t bytes_before = t.bytes_sent();
        for (int i = 0; i < t.steps_per_epoch(); ++i) {
          t.step(i);
          const bool due = (i + 1) % 3 == 0;
          CHECK(t.just_averaged() == due);
          const int differ = ranks_differ(weights(t));
          if (due)
            CHECK(differ == 0);
          else if (p > 1)
            CHECK(differ == 1);  // own shards: the ranks drift apart between averages
          // Bytes only at averages: parameters (and momentum) reduced and broadcast, plus 16 B of weights.
          const std::size_t sent = t.bytes_sent() - bytes_before;
          bytes_before = t.bytes_sent();
          if (!due || p == 1)
            CHECK(sent == 0);
          else
            CHECK(sent > 0);
        }
        CHECK(t.averaging()->averages() == 2);
        CHECK(t.average_now());  // the tail of the run (steps 6, 7)
        CHECK(ranks_differ(weights(t)) == 0);
        CHECK_FALSE(t.average_now());  // nothing new since
      }
    }
}

TEST_CASE("averaging on one process is the ordinary run, bit for bit", "[averaging]") {
  const nn::Dataset data = test::synthetic(96 * 8, 47);
  for (nn::OptimizerKind kind : {nn::OptimizerKind::sgd, nn::OptimizerKind::ngsgd}) {
    DYNAMIC_SECTION(nn::to_string(kind)) {
      nn::TrainSettings s;
      s.optimizer = kind;
      s.batch = 96;
      s.seed = 12;
      auto run = [&](long every) {
        s.average_every = every;
        s.average_momentum = every > 0;
        nn::Trainer t(data, s, nn::World());
        std::vector<double> losses;
        for (int e = 0; e < 2; ++e) {
          t.start_epoch(e);
          for (int i = 0; i < t.steps_per_epoch(); ++i) losses.push_back(t.step(i).mean_loss());
        }
        t.average_now();
        return std::make_pair(losses, weights(t));
      };
      const auto plain = run(0), averaged = run(2);
      CHECK(plain.first == averaged.first);
      CHECK(plain.second == averaged.second);
    }
  }
}

TEST_CASE("NG-SGD without averaging on several ranks is refused", "[averaging]") {
  const nn::World world(MPI_COMM_WORLD);
  if (world.size() == 1) return;
  nn::TrainSettings s;
  s.optimizer = nn::OptimizerKind::ngsgd;
  s.batch = 96;
  const nn::Dataset data = test::synthetic(960, 3);
  CHECK_THROWS_WITH(nn::Trainer(data, s, world), Catch::Contains("--average-every"));
  s.optimizer = nn::OptimizerKind::adam;
  s.average_every = 10;
  CHECK_THROWS_WITH(nn::Trainer(data, s, world), Catch::Contains("only sgd and ngsgd"));
}
#endif
