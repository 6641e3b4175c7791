#pragma once
/// \file mlp_stage.hpp
/// \brief Some consecutive Dense(+ReLU) layers of an MLP as one stage of kfac::Pipeline (the
/// contract in kfac/pipeline/stage.hpp), trained with nn::Sgd.
///
/// Under FDG a stage has several batches in flight (up to its delay + 1), so each batch's
/// activations live in a slot of their own from its forward to its backward; the backward
/// goes through the current weights. The pipeline hands host tensors (kfac::StageTensor); the
/// stage computes on nn::ExecSpace and mirrors its input, output gradient and results at that
/// boundary (no copies when ExecSpace is a host space: the types are then the same).
///
/// Optionally the stage preconditions its own layers with K-FAC (enable_kfac): a
/// kfac::Preconditioner over this stage's Dense layers only, on this rank alone (SerialComm),
/// fed in backward and stepped in apply_update before the SGD step.

#include "common/init.hpp"
#include "common/kfac_glue.hpp"
#include "common/sgd.hpp"
#include "common/tensor.hpp"

#include <KokkosBlas3_gemm.hpp>
#include <kfac/pipeline/stage.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace nn {

/// Kernels of MlpStage (free functions: nvcc rejects device lambdas in private members).
namespace detail {
inline void add_bias_relu(const Matrix& y, const Vector& b, bool relu) {
  Kokkos::parallel_for("nn::mlp_stage::bias", range2(y.extent(0), y.extent(1)), KOKKOS_LAMBDA(const int i, const int o) {
    const float v = y(i, o) + b(o);
    y(i, o) = relu ? (v > 0.0f ? v : 0.0f) : v;
  });
}
/// g <- g * (y > 0), the ReLU's backward through its output.
inline void relu_mask(const Matrix& g, const Matrix& y) {
  Kokkos::parallel_for("nn::mlp_stage::relu_mask", range2(g.extent(0), g.extent(1)), KOKKOS_LAMBDA(const int i, const int o) {
    const float v = g(i, o);
    g(i, o) = y(i, o) > 0.0f ? v : 0.0f;
  });
}
inline void column_sums(const Matrix& g, const Vector& out) {
  const int n = int(g.extent(0));
  Kokkos::parallel_for("nn::mlp_stage::bias_grad", Kokkos::RangePolicy<ExecSpace>(0, int(g.extent(1))),
                       KOKKOS_LAMBDA(const int o) {
                         double s = 0.0;
                         for (int i = 0; i < n; ++i) s += g(i, o);
                         out(o) = float(s);
                       });
}
}  // namespace detail

class MlpStage {
 public:
  using scalar_type = float;
  using HostMatrix = kfac::StageTensor<float>;

  /// \param widths [in] the whole MLP's widths (input, hidden..., classes)
  /// \param first, last [in] this stage holds layers [first, last) (layer i maps widths[i] -> widths[i+1])
  /// Layer i's weights depend only on (seed, i), so every split of the same MLP starts equal.
  MlpStage(const std::vector<int>& widths, int first, int last, std::uint64_t seed, SgdOptions sgd)
      : first_(first), last_(last), classes_layer_(int(widths.size()) - 2) {
    if (first < 0 || last <= first || last > int(widths.size()) - 1)
      throw std::invalid_argument("nn::MlpStage: layers [" + std::to_string(first) + ", " + std::to_string(last) +
                                  ") are not a range of the MLP's layers");
    std::vector<Param> params;
    for (int i = first; i < last; ++i) {
      Layer l;
      l.in = widths[i];
      l.out = widths[i + 1];
      l.w = Matrix("nn::mlp_stage::W", l.out, l.in);
      l.b = Vector("nn::mlp_stage::b", l.out);
      l.dw = Matrix("nn::mlp_stage::dW", l.out, l.in);
      l.db = Vector("nn::mlp_stage::db", l.out);
      SplitMix64 rng(derive_seed(seed, 1, std::uint64_t(i)));
      fill_uniform(l.w, init_bound(i == classes_layer_ ? Init::lecun : Init::he, l.in), rng);
      params.push_back({"fc" + std::to_string(i + 1) + ".weight", flat(l.w), flat(l.dw), true});
      params.push_back({"fc" + std::to_string(i + 1) + ".bias", l.b, l.db, false});
      layers_.push_back(l);
    }
    sgd_ = std::make_unique<Sgd>(params, sgd);
  }

#if KFAC_EXAMPLES_HAVE_KFAC
  /// \brief Preconditions this stage's layers with K-FAC from now on (settings as nn::KfacSgd's;
  /// lr and momentum stay the SGD's given at construction).
  void enable_kfac(const KfacSettings& s) {
    pre_ = std::make_unique<Preconditioner>(kfac_options(s));
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const kfac::Dense d(layers_[i].in, layers_[i].out, true);
      if (s.inverse == "cholesky") pre_->register_layer<kfac::Dense, kfac::Symmetric, kfac::Cholesky<>>(name(i), d);
      else pre_->register_layer(name(i), d);
    }
  }
