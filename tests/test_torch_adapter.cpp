// The LibTorch adapter (kfac/adapters/torch.hpp): a LibTorch model's preconditioned gradients
// equal those of the same layers fed to kfac directly with the same inputs; the mean-reduced
// cross-entropy convention; the modules it cannot handle or that were not observed are named;
// skipped modules' gradients are left bit for bit.
#include <kfac/adapters/torch.hpp>
// LibTorch's logging (glog) defines CHECK; the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "torch_errors.hpp"

namespace {

using Host = kfac::impl::TorchExec;
using kfac::adapters::observed;
using kfac::adapters::TorchOptions;
using kfac::adapters::TorchPreconditioner;

/// What the test itself records of each layer, independently of the adapter: the input (for
/// BatchNorm2d the test's own x̂) and the output gradient (its own tensor hook).
struct Tape {
  std::map<std::string, at::Tensor> input, grad;
  template <class M>
  at::Tensor call(const std::string& name, M& module, const at::Tensor& x) {
    input[name] = x.detach().clone();
    at::Tensor y = observed(module, x);
    if (y.requires_grad()) y.register_hook([this, name](const at::Tensor& g) { grad[name] = g.detach().clone(); });
    return y;
  }
};

/// x̂ of a training-mode BatchNorm2d by plain loops in double: batch mean, biased variance.
at::Tensor reference_xhat(const at::Tensor& x, double eps) {
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  at::Tensor out = torch::empty_like(xd);
  const int64_t N = xd.size(0), C = xd.size(1), HW = xd.size(2) * xd.size(3);
  const double* p = xd.data_ptr<double>();
  double* q = out.data_ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    double mean = 0, var = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) mean += p[(n * C + c) * HW + i];
    mean /= double(N * HW);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) var += (p[(n * C + c) * HW + i] - mean) * (p[(n * C + c) * HW + i] - mean);
    var /= double(N * HW);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) q[(n * C + c) * HW + i] = (p[(n * C + c) * HW + i] - mean) / std::sqrt(var + eps);
  }
  return out;
}

/// A small CNN: Conv2d with stride, padding and dilation, BatchNorm2d, Conv2d without bias,
/// Linear with and without bias.
struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  NetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, {3, 2}).stride({2, 1}).padding({1, 2}).dilation({1, 2})));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(3));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1).bias(false)));
    fc1 = register_module("fc1", torch::nn::Linear(4 * 4 * 7, 6));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(6, 5).bias(false)));
  }
  at::Tensor forward(at::Tensor x, Tape& t) {
    x = t.call("conv1", conv1, x);
    x = torch::relu(t.call("bn1", bn1, x));
    x = torch::relu(t.call("conv2", conv2, x));
    x = torch::relu(t.call("fc1", fc1, x.flatten(1)));
    return t.call("fc2", fc2, x);
  }
};
TORCH_MODULE(Net);

kfac::Options options() {
  return kfac::Options{}.with_damping(3e-2).with_kl_clip(1e-2).with_lr(0.1).with_inv_update_steps(2).with_factor_decay(0.9);
}

std::vector<at::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<at::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return g;
}

template <class T>
auto raw(const at::Tensor& t) {
  T* p = t.data_ptr<T>();
  if (t.dim() == 4) return kfac::adapters::from_raw(p, t.size(0), t.size(1) * t.size(2) * t.size(3));
  if (t.dim() == 2) return kfac::adapters::from_raw(p, t.size(0), t.size(1));
  return kfac::adapters::from_raw(p, t.numel(), 1);
}
template <class T>
auto raw4(const at::Tensor& t) {
  return kfac::adapters::from_raw(t.data_ptr<T>(), t.size(0), t.size(1), t.size(2), t.size(3));
}
template <class T>
auto raw1(const at::Tensor& t) {
  return t.defined() ? kfac::adapters::from_raw(t.data_ptr<T>(), std::size_t(t.numel()))
                     : kfac::adapters::from_raw(static_cast<T*>(nullptr), 0);
}

}  // namespace

