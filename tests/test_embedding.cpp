// kfac::Embedding under kfac::EmbeddingFisher: diag(A), G and the preconditioned step against the
// dense Kronecker solve in double built from one-hot rows, refused ids and shapes, checkpoints,
// the cost model, and a long run of a tiny embedding model.
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <kfac/planning/cost_model.hpp>

#include "helpers.hpp"

using namespace kfac_test;

namespace {

using V3 = Kokkos::View<double***, Kokkos::LayoutRight, Kokkos::HostSpace>;
template <class Factor = kfac::Symmetric>
using EBlock = kfac::EmbeddingBlock<Factor, kfac::Eigendecomposition<>, kfac::DoublePrecision, double, Host>;

constexpr int kVocabulary = 7, kDim = 4;

/// One micro-batch: token ids (rank 1 when `tokens` is 0, else (batch, tokens)) and the output
/// gradient ((batch, dim) or (batch, tokens, dim)).
struct Micro {
  int n, t;
  bool sequence;
  V1<double> ids1;
  V2<double> ids2;
  V2<double> g2;
  V3 g3;

  Micro(int batch, int tokens, bool seq, Rng& rng, int padding)
      : n(batch), t(seq ? tokens : 1), sequence(seq) {
    if (seq) {
      ids2 = V2<double>("ids", n, t);
      g3 = V3("g", n, t, kDim);
    } else {
      ids1 = V1<double>("ids", n);
      g2 = V2<double>("g", n, kDim);
    }
    for (int k = 0; k < n * t; ++k) {
      // ids 0..4 only, so that rows 5 and 6 have a_v = 0; the padding index appears
      const double u = 0.5 * (rng.uniform() + 1.0);
      const double v = padding >= 0 && k % 3 == 0 ? padding : double(int(u * 5) % 5);
      id_data()[k] = v;
    }
    for (int k = 0; k < n * t * kDim; ++k) g_data()[k] = rng.uniform();
  }
  double* id_data() const { return sequence ? ids2.data() : ids1.data(); }
  double* g_data() const { return sequence ? g3.data() : g2.data(); }
  void feed(Pre& pre, const std::string& name) const {
    if (sequence) {
      pre.observe_input(name, ids2);
      pre.observe_output_grad(name, g3);
    } else {
      pre.observe_input(name, ids1);
      pre.observe_output_grad(name, g2);
    }
  }
};

/// The dense statistics of one step from the definitions: per token, the one-hot row e_id and
/// the row scale * g (nothing for a padding token); A = sum e e^T / (N T), G = sum g g^T / N.
struct Reference {
  MatrixXd a_sum = MatrixXd::Zero(kVocabulary, kVocabulary), g_sum = MatrixXd::Zero(kDim, kDim);
  double a_norm = 0, g_norm = 0;

