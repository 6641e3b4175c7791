// Training: runs repeat bitwise from a seed, and K-FAC lowers the loss faster than SGD on a
// fixed badly conditioned problem.

#include "common/trainer.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <fstream>
#include <vector>

#ifndef KFAC_EXAMPLES_DATA_DIR
#define KFAC_EXAMPLES_DATA_DIR "/usr/share/datasets/fashion-mnist"
#endif

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

bool have_fashion_mnist() {
  return bool(std::ifstream(std::string(KFAC_EXAMPLES_DATA_DIR) + "/train-images-idx3-ubyte.gz"));
}

}  // namespace

TEST_CASE("a short run gives the same losses twice", "[training][determinism]") {
  const nn::Dataset data = test::synthetic(256, 21);
  std::vector<nn::OptimizerKind> kinds{nn::OptimizerKind::sgd, nn::OptimizerKind::adam};
  if (KFAC_EXAMPLES_HAVE_KFAC) kinds.push_back(nn::OptimizerKind::kfac);
  for (const char* model : {"mlp", "cnn"})
    for (nn::OptimizerKind k : kinds) {
      DYNAMIC_SECTION(model << " " << nn::to_string(k)) {
        nn::TrainSettings s;
        s.model = model;
        s.optimizer = k;
        s.batch = 64;
        s.seed = 5;
        const auto first = losses(data, s, 2), second = losses(data, s, 2);
        REQUIRE(first.size() == 8);
        CHECK(first == second);  // bitwise
        s.seed = 6;
        CHECK(losses(data, s, 2) != first);
      }
    }
}

TEST_CASE("a short run on Fashion-MNIST repeats and learns", "[training][determinism][data]") {
  if (!have_fashion_mnist()) {
    WARN("Fashion-MNIST not installed; skipped (apt-get install dataset-fashion-mnist)");
    return;
  }
  const nn::Dataset data = nn::load_fashion_mnist(KFAC_EXAMPLES_DATA_DIR, "train", 1024);
  nn::TrainSettings s;
  s.batch = 128;
  const auto first = losses(data, s, 2), second = losses(data, s, 2);
  CHECK(first == second);
  CHECK(first.back() < 0.6 * first.front());
}

#if KFAC_EXAMPLES_HAVE_KFAC
TEST_CASE("K-FAC lowers the training loss faster than SGD", "[training][kfac]") {
  // Features scaled over two orders of magnitude: what curvature information is for.
  const nn::Dataset data = test::synthetic(2048, 31, 1.0);
  nn::TrainSettings s;
  s.batch = 128;
  s.seed = 3;
  s.optimizer = nn::OptimizerKind::sgd;
  const auto sgd = losses(data, s, 2);
  // The eigendecomposition settings (the CNN's): on this problem they reach about 1e-6. The
  // MLP's damped Cholesky inverses (damping 0.3, kl_clip 1e-2), best on Fashion-MNIST, stay
  // at 0.26 here, worse than SGD: damping each factor by sqrt(damping) flattens the
  // preconditioner where these features' scales differ most (docs/fashion_mnist.md).
  s.optimizer = nn::OptimizerKind::kfac;
  s.kfac = nn::default_kfac("cnn");
  s.lr = nn::default_lr(nn::OptimizerKind::kfac, "cnn");
  const auto kfac = losses(data, s, 2);
  // Mean over the last 8 steps, to compare levels rather than one noisy batch.
  auto tail = [](const std::vector<double>& v) {
    double sum = 0.0;
    for (std::size_t i = v.size() - 8; i < v.size(); ++i) sum += v[i];
    return sum / 8;
  };
  INFO("sgd " << tail(sgd) << ", kfac " << tail(kfac));
  CHECK(tail(kfac) < 0.5 * tail(sgd));  // measured: about 2e-6 against 0.06
}
#endif