TEST_CASE("torch adapter: preconditioned gradients equal kfac fed directly", "[torch][adapter]") {
  torch::manual_seed(7);
  Net net;
  net->to(at::kDouble);
  TorchPreconditioner kp(*net, options());
  CHECK(kp.dtype() == at::kDouble);
  CHECK((kp.modules() == std::vector<std::string>{"conv1", "bn1", "conv2", "fc1", "fc2"}));

  // The same layers registered with kfac by hand, fed what the test recorded.
  kfac::Preconditioner<double, Host> ref(options());
  ref.register_layer("conv1", kfac::Conv2d(2, 3, 3, 2).with_stride(2, 1).with_padding(1, 2).with_dilation(1, 2));
  ref.register_layer("bn1", kfac::BatchNorm2d(3));
  ref.register_layer("conv2", kfac::Conv2d(3, 4, 3, 3).with_padding(1, 1).with_bias(false));
  ref.register_layer("fc1", kfac::Dense(112, 6));
  ref.register_layer("fc2", kfac::Dense(6, 5, false));

  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = torch::randn({6, 2, 7, 5}, at::kDouble);
    const at::Tensor y = torch::randint(0, 5, {6}, at::kLong);
    net->zero_grad();
    Tape tape;
    torch::nn::functional::cross_entropy(net->forward(x, tape), y).backward();
    const std::vector<at::Tensor> before = grads_of(*net);
    kp.precondition();

    // The reference: unpreconditioned copies of the gradients, preconditioned by kfac directly.
    REQUIRE(ref.wants_observations());  // factor_update_steps = 1
    const double eps = net->bn1->options.eps();
    for (const char* conv : {"conv1", "conv2"}) {
      ref.observe_input(conv, raw4<double>(tape.input[conv]));
      ref.observe_output_grad(conv, raw4<double>(tape.grad[conv]));
    }
    const at::Tensor xhat = reference_xhat(tape.input["bn1"], eps);
    ref.observe_input("bn1", raw4<double>(xhat));
    ref.observe_output_grad("bn1", raw4<double>(tape.grad["bn1"]));
    for (const char* fc : {"fc1", "fc2"}) {
      ref.observe_input(fc, raw<double>(tape.input[fc]));
      ref.observe_output_grad(fc, raw<double>(tape.grad[fc]));
    }
    // parameters(): conv1.w, conv1.b, bn1.w, bn1.b, conv2.w, fc1.w, fc1.b, fc2.w
    std::vector<at::Tensor> g;
    for (const auto& t : before) g.push_back(t.clone());
    ref.set_gradient("conv1", raw4<double>(g[0]), raw1<double>(g[1]));
    ref.set_gradient("bn1", raw1<double>(g[2]), raw1<double>(g[3]));
    ref.set_gradient("conv2", raw4<double>(g[4]));
    ref.set_gradient("fc1", raw<double>(g[5]), raw1<double>(g[6]));
    ref.set_gradient("fc2", raw<double>(g[7]));
    ref.step();

    const std::vector<at::Tensor> after = grads_of(*net);
    REQUIRE(after.size() == g.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      INFO("step " << step << ", parameter " << i);
      CHECK(!torch::allclose(after[i], before[i], 1e-6, 0.0));  // preconditioning changed it
      CHECK(torch::allclose(after[i], g[i], 1e-10, 1e-13));
    }
    CHECK(kp.last_kl_scale() == Approx(ref.last_kl_scale()).epsilon(1e-10));
  }
  CHECK(kp.step_count() == 4);
}

TEST_CASE("torch adapter: float models get a float preconditioner", "[torch][adapter][dtype]") {
  torch::manual_seed(3);
  torch::nn::Linear fc(4, 3);
  TorchPreconditioner kp(*fc, options());
  CHECK(kp.dtype() == at::kFloat);
  CHECK((kp.modules() == std::vector<std::string>{"root"}));
  CHECK_NOTHROW(kp.preconditioner<float>());
  CHECK_THROWS_AS(kp.preconditioner<double>(), kfac::Error);

  const at::Tensor x = torch::randn({8, 4});
  const at::Tensor out = observed(fc, x);
  torch::nn::functional::cross_entropy(out, torch::randint(0, 3, {8}, at::kLong)).backward();
  const at::Tensor w0 = fc->weight.grad().clone();
  kp.precondition();
  CHECK(!torch::equal(w0, fc->weight.grad()));
  CHECK(torch::isfinite(fc->weight.grad()).all().item<bool>());
}

