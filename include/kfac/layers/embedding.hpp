#pragma once
/// \file embedding.hpp
/// \brief Layer-type policy for embeddings, \f$y_{n,t} = W_{\mathrm{id}_{n,t}, :}\f$, W of shape
/// (vocabulary, dim) as PyTorch's nn.Embedding stores it.

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdio>
#include <string>

#include "kfac/error.hpp"
#include "kfac/impl/math.hpp"
#include "kfac/impl/tensor.hpp"

namespace kfac {

/// \brief Embedding lookup \f$y_{n,t} = W_{\mathrm{id}_{n,t}, :}\f$: W of shape (vocabulary, dim),
/// applied to one token per sample or to every token of a sequence.
///
/// Its Fisher is Kronecker-factored exactly as a Dense layer's fed the one-hot rows
/// \f$e_{\mathrm{id}}\f$ (tokens as samples, K-FAC-expand, Eschenhagen et al. 2023): with N
/// sequences of T tokens, \f$A = \frac{1}{NT}\sum_{n,t} e_{\mathrm{id}_{nt}} e_{\mathrm{id}_{nt}}^T
/// = \mathrm{diag}(\mathrm{count}_v) / (NT)\f$ and \f$G = \frac{1}{N}\sum_{n,t} g_{nt} g_{nt}^T\f$,
/// g the per-sequence output gradient (LossReduction::mean: kfac multiplies the observed ones by
/// N, as for Dense). A is diagonal, so it is kept as its `vocabulary` diagonal values and never as
/// a matrix. A padding index (`with_padding_index`) marks tokens that contribute nothing, to A nor
/// to G, as PyTorch gives that row no gradient; they still count in the normalizer N T.
/// Not a Kronecker layer type in kfac's sense (`is_kronecker` is false: no rows of A to form);
/// its method is kfac::EmbeddingFisher, its default.
///
/// Observations: the token ids as the Preconditioner's Scalar values (float or double views),
/// (batch) or (batch, tokens); the output gradient (batch, dim) or (batch, tokens, dim), with the
/// ids' batch and token count. An id must be an integer in [0, vocabulary) (float ids are exact up
/// to 2^24). Gradient: the weight gradient (vocabulary, dim), no bias.
class Embedding {
 public:
  static constexpr bool is_kronecker = false;
  static constexpr const char* kind = "embedding";

  /// \param vocabulary [in] rows of W, the number of token ids (>= 1)
  /// \param dim [in] columns of W, the width of an embedding (>= 1)
  Embedding(index_t vocabulary, index_t dim) : vocabulary_(vocabulary), dim_(dim) {
    if (vocabulary < 1 || dim < 1) throw Error("", "Embedding: expected vocabulary >= 1 and dim >= 1");
  }
  /// Tokens with id `p` (0 <= p < vocabulary) contribute to neither factor (nn.Embedding's
  /// padding_idx).
  Embedding& with_padding_index(index_t p) {
    if (p < 0 || p >= vocabulary_)
      throw Error("", "Embedding: expected 0 <= padding_index < vocabulary (" + std::to_string(vocabulary_) +
                          "), got " + std::to_string(p));
    padding_ = p;
    return *this;
  }

  index_t vocabulary() const { return vocabulary_; }
  index_t dim() const { return dim_; }
  bool has_padding_index() const { return padding_ >= 0; }
  /// The padding index, -1 when there is none.
  index_t padding_index() const { return padding_; }
  index_t weight_rows() const { return vocabulary_; }
  index_t weight_cols() const { return dim_; }
  std::string describe() const {
    return std::string(kind) + "(vocabulary=" + std::to_string(vocabulary_) + ",dim=" + std::to_string(dim_) +
           (has_padding_index() ? ",padding=" + std::to_string(padding_) : "") + ")";
  }

  /// Token ids: a rank-1 (batch) or rank-2 (batch, tokens) view. Their values are checked when
  /// they are observed (check_ids).
  std::string check_input(const impl::Extents& e) const {
    if (e.rank > 2)
      return "input has shape " + e.str() + ", expected token ids of shape (batch) or (batch, tokens)";
    return {};
  }
  std::string check_output_grad(const impl::Extents& e, const impl::Extents& input) const {
    if (!impl::are_feature_rows(e, dim_))
      return "output gradient has shape " + e.str() + ", expected (batch, " + std::to_string(dim_) +
             ") or (batch, tokens, " + std::to_string(dim_) + ")";
    if (input[0] == 0) return {};  // no token ids to pair with
    const long t = impl::tokens_of(e, dim_), t_in = tokens(input);
    if (e[0] != input[0] || t != t_in)
      return "output gradient has shape " + e.str() + " (batch " + std::to_string(e[0]) + ", " + std::to_string(t) +
             " tokens per sample), but the token ids it pairs with have shape " + input.str() + " (batch " +
             std::to_string(input[0]) + ", " + std::to_string(t_in) + " tokens per sample)";
    return {};
  }
  /// Tokens per sample of token ids of extents `e`: (batch, tokens), or 1 for (batch).
  static long tokens(const impl::Extents& e) { return e.rank == 2 ? e[1] : 1; }