#endif

  int input_features() const { return layers_.front().in; }
  int output_features() const { return layers_.back().out; }
  /// Seconds spent in each layer's forward + backward so far (for the pipeline cost model).
  const std::vector<double>& layer_seconds() const { return layer_seconds_; }

  HostMatrix forward(long batch, const HostMatrix& x) { return to_host(run_forward(acquire(batch), x)); }

  /// Evaluation: a forward pass in a slot of its own, touching no batch in flight.
  HostMatrix predict(const HostMatrix& x) { return to_host(run_forward(eval_, x)); }

  /// `x` is the input forward received (the pipeline's stash); the slot kept its device copy.
  HostMatrix backward(long batch, const HostMatrix& x, const HostMatrix& gy, bool need_input_grad) {
    Slot& s = find(batch);
    const int n = int(x.extent(0));
    Matrix g = Kokkos::create_mirror_view_and_copy(MemSpace(), gy);
    for (std::size_t i = layers_.size(); i-- > 0;) {
      Kokkos::Timer timer;
      Layer& l = layers_[i];
      const Matrix h = i ? s.out[i - 1] : s.input;
      if (relu(i)) {
        const Matrix gz = s.scratch[2].matrix(n, l.out);
        Kokkos::deep_copy(gz, g);
        detail::relu_mask(gz, s.out[i]);
        g = gz;
      }
      KokkosBlas::gemm("T", "N", 1.0f, g, h, 0.0f, l.dw);
      detail::column_sums(g, l.db);
#if KFAC_EXAMPLES_HAVE_KFAC
      if (pre_) {
        if (pre_->wants_observations(name(i))) {
          pre_->observe_input(name(i), h);
          pre_->observe_output_grad(name(i), g);
        }
        pre_->set_gradient(name(i), l.dw, l.db);
      }
#endif
      if (i > 0 || need_input_grad) {
        const Matrix dx = s.scratch[i % 2].matrix(n, l.in);
        KokkosBlas::gemm("N", "N", 1.0f, g, l.w, 0.0f, dx);
        g = dx;
      }
      Kokkos::fence();
      layer_seconds_[i] += timer.seconds();
    }
    s.batch = -1;  // the slot is free again; g stays valid until the next call
    return need_input_grad ? to_host(g) : HostMatrix();
  }

  void apply_update(long) {
#if KFAC_EXAMPLES_HAVE_KFAC
    if (pre_) pre_->step();  // preconditions dW and db in place
#endif
    sgd_->step();
  }

  /// Parameters of every layer, in order (W then b), on the host.
  std::vector<float> parameters() const {
    std::vector<float> p;
    for (const auto& l : layers_)
      for (const Vector& v : {flat(l.w), l.b}) {
        auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
        p.insert(p.end(), h.data(), h.data() + h.size());
      }
    return p;
  }

 private:
  struct Layer {
    int in = 0, out = 0;
    Matrix w, dw;
    Vector b, db;
  };
  struct Slot {
    long batch = -1;
    std::vector<Buffer<float>> store;
    Matrix input;             ///< the batch's input in ExecSpace's memory
    std::vector<Matrix> out;  ///< each layer's output (after the ReLU)
    Buffer<float> scratch[3];
  };

  bool relu(std::size_t i) const { return first_ + int(i) != classes_layer_; }
  std::string name(std::size_t i) const { return "fc" + std::to_string(first_ + int(i) + 1); }

  static HostMatrix to_host(const Matrix& m) { return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m); }

  Matrix run_forward(Slot& s, const HostMatrix& x) {
    const int n = int(x.extent(0));
    s.store.resize(layers_.size());
    s.out.resize(layers_.size());
    s.input = Kokkos::create_mirror_view_and_copy(MemSpace(), x);
    Matrix h = s.input;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      Kokkos::Timer timer;
      const Layer& l = layers_[i];
      s.out[i] = s.store[i].matrix(n, l.out);
      KokkosBlas::gemm("N", "T", 1.0f, h, l.w, 0.0f, s.out[i]);
      detail::add_bias_relu(s.out[i], l.b, relu(i));
      h = s.out[i];
      Kokkos::fence();
      if (&s != &eval_) layer_seconds_[i] += timer.seconds();
    }
    return h;
  }
  Slot& acquire(long batch) {
    for (auto& s : slots_)
      if (s->batch < 0) {
        s->batch = batch;
        return *s;
      }
    slots_.push_back(std::make_unique<Slot>());
    slots_.back()->batch = batch;
    return *slots_.back();
  }
  Slot& find(long batch) {
    for (auto& s : slots_)
      if (s->batch == batch) return *s;
    throw std::logic_error("nn::MlpStage: backward of batch " + std::to_string(batch) + " without its forward");
  }

  int first_, last_, classes_layer_;
  std::vector<Layer> layers_;
  std::unique_ptr<Sgd> sgd_;
#if KFAC_EXAMPLES_HAVE_KFAC
  using Preconditioner = kfac::Preconditioner<float, ExecSpace, kfac::SerialComm>;
  std::unique_ptr<Preconditioner> pre_;
#endif
  std::vector<std::unique_ptr<Slot>> slots_;  ///< stable addresses: a slot's views outlive others' growth
  Slot eval_;
  std::vector<double> layer_seconds_ = std::vector<double>(std::size_t(last_ - first_), 0.0);
};

}  // namespace nn