TEST_CASE("torch adapter: G of a mean-reduced cross_entropy is the per-sample Fisher factor", "[torch][adapter][loss]") {
  // With loss = mean_n CE(z_n, y_n), autograd gives dL/dz_n = (softmax(z_n) - e_{y_n}) / N.
  // kfac's LossReduction::mean multiplies output gradients by N before forming G, so G must be
  // (1/N) sum_n g_n g_n^T with the per-sample gradients g_n = softmax(z_n) - e_{y_n}, computed
  // here in closed form from the logits (not from autograd), and A = (1/N) sum_n [x_n;1][x_n;1]^T.
  torch::manual_seed(11);
  torch::nn::Linear fc(torch::nn::LinearOptions(5, 4));
  fc->to(at::kDouble);
  TorchPreconditioner kp(*fc, kfac::Options{}.with_loss_reduction(kfac::LossReduction::mean));
  const int N = 9;
  const at::Tensor x = torch::randn({N, 5}, at::kDouble);
  const at::Tensor y = torch::randint(0, 4, {N}, at::kLong);
  const at::Tensor z = observed(fc, x);
  torch::nn::functional::cross_entropy(z, y).backward();
  kp.precondition();

  using Block = kfac::KFAC<>::block_type<kfac::Dense, double, Host>;
  const auto& block = kp.preconditioner<double>().layer_as<Block>("root");
  const auto G = block.factor_g();
  const auto A = block.factor_a();
  const at::Tensor p = torch::softmax(z.detach(), 1);
  for (int i = 0; i < 4; ++i)
    for (int j = i; j < 4; ++j) {  // Symmetric factors keep the upper triangle
      double g = 0;
      for (int n = 0; n < N; ++n) {
        const double gi = p[n][i].item<double>() - (y[n].item<long>() == i ? 1.0 : 0.0);
        const double gj = p[n][j].item<double>() - (y[n].item<long>() == j ? 1.0 : 0.0);
        g += gi * gj;
      }
      CHECK(double(G(i, j)) == Approx(g / N).epsilon(1e-12).margin(1e-15));
    }
  for (int i = 0; i < 6; ++i)
    for (int j = i; j < 6; ++j) {
      double a = 0;
      for (int n = 0; n < N; ++n) a += (i < 5 ? x[n][i].item<double>() : 1.0) * (j < 5 ? x[n][j].item<double>() : 1.0);
      CHECK(double(A(i, j)) == Approx(a / N).epsilon(1e-12).margin(1e-15));
    }
}

namespace {
struct GroupedImpl : torch::nn::Module {
  torch::nn::Conv2d grouped{nullptr}, depthwise{nullptr};
  torch::nn::Linear fc{nullptr};
  GroupedImpl() {
    grouped = register_module("grouped", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).groups(2)));
    depthwise = register_module("depthwise", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).groups(4)));
    fc = register_module("fc", torch::nn::Linear(4, 2));
  }
};
struct TwoImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  torch::nn::EmbeddingBag bag{nullptr};
  explicit TwoImpl(bool with_bag = false) {
    fc1 = register_module("fc1", torch::nn::Linear(4, 4));
    fc2 = register_module("fc2", torch::nn::Linear(4, 4));
    fc3 = register_module("fc3", torch::nn::Linear(4, 3));
    if (with_bag) bag = register_module("bag", torch::nn::EmbeddingBag(10, 4));
  }
};

using kfac_test::error_of;
using kfac_test::has;
}  // namespace

