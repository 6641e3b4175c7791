#pragma once
/// \file format.hpp
/// \brief The versioned, checksummed binary checkpoint envelope and its byte reader/writer
/// (see docs/reliability.md; the bodies are in serializer.hpp).
///
/// All integers little-endian (the format is written and read on little-endian machines; a
/// big-endian reader rejects it by its version field, which it reads as 16777216).
///
///     magic      8 bytes  "KFACCKPT"
///     version    u32      2 (1 is still read)
///     body_size  u64      bytes of the body that follows
///     body       ...
///     checksum   u64      FNV-1a 64 of the body
///
/// The body of each version is described in serializer.hpp.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "kfac/core/hash.hpp"
#include "kfac/error.hpp"

namespace kfac {
namespace impl {

constexpr char checkpoint_magic[8] = {'K', 'F', 'A', 'C', 'C', 'K', 'P', 'T'};
constexpr std::uint32_t checkpoint_version = 2;       ///< written
constexpr std::uint32_t oldest_checkpoint_version = 1;  ///< still read


class ByteWriter {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable<T>::value, "ByteWriter: trivially copyable only");
    const char* p = reinterpret_cast<const char*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void put_string(const std::string& s) {
    put(std::uint32_t(s.size()));
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  void put_raw(const void* p, std::size_t n) {
    const char* c = static_cast<const char*>(p);
    bytes_.insert(bytes_.end(), c, c + n);
  }
  const std::vector<char>& bytes() const { return bytes_; }

 private:
  std::vector<char> bytes_;
};

/// Reads a body; every read is bounds-checked and throws kfac::Error("checkpoint ...") on overrun.
class ByteReader {
 public:
  ByteReader(const char* p, std::size_t n) : p_(p), n_(n) {}
  template <class T>
  T get(const char* what) {
    T v;
    need(sizeof(T), what);
    std::memcpy(&v, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  std::string get_string(const char* what) {
    const auto len = get<std::uint32_t>(what);
    need(len, what);
    std::string s(p_ + off_, len);
    off_ += len;
    return s;
  }
  const char* get_raw(std::size_t n, const char* what) {
    need(n, what);
    const char* p = p_ + off_;
    off_ += n;
    return p;
  }
  bool done() const { return off_ == n_; }

 private:
  void need(std::size_t n, const char* what) const {
    if (n > n_ - off_)
      throw Error("", std::string("checkpoint is truncated or corrupt (while reading ") + what + ")");
  }
  const char* p_;
  std::size_t n_, off_ = 0;
};

/// True when `count` scalars of `scalar_size` bytes (2: binary16, 4: float, 8: double) at `p` are all finite.
inline bool all_finite(const char* p, std::size_t count, std::size_t scalar_size) {
  for (std::size_t i = 0; i < count; ++i) {
    if (scalar_size == 8) {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      if (!std::isfinite(v)) return false;
    } else if (scalar_size == 2) {  // binary16: finite unless the exponent bits are all set
      std::uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      if ((v & 0x7C00u) == 0x7C00u) return false;
    } else {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      if (!std::isfinite(v)) return false;
    }
  }
  return true;
}

/// Wraps a body with magic, version, size and checksum.
inline void write_checkpoint(std::ostream& os, const std::vector<char>& body,
                             std::uint32_t v = checkpoint_version) {
  os.write(checkpoint_magic, 8);
  const std::uint64_t size = body.size(), sum = fnv1a_bytes(body.data(), body.size());
  os.write(reinterpret_cast<const char*>(&v), 4);
  os.write(reinterpret_cast<const char*>(&size), 8);
  os.write(body.data(), std::streamsize(body.size()));
  os.write(reinterpret_cast<const char*>(&sum), 8);
  if (!os) throw Error("", "checkpoint: writing failed");
}

/// Reads and verifies the envelope; returns the body and sets `version`. Caps the body at
/// `max_bytes`.
inline std::vector<char> read_checkpoint(std::istream& is, std::uint32_t& version,
                                         std::uint64_t max_bytes = (1ull << 40)) {
  // A stream with exceptions enabled (is.exceptions(failbit | badbit)) throws
  // std::ios_base::failure where another sets failbit: both are the same kfac::Error.
  auto read = [&](char* p, std::size_t n, const char* error) {
    try {
      is.read(p, std::streamsize(n));
    } catch (const std::ios_base::failure&) {
      throw Error("", error);
    }
    if (!is) throw Error("", error);
  };
  char magic[8] = {};
  read(magic, 8, "not a kfac checkpoint (bad magic number)");
  if (std::memcmp(magic, checkpoint_magic, 8) != 0) throw Error("", "not a kfac checkpoint (bad magic number)");
  std::uint32_t v = 0;
  std::uint64_t size = 0;
  read(reinterpret_cast<char*>(&v), 4, "checkpoint is truncated (no version)");
  if (v < oldest_checkpoint_version || v > checkpoint_version)
    throw Error("", "checkpoint version " + std::to_string(v) + " is not supported (expected " +
                        std::to_string(oldest_checkpoint_version) + " to " +
                        std::to_string(checkpoint_version) + ")");
  version = v;
  read(reinterpret_cast<char*>(&size), 8, "checkpoint is truncated (no size)");
  if (size > max_bytes) throw Error("", "checkpoint body size " + std::to_string(size) + " is implausible");
  std::vector<char> body;
  // Read in chunks so a corrupt size cannot force a huge allocation before the data is there.
  const std::size_t chunk = std::size_t(1) << 20;
  while (body.size() < size) {
    const std::size_t n = std::min<std::uint64_t>(chunk, size - body.size());
    const std::size_t old = body.size();
    body.resize(old + n);
    read(body.data() + old, n, "checkpoint is truncated (body shorter than its header says)");
  }
  std::uint64_t sum = 0;
  read(reinterpret_cast<char*>(&sum), 8, "checkpoint is truncated (no checksum)");
  if (sum != fnv1a_bytes(body.data(), body.size()))
    throw Error("", "checkpoint checksum mismatch: the file is corrupt");
  return body;
}

}  // namespace impl
}  // namespace kfac
