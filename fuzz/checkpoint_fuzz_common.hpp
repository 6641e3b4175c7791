#pragma once
// The fixed preconditioner the checkpoint fuzzer loads into, and the deterministic training that
// produces its seed checkpoints. Shared by checkpoint_fuzzer.cpp and make_corpus.cpp so the seed
// corpus always matches the registration the fuzzer checks against.
#include <cstdint>
#include <cstring>
#include <kfac/kfac.hpp>
#include <sstream>
#include <string>

namespace kfac_fuzz {

using Host = Kokkos::DefaultHostExecutionSpace;
using Pre = kfac::Preconditioner<double, Host>;
using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V4 = Kokkos::View<double****, Kokkos::LayoutRight, Kokkos::HostSpace>;

/// Decompositions every other step, so seeds exist both right after a decomposition and between.
inline kfac::Options options() {
  return kfac::Options{}.with_damping(1e-2).with_kl_clip(1e-2).with_lr(0.1)
      .with_factor_update_steps(1).with_inv_update_steps(2).with_factor_decay(0.9)
      .with_precompute_reciprocal(true);
}

/// Every buffer kind the format has: symmetric factors with eigendecompositions (fc, conv),
/// unit-wise closed-form blocks (bn), full factors with Cholesky inverses (chol), diagonal
/// factors without a decomposition (diag), float factors with double Newton-Schulz inverses
/// (mixed).
inline void register_layers(Pre& pre) {
  pre.register_layer<kfac::Dense>("fc", kfac::Dense(4, 3));
  pre.register_layer<kfac::Conv2d>("conv", kfac::Conv2d(2, 2, 2, 2));
  pre.register_layer<kfac::BatchNorm2d>("bn", kfac::BatchNorm2d(2));
  // pi = 1 (kfac 0.1's form, with_pi_damping(false)): the corpus's valid seeds carry its signatures.
  pre.register_layer("chol", kfac::Dense(3, 2, false),
                     kfac::KFAC<kfac::Full, kfac::Cholesky<>, kfac::Precision<double>>(
                         kfac::Cholesky<>{}.with_pi_damping(false)));
  pre.register_layer<kfac::Dense, kfac::Diagonal>("diag", kfac::Dense(3, 2));
  pre.register_layer("mixed", kfac::Dense(2, 2),
                     kfac::KFAC<kfac::Symmetric, kfac::NewtonSchulz, kfac::MixedPrecision>(
                         kfac::NewtonSchulz{}.with_pi_damping(false)));
}

/// Deterministic values in [-1, 1): a 64-bit LCG, the high bits scaled.
struct Lcg {
  std::uint64_t s;
  double next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return double(s >> 11) * (2.0 / 9007199254740992.0) - 1.0;
  }
  template <class V>
  V fill(V v) {
    for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = next();
    return v;
  }
};

/// One training-like step: observations (when wanted), gradients, step(). Throws kfac::Error
/// like step() does.
inline void train_step(Pre& pre, std::uint64_t seed) {
  Lcg r{seed * 7919 + 1};
  const int n = 3;
  if (pre.wants_observations()) {
    pre.observe_input("fc", r.fill(V2("x", n, 4)));
    pre.observe_output_grad("fc", r.fill(V2("g", n, 3)));
    pre.observe_input("conv", r.fill(V4("x", n, 2, 3, 3)));
    pre.observe_output_grad("conv", r.fill(V4("g", n, 2, 2, 2)));
    pre.observe_input("bn", r.fill(V4("x", n, 2, 2, 2)));
    pre.observe_output_grad("bn", r.fill(V4("g", n, 2, 2, 2)));
    pre.observe_input("chol", r.fill(V2("x", n, 3)));
    pre.observe_output_grad("chol", r.fill(V2("g", n, 2)));
    pre.observe_input("diag", r.fill(V2("x", n, 3)));
    pre.observe_output_grad("diag", r.fill(V2("g", n, 2)));
    pre.observe_input("mixed", r.fill(V2("x", n, 2)));
    pre.observe_output_grad("mixed", r.fill(V2("g", n, 2)));
  }
  // The gradients must outlive step().
  V2 fc_w = r.fill(V2("w", 3, 4)), chol_w = r.fill(V2("w", 2, 3)), diag_w = r.fill(V2("w", 2, 3));
  V2 mixed_w = r.fill(V2("w", 2, 2));
  V4 conv_w = r.fill(V4("w", 2, 2, 2, 2));
  V1 fc_b = r.fill(V1("b", 3)), conv_b = r.fill(V1("b", 2)), gamma = r.fill(V1("g", 2));
  V1 beta = r.fill(V1("b", 2)), diag_b = r.fill(V1("b", 2)), mixed_b = r.fill(V1("b", 2));
  pre.set_gradient("fc", fc_w, fc_b);
  pre.set_gradient("conv", conv_w, conv_b);
  pre.set_gradient("bn", gamma, beta);
  pre.set_gradient("chol", chol_w);
  pre.set_gradient("diag", diag_w, diag_b);
  pre.set_gradient("mixed", mixed_w, mixed_b);
  pre.step();
}

inline std::string saved(const Pre& pre, bool with_decompositions = true) {
  std::ostringstream os(std::ios::binary);
  pre.save(os, with_decompositions);
  return os.str();
}

/// Envelope layout (kfac/checkpoint/format.hpp): magic 8, version 4, body size 8, body, checksum 8.
constexpr std::size_t kHeader = 20, kTrailer = 8;

/// `bytes` with the envelope's size and checksum rewritten to match the body between them, so
/// that a mutated body gets past the checksum and exercises the body parser.
inline std::string rewrapped(std::string bytes) {
  if (bytes.size() < kHeader + kTrailer) return bytes;
  const std::uint64_t size = bytes.size() - kHeader - kTrailer;
  const std::uint64_t sum = kfac::impl::fnv1a_bytes(bytes.data() + kHeader, size);
  std::memcpy(&bytes[12], &size, 8);
  std::memcpy(&bytes[bytes.size() - kTrailer], &sum, 8);
  return bytes;
}

}  // namespace kfac_fuzz
