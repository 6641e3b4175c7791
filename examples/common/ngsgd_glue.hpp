#pragma once
/// \file ngsgd_glue.hpp
/// \brief SGD with momentum on gradients preconditioned by Kaldi's online natural gradient
/// (kfac::NGSGD, Povey, Zhang & Khudanpur 2014, arXiv:1410.7455) on every Dense and Conv2d layer.
///
/// The estimates are per rank and kfac::Independent communicates nothing per step, so this rule
/// is meant for one process or for periodic parameter averaging (parameter_averaging.hpp), never
/// for the synchronous data-parallel mode (ranks would precondition the same averaged gradient
/// with different estimates and drift apart). KL clipping is off (docs/ngsgd.md: with NG-SGD
/// layers only it would be a gradient-norm clip whose threshold depends on the learning rate).

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/kfac_glue.hpp"  // KFAC_EXAMPLES_HAVE_KFAC and the kfac headers
#include "common/network.hpp"
#include "common/sgd.hpp"
#include "common/world.hpp"

namespace nn {

/// | type | name | description | default |
/// |---|---|---|---|
/// | double | lr | SGD learning rate | 0.05 |
/// | double | momentum | SGD momentum applied to the preconditioned gradient | 0.9 |
/// | double | weight_decay | L2 on weights, added after preconditioning | 0 |
/// | long | update_period | minibatches between updates of the estimates (kfac::NGSGD) | 4 (Kaldi) |
/// | double | alpha | smoothing towards the identity (kfac::NGSGD) | 4 (Kaldi) |
/// | long | rank | rank of both estimates (at most the dimension - 1); -1 keeps Kaldi's min(20, (in+1)/2), min(80,
/// (out+1)/2). The demo uses 20: as few epochs to 88% on the MLP as Kaldi's ranks, at 0.86x their step cost
/// (docs/fashion_mnist.md) | 20 |
struct NgsgdSettings {
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  long update_period = 4;
  double alpha = 4.0;
  long rank = 20;
};

#if KFAC_EXAMPLES_HAVE_KFAC

class NgsgdSgd {
 public:
  /// \param world [in] one process, or the ranks of an averaging run (each keeps its own estimates)
  NgsgdSgd(Network& net, const NgsgdSettings& s, const World& world = World())
      : sgd_(net.params(), SgdOptions{}.with_lr(s.lr).with_momentum(s.momentum).with_weight_decay(s.weight_decay)) {
    const kfac::Options options =
        kfac::Options{}.with_lr(s.lr).with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::mean);
#if KFAC_EXAMPLES_HAVE_MPI
    if (world.size() > 1) mpi_ = std::make_unique<MpiPreconditioner>(options, ExecSpace(), kfac::MpiComm(world.comm()));
#endif
    if (world.size() > 1 && !mpi_) throw std::runtime_error("NG-SGD on several ranks needs kfac built with MPI");
    if (!mpi_) serial_ = std::make_unique<SerialPreconditioner>(options);
    kfac::NGSGD method = kfac::NGSGD{}.with_update_period(s.update_period).with_alpha(s.alpha);
    with_preconditioner([&](auto& pre) {
      net.for_each_layer([&](const std::string& name, const auto& layer) {
        using L = std::decay_t<decltype(layer)>;
        kfac::NGSGD m = method;
        if constexpr (std::is_same_v<L, Dense>) {
          if (s.rank >= 0)
            m.with_rank_in(clamp(s.rank, layer.in_features() + (layer.has_bias() ? 1 : 0)))
                .with_rank_out(clamp(s.rank, layer.out_features()));
          pre.register_layer(name, kfac_layer_of(layer), m);
        } else if constexpr (std::is_same_v<L, Conv2d>) {
          const Conv2dShape& c = layer.shape();
          if (s.rank >= 0)
            m.with_rank_in(clamp(s.rank, long(c.in_channels) * c.kernel_h * c.kernel_w + (c.bias ? 1 : 0)))
                .with_rank_out(clamp(s.rank, c.out_channels));
          pre.register_layer(name, kfac_layer_of(layer), m);
        }
        // BatchNorm2d: left to plain SGD (NG-SGD handles Dense and Conv2d only).
      });
    });
  }

  /// \brief After forward and backward: observations on update steps, the gradients, the
  /// preconditioning in place, then the SGD step.
  void step(Network& net) {
    with_preconditioner([&](auto& pre) {
      net.for_each_layer([&](const std::string& name, const auto& layer) {
        using L = std::decay_t<decltype(layer)>;
        if constexpr (std::is_same_v<L, Dense> || std::is_same_v<L, Conv2d>) {
          if (pre.wants_observations(name)) {
            pre.observe_input(name, layer.input());
            pre.observe_output_grad(name, layer.output_grad());
          }
          pre.set_gradient(name, layer.weight_grad(), layer.bias_grad());
        }
      });
      pre.step();
    });
    sgd_.step();
  }

  Sgd& sgd() { return sgd_; }
  /// \brief Bytes the preconditioner sent (0 under kfac::Independent; MPI runs only).
  std::size_t bytes_sent() const {
#if KFAC_EXAMPLES_HAVE_MPI
    if (mpi_) return comm_bytes(*mpi_);
#endif
    return 0;
  }

 private:
  using SerialPreconditioner = kfac::Preconditioner<float, ExecSpace, kfac::SerialComm, kfac::Independent>;
#if KFAC_EXAMPLES_HAVE_MPI
  using MpiPreconditioner = kfac::Preconditioner<float, ExecSpace, kfac::MpiComm, kfac::Independent>;
  template <class Pre>
  static std::size_t comm_bytes(const Pre& pre) {
    return pre.communicator().bytes_sent();
  }
#else
  using MpiPreconditioner = SerialPreconditioner;  // never constructed
#endif

  static long clamp(long r, long dim) { return r < dim ? r : dim - 1; }

  template <class F>
  void with_preconditioner(F&& f) {
    if (mpi_)
      f(*mpi_);
    else
      f(*serial_);
  }

  std::unique_ptr<SerialPreconditioner> serial_;
  std::unique_ptr<MpiPreconditioner> mpi_;
  Sgd sgd_;
};

#else

class NgsgdSgd {
 public:
  NgsgdSgd(Network&, const NgsgdSettings&, const World& = World()) {
    throw std::runtime_error("this build of the examples has no kfac (KFAC_EXAMPLES_WITHOUT_KFAC)");
  }
  void step(Network&) {}
  Sgd& sgd() { throw std::logic_error("no kfac"); }
  std::size_t bytes_sent() const { return 0; }
};

#endif

}  // namespace nn