TEST_CASE("torch adapter: unsupported modules are named at registration", "[torch][adapter][errors]") {
  auto grouped = std::make_shared<GroupedImpl>();
  const std::string e = error_of([&] { TorchPreconditioner kp(*grouped); });
  INFO(e);
  CHECK(has(e, "'grouped'"));
  CHECK(has(e, "grouped convolutions (groups = 2)"));
  CHECK(has(e, "'depthwise'"));
  CHECK(has(e, "depthwise"));
  CHECK(!has(e, "'fc'"));
  // Skipped by name pattern, then by type: registration succeeds with what is left.
  TorchPreconditioner by_name(*grouped, {}, TorchOptions{}.with_skip({"*wise", "group?d"}));
  CHECK((by_name.modules() == std::vector<std::string>{"fc"}));
  CHECK(by_name.skipped().size() == 2);
  auto grouped2 = std::make_shared<GroupedImpl>();
  TorchPreconditioner by_type(*grouped2, {}, TorchOptions{}.with_skip({"torch::nn::Conv2d"}));
  CHECK((by_type.modules() == std::vector<std::string>{"fc"}));

  // A module kfac has no layer type for is named too, never silently left out.
  auto with_bag = std::make_shared<TwoImpl>(true);
  std::string layer;
  const std::string e2 = error_of([&] { TorchPreconditioner kp(*with_bag); }, &layer);
  INFO(e2);
  CHECK(layer == "bag");
  CHECK(has(e2, "no layer type"));
  CHECK_NOTHROW(TorchPreconditioner(*with_bag, {}, TorchOptions{}.with_skip({"EmbeddingBag"})));

  // A module already driven by another preconditioner.
  auto two = std::make_shared<TwoImpl>();
  TorchPreconditioner first(*two);
  CHECK(has(error_of([&] { TorchPreconditioner second(*two); }), "already registered"));

  // Parameters off the CPU (a meta tensor stands in for CUDA, which Debian's LibTorch has not;
  // trainable, as a model's parameters are: a frozen one would be skipped).
  struct OffCpu : torch::nn::LinearImpl {
    OffCpu() : torch::nn::LinearImpl(3, 2) { weight = torch::empty({2, 3}, torch::TensorOptions().device(torch::kMeta).requires_grad(true)); }
  };
  OffCpu off;
  const std::string e3 = error_of([&] { TorchPreconditioner kp(off); }, &layer);
  CHECK(layer == "root");
  CHECK(has(e3, "CPU tensors only"));

  // Half precision.
  torch::nn::Linear half(3, 2);
  half->to(at::kHalf);
  CHECK(has(error_of([&] { TorchPreconditioner kp(*half); }), "float32 and float64"));
}

TEST_CASE("torch adapter: modules not observed on a factor-update step are named", "[torch][adapter][errors]") {
  torch::manual_seed(5);
  auto net = std::make_shared<TwoImpl>();
  TorchPreconditioner kp(*net, options());
  const at::Tensor x = torch::randn({5, 4});
  // fc2 is called directly (as a functional call would be): its input is never seen.
  at::Tensor h = net->fc2(torch::relu(observed(net->fc1, x)));
  torch::nn::functional::cross_entropy(observed(net->fc3, h), torch::randint(0, 3, {5}, at::kLong)).backward();
  const std::vector<at::Tensor> before = grads_of(*net);
  std::string layer;
  const std::string e = error_of([&] { kp.precondition(); }, &layer);
  INFO(e);
  CHECK(layer == "fc2");
  CHECK(has(e, "not observed"));
  CHECK(kp.step_count() == 0);  // nothing happened
  const std::vector<at::Tensor> after = grads_of(*net);
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(torch::equal(before[i], after[i]));

  // Two modules missing: both named in one error. fc3's output gradient never arrives (no
  // backward through it), fc2 again not observed.
  net->zero_grad();
  h = net->fc2(torch::relu(observed(net->fc1, x)));
  at::Tensor unused = observed(net->fc3, h);
  h.sum().backward();
  const std::string e2 = error_of([&] { kp.precondition(); }, &layer);
  INFO(e2);
  CHECK(layer.empty());
  CHECK(has(e2, "'fc2'"));
  CHECK(has(e2, "'fc3'"));
  CHECK(kp.step_count() == 0);

  // Observed properly: it works, and the step advances.
  net->zero_grad();
  h = observed(net->fc2, torch::relu(observed(net->fc1, x)));
  torch::nn::functional::cross_entropy(observed(net->fc3, h), torch::randint(0, 3, {5}, at::kLong)).backward();
  CHECK_NOTHROW(kp.precondition());
  CHECK(kp.step_count() == 1);
}

