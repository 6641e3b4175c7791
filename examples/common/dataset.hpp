#pragma once
/// \file dataset.hpp
/// \brief Fashion-MNIST in device memory, and the shuffled mini-batches a training run draws.

#include "common/idx_reader.hpp"
#include "common/rng.hpp"
#include "common/tensor.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace nn {

struct Dataset {
  Tensor images;  ///< (N, C, H, W), normalised
  Labels labels;  ///< N labels
  int num_classes = 10;
  int size() const { return int(labels.extent(0)); }
};

/// \brief A batch: views into storage that the caller (a Batcher or a Dataset) keeps alive.
struct Batch {
  Tensor x;
  Labels y;
};

/// \brief Moves host arrays to the device.
/// \param pixels [in] n*c*h*w values in NCHW order, already normalised
inline Dataset make_dataset(const std::vector<float>& pixels, const std::vector<int>& labels, int c, int h, int w,
                            int num_classes) {
  const int n = int(labels.size());
  if (pixels.size() != std::size_t(n) * c * h * w)
    throw std::invalid_argument("nn::make_dataset: pixel count does not match labels and image shape");
  Dataset d;
  d.images = Tensor("nn::dataset::images", n, c, h, w);
  d.labels = Labels("nn::dataset::labels", n);
  d.num_classes = num_classes;
  auto hi = Kokkos::create_mirror_view(d.images);
  auto hl = Kokkos::create_mirror_view(d.labels);
  std::copy(pixels.begin(), pixels.end(), hi.data());
  std::copy(labels.begin(), labels.end(), hl.data());
  Kokkos::deep_copy(d.images, hi);
  Kokkos::deep_copy(d.labels, hl);
  return d;
}

/// \brief How load_fashion_mnist scales the pixels.
enum class Pixels { standardized, unit };

/// \brief Loads one split of Fashion-MNIST (`split` = "train" or "t10k").
/// \param limit [in] keep the first `limit` samples (the files are already shuffled); 0 keeps all
/// \throws std::runtime_error naming the file when a file is missing or malformed
/// \param pixels [in] standardized (the classifiers' inputs) or unit: pixel / 255 in [0, 1] (the autoencoder's)
inline Dataset load_fashion_mnist(const std::string& dir, const std::string& split, int limit = 0,
                                  Pixels pixels_as = Pixels::standardized) {
  const std::string image_path = dir + "/" + split + "-images-idx3-ubyte.gz";
  const std::string label_path = dir + "/" + split + "-labels-idx1-ubyte.gz";
  const IdxArray images = read_idx(image_path);
  const IdxArray labels = read_idx(label_path);
  if (images.dims.size() != 3 || images.dims[1] != 28 || images.dims[2] != 28)
    detail::idx_fail(image_path, "expected images of shape (N, 28, 28)");
  if (labels.dims.size() != 1 || labels.dims[0] != images.dims[0])
    detail::idx_fail(label_path, "expected one label per image (" + std::to_string(images.dims[0]) + ")");
  int n = int(images.dims[0]);
  if (limit > 0 && limit < n) n = limit;

  // Per-pixel statistics of the Fashion-MNIST training set.
  const bool unit = pixels_as == Pixels::unit;
  const float mean = unit ? 0.0f : 0.2860f, inv_std = unit ? 1.0f : 1.0f / 0.3530f;
  std::vector<float> pixels(std::size_t(n) * 784);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = (images.data[i] / 255.0f - mean) * inv_std;
  std::vector<int> y(n);
  for (int i = 0; i < n; ++i) {
    y[i] = labels.data[i];
    if (y[i] > 9) detail::idx_fail(label_path, "label " + std::to_string(y[i]) + " is not in 0..9");
  }
  return make_dataset(pixels, y, 1, 28, 28, 10);
}

/// \brief Samples [begin, end) of a dataset, without copying.
inline Batch slice(const Dataset& d, int begin, int end) {
  const Tensor& im = d.images;
  const std::size_t per_sample = im.extent(1) * im.extent(2) * im.extent(3);
  return {Tensor(im.data() + std::size_t(begin) * per_sample, end - begin, im.extent(1), im.extent(2), im.extent(3)),
          Labels(d.labels.data() + begin, end - begin)};
}

/// \brief Draws mini-batches without replacement, in an order reshuffled every epoch from the
/// seed alone; the last incomplete batch of an epoch is dropped so every step sees `batch` samples.
///
/// Data-parallel: with `shards` > 1 every shard draws the same global batch of `batch` samples
/// and get() returns only shard `shard`'s slice of it (batch / shards samples, consecutive).
class Batcher {
 public:
  Batcher(const Dataset& data, int batch, std::uint64_t seed, int shard = 0, int shards = 1)
      : data_(data), batch_(batch < data.size() ? batch : data.size()), seed_(seed), shard_(shard),
        shards_(shards), order_("nn::batcher::order", data.size()), x_("nn::batcher::x"), y_("nn::batcher::y") {
    if (batch_ < 1) throw std::invalid_argument("nn::Batcher: empty dataset or batch");
    if (shards_ < 1 || shard_ < 0 || shard_ >= shards_ || batch_ % shards_ != 0)
      throw std::invalid_argument("nn::Batcher: the batch (" + std::to_string(batch_) +
                                  ") must split evenly over " + std::to_string(shards_) + " processes");
  }

  /// \brief Samples per step over all shards.
  int batch_size() const { return batch_; }
  /// \brief Samples per step of this shard.
  int local_batch_size() const { return batch_ / shards_; }
  int steps_per_epoch() const { return data_.size() / batch_; }

  void start_epoch(int epoch) {
    SplitMix64 rng(derive_seed(seed_, 2, std::uint64_t(epoch)));
    const std::vector<int> p = permutation(data_.size(), rng);
    auto host = Kokkos::create_mirror_view(order_);
    std::copy(p.begin(), p.end(), host.data());
    Kokkos::deep_copy(order_, host);
  }

  /// \brief The step-th batch of the current epoch, gathered into storage this Batcher owns.
  Batch get(int step) {
    const Tensor& im = data_.images;
    const int b = local_batch_size();
    const Tensor x = x_.tensor(b, im.extent(1), im.extent(2), im.extent(3));
    const Matrix dst = as_matrix(x), src = as_matrix(im);
    const Labels y(y_.matrix(b, 1).data(), b), labels = data_.labels, order = order_;
    const int first = step * batch_ + shard_ * b;
    Kokkos::parallel_for("nn::batcher::gather", range2(b, dst.extent(1)), KOKKOS_LAMBDA(const int s, const int k) {
      dst(s, k) = src(order(first + s), k);
      if (k == 0) y(s) = labels(order(first + s));
    });
    return {x, y};
  }

 private:
  Dataset data_;
  int batch_;
  std::uint64_t seed_;
  int shard_, shards_;
  Labels order_;
  Buffer<float> x_;
  Buffer<int> y_;
};

}  // namespace nn
