#pragma once
/// \file torch_impl.hpp
/// \brief Definitions for kfac/adapters/torch.hpp (included at its end).

#include <optional>
#include <utility>

namespace kfac {
namespace impl {

inline std::string torch_shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

struct ModuleProblem {
  std::string name, why;
};
/// One problem: an Error naming the module; several: one Error naming each of them.
inline void throw_module_problems(const std::vector<ModuleProblem>& problems, const std::string& what) {
  if (problems.size() == 1) throw Error(problems.front().name, problems.front().why);
  if (problems.empty()) return;
  std::string all = what + ": ";
  for (std::size_t i = 0; i < problems.size(); ++i)
    all += (i ? "; " : "") + ("'" + problems[i].name + "' " + problems[i].why);
  throw Error("", all);
}

/// The module type as written in C++ ("torch::nn::Conv2d") from Module::name().
inline std::string torch_type_name(const torch::nn::Module& m) {
  std::string n = m.name();
  const std::string impl = "Impl";
  if (n.size() > impl.size() && n.compare(n.size() - impl.size(), impl.size(), impl) == 0)
    n.erase(n.size() - impl.size());
  return n;
}

/// What kfac sees of one call's input: the input itself (Linear, Conv2d), reduced over tokens
/// (Linear on sequences), or the normalized input x̂ (BatchNorm2d). No copy unless a reduction
/// or x̂ needs one.
inline at::Tensor torch_observation(TorchCapture& c, const at::Tensor& x, long& tokens) {
  tokens = 1;
  const std::string dev = torch_device_problem(x, "the input");
  if (!dev.empty()) throw Error(c.name, dev);
  const at::Tensor xd = x.detach();
  switch (c.kind) {
    case TorchKind::dense: {
      if (xd.dim() == 2) return xd;
      if (xd.dim() < 2) throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batch dimension (batch, in)");
      const int64_t in = xd.size(-1);
      switch (c.tokens) {
        case adapters::TokenReduction::none:
          throw Error(c.name, "input has shape " + torch_shape(xd) + " (a sequence: batch, tokens, ..., in); state how tokens "
                              "reduce with TorchOptions::with_token_reduction(TokenReduction::expand or ::reduce)");
        case adapters::TokenReduction::expand: return xd.reshape({-1, in});
        case adapters::TokenReduction::reduce: {
          const at::Tensor seq = xd.reshape({xd.size(0), -1, in});
          tokens = long(seq.size(1));
          return seq.mean(1);
        }
      }
      break;
    }
    case TorchKind::conv2d:
      if (xd.dim() != 4) throw Error(c.name, "input has shape " + torch_shape(xd) + "; kfac needs a batched (N, C, H, W) input");
      return xd;
    case TorchKind::batch_norm: {
      if (xd.dim() != 4) throw Error(c.name, "input has shape " + torch_shape(xd) + ", expected (N, C, H, W)");
      // Training mode normalizes with the batch mean and the biased batch variance.
      const at::Tensor mean = xd.mean({0, 2, 3}, /*keepdim=*/true);
      const at::Tensor var = xd.var({0, 2, 3}, /*unbiased=*/false, /*keepdim=*/true);
      return (xd - mean) * torch::rsqrt(var + c.bn_eps);
    }
  }
  return xd;
}

/// The output gradient as kfac sees it, reduced like the call's input.
inline at::Tensor torch_output_grad(const TorchCapture& c, const at::Tensor& g, long tokens) {
  if (c.kind != TorchKind::dense || g.dim() == 2) return g;
  const int64_t out = g.size(-1);
  if (c.tokens == adapters::TokenReduction::expand) return g.reshape({-1, out});
  return g.reshape({g.size(0), tokens, out}).sum(1);
}

}  // namespace impl

namespace adapters {

template <class ModuleRef>
at::Tensor observed(ModuleRef& module, const at::Tensor& x) {
  auto* mod = module.get();  // ModuleHolder::get() or std::shared_ptr::get()
  const auto capture = impl::TorchRegistry::instance().find(mod);
  if (!capture || !capture->wanted || !mod->is_training() || !at::GradMode::is_enabled()) return mod->forward(x);
  long tokens = 1;
  at::Tensor seen = impl::torch_observation(*capture, x, tokens);
  at::Tensor y = mod->forward(x);
  if (!y.requires_grad()) return y;
  std::size_t slot;
  long generation;
  {
    std::lock_guard<std::mutex> lock(capture->mutex);
    capture->inputs.push_back(std::move(seen));
    capture->grads.emplace_back();
    capture->tokens_per_row.push_back(tokens);
    slot = capture->inputs.size() - 1;
    generation = capture->generation;
  }
  y.register_hook([capture, slot, generation](const at::Tensor& g) {
    std::lock_guard<std::mutex> lock(capture->mutex);
    if (capture->generation == generation && slot < capture->grads.size()) capture->grads[slot] = g.detach();
  });
  return y;
}

inline TorchPreconditioner::TorchPreconditioner(const torch::nn::Module& model, Options options,
                                                TorchOptions torch_options)
    : torch_options_(std::move(torch_options)) {
  if (torch_options_.accumulation_steps < 1)
    throw Error("", "TorchOptions::accumulation_steps must be >= 1 (got " + std::to_string(torch_options_.accumulation_steps) + ")");
  // Pass 1: what each module is, and what kfac cannot handle (all of it, in one error).
  struct Found {
    std::string name;
    const torch::nn::Module* module;
    impl::TorchKind kind;
    std::optional<Dense> dense;
    std::optional<Conv2d> conv;
    std::optional<BatchNorm2d> bn;
    double eps = 1e-5;
    at::Tensor weight, bias;
  };
  std::vector<Found> found;
  std::vector<impl::ModuleProblem> problems;
  // The root by reference (named_modules(include_self) would need it held in a shared_ptr).
  std::vector<std::pair<std::string, const torch::nn::Module*>> all{{"root", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false)) all.emplace_back(item.key(), item.value().get());
  for (const auto& [name, module] : all) {
    const torch::nn::Module& m = *module;
    const std::string type = impl::torch_type_name(m);
    const bool owns_parameters = !m.named_parameters(/*recurse=*/false).is_empty();
    if (!owns_parameters) continue;  // containers, activations, BatchNorm2d(affine=false), ...
    if (is_skipped(name, m)) {
      skipped_.push_back(name + " (" + type + ", skip list)");
      continue;
    }
    auto problem = [&](const std::string& why) { problems.push_back({name, "(" + type + ") " + why}); };
    Found f{name, &m, impl::TorchKind::dense, {}, {}, {}, 1e-5, {}, {}};
    if (const auto* l = m.as<torch::nn::Linear>()) {
      f.dense.emplace(index_t(l->options.in_features()), index_t(l->options.out_features()), l->options.bias());
      f.weight = l->weight;
      f.bias = l->options.bias() ? l->bias : at::Tensor();
    } else if (const auto* c = m.as<torch::nn::Conv2d>()) {
      const auto& o = c->options;
      const auto k = *o.kernel_size(), s = *o.stride(), d = *o.dilation();
      if (o.groups() != 1) {
        problem(o.groups() == o.in_channels() ? "depthwise convolutions (groups = in_channels = " + std::to_string(o.groups()) +
                                                    ") are not supported"
                                              : "grouped convolutions (groups = " + std::to_string(o.groups()) + ") are not supported");
        continue;
      }
      if (!c10::get_if<torch::enumtype::kZeros>(&o.padding_mode())) {
        problem("only zero padding is supported (padding_mode " + torch::enumtype::get_enum_name(o.padding_mode()) + ")");
        continue;
      }
      std::array<int64_t, 2> pad{0, 0};
      if (const auto* p = c10::get_if<torch::ExpandingArray<2>>(&o.padding())) pad = **p;
      else if (c10::get_if<torch::enumtype::kSame>(&o.padding())) {
        for (int i = 0; i < 2; ++i) {
          const int64_t total = d[i] * (k[i] - 1);
          if (total % 2 != 0) {
            problem("padding 'same' with an even dilated kernel pads asymmetrically; kfac supports symmetric padding only");
            pad[0] = -1;
            break;
          }
          pad[i] = total / 2;
        }
        if (pad[0] < 0) continue;
      }
      f.kind = impl::TorchKind::conv2d;
      f.conv.emplace(index_t(o.in_channels()), index_t(o.out_channels()), index_t(k[0]), index_t(k[1]));
      f.conv->with_stride(index_t(s[0]), index_t(s[1])).with_padding(index_t(pad[0]), index_t(pad[1]))
          .with_dilation(index_t(d[0]), index_t(d[1])).with_bias(o.bias());
      f.weight = c->weight;
      f.bias = o.bias() ? c->bias : at::Tensor();
    } else if (const auto* b = m.as<torch::nn::BatchNorm2d>()) {
      f.kind = impl::TorchKind::batch_norm;
      f.bn.emplace(index_t(b->options.num_features()));
      f.eps = b->options.eps();
      f.weight = b->weight;
      f.bias = b->bias;
    } else {
      problem("owns parameters but kfac has no layer type for it (supported: torch::nn::Linear, Conv2d, BatchNorm2d); "
              "add it to TorchOptions::with_skip to leave it to the optimizer alone");
      continue;
    }
    // Frozen (kfac-pytorch skips them too): nothing for the optimizer to update, nothing to precondition.
    const bool weight_frozen = !f.weight.requires_grad();
    if (weight_frozen && (!f.bias.defined() || !f.bias.requires_grad())) {
      skipped_.push_back(name + " (" + type + ", frozen: requires_grad = false)");
      frozen_.push_back(name);
      continue;
    }
    if (f.bias.defined() && weight_frozen != !f.bias.requires_grad()) {
      problem(std::string("its ") + (weight_frozen ? "weight" : "bias") + " is frozen (requires_grad = false) but its " +
              (weight_frozen ? "bias" : "weight") + " is not; freeze both, or add it to TorchOptions::with_skip");
      continue;
    }
    for (const at::Tensor* p : {&f.weight, &f.bias}) {
      const std::string dev = impl::torch_device_problem(*p, "a parameter");
      if (!dev.empty()) problem(dev);
      else if (p->defined() && p->scalar_type() != at::kFloat && p->scalar_type() != at::kDouble)
        problem(std::string("parameters of dtype ") + c10::toString(p->scalar_type()) + "; kfac supports float32 and float64");
      else if (p->defined() && dtype_ != at::ScalarType::Undefined && p->scalar_type() != dtype_)
        problem(std::string("parameters of dtype ") + c10::toString(p->scalar_type()) + " where the other modules' are " +
                c10::toString(dtype_) + "; one model, one dtype");
      else if (p->defined()) dtype_ = p->scalar_type();
    }
    found.push_back(std::move(f));
  }
  impl::throw_module_problems(problems, "modules kfac cannot handle");
  if (found.empty()) throw Error("", "the model has no torch::nn::Linear, Conv2d or BatchNorm2d module to precondition");

  // Pass 2: the runtime choice of Scalar, then registration.
#if KFAC_HAVE_MPI
  if (torch_options_.mpi) {
    if (dtype_ == at::kDouble) backend_ = std::make_unique<impl::TorchBackendOf<double, MpiComm>>(std::move(options), *torch_options_.mpi);
    else backend_ = std::make_unique<impl::TorchBackendOf<float, MpiComm>>(std::move(options), *torch_options_.mpi);
  }
#endif
  if (!backend_ && dtype_ == at::kDouble) backend_ = std::make_unique<impl::TorchBackendOf<double, SerialComm>>(std::move(options), SerialComm{});
  else if (!backend_) backend_ = std::make_unique<impl::TorchBackendOf<float, SerialComm>>(std::move(options), SerialComm{});
  for (auto& f : found) {
    if (f.dense) backend_->add(f.name, *f.dense);
    else if (f.conv) backend_->add(f.name, *f.conv);
    else backend_->add(f.name, *f.bn);
    auto capture = std::make_shared<impl::TorchCapture>();
    capture->name = f.name;
    capture->kind = f.kind;
    capture->tokens = torch_options_.tokens;
    capture->bn_eps = f.eps;
    entries_.push_back({capture, f.module, f.weight, f.bias});
  }
  for (std::size_t i = 0; i < entries_.size(); ++i)
    if (!impl::TorchRegistry::instance().insert(entries_[i].module, entries_[i].capture)) {
      for (std::size_t j = 0; j < i; ++j) impl::TorchRegistry::instance().erase(entries_[j].module);
      const std::string name = entries_[i].capture->name;
      entries_.clear();
      throw Error(name, "the module is already registered with another kfac::adapters::TorchPreconditioner");
    }
  refresh_wanted();
}

inline TorchPreconditioner::~TorchPreconditioner() {
  for (const auto& e : entries_) impl::TorchRegistry::instance().erase(e.module);
}

inline bool TorchPreconditioner::is_skipped(const std::string& name, const torch::nn::Module& m) const {
  const std::string type = impl::torch_type_name(m);                          // torch::nn::Conv2d
  const std::string short_type = type.substr(type.rfind(':') == std::string::npos ? 0 : type.rfind(':') + 1);
  const char* kind = m.as<torch::nn::Linear>() ? Dense::kind : m.as<torch::nn::Conv2d>() ? Conv2d::kind
                     : m.as<torch::nn::BatchNorm2d>() ? BatchNorm2d::kind : "";
  for (const auto& s : torch_options_.skip)
    if (impl::glob_match(s.c_str(), name.c_str()) || s == type || s == type + "Impl" || s == short_type || s == kind)
      return true;
  return false;
}

inline std::vector<std::string> TorchPreconditioner::modules() const {
  std::vector<std::string> v;
  for (const auto& e : entries_) v.push_back(e.capture->name);
  return v;
}

inline std::vector<impl::ModuleProblem> TorchPreconditioner::check_observed() const {
  std::vector<impl::ModuleProblem> missing;
  for (const auto& e : entries_) {
    const auto& c = *e.capture;
    if (backend_->is_skipped(c.name)) continue;
    std::string why;
    const long k = torch_options_.accumulation_steps;
    if (!e.weight.requires_grad())
      why = "its parameters were frozen (requires_grad = false) after the TorchPreconditioner was built; "
            "build a new one (frozen modules are skipped at construction)";
    else if (!e.weight.grad().defined()) why = "its parameters have no gradient (was backward() run through it?)";
    else if (!impl::torch_device_problem(e.weight.grad(), "its gradient").empty())
      why = impl::torch_device_problem(e.weight.grad(), "its gradient");
    else if (c.wanted && c.inputs.empty())
      why = "not observed: its forward was not called through kfac::adapters::observed() in training mode with autograd on";
    else if (c.wanted && long(c.inputs.size()) % k != 0)
      why = "observed " + std::to_string(c.inputs.size()) + " times, not a multiple of TorchOptions::accumulation_steps = " +
            std::to_string(k) + " (one call per micro-batch, or the same number of calls in each)";
    else if (c.wanted)
      for (std::size_t i = 0; i < c.grads.size() && why.empty(); ++i)
        if (!c.grads[i].defined())
          why = "the output gradient of call " + std::to_string(i + 1) + " of " + std::to_string(c.grads.size()) +
                " never arrived (no backward() through that output since the forward?)";
    if (!why.empty()) missing.push_back({c.name, why});
  }
  return missing;
}

inline void TorchPreconditioner::refresh_wanted() {
  for (auto& e : entries_) {
    e.capture->clear();
    e.capture->wanted = !backend_->is_skipped(e.capture->name) && backend_->wants_observations(e.capture->name);
  }
}

inline void TorchPreconditioner::precondition() {
  struct Dropper {  // the observations are dropped however this ends
    TorchPreconditioner& self;
    ~Dropper() { self.refresh_wanted(); }
  } dropper{*this};
  // Everything that can fail is checked before kfac sees anything, so that a bad value leaves
  // no observation pending in kfac; and agreed on over the ranks, so that no rank waits in a
  // collective for one that threw.
  std::vector<impl::ModuleProblem> problems = check_observed();
  auto as_kfac = [&](at::Tensor t) { return (t.scalar_type() == dtype_ ? t : t.to(dtype_)).contiguous(); };
  // Each micro-batch's loss was divided by k: its output gradients are 1/k of the per-sample
  // ones kfac's loss reduction expects (G would come out k^2 too small).
  const long k = torch_options_.accumulation_steps;
  auto output_grad = [&](const at::Tensor& g) { return k == 1 ? as_kfac(g) : as_kfac(g * double(k)); };
  const bool check_finite = backend_->options().nonfinite == NonFinitePolicy::raise;
  struct Observation {
    const std::string* name;
    at::Tensor x, g;
  };
  std::vector<Observation> observations;
  for (const auto& e : entries_) {
    const auto& c = *e.capture;
    if (!c.wanted || !problems.empty()) continue;
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      Observation o{&c.name, as_kfac(c.inputs[i]), output_grad(impl::torch_output_grad(c, c.grads[i], c.tokens_per_row[i]))};
      if (check_finite && !torch::isfinite(o.x).all().item<bool>())
        problems.push_back({c.name, "non-finite values (NaN/Inf) in its input; nothing was preconditioned"});
      else if (check_finite && !torch::isfinite(o.g).all().item<bool>())
        problems.push_back({c.name, "non-finite values (NaN/Inf) in its output gradient; nothing was preconditioned"});
      observations.push_back(std::move(o));
    }
  }
  const long anywhere = backend_->agree_max(problems.empty() ? 0 : 1);
  impl::throw_module_problems(problems, "modules not ready at step " + std::to_string(step_count()));
  if (anywhere) throw Error("", "another rank's LibTorch modules were not ready at step " + std::to_string(step_count()) +
                                    " (its error names them); nothing was preconditioned");
  for (const auto& o : observations) backend_->observe(*o.name, o.x, o.g);
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (the .grad(), kfac's contiguous copy)
  for (const auto& e : entries_) {
    if (backend_->is_skipped(e.capture->name)) continue;
    at::Tensor w = e.weight.grad(), b = e.bias.defined() ? e.bias.grad() : at::Tensor();
    if (e.bias.defined() && !b.defined()) {  // a bias without a gradient counts as 0
      at::Tensor bias = e.bias;
      b = bias.mutable_grad() = torch::zeros_like(bias);
    }
    at::Tensor kw = as_kfac(w), kb = b.defined() ? as_kfac(b) : b;
    if (kw.data_ptr() != w.data_ptr()) copy_back.emplace_back(w, kw);
    if (b.defined() && kb.data_ptr() != b.data_ptr()) copy_back.emplace_back(b, kb);
    backend_->set_gradient(e.capture->name, kw, kb);
  }
  backend_->step();
  torch::NoGradGuard no_grad;
  for (auto& [grad, copy] : copy_back) grad.copy_(copy);
}

template <class Scalar, class Comm>
Preconditioner<Scalar, impl::TorchExec, Comm>& TorchPreconditioner::preconditioner() {
  auto* b = dynamic_cast<impl::TorchBackendOf<Scalar, Comm>*>(backend_.get());
  bool mpi = false;
#if KFAC_HAVE_MPI
  mpi = bool(torch_options_.mpi);
#endif
  if (!b)
    throw Error("", std::string("preconditioner<Scalar, Comm>(): the adapter holds a Preconditioner<") +
                        (dtype_ == at::kDouble ? "double" : "float") + ", ..., " + (mpi ? "MpiComm" : "SerialComm") + ">");
  return b->preconditioner();
}

}  // namespace adapters
}  // namespace kfac