TEST_CASE("torch adapter: a Linear with 3-D input needs a token reduction", "[torch][adapter][errors][tokens]") {
  torch::manual_seed(9);
  torch::nn::Linear fc(4, 3);
  fc->to(at::kDouble);
  const at::Tensor x = torch::randn({2, 5, 4}, at::kDouble);
  {
    TorchPreconditioner kp(*fc);
    std::string layer;
    const std::string e = error_of([&] { observed(fc, x); }, &layer);
    CHECK(layer == "root");
    CHECK(has(e, "with_token_reduction"));
  }
  for (auto mode : {kfac::adapters::TokenReduction::expand, kfac::adapters::TokenReduction::reduce}) {
    fc->zero_grad();
    TorchPreconditioner kp(*fc, options(), TorchOptions{}.with_token_reduction(mode));
    at::Tensor gy;
    at::Tensor y = observed(fc, x);
    y.register_hook([&](const at::Tensor& g) { gy = g.clone(); });
    y.pow(2).mean().backward();
    at::Tensor w = fc->weight.grad().clone(), b = fc->bias.grad().clone();
    kp.precondition();
    // The reference, a Dense over samples: expand = (B T) rows, A over B T and G over B (Eschenhagen et
    // al. 2023), so each row's gradient is divided by sqrt(T) (the mean loss scales rows by B T, not B);
    // reduce = inputs averaged, gradients summed over T.
    const bool expand = mode == kfac::adapters::TokenReduction::expand;
    const at::Tensor xr = expand ? x.reshape({10, 4}).contiguous() : x.mean(1).contiguous();
    const at::Tensor gr = expand ? (gy.reshape({10, 3}) / std::sqrt(5.0)).contiguous() : gy.sum(1).contiguous();
    kfac::Preconditioner<double, Host> ref(options());
    ref.register_layer("fc", kfac::Dense(4, 3));
    ref.observe_input("fc", raw<double>(xr));
    ref.observe_output_grad("fc", raw<double>(gr));
    ref.set_gradient("fc", raw<double>(w), raw1<double>(b));
    ref.step();
    CHECK(torch::allclose(fc->weight.grad(), w, 1e-10, 1e-13));
    CHECK(torch::allclose(fc->bias.grad(), b, 1e-10, 1e-13));
  }
}

TEST_CASE("torch adapter: a LayerNorm over tokens equals kfac fed torch's own normalized input", "[torch][adapter][layer_norm]") {
  torch::manual_seed(21);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({4}).eps(1e-3));
  ln->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    ln->weight.uniform_(0.5, 1.5);
    ln->bias.uniform_(-0.5, 0.5);
  }
  TorchPreconditioner kp(*ln, options());
  CHECK((kp.modules() == std::vector<std::string>{"root"}));
  const at::Tensor x = torch::randn({3, 2, 5, 4}, at::kDouble);  // (B, ..., D): 10 tokens per sample
  at::Tensor gy;
  at::Tensor y = observed(ln, x);
  y.register_hook([&](const at::Tensor& g) { gy = g.clone(); });
  (y.sin().sum() / 3.0).backward();
  at::Tensor w = ln->weight.grad().clone(), b = ln->bias.grad().clone();
  kp.precondition();
  // torch's normalization, not kfac's, as the reference's x̂.
  const at::Tensor xhat = torch::layer_norm(x, {4}, {}, {}, 1e-3).reshape({3, 10, 4}).contiguous();
  const at::Tensor g = gy.reshape({3, 10, 4}).contiguous();
  kfac::Preconditioner<double, Host> ref(options());
  ref.register_layer("ln", kfac::LayerNorm(4));
  ref.observe_input("ln", kfac::adapters::from_raw(xhat.data_ptr<double>(), 3, 10, 4));
  ref.observe_output_grad("ln", kfac::adapters::from_raw(g.data_ptr<double>(), 3, 10, 4));
  ref.set_gradient("ln", raw1<double>(w), raw1<double>(b));
  ref.step();
  CHECK(torch::allclose(ln->weight.grad(), w, 1e-10, 1e-13));
  CHECK(torch::allclose(ln->bias.grad(), b, 1e-10, 1e-13));
  CHECK(!torch::allclose(ln->weight.grad(), gy.new_zeros({4}), 1e-3, 1e-3));
  // Normalized over two dimensions: named.
  torch::nn::LayerNorm wide(torch::nn::LayerNormOptions({2, 4}));
  std::string layer;
  const std::string e = error_of([&] { TorchPreconditioner bad(*wide); }, &layer);
  CHECK(layer == "root");
  CHECK(has(e, "normalizes over its last 2 dimensions"));
}