  void add(const Micro& m, double scale, int padding) {
    for (int r = 0; r < m.n * m.t; ++r) {
      const int id = int(m.id_data()[r]);
      if (id == padding) continue;
      MatrixXd e = MatrixXd::Zero(kVocabulary, 1), g(kDim, 1);
      e(id, 0) = 1.0;
      for (int i = 0; i < kDim; ++i) g(i, 0) = scale * m.g_data()[r * kDim + i];
      a_sum += e * e.transpose();
      g_sum += g * g.transpose();
    }
    a_norm += double(m.n) * double(m.t);
    g_norm += double(m.n);
  }
  MatrixXd a() const { return a_sum / a_norm; }
  MatrixXd g() const { return g_sum / g_norm; }
};

/// Two steps of two micro-batches (batch 3 then 2) on an Embedding(7, 4), each step's A, G and
/// preconditioned gradient against the reference (running averages with decay 0.6). A
/// decomposition every 2 steps: step 1 preconditions with diag(A) and G of step 0, as K-FAC
/// does with its factors (a diagonal G, nothing to decompose: with those of step 1).
template <class Factor>
void check_steps(bool sequence, int padding, kfac::LossReduction reduction, unsigned seed) {
  INFO("sequence " << sequence << ", padding " << padding << ", mean "
                   << (reduction == kfac::LossReduction::mean) << ", G " << Factor::name);
  Rng rng(seed);
  const double damping = 0.03, decay = 0.6;
  Pre pre(plain_options(damping).with_loss_reduction(reduction).with_factor_decay(decay).with_inv_update_steps(2));
  kfac::Embedding layer(kVocabulary, kDim);
  if (padding >= 0) layer.with_padding_index(padding);
  pre.register_layer("emb", layer, kfac::EmbeddingFisher<Factor>{});
  MatrixXd a_run, g_run, a_used, g_used;
  for (int step = 0; step < 2; ++step) {
    Reference ref;
    for (const int n : {3, 2}) {
      const Micro m(n, 3, sequence, rng, padding);
      m.feed(pre, "emb");
      ref.add(m, reduction == kfac::LossReduction::mean ? double(n) : 1.0, padding);
    }
    a_run = step == 0 ? ref.a() : MatrixXd(decay * a_run + (1 - decay) * ref.a());
    g_run = step == 0 ? ref.g() : MatrixXd(decay * g_run + (1 - decay) * ref.g());
    auto w = random_view<double>(kVocabulary, kDim, rng);
    const MatrixXd x = to_eigen(w);
    pre.set_gradient("emb", w);
    pre.step();
    INFO("step " << step);
    const auto& block = pre.layer_as<EBlock<Factor>>("emb");
    const auto a = block.factor_a();
    REQUIRE(a.extent(0) == std::size_t(kVocabulary));
    for (int v = 0; v < kVocabulary; ++v) CHECK(a(v) == Approx(a_run(v, v)).epsilon(1e-14).margin(1e-16));
    CHECK(a(5) == 0.0);  // ids that never occur
    if (padding >= 0) CHECK(a(padding) == 0.0);  // padding tokens were there, and count for nothing
    if (Factor::is_diagonal) {
      for (int i = 0; i < kDim; ++i) CHECK(block.factor_g()(i, 0) == Approx(g_run(i, i)).epsilon(1e-13));
    } else {
      const MatrixXd g = symmetric_from_upper(block.factor_g());
      CHECK((g - g_run).norm() <= 1e-13 * g_run.norm());
    }
    if (step == 0 || Factor::is_diagonal) {  // what the step preconditions with
      a_used = a_run;
      g_used = Factor::is_diagonal ? MatrixXd(g_run.diagonal().asDiagonal()) : g_run;
    }
    if (!Factor::is_diagonal) {
      const auto decomposed = block.decomposition_a();
      REQUIRE(decomposed.extent(0) == std::size_t(kVocabulary));
      for (int v = 0; v < kVocabulary; ++v) CHECK(decomposed(v) == Approx(a_used(v, v)).epsilon(1e-14).margin(1e-16));
    }
    // (A ⊗ G + damping I) vec(V) = vec(X), vec row by row: reference.hpp's solve with its roles
    // of A and G exchanged (it solves (G ⊗ A + damping I) for a g x a gradient)
    const MatrixXd want = dense_kronecker_solve(g_used, a_used, x, damping);
    const MatrixXd got = to_eigen(w);
    INFO("relative error " << (got - want).norm() / want.norm());
    CHECK((got - want).norm() <= 1e-11 * want.norm());
  }
}

}  // namespace

TEST_CASE("Embedding: diag(A), G and the step against the dense Kronecker solve in double",
          "[embedding][reference]") {
  static_assert(std::is_same<kfac::default_method<kfac::Embedding>::type, kfac::EmbeddingFisher<>>::value);
  static_assert(!kfac::KFAC<>::accepts<kfac::Embedding> && !kfac::UnitWiseFisher<>::accepts<kfac::Embedding>);
  unsigned seed = 1;
  for (const bool sequence : {false, true})
    for (const int padding : {-1, 2})
      for (const auto reduction : {kfac::LossReduction::sum, kfac::LossReduction::mean}) {
        check_steps<kfac::Symmetric>(sequence, padding, reduction, seed++);
        check_steps<kfac::Diagonal>(sequence, padding, reduction, seed++);
      }
  check_steps<kfac::Full>(true, 2, kfac::LossReduction::mean, seed++);
}

