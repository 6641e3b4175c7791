#pragma once
// A third method defined outside the library, to check that the Block interface is all a method
// needs: ScaledIdentity preconditions a Dense layer with V = X / (s + damping), s a running
// average of the mean squared observed input (averaged over the ranks), and keeps a private
// count of the micro-batches it observed (checkpointed, never averaged). Its one decomposable
// unit computes 1 / (s + damping); toy_fail makes decompose() fail on demand.
#include <Kokkos_Core.hpp>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include <kfac/kfac.hpp>

#include "toy_dense_block.hpp"

namespace kfac_test {

/// How ScaledIdentity's decompose() fails on this process (none: it succeeds).
enum class ToyFailure { none, error, bad_alloc, nan };
inline ToyFailure toy_fail = ToyFailure::none;
/// decompose() calls on this process, failed or not.
inline long toy_decompose_calls = 0;

template <class Scalar, class Exec>
class ScaledIdentityBlock final : public DenseToyBlock<Scalar, Exec> {
  using base = DenseToyBlock<Scalar, Exec>;
  using M = typename Exec::memory_space;
  using Vec = Kokkos::View<double*, M>;

 public:
  using typename base::grad_matrix;
  using typename base::grad_vector;
  using typename base::tensor_type;

  ScaledIdentityBlock(std::string name, const kfac::Dense& layer) : base(std::move(name), layer, describe(layer)) {
    this->use_units({&inverse_});
  }

  /// The one unit: 1 / (s + damping).
  class Inverse final : public kfac::impl::UnitState<Exec> {
   public:
    explicit Inverse(const ScaledIdentityBlock& block) : block_(block) {}
    void allocate() {
      if (inv_.extent(0) == 0) inv_ = Vec("toy::inv", 1);
    }
    void release() override { inv_ = Vec(); }
    void decompose(const Exec&, double damping, int) override {
      allocate();
      ++toy_decompose_calls;
      // A failing call leaves its buffer scribbled on: the rollback must undo that.
      switch (toy_fail) {
        case ToyFailure::error: inv_(0) = -1; throw kfac::Error(block_.name(), "toy decomposition refused");
        case ToyFailure::bad_alloc: inv_(0) = -1; throw std::bad_alloc();
        case ToyFailure::nan: inv_(0) = std::numeric_limits<double>::quiet_NaN(); return;
        case ToyFailure::none: break;
      }
      inv_(0) = 1.0 / (block_.s_(0) + damping);
    }
    std::vector<kfac::impl::Buffer> buffers() override {
      allocate();
      return {kfac::impl::buffer_of(inv_)};
    }
    const Vec& value() const { return inv_; }

   private:
    const ScaledIdentityBlock& block_;
    Vec inv_;
  };

  /// One unit (the scalar 1 / (s + damping)); the checkpoint holds s and the input counter.
  static kfac::impl::BlockDescription describe(const kfac::Dense& layer) {
    kfac::impl::BlockDescription d;
    d.kind = "toy";
    d.signature = layer.describe() + "/scaled_identity";
    d.checkpoint = {{1, 8}, {1, 8}};
    d.averaged = {{1, false, false}};  // s (the counter is per rank)
    d.units = {{{1.0, 1.0}, {{1, 8}}, "inverse"}};
    return d;
  }
  void add_input(const Exec&, const tensor_type& x) override {
    for (std::size_t i = 0; i < x.span(); ++i) sumsq_ += double(x.data()[i]) * double(x.data()[i]);
    count_ += double(x.span());
  }
  kfac::impl::ObservationCheck check_observations() const override {
    return {this->observations().inputs() == 0 ? "no observations were given" : std::string()};
  }
  void drop_observations() override { sumsq_ = count_ = 0; }

  void update_statistics(const Exec&, double decay) override {
    allocate_state_buffers();
    const double m = sumsq_ / count_;
    s_(0) = this->has_statistics() ? decay * s_(0) + (1 - decay) * m : m;
    counter_(0) += double(this->observations().inputs());
    this->set_statistics(true);
  }
  std::vector<kfac::impl::Buffer> checkpoint_state() override {
    return {kfac::impl::buffer_of(s_), kfac::impl::buffer_of(counter_)};
  }
  void allocate_state() override { allocate_state_buffers(); this->set_statistics(true); }
  void release_state() override { s_ = Vec(); counter_ = Vec(); this->set_statistics(false); }

  void precondition(const Exec&, double, const kfac::impl::ApplyPart&) override {
    const auto& ws = this->workspace_;
    const double inv = inverse_.value()(0);
    for (std::size_t i = 0; i < ws.x().span(); ++i) ws.v().data()[i] = ws.x().data()[i] * inv;
  }
  kfac::MemoryReport memory() const override {
    return {this->name(), this->kind(), (s_.span() + counter_.span()) * 8, inverse_.value().span() * 8,
            this->workspace_.bytes()};
  }

  double statistic() const { return this->has_statistics() ? s_(0) : -1; }
  double counter() const { return this->has_statistics() ? counter_(0) : -1; }
  double inverse() const { return inverse_.value().extent(0) ? inverse_.value()(0) : -1; }

 private:
  void allocate_state_buffers() {
    if (s_.extent(0) == 0) { s_ = Vec("toy::s", 1); counter_ = Vec("toy::counter", 1); }
  }

  double sumsq_ = 0, count_ = 0;
  Vec s_, counter_;
  Inverse inverse_{*this};
};

/// \brief The toy method object: V = X / (s + damping), written as the smallest method object
/// (no per-layer overrides: its layers follow the Preconditioner's Options).
struct BareScaledIdentity {
  using method_tag = void;
  static constexpr const char* name = "scaled_identity";
  template <class L>
  static constexpr bool accepts = std::is_same<L, kfac::Dense>::value;
  template <class Scalar, class Exec, class LayerType>
  std::unique_ptr<kfac::impl::Block<Scalar, Exec>> make_block(const std::string& n, const LayerType& layer) const {
    return std::make_unique<ScaledIdentityBlock<Scalar, Exec>>(n, layer);
  }
};

/// \brief The toy method with per-layer overrides (with_damping and the like).
struct ScaledIdentity : BareScaledIdentity, kfac::impl::LayerOverrides<ScaledIdentity> {};

template <class Exec = Kokkos::DefaultHostExecutionSpace>
using ToyBlock = ScaledIdentityBlock<double, Exec>;

/// Sets toy_fail for the lifetime of the object.
struct ToyFailScope {
  explicit ToyFailScope(ToyFailure f) { toy_fail = f; }
  ~ToyFailScope() { toy_fail = ToyFailure::none; }
};

}  // namespace kfac_test