TEST_CASE("torch adapter: an Embedding over token ids equals kfac fed the same ids and output gradients",
          "[torch][adapter][embedding]") {
  torch::manual_seed(23);
  // max_norm renormalizes rows in place before the lookup; the gradient is the plain lookup's.
  torch::nn::Embedding emb(torch::nn::EmbeddingOptions(7, 4).padding_idx(0).max_norm(1.5));
  emb->to(at::kDouble);
  TorchPreconditioner kp(*emb, options());
  CHECK((kp.modules() == std::vector<std::string>{"root"}));
  kfac::Preconditioner<double, Host> ref(options());
  ref.register_layer("emb", kfac::Embedding(7, 4).with_padding_index(0));
  for (int step = 0; step < 3; ++step) {
    // (batch, tokens) ids, then (batch, 1, tokens): its tokens are one run per sample.
    const at::Tensor ids = torch::randint(0, 7, {3, 5}, at::kLong);
    at::Tensor gy;
    at::Tensor y = observed(emb, step < 2 ? ids : ids.reshape({3, 1, 5}));
    y.register_hook([&](const at::Tensor& g) { gy = g.clone(); });
    emb->zero_grad();
    (y.sin().sum() / 3.0).backward();
    const at::Tensor w = emb->weight.grad().clone();
    kp.precondition();
    const at::Tensor x = ids.to(at::kDouble).contiguous(), g = gy.reshape({3, 5, 4}).contiguous();
    ref.observe_input("emb", kfac::adapters::from_raw(x.data_ptr<double>(), 3, 5));
    ref.observe_output_grad("emb", kfac::adapters::from_raw(g.data_ptr<double>(), 3, 5, 4));
    ref.set_gradient("emb", kfac::adapters::from_raw(w.data_ptr<double>(), 7, 4));
    ref.step();
    INFO("step " << step);
    CHECK(torch::allclose(emb->weight.grad(), w, 1e-10, 1e-13));
    CHECK(torch::equal(emb->weight.grad()[0], torch::zeros({4}, at::kDouble)));  // the padding row's
    CHECK(!torch::allclose(emb->weight.grad(), gy.new_zeros({7, 4}), 1e-3, 1e-3));
  }
  // Rank-1 ids: one token per sample.
  torch::nn::Embedding one(torch::nn::EmbeddingOptions(5, 3));
  TorchPreconditioner kp1(*one, options());
  const at::Tensor ids = torch::tensor({4, 1, 1, 0}, at::kLong);
  at::Tensor gy;
  at::Tensor y = observed(one, ids);
  y.register_hook([&](const at::Tensor& g) { gy = g.clone(); });
  (y.cos().sum() / 4.0).backward();
  const at::Tensor w = one->weight.grad().clone();
  kp1.precondition();
  kfac::Preconditioner<float, Host> ref1(options());
  ref1.register_layer("one", kfac::Embedding(5, 3));
  const at::Tensor x = ids.to(at::kFloat);
  ref1.observe_input("one", kfac::adapters::from_raw(x.data_ptr<float>(), 4));
  const at::Tensor g = gy.contiguous();
  ref1.observe_output_grad("one", kfac::adapters::from_raw(g.data_ptr<float>(), 4, 3));
  ref1.set_gradient("one", kfac::adapters::from_raw(w.data_ptr<float>(), 5, 3));
  ref1.step();
  CHECK(torch::allclose(one->weight.grad(), w, 1e-5, 1e-7));
}