TEST_CASE("Embedding: the default method is EmbeddingFisher<>, and a batch of one token equals token ids of rank 1",
          "[embedding][tokens]") {
  Rng rng(3);
  Pre flat(plain_options()), seq(plain_options());
  flat.register_layer("emb", kfac::Embedding(kVocabulary, kDim));
  seq.register_layer("emb", kfac::Embedding(kVocabulary, kDim), kfac::EmbeddingFisher<>{});
  const Micro m(5, 1, false, rng, -1);
  V2<double> ids2(m.ids1.data(), 5, 1);
  V3 g3(m.g2.data(), 5, 1, kDim);
  m.feed(flat, "emb");
  seq.observe_input("emb", ids2);
  seq.observe_output_grad("emb", g3);
  auto w = random_view<double>(kVocabulary, kDim, rng);
  auto w2 = clone(w);
  flat.set_gradient("emb", w);
  seq.set_gradient("emb", w2);
  flat.step();
  seq.step();
  CHECK(same_bits(w, w2));
  CHECK(flat.layer_as<EBlock<>>("emb").decomposition_g() != nullptr);
}

namespace {
/// A preconditioner with one Embedding(7, 4) "emb" with padding index 2.
std::unique_ptr<Pre> make_embedding_pre(double decay = 0.9, long inv_steps = 10) {
  auto p = std::make_unique<Pre>(plain_options().with_factor_decay(decay).with_inv_update_steps(inv_steps));
  p->register_layer("emb", kfac::Embedding(kVocabulary, kDim).with_padding_index(2));
  return p;
}
}  // namespace

TEST_CASE("Embedding: bad ids and shapes are refused by name, and the state is unchanged", "[embedding][errors]") {
  Rng rng(5);
  const Micro good(3, 2, true, rng, 2);
  auto w = random_view<double>(kVocabulary, kDim, rng);
  // The reference: the good observations alone.
  auto ref = make_embedding_pre();
  auto w_ref = clone(w);
  good.feed(*ref, "emb");
  ref->set_gradient("emb", w_ref);
  ref->step();

  struct Bad {
    const char* what;
    double id;
    std::vector<std::string> parts;
  };
  const std::vector<Bad> bad_ids{{"negative", -1.0, {"token id -1 (sample 1, token 0)", "negative"}},
                                 {"beyond the vocabulary", 7.0, {"token id 7", "out of range", "vocabulary has 7"}},
                                 {"not an integer", 2.5, {"token id 2.5", "not an integer"}},
                                 {"NaN", std::nan(""), {"NaN"}}};
  for (const auto& b : bad_ids) {
    INFO(b.what);
    auto pre = make_embedding_pre();
    V2<double> ids = clone(good.ids2);
    ids(1, 0) = b.id;
    expect_error([&] { pre->observe_input("emb", ids); }, "emb", b.parts);
    // the gradient that would pair with the refused ids has none to pair with
    expect_error([&] { pre->observe_output_grad("emb", good.g3); }, "emb", {"without a matching input"});
    auto w2 = clone(w);
    good.feed(*pre, "emb");
    pre->set_gradient("emb", w2);
    pre->step();
    CHECK(same_bits(w2, w_ref));
  }
  SECTION("shapes") {
    auto pre = make_embedding_pre();
    expect_error([&] { pre->observe_input("emb", V3("ids", 3, 2, 1)); }, "emb",
                 {"(3, 2, 1)", "expected token ids of shape (batch) or (batch, tokens)"});
    pre->observe_input("emb", good.ids2);
    expect_error([&] { pre->observe_output_grad("emb", V3("g", 3, 4, kDim)); }, "emb",
                 {"(3, 4, 4)", "4 tokens per sample", "token ids it pairs with have shape (3, 2)", "2 tokens"});
    expect_error([&] { pre->observe_output_grad("emb", V2<double>("g", 3, kDim)); }, "emb",
                 {"1 tokens per sample", "2 tokens per sample"});
    expect_error([&] { pre->observe_output_grad("emb", V3("g", 3, 2, 5)); }, "emb",
                 {"(3, 2, 5)", "expected (batch, 4) or (batch, tokens, 4)"});
    expect_error([&] { pre->observe_output_grad("emb", V3("g", 2, 2, kDim)); }, "emb", {"batch 2", "batch 3"});
    pre->observe_output_grad("emb", good.g3);
    auto w2 = clone(w);
    pre->set_gradient("emb", w2);
    pre->step();
    CHECK(same_bits(w2, w_ref));
    // rank-1 ids pair with (batch, dim) gradients only
    pre->observe_input("emb", V1<double>("ids", 3));
    expect_error([&] { pre->observe_output_grad("emb", V3("g", 3, 2, kDim)); }, "emb",
                 {"2 tokens per sample", "(3)", "1 tokens per sample"});
    // a gradient of the wrong width is refused on a step without a statistics update too
    Pre later(plain_options().with_factor_update_steps(2));
    later.register_layer("emb", kfac::Embedding(kVocabulary, kDim));
    good.feed(later, "emb");
    auto w3 = clone(w);
    later.set_gradient("emb", w3);
    later.step();
    REQUIRE_FALSE(later.wants_observations("emb"));
    expect_error([&] { later.observe_output_grad("emb", V3("g", 3, 2, 5)); }, "emb", {"(3, 2, 5)"});
  }
  SECTION("padding index and sizes") {
    expect_error([] { kfac::Embedding(kVocabulary, kDim).with_padding_index(7); }, "", {"padding_index"});
    expect_error([] { kfac::Embedding(0, kDim); }, "", {"vocabulary >= 1"});
  }
}

