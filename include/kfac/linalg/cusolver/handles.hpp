#pragma once
// cuSOLVER handles, one per CUDA stream, for the cuSOLVER vendor path (cusolver.hpp). Compiled
// only when Kokkos has CUDA.
#include <Kokkos_Core.hpp>
#include <cusolverDn.h>
#include <map>
#include <mutex>

#include "kfac/error.hpp"

namespace kfac {
namespace impl {

/// \brief cuSOLVER handles, one per execution-space instance (keyed by its stream, and bound
/// to it), created on first use and all destroyed by a Kokkos finalize hook, so none outlives
/// the CUDA context Kokkos tears down.
class CusolverHandles {
 public:
  static cusolverDnHandle_t get(const Kokkos::Cuda& exec) {
    CusolverHandles& self = instance();
    const std::lock_guard<std::mutex> lock(self.mutex_);
    const cudaStream_t stream = exec.cuda_stream();
    const auto found = self.handles_.find(stream);
    if (found != self.handles_.end()) return found->second;
    cusolverDnHandle_t h = nullptr;
    if (cusolverDnCreate(&h) != CUSOLVER_STATUS_SUCCESS) throw Error("", "linalg: cusolverDnCreate failed");
    if (cusolverDnSetStream(h, stream) != CUSOLVER_STATUS_SUCCESS) {
      cusolverDnDestroy(h);
      throw Error("", "linalg: cusolverDnSetStream failed");
    }
    if (!self.hooked_) {
      Kokkos::push_finalize_hook([] { instance().destroy_all(); });
      self.hooked_ = true;
    }
    self.handles_.emplace(stream, h);
    return h;
  }
  /// Handles alive now (for tests and diagnostics).
  static std::size_t count() {
    CusolverHandles& self = instance();
    const std::lock_guard<std::mutex> lock(self.mutex_);
    return self.handles_.size();
  }

 private:
  static CusolverHandles& instance() {
    static CusolverHandles registry;
    return registry;
  }
  void destroy_all() {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto& kv : handles_) cusolverDnDestroy(kv.second);
    handles_.clear();
    hooked_ = false;
  }
  std::mutex mutex_;
  std::map<cudaStream_t, cusolverDnHandle_t> handles_;
  bool hooked_ = false;
};

}  // namespace impl
}  // namespace kfac
