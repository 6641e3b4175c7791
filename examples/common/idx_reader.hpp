#pragma once
/// \file idx_reader.hpp
/// \brief Reader for IDX files (the MNIST format), gzip-compressed or plain, through zlib.
///
/// IDX: 2 zero bytes, a type byte (0x08 = unsigned byte; the only type MNIST-like sets use), the
/// number of dimensions, then each dimension as a big-endian uint32, then the data in row-major
/// order. Every malformed input ends in std::runtime_error naming the file.

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace nn {

struct IdxArray {
  std::vector<std::size_t> dims;
  std::vector<std::uint8_t> data;  ///< row-major, product(dims) bytes
};

namespace detail {

inline constexpr const char* idx_install_hint =
    "the Fashion-MNIST files are missing or damaged; (re)install them with "
    "`apt-get install dataset-fashion-mnist` (or pass --data DIR)";

[[noreturn]] inline void idx_fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what + "; " + idx_install_hint);
}

/// Closes the gzFile on every exit path.
class GzFile {
 public:
  explicit GzFile(const std::string& path) : f_(gzopen(path.c_str(), "rb")) {}
  ~GzFile() {
    if (f_) gzclose(f_);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;
  gzFile get() const { return f_; }
  /// \brief Closes now and returns zlib's verdict (Z_BUF_ERROR: the gzip stream was cut short).
  int close() {
    const int rc = gzclose(f_);
    f_ = nullptr;
    return rc;
  }

 private:
  gzFile f_;
};

/// Reads exactly `size` bytes or fails, describing a short read as truncation.
inline void read_exact(GzFile& f, const std::string& path, void* dst, std::size_t size, const char* what) {
  auto* out = static_cast<unsigned char*>(dst);
  std::size_t done = 0;
  while (done < size) {
    const std::size_t chunk = std::min<std::size_t>(size - done, 1u << 30);
    const int got = gzread(f.get(), out + done, unsigned(chunk));
    if (got < 0) {
      int err = 0;
      const char* msg = gzerror(f.get(), &err);
      idx_fail(path, std::string("corrupt data while reading the ") + what + " (zlib: " + msg + ")");
    }
    if (got == 0) break;
    done += std::size_t(got);
  }
  if (done < size)
    idx_fail(path, "truncated " + std::string(what) + ": expected " + std::to_string(size) + " bytes, got " +
                       std::to_string(done));
}

/// The last 4 bytes of a gzip file, little-endian: the uncompressed size mod 2^32.
inline std::uint32_t gzip_size_field(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  unsigned char b[4] = {0, 0, 0, 0};
  if (in && in.tellg() >= 4) {
    in.seekg(-4, std::ios::end);
    in.read(reinterpret_cast<char*>(b), 4);
  }
  return std::uint32_t(b[0]) | (std::uint32_t(b[1]) << 8) | (std::uint32_t(b[2]) << 16) | (std::uint32_t(b[3]) << 24);
}

}  // namespace detail

/// \brief Reads a whole IDX file of unsigned bytes.
/// \throws std::runtime_error if the file is missing, not IDX, of another element type, or its
/// data is shorter or longer than its header says.
inline IdxArray read_idx(const std::string& path) {
  detail::GzFile f(path);
  if (!f.get()) detail::idx_fail(path, std::string("cannot open (") + std::strerror(errno) + ")");

  unsigned char magic[4];
  detail::read_exact(f, path, magic, 4, "header");
  char hex[16];
  std::snprintf(hex, sizeof hex, "0x%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
  if (magic[0] != 0 || magic[1] != 0)
    detail::idx_fail(path, std::string("bad magic number ") + hex + " (an IDX file starts with 0x0000)");
  if (magic[2] != 0x08)
    detail::idx_fail(path, std::string("magic number ") + hex + " has element type " + std::to_string(magic[2]) +
                               ", expected 8 (unsigned byte)");
  const int rank = magic[3];
  if (rank < 1 || rank > 4) detail::idx_fail(path, "unsupported number of dimensions " + std::to_string(rank));

  IdxArray a;
  std::size_t total = 1;
  for (int d = 0; d < rank; ++d) {
    unsigned char be[4];
    detail::read_exact(f, path, be, 4, "header");
    const std::size_t n = (std::size_t(be[0]) << 24) | (std::size_t(be[1]) << 16) | (std::size_t(be[2]) << 8) | be[3];
    if (n == 0) detail::idx_fail(path, "dimension " + std::to_string(d) + " is zero");
    // The buffer is allocated before the data is read, so a corrupt header must not ask for much.
    if (total > (std::size_t(1) << 30) / n) detail::idx_fail(path, "implausibly large dimensions (over 1 GiB)");
    total *= n;
    a.dims.push_back(n);
  }
  a.data.resize(total);
  detail::read_exact(f, path, a.data.data(), total, "data");

  unsigned char extra;
  const int tail = gzread(f.get(), &extra, 1);  // also makes zlib check the gzip trailer
  if (tail < 0) {
    int err = 0;
    detail::idx_fail(path, std::string("corrupt data after the payload (zlib: ") + gzerror(f.get(), &err) + ")");
  }
  if (tail > 0) detail::idx_fail(path, "unexpected bytes after the data the header announces");
  const bool compressed = !gzdirect(f.get());
  if (f.close() != Z_OK) detail::idx_fail(path, "the gzip stream is truncated or its checksum is wrong");
  // zlib does not notice a gzip trailer cut short once it has seen the end of the file, so
  // compare the trailer's size field (uncompressed length mod 2^32) with what was read. That
  // assumes one gzip member, as the IDX distributions are.
  if (compressed && detail::gzip_size_field(path) != std::uint32_t(4 + 4 * rank + total))
    detail::idx_fail(path, "truncated gzip stream (its size field does not match the data)");
  return a;
}

}  // namespace nn