TEST_CASE("Embedding: a checkpoint round trip resumes bit for bit", "[embedding][checkpoint]") {
  for (const bool diagonal : {false, true}) {
    INFO("diagonal G " << diagonal);
    Rng rng(12);
    auto make = [&] {
      auto p = std::make_unique<Pre>(plain_options().with_factor_decay(0.9).with_inv_update_steps(2));
      kfac::Embedding layer = kfac::Embedding(kVocabulary, kDim).with_padding_index(2);
      if (diagonal) p->register_layer("emb", layer, kfac::EmbeddingFisher<kfac::Diagonal>{});
      else p->register_layer("emb", layer);
      return p;
    };
    auto a = make();
    auto feed = [&](Pre& p, const Micro& m, V2<double>& w) {
      m.feed(p, "emb");
      p.set_gradient("emb", w);
      p.step();
    };
    for (int s = 0; s < 3; ++s) {
      const Micro m(4, 3, true, rng, 2);
      auto w = random_view<double>(kVocabulary, kDim, rng);
      feed(*a, m, w);
    }
    std::stringstream bytes;
    a->save(bytes);
    auto b = make();
    REQUIRE(b->load(bytes));
    const Micro m(4, 3, true, rng, 2);
    auto wa = random_view<double>(kVocabulary, kDim, rng);
    auto wb = clone(wa);
    feed(*a, m, wa);  // step 3: no decomposition, the restored eigenbasis of G
    feed(*b, m, wb);
    CHECK(same_bits(wa, wb));
  }
}

