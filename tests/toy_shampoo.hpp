#pragma once
// A method whose statistics come from the gradient, defined outside the library, to check that
// Block::observe_gradient is all such a method needs. Shampoo (Gupta, Koren and Singer 2018,
// "Shampoo: Preconditioned Stochastic Tensor Optimization"), for a Dense layer: the gradient X
// (g x c, the bias as a last column when the layer has one) gives running averages
// L <- decay L + (1 - decay) X X^T (g x g) and R <- decay R + (1 - decay) X^T X (c x c), averaged
// over the ranks; the two decomposable units compute (L + eps I)^{-1/4} and (R + eps I)^{-1/4}
// (eps: the damping) by a symmetric eigendecomposition on the host; V = (L + eps I)^{-1/4} X
// (R + eps I)^{-1/4}. The first update sets L = X X^T and R = X^T X.
#include <Eigen/Dense>
#include <Kokkos_Core.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <kfac/kfac.hpp>

#include "toy_dense_block.hpp"

namespace kfac_test {

template <class Scalar, class Exec>
class ShampooBlock final : public DenseToyBlock<Scalar, Exec> {
  using base = DenseToyBlock<Scalar, Exec>;
  using Mat = typename base::Mat;
  using Rows = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Map = Eigen::Map<Rows>;
  using base::c_;
  using base::g_;

 public:
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  ShampooBlock(std::string name, const kfac::Dense& layer) : base(std::move(name), layer, describe(layer)) {
    this->use_units({&left_root_, &right_root_});
  }

  /// A unit: (F + damping I)^{-1/4} of one statistic F (L or R), through F = Q diag(lambda) Q^T.
  class Root final : public kfac::impl::UnitState<Exec> {
   public:
    Root(const ShampooBlock& block, const Mat& statistic, int n, const char* label)
        : block_(block), statistic_(statistic), n_(n), label_(label) {}
    void allocate() {
      if (root_.extent(0) == 0) root_ = Mat(std::string(label_), n_, n_);
    }
    void release() override { root_ = Mat(); }
    void decompose(const Exec&, double damping, int) override {
      allocate();
      const Eigen::SelfAdjointEigenSolver<Rows> eig(map(statistic_));
      if (eig.info() != Eigen::Success) throw kfac::Error(block_.name(), "eigendecomposition failed");
      Eigen::VectorXd root = eig.eigenvalues().array() + damping;
      if (!(root.minCoeff() > 0)) throw kfac::Error(block_.name(), "statistic + damping is not positive definite");
      root = root.array().pow(-0.25);
      map(root_) = eig.eigenvectors() * root.asDiagonal() * eig.eigenvectors().transpose();
    }
    std::vector<kfac::impl::Buffer> buffers() override {
      allocate();
      return {kfac::impl::buffer_of(root_)};
    }
    const Mat& root() const { return root_; }

   private:
    const ShampooBlock& block_;
    const Mat& statistic_;  // the block's L or R, read when decomposing
    int n_;
    const char* label_;
    Mat root_;
  };

  /// Two units, the roots of L (g x g) and R (c x c), each an eigendecomposition; the
  /// checkpoint holds L and R. Planned work: preconditioning, (L root) X, then times (R root).
  /// The statistics' two products come from the gradient, once per update whatever the batch,
  /// which BlockPlan's per-row term cannot state: they are left unpriced.
  static kfac::impl::BlockDescription describe(const kfac::Dense& layer) {
    const int g = int(layer.out()), c = int(layer.in()) + (layer.bias() ? 1 : 0);
    kfac::impl::BlockDescription d;
    d.kind = "shampoo";
    d.signature = layer.describe() + "/shampoo";
    d.checkpoint = {{squared(g), 8}, {squared(c), 8}};
    for (int side : {g, c}) {
      const double n = side;
      kfac::impl::UnitCost cost{n * n * n, n * n};
      cost.work.eigh_n3 = n * n * n;
      d.units.push_back({cost, {{squared(side), 8}}, d.units.empty() ? "L" : "R"});
    }
    d.averaged = {{g, true, false}, {c, true, false}};
    d.memory.workspace = std::size_t(g) * std::size_t(c) * 8;  // the pending gradient (g x c), besides X and V
    d.plan.apply.gemm_flops = 2.0 * g * c * double(g + c);
    return d;
  }

