// The LibTorch front end's diagonal fallback (TorchOptions::with_fallback(TorchFallback::diagonal)):
// a custom module's parameters and a MultiheadAttention's (out_proj included) get kfac::DiagonalFisher,
// whose preconditioned gradients equal X / (f + damping) with f the running average of
// (sum_n g_n)^2 / N over per-sample gradients g_n that autograd computes in float64 one sample at a
// time; without the fallback the same models are refused by name; a tied parameter is registered
// once; the kinded modules are unchanged by the option; the refusal lists the registered classes.
#include <kfac/adapters/torch.hpp>
// LibTorch's logging (glog) defines CHECK; the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torch_errors.hpp"

namespace {

using kfac::adapters::observed;
using kfac::adapters::TorchFallback;
using kfac::adapters::TorchOptions;
using kfac::adapters::TorchPreconditioner;

/// A module kfac has no kind for: an element-wise scale and a (2, 2) shift read as 4 values.
struct ScaleShiftImpl : torch::nn::Module {
  at::Tensor weight, shift;
  ScaleShiftImpl() {
    weight = register_parameter("weight", torch::ones({4}));
    shift = register_parameter("shift", torch::zeros({2, 2}));
  }
  at::Tensor forward(const at::Tensor& x) { return x * weight + shift.reshape({-1}); }
};
TORCH_MODULE(ScaleShift);

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  ScaleShift scale{nullptr};
  NetImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 4));
    scale = register_module("scale", ScaleShift());
  }
  at::Tensor forward(const at::Tensor& x) { return observed(scale, torch::tanh(observed(fc, x))); }
};
TORCH_MODULE(Net);

/// Self-attention over (L, N, E) sequences (LibTorch's layout: the batch is the second dimension).
struct AttentionNetImpl : torch::nn::Module {
  torch::nn::MultiheadAttention attn{nullptr};
  AttentionNetImpl() { attn = register_module("attn", torch::nn::MultiheadAttention(4, 2)); }
  at::Tensor forward(const at::Tensor& x) { return std::get<0>(observed(attn, x, x, x)); }
};
TORCH_MODULE(AttentionNet);

/// A language-model head sharing the embedding's matrix (tied weights), plus its own bias.
struct HeadImpl : torch::nn::Module {
  at::Tensor weight, bias;
  explicit HeadImpl(const at::Tensor& tied) {
    weight = register_parameter("weight", tied);
    bias = register_parameter("bias", torch::zeros({tied.size(0)}));
  }
  at::Tensor forward(const at::Tensor& h) { return h.matmul(weight.t()) + bias; }
};
TORCH_MODULE(Head);

struct TiedImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  Head head{nullptr};
  TiedImpl() {
    emb = register_module("emb", torch::nn::Embedding(10, 4));
    head = register_module("head", Head(emb->weight));
  }
  at::Tensor forward(const at::Tensor& ids) { return observed(head, torch::tanh(observed(emb, ids))); }
};
TORCH_MODULE(Tied);

using kfac_test::error_of;
using kfac_test::has;

using Params = std::map<std::string, at::Tensor>;
/// One sample's loss (`i`) or the batch's (the mean of the samples' losses: `i` < 0).
using Loss = std::function<at::Tensor(int64_t i)>;

/// \brief Steps `kp` `steps` times on fresh batches from `batch(step)` and checks every parameter in
/// `fallback` against the float64 reference: per step f̂ = (sum_n g_n)^2 / N from each sample's own
/// gradient g_n (autograd, one sample at a time), f = decay f + (1 - decay) f̂ (f̂ at the first step),
/// preconditioned gradient X / (f + damping) with X the batch loss's gradient.
void check_against_reference(torch::nn::Module& model, TorchPreconditioner& kp, const Params& fallback, int64_t n,
                             const std::function<Loss(int)>& batch, int steps, double damping, double decay) {
  std::map<std::string, at::Tensor> f;
  for (int step = 0; step < steps; ++step) {
    const Loss loss = batch(step);
    std::map<std::string, at::Tensor> sum;
    for (const auto& [name, p] : fallback) sum[name] = torch::zeros_like(p);
    model.eval();  // out of training mode observed() records nothing: the reference leaves kfac untouched
    for (int64_t i = 0; i < n; ++i) {
      model.zero_grad();
      loss(i).backward();
      for (const auto& [name, p] : fallback) sum[name] += p.grad();
    }
    model.train();
    for (const auto& [name, p] : fallback) {
      const at::Tensor fhat = sum[name].square() / double(n);
      f[name] = step == 0 ? fhat : decay * f[name] + (1 - decay) * fhat;
    }
    model.zero_grad();
    loss(-1).backward();
    std::map<std::string, at::Tensor> want;
    for (const auto& [name, p] : fallback) want[name] = p.grad() / (f[name] + damping);
    kp.precondition();
    for (const auto& [name, p] : fallback) {
      INFO("step " << step << ", parameter " << name << ": got " << p.grad() << " want " << want[name]);
      CHECK(torch::allclose(p.grad(), want[name], 1e-10, 1e-14));
    }
  }
}