TEST_CASE("Embedding: the cost model prices the block from its description", "[embedding][cost_model]") {
  const kfac::index_t v = 1000, d = 16;
  const auto s = kfac::LayerShape::of("emb", kfac::Embedding(v, d));
  CHECK(s.kind == "embedding");
  CHECK_FALSE(s.kronecker);
  CHECK(s.g_dim == v);  // the gradient is vocabulary x dim
  CHECK(s.a_dim == d);
  CHECK(s.factor_payload_counts() == std::vector<std::size_t>{std::size_t(v), std::size_t(d * (d + 1) / 2)});
  REQUIRE(s.decomposed_factors() == 1);
  CHECK(s.decomposition_buffer_counts(0) ==
        std::vector<std::size_t>{std::size_t(d * d), std::size_t(d), std::size_t(v)});  // Q, lambda, diag(A)
  CHECK(s.unit_costs[0].work.eigh_n3 == double(d) * d * d);
  CHECK(s.plan.apply.gemm_flops == 4.0 * d * d * v);
  const auto diag = kfac::LayerShape::of("emb", kfac::Embedding(v, d), kfac::EmbeddingFisher<kfac::Diagonal>{});
  CHECK(diag.decomposed_factors() == 0);
  CHECK(diag.factor_payload_counts() == std::vector<std::size_t>{std::size_t(v), std::size_t(d)});
  // MEM-OPT at 2 ranks: the one gradient worker sends the whole preconditioned gradient once.
  const auto p = kfac::CostModel(std::vector<kfac::LayerShape>{s}).predict(2, 0.5);
  CHECK(p.ranks[0].gradient_bytes_sent + p.ranks[1].gradient_bytes_sent == std::size_t(v * d * 8));
  CHECK(p.ranks[0].factor_bytes_sent == 2 * 8 * std::size_t(v + d * (d + 1) / 2));
  CHECK(p.gradient_pass_seconds > 0);

  // Memory: what a real Preconditioner reports after two steps, layer by layer.
  for (const bool reciprocal : {false, true}) {
    const auto opts = plain_options().with_inv_update_steps(1).with_precompute_reciprocal(reciprocal);
    Pre pre(opts);
    pre.register_layer("emb", kfac::Embedding(kVocabulary, kDim).with_padding_index(2));
    pre.register_layer("diag", kfac::Embedding(kVocabulary, kDim), kfac::EmbeddingFisher<kfac::Diagonal>{});
    kfac::CostModel model;
    model.add("emb", kfac::Embedding(kVocabulary, kDim).with_padding_index(2), kfac::EmbeddingFisher<>{});
    model.add("diag", kfac::Embedding(kVocabulary, kDim), kfac::EmbeddingFisher<kfac::Diagonal>{});
    Rng rng(9);
    for (int step = 0; step < 2; ++step) {
      const Micro m(4, 3, true, rng, 2);
      auto w = random_view<double>(kVocabulary, kDim, rng), w2 = random_view<double>(kVocabulary, kDim, rng);
      m.feed(pre, "emb");
      m.feed(pre, "diag");
      pre.set_gradient("emb", w);
      pre.set_gradient("diag", w2);
      pre.step();
    }
    const auto got = pre.memory_report();
    const auto& mem = model.predict(1, opts).ranks[0].memory;
    REQUIRE(got.size() == 2);
    for (std::size_t l = 0; l < 2; ++l) {
      INFO("layer " << got[l].name << ", precompute_reciprocal " << reciprocal);
      CHECK(mem[l].factor_bytes == got[l].factor_bytes);
      CHECK(mem[l].decomposition_bytes == got[l].decomposition_bytes);
      CHECK(mem[l].workspace_bytes == got[l].workspace_bytes);
    }
    // diag(A) and G, never a vocabulary x vocabulary matrix
    CHECK(got[0].factor_bytes == (kVocabulary + kDim * kDim) * 8);
    CHECK(got[1].factor_bytes == (kVocabulary + kDim) * 8);
    CHECK(got[0].decomposition_bytes == (kDim * kDim + kDim + kVocabulary) * 8);
  }
}

TEST_CASE("Embedding: a few hundred steps of a tiny embedding model decrease its loss and stay finite",
          "[embedding][long_run]") {
  // y[n, t] = W[id[n, t]]; loss = (1/N) sum over non-padding tokens of |y - target[id]|^2 / 2.
  // The observed output gradients are Monte Carlo samples of the model's Fisher (unit-variance
  // noise over N, LossReduction::mean): A ⊗ G then estimates count_v / N, this loss's Hessian.
  const int vocab = 20, dim = 6, n = 8, t = 5, pad = 0;
  Rng rng(21);
  const auto target = random_view<double>(vocab, dim, rng);
  V2<double> weights("w", vocab, dim);
  Pre pre(kfac::Options{}.with_damping(1e-3).with_kl_clip(0.0).with_inv_update_steps(5));
  pre.register_layer("emb", kfac::Embedding(vocab, dim).with_padding_index(pad));
  // A fixed evaluation batch: every id, with frequencies skewed towards small ids.
  auto draw = [&](V2<double>& ids) {
    for (int k = 0; k < n * t; ++k) {
      const double u = 0.5 * (rng.uniform() + 1.0);
      ids.data()[k] = double(int(u * u * vocab) % vocab);
    }
  };
  auto loss_of = [&](const V2<double>& ids) {
    double l = 0;
    for (int k = 0; k < n * t; ++k) {
      const int id = int(ids.data()[k]);
      if (id == pad) continue;
      for (int i = 0; i < dim; ++i) l += 0.5 * std::pow(weights(id, i) - target(id, i), 2) / n;
    }
    return l;
  };
  V2<double> eval("eval", n, t);
  draw(eval);
  const double first = loss_of(eval);
  double last = first;
  for (int step = 0; step < 300; ++step) {
    V2<double> ids("ids", n, t);
    draw(ids);
    V3 noise("noise", n, t, dim);
    for (std::size_t k = 0; k < noise.span(); ++k) noise.data()[k] = std::sqrt(3.0) * rng.uniform() / n;
    V2<double> grad("grad", vocab, dim);
    for (int k = 0; k < n * t; ++k) {
      const int id = int(ids.data()[k]);
      if (id == pad) continue;
      for (int i = 0; i < dim; ++i) grad(id, i) += (weights(id, i) - target(id, i)) / n;
    }
    pre.observe_input("emb", ids);
    pre.observe_output_grad("emb", noise);
    pre.set_gradient("emb", grad);
    pre.step();
    for (int v = 0; v < vocab; ++v)
      for (int i = 0; i < dim; ++i) {
        REQUIRE(std::isfinite(grad(v, i)));
        weights(v, i) -= 0.2 * grad(v, i);
      }
    last = loss_of(eval);
    REQUIRE(std::isfinite(last));
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 1e-3 * first);
  for (int i = 0; i < dim; ++i) CHECK(weights(pad, i) == 0.0);  // the padding row never moves
}