TEST_CASE("torch adapter: Embeddings kfac cannot precondition are named", "[torch][adapter][embedding][errors]") {
  std::string layer;
  torch::nn::Sequential sparse(torch::nn::Embedding(torch::nn::EmbeddingOptions(6, 2).sparse(true)),
                               torch::nn::Linear(2, 2));
  const std::string e = error_of([&] { TorchPreconditioner kp(*sparse); }, &layer);
  INFO(e);
  CHECK(layer == "0");
  CHECK(has(e, "(torch::nn::Embedding) sparse gradients"));
  CHECK(has(e, "TorchOptions::with_skip"));
  torch::nn::Embedding by_freq(torch::nn::EmbeddingOptions(6, 2).scale_grad_by_freq(true));
  CHECK(has(error_of([&] { TorchPreconditioner kp(*by_freq); }), "scale_grad_by_freq divides each row's gradient"));
  // Float32 parameters: ids above 2^24 would not be exact.
  torch::nn::Embedding big(torch::nn::EmbeddingOptions((int64_t(1) << 24) + 1, 1));
  const std::string e2 = error_of([&] { TorchPreconditioner kp(*big); }, &layer);
  INFO(e2);
  CHECK(layer == "root");
  CHECK(has(e2, "a vocabulary of 16777217 ids with float32 parameters"));
  big->to(at::kDouble);
  CHECK_NOTHROW(TorchPreconditioner(*big));
  // Left to the optimizer by kind.
  TorchPreconditioner skip(*sparse, {}, TorchOptions{}.with_skip({"embedding"}));
  CHECK((skip.modules() == std::vector<std::string>{"1"}));
  // Tied weights: the head reuses the Embedding's weight; named at construction, fine with one skipped.
  torch::nn::Embedding tok(5, 3);
  torch::nn::Linear head(torch::nn::LinearOptions(3, 5).bias(false));
  head->weight = tok->weight;  // what forward computes with (its parameter list keeps the old tensor)
  torch::nn::Sequential tied(tok, head);
  const std::string e3 = error_of([&] { TorchPreconditioner kp(*tied); }, &layer);
  INFO(e3);
  CHECK(layer == "1");
  CHECK(has(e3, "its weight is also a parameter of '0' (tied weights)"));
  CHECK((TorchPreconditioner(*tied, {}, TorchOptions{}.with_skip({"1"})).modules() == std::vector<std::string>{"0"}));
}

TEST_CASE("torch adapter: skipped modules' gradients are untouched bit for bit", "[torch][adapter][skip]") {
  torch::manual_seed(13);
  Net net;
  TorchPreconditioner kp(*net, options(), TorchOptions{}.with_skip({"fc2", "BatchNorm2d"}));
  CHECK((kp.modules() == std::vector<std::string>{"conv1", "conv2", "fc1"}));
  for (int step = 0; step < 3; ++step) {
    net->zero_grad();
    Tape tape;  // observed() on skipped modules is a plain call
    torch::nn::functional::cross_entropy(net->forward(torch::randn({4, 2, 7, 5}), tape), torch::randint(0, 5, {4}, at::kLong))
        .backward();
    const at::Tensor fc2 = net->fc2->weight.grad().clone(), bnw = net->bn1->weight.grad().clone(),
                     bnb = net->bn1->bias.grad().clone(), fc1 = net->fc1->weight.grad().clone();
    kp.precondition();
    CHECK(torch::equal(fc2, net->fc2->weight.grad()));
    CHECK(torch::equal(bnw, net->bn1->weight.grad()));
    CHECK(torch::equal(bnb, net->bn1->bias.grad()));
    CHECK(!torch::equal(fc1, net->fc1->weight.grad()));
  }
}

TEST_CASE("torch adapter: frozen modules are skipped and listed", "[torch][adapter][frozen]") {
  torch::manual_seed(17);
  auto net = std::make_shared<TwoImpl>();
  for (auto& p : net->fc2->parameters()) p.requires_grad_(false);
  TorchPreconditioner kp(*net, options());
  CHECK((kp.modules() == std::vector<std::string>{"fc1", "fc3"}));
  CHECK((kp.frozen() == std::vector<std::string>{"fc2"}));
  REQUIRE(kp.skipped().size() == 1);
  CHECK(has(kp.skipped()[0], "fc2 (torch::nn::Linear, frozen: requires_grad = false)"));
  for (int step = 0; step < 2; ++step) {
    net->zero_grad();
    const at::Tensor h = observed(net->fc2, torch::relu(observed(net->fc1, torch::randn({6, 4}))));
    torch::nn::functional::cross_entropy(observed(net->fc3, h), torch::randint(0, 3, {6}, at::kLong)).backward();
    const at::Tensor fc1 = net->fc1->weight.grad().clone();
    CHECK_NOTHROW(kp.precondition());  // was: "its parameters have no gradient"
    CHECK(!torch::equal(fc1, net->fc1->weight.grad()));
    CHECK(!net->fc2->weight.grad().defined());
  }
  // Frozen after construction: named, with what to do.
  for (auto& p : net->fc3->parameters()) p.requires_grad_(false);
  net->zero_grad();
  const at::Tensor h = observed(net->fc2, torch::relu(observed(net->fc1, torch::randn({6, 4}))));
  torch::nn::functional::cross_entropy(observed(net->fc3, h), torch::randint(0, 3, {6}, at::kLong)).backward();
  std::string layer;
  const std::string e = error_of([&] { kp.precondition(); }, &layer);
  CHECK(layer == "fc3");
  CHECK(has(e, "frozen (requires_grad = false) after the TorchPreconditioner was built"));
  CHECK(kp.step_count() == 2);
}