kfac::Options reference_options(double damping, double decay) {
  return kfac::Options{}.with_damping(damping).with_kl_clip(0.0).with_factor_decay(decay).with_factor_update_steps(1)
      .with_inv_update_steps(1);
}

TorchOptions with_diagonal() { return TorchOptions{}.with_fallback(TorchFallback::diagonal); }

}  // namespace

TEST_CASE("torch fallback: a custom module's parameters get the diagonal Fisher of per-sample gradients",
          "[torch][fallback]") {
  torch::manual_seed(3);
  Net net;
  net->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    net->scale->weight.uniform_(0.5, 1.5);
    net->scale->shift.uniform_(-0.5, 0.5);
  }
  const double damping = 0.01, decay = 0.6;
  TorchPreconditioner kp(*net, reference_options(damping, decay), with_diagonal());
  CHECK(kp.modules() == std::vector<std::string>{"fc", "scale.weight", "scale.shift"});
  CHECK(kp.skipped().empty());
  const int64_t n = 5;
  auto batch = [&](int) -> Loss {
    const at::Tensor x = torch::randn({n, 3}, at::kDouble), y = torch::randn({n, 4}, at::kDouble);
    return [&net, x, y](int64_t i) {
      if (i < 0) return torch::mse_loss(net->forward(x), y);
      return torch::mse_loss(net->forward(x.slice(0, i, i + 1)), y.slice(0, i, i + 1));
    };
  };
  check_against_reference(*net, kp, {{"scale.weight", net->scale->weight}, {"scale.shift", net->scale->shift}}, n,
                          batch, 3, damping, decay);
}

TEST_CASE("torch fallback: MultiheadAttention is all-diagonal, out_proj included, counting its (L, N, E) batch",
          "[torch][fallback][attention]") {
  torch::manual_seed(4);
  AttentionNet net;
  net->to(at::kDouble);
  const double damping = 0.02, decay = 0.5;
  TorchPreconditioner kp(*net, reference_options(damping, decay), with_diagonal());
  CHECK(kp.modules() == std::vector<std::string>{"attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
                                                 "attn.out_proj.bias"});
  const int64_t length = 3, n = 4;  // L != N: counting the wrong dimension changes f
  auto batch = [&](int) -> Loss {
    const at::Tensor x = torch::randn({length, n, 4}, at::kDouble), y = torch::randn({length, n, 4}, at::kDouble);
    return [&net, x, y](int64_t i) {
      if (i < 0) return torch::mse_loss(net->forward(x), y);
      return torch::mse_loss(net->forward(x.slice(1, i, i + 1)), y.slice(1, i, i + 1));
    };
  };
  check_against_reference(*net, kp,
                          {{"attn.in_proj_weight", net->attn->in_proj_weight},
                           {"attn.in_proj_bias", net->attn->in_proj_bias},
                           {"attn.out_proj.weight", net->attn->out_proj->weight},
                           {"attn.out_proj.bias", net->attn->out_proj->bias}},
                          n, batch, 2, damping, decay);
}

TEST_CASE("torch fallback: without it the same models are refused by name", "[torch][fallback][errors]") {
  Net net;
  std::string layer;
  const std::string e = error_of([&] { TorchPreconditioner kp(*net); }, &layer);
  INFO(e);
  CHECK(layer == "scale");
  CHECK(has(e, "ScaleShift) owns parameters but kfac has no layer type for it"));
  CHECK(has(e, "torch::nn::Linear, torch::nn::Conv2d, torch::nn::BatchNorm2d, torch::nn::LayerNorm, "
               "torch::nn::Embedding"));
  CHECK(has(error_of([&] { TorchPreconditioner kp(*net, {}, TorchOptions{}.with_fallback(TorchFallback::none)); }),
            "no layer type"));
  // Bad input leaves nothing behind: the model can be registered afterwards.
  CHECK_NOTHROW(TorchPreconditioner(*net, {}, TorchOptions{}.with_fallback(TorchFallback::diagonal)));

  AttentionNet attention;
  const std::string e2 = error_of([&] { TorchPreconditioner kp(*attention); }, &layer);
  INFO(e2);
  CHECK(layer == "attn");
  CHECK(has(e2, "torch::nn::MultiheadAttention) owns parameters"));
}

