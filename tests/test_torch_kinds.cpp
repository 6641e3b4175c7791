// The LibTorch front end's module kinds are an open seam: a layer kind defined in this file alone
// (a per-feature scale, no file under include/ touched) is registered for a custom torch::nn
// module through kfac::adapters::register_torch_module, and its preconditioned gradient equals
// (F + damping)^-1 g with F the mean of squared per-sample gradients that autograd computes in
// float64 one sample at a time (no formula of kfac's).
#include <kfac/adapters/torch.hpp>
// LibTorch's logging (glog) defines CHECK; the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "feature_scale.hpp"  // the layer kind, defined by the tests alone

namespace {

using kfac_test::FeatureScale;

/// The torch module of the kind.
struct ScaleImpl : torch::nn::Module {
  at::Tensor weight;
  /// A vector of d scales; `cols` > 0 makes it a matrix, which the translation refuses.
  explicit ScaleImpl(int64_t d, int64_t cols = 0) {
    weight = register_parameter("weight", cols > 0 ? torch::ones({d, cols}) : torch::ones({d}));
  }
  at::Tensor forward(const at::Tensor& x) { return x * weight; }
};
TORCH_MODULE(Scale);

/// (batch, ..., d) as the (batch, tokens, d) the kind observes.
at::Tensor as_rows(const kfac::impl::TorchCapture&, const at::Tensor& t) {
  return t.reshape({t.size(0), -1, t.size(-1)});
}

void register_scale() {
  kfac::adapters::register_torch_module<ScaleImpl>(
      FeatureScale::kind, [](const ScaleImpl& m, const kfac::adapters::TorchContext&, std::string& problem)
                              -> std::optional<kfac::adapters::TorchLayer> {
        if (m.weight.dim() != 1) {
          problem = "its weight is not a vector";
          return std::nullopt;
        }
        kfac::adapters::TorchLayer t =
            kfac::adapters::torch_layer(FeatureScale{long(m.weight.size(0))}, kfac::UnitWiseFisher<>{}, as_rows);
        t.weight = m.weight;
        t.output_grad = as_rows;
        return t;
      });
}

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  Scale scale{nullptr};
  NetImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 4));
    scale = register_module("scale", Scale(4));
  }
  at::Tensor forward(const at::Tensor& x) {
    using kfac::adapters::observed;
    return observed(scale, torch::tanh(observed(fc, x)));
  }
};
TORCH_MODULE(Net);

at::Tensor loss_of(Net& net, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(net->forward(x), y);  // the mean over every sample, token and feature
}

}  // namespace

TEST_CASE("torch kinds: a module kind from a test file alone equals the per-sample Fisher", "[torch][kinds][seam]") {
  register_scale();
  torch::manual_seed(5);
  Net net;
  net->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    net->scale->weight.uniform_(0.5, 1.5);
  }
  const double damping = 0.01;
  auto kp = std::make_unique<kfac::adapters::TorchPreconditioner>(
      *net, kfac::Options{}.with_damping(damping).with_kl_clip(0).with_factor_decay(0.5),
      kfac::adapters::TorchOptions{}.with_token_reduction(kfac::adapters::TokenReduction::expand));
  CHECK(kp->modules() == std::vector<std::string>{"fc", "scale"});
  const int64_t n = 6, tokens = 5;
  const at::Tensor x = torch::randn({n, tokens, 3}, at::kDouble), y = torch::randn({n, tokens, 4}, at::kDouble);
  // The reference: each sample's own loss (the mean over its tokens and features, so that N
  // times the batch loss's gradient is their sum), by autograd, one sample at a time.
  at::Tensor fisher = torch::zeros({4}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) {
    net->zero_grad();
    // Out of training mode observed() records nothing: the reference passes leave kfac untouched.
    net->eval();
    loss_of(net, x.slice(0, i, i + 1), y.slice(0, i, i + 1)).backward();
    net->train();
    fisher += net->scale->weight.grad().square() / double(n);
  }
  net->zero_grad();
  loss_of(net, x, y).backward();
  const at::Tensor grad = net->scale->weight.grad().clone();
  kp->precondition();
  const at::Tensor want = grad / (fisher + damping);
  const at::Tensor got = net->scale->weight.grad();
  INFO("got " << got << " want " << want);
  CHECK(torch::allclose(got, want, 1e-10, 1e-14));
  CHECK_FALSE(torch::allclose(grad, want, 1e-3, 0));  // preconditioning changed it

  // The skip list takes the kind's name as it takes the built-in ones'.
  kp.reset();
  kfac::adapters::TorchPreconditioner skipping(*net, kfac::Options{}, kfac::adapters::TorchOptions{}
                                                   .with_skip({"feature_scale"})
                                                   .with_token_reduction(kfac::adapters::TokenReduction::expand));
  CHECK(skipping.modules() == std::vector<std::string>{"fc"});
}

TEST_CASE("torch kinds: a registered module's translation may refuse it by name", "[torch][kinds][seam][errors]") {
  register_scale();
  struct HolderImpl : torch::nn::Module {
    Scale bad{nullptr};
    HolderImpl() { bad = register_module("bad", Scale(3, 2)); }
  };
  auto holder = std::make_shared<HolderImpl>();
  try {
    kfac::adapters::TorchPreconditioner kp(*holder);
    FAIL("no error");
  } catch (const kfac::Error& e) {
    CHECK(e.layer() == "bad");
    CHECK(std::string(e.what()).find("its weight is not a vector") != std::string::npos);
  }
}