TEST_CASE("torch adapter: a module frozen in part is named", "[torch][adapter][frozen][errors]") {
  auto net = std::make_shared<TwoImpl>();
  net->fc2->weight.requires_grad_(false);
  std::string layer;
  const std::string e = error_of([&] { TorchPreconditioner kp(*net); }, &layer);
  CHECK(layer == "fc2");
  CHECK(has(e, "its weight is frozen (requires_grad = false) but its bias is not"));
}

namespace {
/// Conv2d then Linear (no BatchNorm: its batch statistics differ between micro-batches and the
/// whole batch, so there the big-batch equality does not hold by construction).
struct AccumImpl : torch::nn::Module {
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
  AccumImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(3 * 5 * 4, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return observed(fc, torch::relu(observed(conv, x)).flatten(1)); }
};
}  // namespace

TEST_CASE("torch adapter: k accumulated micro-batches equal one big batch", "[torch][adapter][accumulation]") {
  // PyTorch's recipe: each micro-batch's mean loss divided by k, backward() k times, one step.
  // The accumulated .grad() is then the big batch's; with accumulation_steps(k) so is G (without
  // it the output gradients are 1/k of the per-sample ones and G is k^2 too small).
  torch::manual_seed(19);
  const int k = 4, micro = 3, N = k * micro;
  auto big = std::make_shared<AccumImpl>(), acc = std::make_shared<AccumImpl>();
  big->to(at::kDouble);
  acc->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < big->parameters().size(); ++i) acc->parameters()[i].copy_(big->parameters()[i]);
  }
  TorchPreconditioner kp_big(*big, options());
  TorchPreconditioner kp_acc(*acc, options(), TorchOptions{}.with_accumulation_steps(k));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = torch::randn({N, 2, 5, 4}, at::kDouble);
    const at::Tensor y = torch::randint(0, 4, {N}, at::kLong);
    big->zero_grad();
    torch::nn::functional::cross_entropy(big->forward(x), y).backward();
    kp_big.precondition();
    acc->zero_grad();
    for (int m = 0; m < k; ++m) {
      const auto rows = torch::indexing::Slice(m * micro, (m + 1) * micro);
      (torch::nn::functional::cross_entropy(acc->forward(x.index({rows})), y.index({rows})) / double(k)).backward();
    }
    kp_acc.precondition();
    const auto gb = grads_of(*big), ga = grads_of(*acc);
    for (std::size_t i = 0; i < gb.size(); ++i) {
      INFO("step " << step << ", parameter " << i << ": max |diff| " << (gb[i] - ga[i]).abs().max().item<double>());
      CHECK(torch::allclose(ga[i], gb[i], 1e-9, 1e-12));
    }
    CHECK(kp_acc.last_kl_scale() == Approx(kp_big.last_kl_scale()).epsilon(1e-9));
  }
}

TEST_CASE("torch adapter: accumulation_steps is checked", "[torch][adapter][accumulation][errors]") {
  auto net = std::make_shared<AccumImpl>();
  CHECK(has(error_of([&] { TorchPreconditioner kp(*net, options(), TorchOptions{}.with_accumulation_steps(0)); }),
            "TorchOptions::accumulation_steps must be >= 1 (got 0)"));
  TorchPreconditioner kp(*net, options(), TorchOptions{}.with_accumulation_steps(2));
  (torch::nn::functional::cross_entropy(net->forward(torch::randn({3, 2, 5, 4})), torch::randint(0, 4, {3}, at::kLong)) / 2.0)
      .backward();  // one micro-batch of two
  const std::string e = error_of([&] { kp.precondition(); });
  CHECK(has(e, "'conv' observed 1 times, not a multiple of TorchOptions::accumulation_steps = 2"));
  CHECK(has(e, "'fc' observed 1 times"));
  CHECK(kp.step_count() == 0);
}