TEST_CASE("torch fallback: a tied parameter is registered once, under its first owner", "[torch][fallback][tied]") {
  torch::manual_seed(6);
  Tied net;
  net->to(at::kDouble);
  REQUIRE(net->head->weight.data_ptr() == net->emb->weight.data_ptr());
  // Without the fallback: the tie is named, as before.
  CHECK(has(error_of([&] { TorchPreconditioner kp(*net); }), "no layer type"));
  CHECK(has(error_of([&] { TorchPreconditioner kp(*net, {}, TorchOptions{}.with_skip({"head"})); }),
            "(no kfac::Error)"));

  const double damping = 0.05, decay = 0.7;
  TorchPreconditioner kp(*net, reference_options(damping, decay), with_diagonal());
  // The Embedding shares its weight: it is diagonal too, and the head's copy is skipped as tied.
  CHECK(kp.modules() == std::vector<std::string>{"emb.weight", "head.bias"});
  REQUIRE(kp.skipped().size() == 1);
  CHECK(has(kp.skipped()[0], "head.weight"));
  CHECK(has(kp.skipped()[0], "tied weights: preconditioned once, as 'emb.weight'"));
  const int64_t n = 6;
  auto batch = [&](int) -> Loss {
    const at::Tensor ids = torch::randint(10, {n}, at::kLong), target = torch::randint(10, {n}, at::kLong);
    return [&net, ids, target](int64_t i) {
      if (i < 0) return torch::cross_entropy_loss(net->forward(ids), target);
      return torch::cross_entropy_loss(net->forward(ids.slice(0, i, i + 1)), target.slice(0, i, i + 1));
    };
  };
  check_against_reference(*net, kp, {{"emb.weight", net->emb->weight}, {"head.bias", net->head->bias}}, n, batch, 2,
                          damping, decay);
}

TEST_CASE("torch fallback: frozen parameters are skipped, kinded modules unchanged bit for bit",
          "[torch][fallback][frozen]") {
  CHECK(TorchOptions{}.fallback == TorchFallback::none);
  torch::manual_seed(8);
  Net a, b;
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  a->scale->shift.set_requires_grad(false);
  const kfac::Options options = kfac::Options{}.with_kl_clip(0.0);  // no step scale shared by the layers
  TorchPreconditioner with(*a, options, TorchOptions{}.with_fallback(TorchFallback::diagonal));
  CHECK(with.modules() == std::vector<std::string>{"fc", "scale.weight"});
  CHECK(with.frozen() == std::vector<std::string>{"scale.shift"});
  // The default: the custom module left out by the skip list, the Linear preconditioned as before.
  TorchPreconditioner without(*b, options, TorchOptions{}.with_skip({"scale"}));
  CHECK(without.modules() == std::vector<std::string>{"fc"});
  const at::Tensor x = torch::randn({5, 3}), y = torch::randn({5, 4});
  for (Net* net : {&a, &b}) torch::mse_loss((*net)->forward(x), y).backward();
  const at::Tensor skipped = b->scale->weight.grad().clone();
  with.precondition();
  without.precondition();
  CHECK(torch::equal(a->fc->weight.grad(), b->fc->weight.grad()));
  CHECK(torch::equal(a->fc->bias.grad(), b->fc->bias.grad()));
  CHECK(torch::equal(b->scale->weight.grad(), skipped));
  CHECK_FALSE(torch::allclose(a->scale->weight.grad(), skipped));
}

TEST_CASE("torch fallback: the refusal lists the module classes registered now", "[torch][kinds][errors]") {
  struct MysteryImpl : torch::nn::Module {
    MysteryImpl() { register_parameter("w", torch::ones({2})); }
  };
  struct GateImpl : torch::nn::Module {
    GateImpl() { register_parameter("w", torch::ones({2})); }
  };
  auto mystery = std::make_shared<MysteryImpl>();
  const std::string before = error_of([&] { TorchPreconditioner kp(*mystery); });
  INFO(before);
  CHECK(has(before, "supported: torch::nn::Linear, "));
  CHECK_FALSE(has(before, "GateImpl"));
  CHECK_FALSE(has(before, "Gate,"));
  kfac::adapters::register_torch_module<GateImpl>(
      "gate", [](const GateImpl&, const kfac::adapters::TorchContext&, std::string& problem)
                  -> std::optional<kfac::adapters::TorchLayer> {
        problem = "never taken";
        return std::nullopt;
      });
  const std::string after = error_of([&] { TorchPreconditioner kp(*mystery); });
  INFO(after);
  CHECK(has(after, "torch::nn::Embedding, "));
  CHECK(has(after, "::Gate)"));  // the class as Module::name() spells it, without "Impl"
}
