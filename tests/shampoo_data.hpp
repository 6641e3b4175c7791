#pragma once
// The data of the toy Shampoo tests (toy_shampoo.hpp), shared by test_shampoo and
// test_mpi_shampoo: layers, each step's deterministic batches, and an independent dense
// reference of the method in double.
#include <unsupported/Eigen/MatrixFunctions>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "toy_shampoo.hpp"

namespace kfac_test {

/// A Dense layer of a test network and its method (Shampoo, else K-FAC).
struct ShampooSpec {
  std::string name;
  int in, out;
  bool bias, shampoo;
};

/// Registers `layers` (Shampoo with its defaults, K-FAC with kfac::KFAC<>).
template <class P>
void register_layers(P& pre, const std::vector<ShampooSpec>& layers) {
  for (const auto& s : layers) {
    if (s.shampoo) pre.register_layer(s.name, kfac::Dense(s.in, s.out, s.bias), Shampoo{});
    else pre.register_layer(s.name, kfac::Dense(s.in, s.out, s.bias), kfac::KFAC<>{});
  }
}

/// Step `step`'s batch of every layer: the same on every call and on every rank.
inline std::vector<DenseBatch> batches_at(const std::vector<ShampooSpec>& layers, long step) {
  std::vector<DenseBatch> out;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    Rng rng(std::uint64_t(step) * 131u + l + 7u);
    out.emplace_back(layers[l].in, layers[l].out, layers[l].bias, 4, rng);
  }
  return out;
}

/// Feeds step `step`'s batches to `pre` and steps: each layer's preconditioned gradient
/// (g x c, the bias as a last column).
template <class P>
std::vector<MatrixXd> step_at(P& pre, const std::vector<ShampooSpec>& layers, long step) {
  const auto data = batches_at(layers, step);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    pre.observe_input(layers[l].name, data[l].x);
    pre.observe_output_grad(layers[l].name, data[l].g);
    pre.set_gradient(layers[l].name, data[l].w, data[l].b);
  }
  pre.step();
  std::vector<MatrixXd> out;
  for (const auto& d : data) out.push_back(d.gradient());
  return out;
}

/// Shampoo in dense double, written from its definition: running L and R (the first update sets
/// them), their inverse fourth roots at every `inv_every`-th step by Eigen's matrix power (a
/// Schur decomposition, not the block's eigensolver), V = L^{-1/4} X R^{-1/4}.
struct ShampooReference {
  ShampooReference(double decay_, double damping_, long inv_every_)
      : decay(decay_), damping(damping_), inv_every(inv_every_) {}
  double decay, damping;
  long inv_every;
  long step = 0;
  Eigen::MatrixXd l, r, lroot, rroot;

  Eigen::MatrixXd root(const Eigen::MatrixXd& f) const {
    const Eigen::MatrixXd s = f + damping * Eigen::MatrixXd::Identity(f.rows(), f.cols());
    return s.pow(-0.25);
  }
  MatrixXd precondition(const MatrixXd& grad) {
    const Eigen::MatrixXd x = grad;
    const Eigen::MatrixXd xxt = x * x.transpose(), xtx = x.transpose() * x;
    l = step == 0 ? xxt : Eigen::MatrixXd(decay * l + (1 - decay) * xxt);
    r = step == 0 ? xtx : Eigen::MatrixXd(decay * r + (1 - decay) * xtx);
    if (step % inv_every == 0) {
      lroot = root(l);
      rroot = root(r);
    }
    ++step;
    return lroot * x * rroot;
  }
};

/// max |a - b| <= tol max(1, max |b|).
inline bool close_to(const MatrixXd& a, const MatrixXd& b, double tol) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a - b).cwiseAbs().maxCoeff() <= tol * std::max(1.0, b.cwiseAbs().maxCoeff());
}

}  // namespace kfac_test
