#pragma once
/// \file torch_impl.hpp
/// \brief Definitions for kfac/adapters/torch.hpp (included at its end).

#include <algorithm>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace kfac {
namespace impl {

/// The module type as written in C++ ("torch::nn::Conv2d") from Module::name().
inline std::string torch_type_name(const torch::nn::Module& m) { return TorchModuleKinds::type_name_of(m.name()); }

template <class Scalar, class Comm>
using CppTorchBackend = TorchBackendOf<Scalar, Comm>;

/// \brief What the C++ front end hands the shared core: one spec per module owning parameters, or
/// under the diagonal fallback one per parameter of a module no kind takes; and for each spec the
/// module (its path and address) whose calls observed() records.
struct CppModules {
  std::vector<TorchModuleSpec> specs;
  std::vector<std::pair<std::string, const torch::nn::Module*>> modules;  ///< per spec
};

/// \brief A fallback parameter's observation of one call: its sample count, as a (batch) tensor whose
/// values are never read: the input's first extent, or for MultiheadAttention (`attention`; LibTorch's
/// queries are (L, N, E)) its second (1 for an unbatched query).
inline TorchView torch_sample_count(bool attention) {
  return [attention](const TorchCapture& c, const at::Tensor& x) {
    if (x.dim() < 1)
      throw Error(c.name, "input of shape (); the diagonal fallback counts a call's samples along its first dimension");
    const int64_t n = !attention ? x.size(0) : x.dim() == 3 ? x.size(1) : 1;
    return torch::zeros({n}, at::kFloat);
  };
}

/// The parameters a module's call computes with, by their path below it: its own, and for
/// MultiheadAttention its out_proj's too (its forward reads them without calling out_proj).
inline std::vector<std::pair<std::string, at::Tensor>> cpp_parameters_of(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> v;
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    if (p.value().defined()) v.emplace_back(p.key(), p.value());
  if (const auto* a = m.as<torch::nn::MultiheadAttentionImpl>())
    if (!a->out_proj.is_empty())
      for (const auto& p : a->out_proj->named_parameters(/*recurse=*/false))
        if (p.value().defined()) v.emplace_back("out_proj." + p.key(), p.value());
  return v;
}

/// One module as the core sees it: its kind's translation, or none (refused by the core).
inline TorchModuleSpec cpp_module_spec(const std::string& name, const torch::nn::Module& m,
                                       const std::shared_ptr<const TorchModuleKinds::Kind>& kind, bool skipped) {
  TorchModuleSpec s;
  s.name = name;
  s.type_name = torch_type_name(m);
  s.skipped = skipped;
  s.all_frozen = true;
  for (const auto& p : m.named_parameters(/*recurse=*/false)) s.all_frozen = s.all_frozen && !p.value().requires_grad();
  if (kind)
    s.translate = [kind, &m](const TorchContext& ctx, std::string& problem) {
      return kind->translate(m, ctx, problem);
    };
  return s;
}

/// \brief One parameter of a module under the diagonal fallback, named "module.parameter"; skipped as
/// tied when a module before it registered the same parameter (`registered`: memory -> name).
inline TorchModuleSpec cpp_parameter_spec(const std::string& module, const torch::nn::Module& m,
                                          const std::string& path, const at::Tensor& p,
                                          std::unordered_map<const void*, std::string>& registered) {
  TorchModuleSpec s;
  s.name = module + "." + path;
  s.type_name = torch_type_name(m) + " parameter";
  s.all_frozen = !p.requires_grad();
  const auto tied = p.data_ptr() != nullptr ? registered.find(p.data_ptr()) : registered.end();
  if (tied != registered.end()) {
    s.skipped = true;
    s.skip_reason = "tied weights: preconditioned once, as '" + tied->second + "'";
  } else if (p.requires_grad() && p.data_ptr() != nullptr) {
    registered.emplace(p.data_ptr(), s.name);
  }
  const bool attention = m.as<torch::nn::MultiheadAttentionImpl>() != nullptr;
  s.translate = [p, attention](const TorchContext&, std::string& problem) {
    std::optional<TorchLayer> t = torch_parameter<TorchMethods::default_only>(p, TorchPrecision::scalar, problem);
    if (t) t->input = torch_sample_count(attention);
    return t;
  };
  return s;
}

/// \brief The C++ front end's view of `model` for the shared core. `skip(name, module, kind)` is the
/// skip list. With `fallback` (TorchFallback::diagonal), a module with trainable parameters that no
/// kind takes, or that shares a parameter with another module, has each parameter its call computes
/// with registered on its own (cpp_parameter_spec), as the Python package's fallback does; a
/// MultiheadAttention's out_proj, never called by the attention's forward, is registered with it.
template <class Skip>
CppModules cpp_modules(const torch::nn::Module& model, bool fallback, Skip&& skip) {
  // The root by reference (named_modules(include_self) would need it held in a shared_ptr).
  std::vector<std::pair<std::string, const torch::nn::Module*>> all{{"root", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    all.emplace_back(item.key(), item.value().get());
  std::vector<const torch::nn::Module*> never_called;  // MultiheadAttention's out_proj (with the fallback)
  std::unordered_map<const void*, int> users;          // parameter memory -> how many modules compute with it
  for (const auto& [name, m] : all)
    if (const auto* a = m->template as<torch::nn::MultiheadAttentionImpl>(); fallback && a && !a->out_proj.is_empty())
      never_called.push_back(a->out_proj.get());
  auto called = [&](const torch::nn::Module* m) {
    return std::find(never_called.begin(), never_called.end(), m) == never_called.end();
  };
  for (const auto& [name, m] : all)
    if (fallback && called(m))
      for (const auto& [path, p] : cpp_parameters_of(*m)) users[p.data_ptr()] += p.data_ptr() != nullptr ? 1 : 0;
  CppModules out;
  std::unordered_map<const void*, std::string> registered;  // the fallback's parameters: memory -> name
  for (const auto& [name, module] : all) {
    const torch::nn::Module& m = *module;
    // Containers, activations, BatchNorm2d(affine=false); out_proj under the fallback.
    if (m.named_parameters(/*recurse=*/false).is_empty() || !called(module)) continue;
    const auto kind = TorchModuleKinds::instance().find(m);
    const auto params = fallback ? cpp_parameters_of(m) : std::vector<std::pair<std::string, at::Tensor>>{};
    bool shared = false, trainable = false;
    for (const auto& [path, p] : params) {
      shared = shared || users[p.data_ptr()] > 1;
      trainable = trainable || p.requires_grad();
    }
    const bool diagonal = fallback && (!kind || shared) && trainable;
    const bool skipped =
        skip(name, m, kind ? kind->kind : std::string()) || (diagonal && skip(name, m, Parameter::kind));
    if (!diagonal || skipped) {
      out.specs.push_back(cpp_module_spec(name, m, kind, skipped));
      out.modules.emplace_back(name, module);
      continue;
    }
    for (const auto& [path, p] : params) {
      out.specs.push_back(cpp_parameter_spec(name, m, path, p, registered));
      out.modules.emplace_back(name, module);
    }
  }
  return out;
}

/// The built-in kinds, registered as a user's kind is (adapters::register_torch_module). The
/// LibTorch front end offers no choice of method (the Python package does), so it compiles the
/// default ones only (TorchMethods::default_only).
inline TorchModuleKinds::TorchModuleKinds() {
  constexpr TorchMethods Set = TorchMethods::default_only;
  namespace nn = torch::nn;
  add<nn::LinearImpl>(Dense::kind, [](const nn::LinearImpl& l, const TorchContext& ctx, std::string&) {
    const auto& o = l.options;
    return torch_linear<Set>(o.in_features(), o.out_features(), l.weight, o.bias() ? l.bias : at::Tensor(),
                             TorchMethod{}, ctx);
  });
  add<nn::Conv2dImpl>(Conv2d::kind, [](const nn::Conv2dImpl& c, const TorchContext&, std::string& problem) {
    const auto& o = c.options;
    TorchConv2dSettings s;
    s.in_channels = o.in_channels();
    s.out_channels = o.out_channels();
    s.groups = o.groups();
    s.kernel = *o.kernel_size();
    s.stride = *o.stride();
    s.dilation = *o.dilation();
    if (const auto* p = c10::get_if<torch::ExpandingArray<2>>(&o.padding())) s.padding = **p;
    s.padding_same = c10::get_if<torch::enumtype::kSame>(&o.padding()) != nullptr;
    s.padding_mode = torch::enumtype::get_enum_name(o.padding_mode());
    if (s.padding_mode == "kZeros") s.padding_mode = "zeros";
    return torch_conv2d<Set>(s, c.weight, o.bias() ? c.bias : at::Tensor(), TorchMethod{}, problem);
  });
  add<nn::BatchNorm2dImpl>(BatchNorm2d::kind, [](const nn::BatchNorm2dImpl& b, const TorchContext&, std::string&) {
    return torch_batch_norm<Set>(b.options.num_features(), b.options.eps(), b.weight, b.bias, TorchPrecision::scalar);
  });
  add<nn::LayerNormImpl>(LayerNorm::kind, [](const nn::LayerNormImpl& n, const TorchContext&, std::string& problem) {
    const auto& shape = n.options.normalized_shape();
    return torch_layer_norm<Set>(shape.back(), int64_t(shape.size()), n.options.eps(), n.weight, n.bias,
                                 TorchPrecision::scalar, problem);
  });
  add<nn::EmbeddingImpl>(Embedding::kind, [](const nn::EmbeddingImpl& e, const TorchContext& ctx,
                                              std::string& problem) {
    const auto& o = e.options;
    TorchEmbeddingSettings s;
    s.num_embeddings = o.num_embeddings();
    s.embedding_dim = o.embedding_dim();
    if (o.padding_idx()) s.padding_idx = *o.padding_idx();
    s.sparse = o.sparse();
    s.scale_grad_by_freq = o.scale_grad_by_freq();
    return torch_embedding<Set>(s, e.weight, TorchMethod{}, ctx.front, problem);
  });
}
}  // namespace impl

namespace adapters {

template <class ModuleRef, class... Rest>
auto observed(ModuleRef& module, const at::Tensor& x, Rest&&... rest) {
  auto* mod = module.get();  // ModuleHolder::get() or std::shared_ptr::get()
  using Result = decltype(mod->forward(x, std::forward<Rest>(rest)...));
  const auto captures = impl::TorchRegistry::instance().find(mod);
  const bool wanted = std::any_of(captures.begin(), captures.end(), [](const auto& c) { return c->wanted; });
  if (!wanted || !mod->is_training() || !at::GradMode::is_enabled())
    return mod->forward(x, std::forward<Rest>(rest)...);
  if (captures.front()->layer->kind == Parameter::kind) {  // the diagonal Fisher: the call's sample count only
    std::vector<at::Tensor> seen;
    for (const auto& c : captures) seen.push_back(c->wanted ? impl::torch_observation(*c, x) : at::Tensor());
    Result y = mod->forward(x, std::forward<Rest>(rest)...);
    for (std::size_t i = 0; i < captures.size(); ++i)
      if (seen[i].defined()) {
        captures[i]->add_input(seen[i]);
        captures[i]->set_latest_grad(seen[i]);
      }
    return y;
  }
  const std::shared_ptr<impl::TorchCapture>& capture = captures.front();
  if constexpr (!std::is_same<std::decay_t<Result>, at::Tensor>::value) {
    throw Error(capture->name, "observed(): its forward returns no tensor, so kfac cannot hook its output gradient");
  } else {
    at::Tensor seen = impl::torch_observation(*capture, x);
    at::Tensor y = mod->forward(x, std::forward<Rest>(rest)...);
    if (!y.requires_grad()) return y;
    long generation;
    {
      std::lock_guard<std::mutex> lock(capture->mutex);
      generation = capture->generation;
    }
    const std::size_t slot = capture->add_input(std::move(seen));
    y.register_hook([capture, slot, generation](const at::Tensor& g) { capture->set_grad(slot, generation, g); });
    return y;
  }
}

inline TorchPreconditioner::TorchPreconditioner(const torch::nn::Module& model, Options options,
                                                TorchOptions torch_options)
    : torch_options_(std::move(torch_options)) {
  // What each module owning parameters is, for the shared translation (impl::TorchCore).
  const impl::CppModules found =
      impl::cpp_modules(model, torch_options_.fallback == TorchFallback::diagonal,
                        [this](const std::string& name, const torch::nn::Module& m, const std::string& kind) {
                          return is_skipped(name, m, kind);
                        });
  core_ = std::make_unique<impl::TorchCore>(
      found.specs, std::move(options), torch_options_.tokens, torch_options_.accumulation_steps, impl::cpp_front_end(),
      [&](at::ScalarType dtype, Options o) -> std::unique_ptr<impl::TorchBackend> {
#if KFAC_HAVE_MPI
        if (torch_options_.mpi) {
          const MpiComm& mpi = *torch_options_.mpi;
          if (dtype == at::kDouble) return std::make_unique<impl::CppTorchBackend<double, MpiComm>>(std::move(o), mpi);
          return std::make_unique<impl::CppTorchBackend<float, MpiComm>>(std::move(o), mpi);
        }
#endif
        if (dtype == at::kDouble)
          return std::make_unique<impl::CppTorchBackend<double, SerialComm>>(std::move(o), SerialComm{});
        return std::make_unique<impl::CppTorchBackend<float, SerialComm>>(std::move(o), SerialComm{});
      });
  register_captures(found);
}

inline void TorchPreconditioner::register_captures(const impl::CppModules& found) {
  // The registered modules, in the core's order, each with its captures (several: the fallback's parameters).
  const std::vector<std::string> names = core_->modules();
  std::vector<std::string> paths;
  std::vector<impl::TorchRegistry::Captures> groups;
  for (std::size_t i = 0, j = 0; i < names.size(); ++i) {
    while (found.specs[j].name != names[i]) ++j;
    const auto& [path, module] = found.modules[j];
    if (registered_.empty() || registered_.back() != module) {
      registered_.push_back(module);
      paths.push_back(path);
      groups.emplace_back();
    }
    groups.back().push_back(core_->captures()[i]);
  }
  auto& registry = impl::TorchRegistry::instance();
  for (std::size_t i = 0; i < registered_.size(); ++i)
    if (!registry.insert(registered_[i], groups[i])) {
      for (std::size_t j = 0; j < i; ++j) registry.erase(registered_[j]);
      registered_.clear();
      throw Error(paths[i], "the module is already registered with another kfac::adapters::TorchPreconditioner");
    }
}

inline TorchPreconditioner::~TorchPreconditioner() {
  for (const auto* m : registered_) impl::TorchRegistry::instance().erase(m);
}

inline bool TorchPreconditioner::is_skipped(const std::string& name, const torch::nn::Module& m,
                                            const std::string& kind) const {
  const std::string type = impl::torch_type_name(m);                          // torch::nn::Conv2d
  const std::string short_type = type.substr(type.rfind(':') == std::string::npos ? 0 : type.rfind(':') + 1);
  for (const auto& s : torch_options_.skip)
    if (impl::glob_match(s.c_str(), name.c_str()) || s == type || s == type + "Impl" || s == short_type ||
        (!kind.empty() && s == kind))
      return true;
  return false;
}

inline std::vector<std::string> TorchPreconditioner::modules() const { return core_->modules(); }

inline void TorchPreconditioner::precondition() { core_->precondition(); }

template <class Scalar, class Comm>
Preconditioner<Scalar, impl::TorchExec, Comm>& TorchPreconditioner::preconditioner() {
  auto* b = dynamic_cast<impl::CppTorchBackend<Scalar, Comm>*>(&core_->backend());
  bool mpi = false;
#if KFAC_HAVE_MPI
  mpi = bool(torch_options_.mpi);
#endif
  if (!b)
    throw Error("", std::string("preconditioner<Scalar, Comm>(): the adapter holds a Preconditioner<") +
                        (dtype() == at::kDouble ? "double" : "float") + ", ..., " + (mpi ? "MpiComm" : "SerialComm") + ">");
  return b->preconditioner();
}

}  // namespace adapters
}  // namespace kfac