  // Observations are checked for their shape (DenseToyBlock) and not used (Block's defaults):
  // the statistics come from the gradient.
  void drop_observations() override { pending_set_ = false; }
  /// Takes this step's gradient as the pending statistics' source (a retry replaces it).
  void observe_gradient(const Exec&, const grad_matrix& w, const grad_vector& b) override {
    if (pending_.extent(0) == 0) pending_ = Mat("shampoo::pending", g_, c_);
    this->copy_gradient(w, b, pending_);
    pending_set_ = true;
  }

  void update_statistics(const Exec&, double decay) override {
    if (!pending_set_) throw kfac::Error(this->name(), "update_statistics without a gradient observed");
    allocate_state_buffers();
    const Map x = map(pending_);
    const Rows l = x * x.transpose(), r = x.transpose() * x;
    Map lm = map(l_), rm = map(r_);
    if (this->has_statistics()) {
      lm = decay * lm + (1 - decay) * l;
      rm = decay * rm + (1 - decay) * r;
    } else {
      lm = l;
      rm = r;
    }
    this->set_statistics(true);
  }
  std::vector<kfac::impl::Buffer> checkpoint_state() override {
    return {kfac::impl::buffer_of(l_), kfac::impl::buffer_of(r_)};
  }
  void allocate_state() override { allocate_state_buffers(); this->set_statistics(true); }
  void release_state() override { l_ = Mat(); r_ = Mat(); this->set_statistics(false); }

  /// V = (L root) X (R root), on the workspace's X and V seen as g x c row-major matrices.
  void precondition(const Exec&, double, const kfac::impl::ApplyPart&) override {
    const auto& ws = this->workspace_;
    Map(ws.v().data(), g_, c_) = map(left_root_.root()) * Map(ws.x().data(), g_, c_) * map(right_root_.root());
  }
  kfac::MemoryReport memory() const override {
    return {this->name(), this->kind(), (l_.span() + r_.span()) * 8,
            (left_root_.root().span() + right_root_.root().span()) * 8,
            this->workspace_.bytes() + pending_.span() * 8};
  }
  /// The running statistics L and R, for the tests (column-major copies).
  Eigen::MatrixXd left() const { return map(l_); }
  Eigen::MatrixXd right() const { return map(r_); }

 private:
  static std::size_t squared(int n) { return std::size_t(n) * std::size_t(n); }
  static Map map(const Mat& m) { return Map(m.data(), m.extent(0), m.extent(1)); }
  void allocate_state_buffers() {
    if (l_.extent(0) == 0) { l_ = Mat("shampoo::l", g_, g_); r_ = Mat("shampoo::r", c_, c_); }
  }

  bool pending_set_ = false;
  Mat pending_, l_, r_;
  Root left_root_{*this, l_, g_, "shampoo::l_root"}, right_root_{*this, r_, c_, "shampoo::r_root"};
};

/// \brief The toy Shampoo method object (Dense layers only).
struct Shampoo : kfac::impl::LayerOverrides<Shampoo> {
  using method_tag = void;
  static constexpr const char* name = "shampoo";
  template <class L>
  static constexpr bool accepts = std::is_same<L, kfac::Dense>::value;
  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<kfac::impl::Block<Scalar, Exec>> make_block(const std::string& n, const LayerType& layer) const {
    return std::make_unique<ShampooBlock<Scalar, Exec>>(n, layer);
  }
};

}  // namespace kfac_test
