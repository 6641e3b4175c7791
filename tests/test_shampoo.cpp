// A method whose statistics come from the gradient (toy_shampoo.hpp: Shampoo, defined in the
// tests through Block::observe_gradient): against a dense reference, over a long run with a
// checkpoint, after a failed step retried, in the cost model, and next to K-FAC layers.
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/planning/cost_model.hpp>

#include "shampoo_data.hpp"
#include "toy_method.hpp"

using namespace kfac_test;

namespace {

constexpr double kDecay = 0.9, kDamping = 0.05;

kfac::Options shampoo_options(long inv_every) {
  return plain_options(kDamping).with_factor_decay(kDecay).with_inv_update_steps(inv_every);
}

/// With a bias column (g 3, c 6) and without (g 6, c 4).
const std::vector<ShampooSpec> kShampoo = {{"s", 5, 3, true, true}, {"t", 4, 6, false, true}};

std::string saved(const Pre& pre) {
  std::ostringstream os;
  pre.save(os);
  return os.str();
}

bool bit_equal(const MatrixXd& a, const MatrixXd& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(double)) == 0;
}

/// Steps [from, to): every step's preconditioned gradients.
std::vector<std::vector<MatrixXd>> run(Pre& pre, const std::vector<ShampooSpec>& layers, long from, long to) {
  std::vector<std::vector<MatrixXd>> out;
  for (long s = from; s < to; ++s) out.push_back(step_at(pre, layers, s));
  return out;
}

}  // namespace

TEST_CASE("Shampoo from the gradient equals a dense reference", "[shampoo][toy]") {
  for (long inv_every : {1L, 3L}) {
    INFO("inv_update_steps " << inv_every);
    Pre pre(shampoo_options(inv_every));
    register_layers(pre, kShampoo);
    std::vector<ShampooReference> ref(kShampoo.size(), ShampooReference{kDecay, kDamping, inv_every});
    for (long step = 0; step < 20; ++step) {
      const auto raw = batches_at(kShampoo, step);
      const auto got = step_at(pre, kShampoo, step);
      for (std::size_t l = 0; l < kShampoo.size(); ++l) {
        INFO("step " << step << ", layer " << kShampoo[l].name);
        const MatrixXd expected = ref[l].precondition(raw[l].gradient());
        CHECK(close_to(got[l], expected, 1e-10));
        const auto& blk = pre.layer_as<ShampooBlock<double, Host>>(kShampoo[l].name);
        CHECK(close_to(blk.left(), ref[l].l, 1e-12));
        CHECK(close_to(blk.right(), ref[l].r, 1e-12));
      }
    }
    CHECK(pre.layer("s").kind() == std::string("shampoo"));
  }
}

TEST_CASE("a long Shampoo run stays finite and resumes from a checkpoint bit for bit", "[shampoo][toy][checkpoint]") {
  const long steps = 300, mid = 150;
  Pre whole(shampoo_options(3));
  register_layers(whole, kShampoo);
  const auto expected = run(whole, kShampoo, 0, steps);
  bool finite = true;
  for (const auto& step : expected)
    for (const auto& m : step) finite = finite && m.allFinite();
  CHECK(finite);
  for (const auto& s : kShampoo) {
    const auto& blk = whole.layer_as<ShampooBlock<double, Host>>(s.name);
    CHECK((blk.left().allFinite() && blk.right().allFinite()));
  }

  for (bool with_decompositions : {true, false}) {
    INFO("with decompositions: " << with_decompositions);
    Pre first(shampoo_options(3));
    register_layers(first, kShampoo);
    run(first, kShampoo, 0, mid);
    std::stringstream ckpt;
    first.save(ckpt, with_decompositions);
    Pre resumed(shampoo_options(3));
    register_layers(resumed, kShampoo);
    CHECK(resumed.load(ckpt));
    const auto rest = run(resumed, kShampoo, mid, steps);
    bool same = true;
    for (std::size_t k = 0; k < rest.size(); ++k)
      for (std::size_t l = 0; l < kShampoo.size(); ++l) same = same && bit_equal(rest[k][l], expected[mid + k][l]);
    CHECK(same);
    CHECK(saved(resumed) == saved(whole));
  }
}

