// NG-SGD in the example's trainer: it lowers the training loss faster than plain SGD on a
// Fashion-MNIST subset, runs repeat bitwise from a seed, and rank-0 estimates give plain SGD.

#include <catch2/catch.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "common/trainer.hpp"
#include "helpers.hpp"

#ifndef KFAC_EXAMPLES_DATA_DIR
#define KFAC_EXAMPLES_DATA_DIR "/usr/share/datasets/fashion-mnist"
#endif

#if KFAC_EXAMPLES_HAVE_KFAC
namespace {

std::vector<double> losses(const nn::Dataset& data, nn::TrainSettings s, int epochs) {
  nn::Trainer t(data, s);
  std::vector<double> out;
  for (int e = 0; e < epochs; ++e) {
    t.start_epoch(e);
    for (int i = 0; i < t.steps_per_epoch(); ++i) out.push_back(t.step(i).mean_loss());
  }
  return out;
}

double tail(const std::vector<double>& v) {  // mean over the last 8 steps: levels, not one batch
  double sum = 0.0;
  for (std::size_t i = v.size() - 8; i < v.size(); ++i) sum += v[i];
  return sum / 8;
}

}  // namespace

TEST_CASE("NG-SGD lowers the training loss faster than SGD", "[training][ngsgd][data]") {
  // On Fashion-MNIST (the first 2048 images, 2 epochs of 16 steps), as in the demo. Not on
  // test_training.cpp's synthetic problem, whose features are scaled over two orders of
  // magnitude: there NG-SGD ends at 0.19 against SGD's 0.06 (lr 0.05; both diverge at 0.1),
  // since the norm-preserving scale and alpha = 4's smoothing give it none of K-FAC's
  // per-direction magnitudes (docs/ngsgd.md, "Measured").
  if (!std::ifstream(std::string(KFAC_EXAMPLES_DATA_DIR) + "/train-images-idx3-ubyte.gz")) {
    WARN("Fashion-MNIST not installed; skipped (apt-get install dataset-fashion-mnist)");
    return;
  }
  const nn::Dataset data = nn::load_fashion_mnist(KFAC_EXAMPLES_DATA_DIR, "train", 2048);
  nn::TrainSettings s;
  s.batch = 128;
  s.seed = 3;
  s.lr = 0.05;  // the demo's default of both
  s.optimizer = nn::OptimizerKind::sgd;
  const auto sgd = losses(data, s, 2);
  s.optimizer = nn::OptimizerKind::ngsgd;
  const auto ngsgd = losses(data, s, 2);
  REQUIRE(ngsgd.size() == 32);
  INFO("sgd " << tail(sgd) << ", ngsgd " << tail(ngsgd));
  CHECK(tail(ngsgd) < 0.8 * tail(sgd));  // measured 0.358 against 0.574 (0.62x); 0.386 with the former NG-SGD defaults
  CHECK(losses(data, s, 2) == ngsgd);    // bitwise
}

TEST_CASE("NG-SGD with rank 0 estimates is plain SGD", "[training][ngsgd]") {
  // With rank 0 on both sides the block returns the gradient bit for bit (docs/ngsgd.md), so
  // the rule must reduce to SGD exactly: this checks the glue feeds and applies what it should.
  const nn::Dataset data = test::synthetic(512, 7);
  nn::TrainSettings s;
  s.batch = 64;
  s.seed = 4;
  s.lr = 0.05;
  s.optimizer = nn::OptimizerKind::sgd;
  const auto sgd = losses(data, s, 1);
  s.optimizer = nn::OptimizerKind::ngsgd;
  s.ngsgd.rank = 0;
  CHECK(losses(data, s, 1) == sgd);  // bitwise
  s.ngsgd.rank = -1;                 // Kaldi's ranks: a different trajectory
  CHECK(losses(data, s, 1) != sgd);
}
#endif