TEST_CASE("Embedding: a float Preconditioner with float ids agrees with double", "[embedding][float]") {
  Rng rng(17);
  const Micro m(4, 3, true, rng, 2);
  using PreF = kfac::Preconditioner<float, Host>;
  PreF pf(plain_options().with_loss_reduction(kfac::LossReduction::mean));
  Pre pd(plain_options().with_loss_reduction(kfac::LossReduction::mean));
  const kfac::Embedding layer = kfac::Embedding(kVocabulary, kDim).with_padding_index(2);
  pf.register_layer("emb", layer);
  pd.register_layer("emb", layer);
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> ids("ids", 4, 3);
  Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::HostSpace> g("g", 4, 3, kDim);
  for (std::size_t i = 0; i < ids.span(); ++i) ids.data()[i] = float(m.ids2.data()[i]);
  for (std::size_t i = 0; i < g.span(); ++i) g.data()[i] = float(m.g3.data()[i]);
  auto wd = random_view<double>(kVocabulary, kDim, rng);
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> wf("wf", kVocabulary, kDim);
  for (std::size_t i = 0; i < wf.span(); ++i) wf.data()[i] = float(wd.data()[i]);
  pf.observe_input("emb", ids);
  pf.observe_output_grad("emb", g);
  pf.set_gradient("emb", wf);
  m.feed(pd, "emb");
  pd.set_gradient("emb", wd);
  pf.step();
  pd.step();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < wd.span(); ++i) {
    num += std::pow(double(wf.data()[i]) - wd.data()[i], 2);
    den += wd.data()[i] * wd.data()[i];
  }
  INFO("relative difference " << std::sqrt(num / den));
  CHECK(std::sqrt(num / den) < 1e-4);
  ids(0, 1) = 0.5f;
  expect_error([&] { pf.observe_input("emb", ids); }, "emb", {"token id 0.5", "not an integer"});
}

TEST_CASE("Embedding: a deferred decomposition (decomposition_delay) swaps in G's eigenbasis and diag(A) together",
          "[embedding][deferred]") {
  // With a delay of 1 and a decomposition every 2 steps, step 3 preconditions with the unit
  // decomposed from the statistics of step 2: the same as an undelayed run's step 2 unit.
  Rng rng(23);
  Pre delayed(plain_options().with_inv_update_steps(2).with_decomposition_delay(1));
  Pre plain(plain_options().with_inv_update_steps(2));
  for (Pre* p : {&delayed, &plain}) p->register_layer("emb", kfac::Embedding(kVocabulary, kDim).with_padding_index(2));
  for (int step = 0; step < 4; ++step) {
    const Micro m(3, 2, true, rng, 2);
    auto w = random_view<double>(kVocabulary, kDim, rng);
    auto w2 = clone(w);
    m.feed(delayed, "emb");
    m.feed(plain, "emb");
    delayed.set_gradient("emb", w);
    plain.set_gradient("emb", w2);
    delayed.step();
    plain.step();
    for (std::size_t i = 0; i < w.span(); ++i) REQUIRE(std::isfinite(w.data()[i]));
    if (step == 2) CHECK_FALSE(same_bits(w, w2));  // the delayed run still uses the unit of step 0
  }
  const auto& d = delayed.layer_as<EBlock<>>("emb");
  const auto& p = plain.layer_as<EBlock<>>("emb");
  // after step 3 both hold the unit decomposed from the statistics of step 2
  CHECK(same_bits(d.decomposition_a(), p.decomposition_a()));
  CHECK(same_bits(d.decomposition_g()->lambda, p.decomposition_g()->lambda));
}