TEST_CASE("a failed Shampoo step retried equals one that never failed", "[shampoo][toy][atomic]") {
  // The toy ScaledIdentity layer fails its decomposition after Shampoo has taken the gradient:
  // the retries take it again, and it must replace (not add to) what the failed attempts took.
  const auto register_both = [](Pre& pre) {
    register_layers(pre, kShampoo);
    pre.register_layer("toy", kfac::Dense(4, 3), ScaledIdentity{}.with_damping(0.5));
  };
  Pre failing(shampoo_options(1)), twin(shampoo_options(1));
  register_both(failing);
  register_both(twin);
  const std::vector<ShampooSpec> toy = {{"toy", 4, 3, true, false}};
  for (long step = 0; step < 8; ++step) {
    auto data = batches_at(kShampoo, step), toy_data = batches_at(toy, step);
    data.push_back(toy_data[0]);
    auto twin_data = data;
    for (auto& d : twin_data) d = d.twin();
    for (std::size_t l = 0; l < data.size(); ++l) {
      const std::string name = l < kShampoo.size() ? kShampoo[l].name : "toy";
      data[l].feed(failing, name);
      twin_data[l].feed(twin, name);
    }
    if (step == 4) {
      const ToyFailScope fail(ToyFailure::error);
      CHECK_THROWS_AS(failing.step(), kfac::Error);
      CHECK_THROWS_AS(failing.step(), kfac::Error);
    }
    failing.step();
    twin.step();
    INFO("step " << step);
    for (std::size_t l = 0; l < data.size(); ++l) CHECK(bit_equal(data[l].gradient(), twin_data[l].gradient()));
  }
  CHECK(saved(failing) == saved(twin));
}

TEST_CASE("the cost model describes Shampoo from its block", "[shampoo][toy][cost_model]") {
  const auto opts = shampoo_options(1);
  kfac::CostModel model;
  for (const auto& s : kShampoo) model.add(s.name, kfac::Dense(s.in, s.out, s.bias), Shampoo{});
  const auto& s = model.layer("s");  // g 3, c 6
  CHECK(s.decomposed_factors() == 2);
  CHECK(s.unit_costs[0].work.eigh_n3 == 27.0);
  CHECK(s.unit_costs[1].work.eigh_n3 == 216.0);
  CHECK(s.factor_payload_counts() == std::vector<std::size_t>{9, 36});
  CHECK(s.decomposition_buffer_counts(1) == std::vector<std::size_t>{36});
  const kfac::MachineFigures m;
  CHECK(m.decomposition_seconds(s, 0) == Approx(27 * m.eigen_seconds_per_n3));
  CHECK(m.decomposition_seconds(s, 1) == Approx(216 * m.eigen_seconds_per_n3));
  CHECK(m.preconditioning_seconds(s) == Approx(2.0 * 3 * 6 * (3 + 6) / m.gemm_flops));
  const auto p = model.predict(1, opts);
  CHECK(p.ranks[0].decomposition_n3 == Approx(27 + 216 + 216 + 64));

  Pre pre(opts);
  register_layers(pre, kShampoo);
  run(pre, kShampoo, 0, 2);
  const auto got = pre.memory_report();
  REQUIRE(got.size() == p.ranks[0].memory.size());
  for (std::size_t l = 0; l < got.size(); ++l) {
    INFO("layer " << got[l].name);
    const auto& want = p.ranks[0].memory[l];
    CHECK(want.kind == got[l].kind);
    CHECK(want.factor_bytes == got[l].factor_bytes);
    CHECK(want.decomposition_bytes == got[l].decomposition_bytes);
    CHECK(want.workspace_bytes == got[l].workspace_bytes);
  }
  CHECK(got[0].factor_bytes == (9 + 36) * 8);
  CHECK(got[0].workspace_bytes == 3 * 18 * 8);
}

TEST_CASE("Shampoo layers and K-FAC layers on one preconditioner", "[shampoo][toy]") {
  const std::vector<ShampooSpec> mixed = {{"fc", 3, 2, true, false}, {"s", 5, 3, true, true}, {"fc2", 4, 4, true, false}};
  const std::vector<ShampooSpec> kfac_only = {mixed[0], mixed[2]};
  Pre both(shampoo_options(2)), alone(shampoo_options(2));
  register_layers(both, mixed);
  register_layers(alone, kfac_only);
  ShampooReference ref{kDecay, kDamping, 2};
  for (long step = 0; step < 10; ++step) {
    INFO("step " << step);
    const MatrixXd expected = ref.precondition(batches_at(mixed, step)[1].gradient());
    const auto got = step_at(both, mixed, step);
    // The K-FAC layers draw the same data in both (batches_at seeds by position: fc2 is layer 2
    // of `mixed` and layer 1 of `kfac_only`, so `alone` steps on `mixed`'s data remapped).
    const auto data = batches_at(mixed, step);
    for (std::size_t k : {std::size_t(0), std::size_t(2)}) data[k].feed(alone, mixed[k].name);
    alone.step();
    CHECK(close_to(got[1], expected, 1e-10));
    CHECK(bit_equal(got[0], data[0].gradient()));
    CHECK(bit_equal(got[2], data[2].gradient()));
  }
}