  /// Why the values of token ids `x` are refused (the first bad one: NaN, negative, not an
  /// integer, or not below the vocabulary), or an empty string.
  template <class Exec, class Scalar>
  std::string check_ids(const Exec& exec, const impl::Tensor4<Scalar, Exec>& x) const {
    const int count = int(x.extent(0) * x.extent(1)), per_sample = int(x.extent(1));
    const Scalar* xs = x.data();
    const Scalar top = Scalar(vocabulary_);
    long first = count;
    Kokkos::parallel_reduce(
        "kfac::embedding::check_ids", Kokkos::RangePolicy<Exec>(exec, 0, count),
        KOKKOS_LAMBDA(int i, long& m) {
          const Scalar v = xs[i];
          const bool ok = v >= Scalar(0) && v < top && Scalar(long(v)) == v;  // false for NaN
          if (!ok && i < m) m = i;
        },
        Kokkos::Min<long>(first));
    if (first >= count) return {};
    using Flat = Kokkos::View<const Scalar*, typename Exec::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    Kokkos::View<Scalar*, Kokkos::HostSpace> bad("kfac::embedding::bad_id", 1);
    Kokkos::deep_copy(bad, Kokkos::subview(Flat(xs, std::size_t(count)), std::make_pair(first, first + 1)));
    const double v = double(bad(0));
    char value[40];
    std::snprintf(value, sizeof value, "%.17g", v);
    const std::string at = std::string("token id ") + value + " (sample " + std::to_string(first / per_sample) +
                           ", token " + std::to_string(first % per_sample) + ")";
    if (v != v) return at + " is NaN, expected an integer id in [0, " + std::to_string(vocabulary_) + ")";
    if (v < 0) return at + " is negative, expected an integer id in [0, " + std::to_string(vocabulary_) + ")";
    if (v >= double(vocabulary_))
      return at + " is out of range: the vocabulary has " + std::to_string(vocabulary_) + " ids, 0 to " +
             std::to_string(vocabulary_ - 1);
    return at + " is not an integer";
  }

  /// `ids(i)` = the i-th token id of `x` (valid: check_ids), and `counts(v)` += 1 for every
  /// token of id v that is not the padding index.
  template <class Exec, class Scalar, class Ids, class Counts>
  void take_ids(const Exec& exec, const impl::Tensor4<Scalar, Exec>& x, const Ids& ids, const Counts& counts) const {
    using T = typename Counts::non_const_value_type;
    const Scalar* xs = x.data();
    const int pad = padding_;
    Kokkos::parallel_for(
        "kfac::embedding::count", Kokkos::RangePolicy<Exec>(exec, 0, int(ids.extent(0))), KOKKOS_LAMBDA(int i) {
          const int v = int(xs[i]);
          ids(i) = v;
          if (v != pad) Kokkos::atomic_add(&counts(v), T(1));  // whole numbers: exact in any order
        });
  }
  /// The rows whose Gram product gives G: `rows(r, :)` = scale times the output gradient of
  /// token r (row-major over samples and tokens), or 0 for a padding token (`ids`: the token
  /// ids it pairs with, read only when there is a padding index).
  template <class Exec, class Scalar, class Ids, class Rows>
  void fill_g_rows(const Exec& exec, const Ids& ids, const impl::Tensor4<Scalar, Exec>& g, double scale,
                   const Rows& rows) const {
    using T = typename Rows::non_const_value_type;
    const int n = int(rows.extent(0)), dim = dim_, pad = padding_;
    const T s = T(scale);
    const Scalar* gs = g.data();
    Kokkos::parallel_for(
        "kfac::embedding::g_rows", impl::RowMajorRange<Exec>(exec, {0, 0}, {n, dim}), KOKKOS_LAMBDA(int r, int c) {
          rows(r, c) = pad >= 0 && ids(r) == pad ? T(0) : s * T(gs[std::size_t(r) * dim + c]);
        });
  }

 private:
  index_t vocabulary_, dim_;
  index_t padding_ = -1;
};

}  // namespace kfac
