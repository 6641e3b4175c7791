// idx_reader.hpp: valid files load; missing, bad-magic and truncated files fail with a message
// that names the file and says how to reinstall the data.

#include "common/dataset.hpp"
#include "common/idx_reader.hpp"

#include <catch2/catch.hpp>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

/// A file in the temporary directory, removed when the test ends.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& name)
      : path((std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + std::string("/kfac_examples_") +
             std::to_string(getpid()) + "_" + name) {}
  ~TempFile() { std::remove(path.c_str()); }
};

/// A fresh private directory, removed (with the files a test removed first) when the test ends.
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + std::string("/kfac_examples_XXXXXX");
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() { rmdir(path.c_str()); }
};

std::vector<unsigned char> idx_bytes(std::vector<unsigned> dims, unsigned char type = 0x08) {
  std::vector<unsigned char> b{0, 0, type, static_cast<unsigned char>(dims.size())};
  std::size_t total = 1;
  for (unsigned d : dims) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(d >> s));
    total *= d;
  }
  for (std::size_t i = 0; i < total; ++i) b.push_back(static_cast<unsigned char>(i * 7 % 251));
  return b;
}

void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), unsigned(bytes.size())) == int(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

void write_raw(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

std::vector<unsigned char> read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
}

/// The reader's error for `path`, or "" if it read the file.
std::string error_of(const std::string& path) {
  try {
    nn::read_idx(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

std::string load_error(const std::string& dir) {
  try {
    nn::load_fashion_mnist(dir, "train");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

void require_clear_error(const std::string& message, const std::string& path, const std::string& problem) {
  INFO(message);
  CHECK(message.find(path) != std::string::npos);
  CHECK(message.find(problem) != std::string::npos);
  CHECK(message.find("apt-get install dataset-fashion-mnist") != std::string::npos);
}

}  // namespace

TEST_CASE("idx reader loads gzip and plain files", "[idx]") {
  const auto bytes = idx_bytes({3, 4, 5});
  TempFile gz("ok.gz"), plain("ok.idx");
  write_gz(gz.path, bytes);
  write_raw(plain.path, bytes);
  for (const auto* path : {&gz.path, &plain.path}) {
    const nn::IdxArray a = nn::read_idx(*path);
    REQUIRE(a.dims == std::vector<std::size_t>{3, 4, 5});
    REQUIRE(a.data.size() == 60);
    CHECK(a.data[59] == 59 * 7 % 251);
  }
}

TEST_CASE("idx reader rejects a missing file", "[idx]") {
  const std::string path = "/nonexistent/train-images-idx3-ubyte.gz";
  require_clear_error(error_of(path), path, "cannot open");
}

TEST_CASE("idx reader rejects a bad magic number", "[idx]") {
  TempFile f("magic.gz");
  auto bytes = idx_bytes({2, 2});
  bytes[0] = 0x1f;
  write_gz(f.path, bytes);
  require_clear_error(error_of(f.path), f.path, "bad magic number");

  TempFile t("type.gz");
  write_gz(t.path, idx_bytes({2, 2}, 0x0D));  // 0x0D = float, not what MNIST-like sets hold
  require_clear_error(error_of(t.path), t.path, "element type");
}

TEST_CASE("idx reader rejects truncated data", "[idx]") {
  const auto bytes = idx_bytes({100, 28, 28});

  SECTION("payload shorter than the header says") {
    TempFile f("short.gz");
    write_gz(f.path, std::vector<unsigned char>(bytes.begin(), bytes.end() - 100));
    require_clear_error(error_of(f.path), f.path, "truncated data");
  }
  SECTION("gzip stream cut in the middle") {
    TempFile f("cut.gz");
    write_gz(f.path, bytes);
    const auto gz = read_raw(f.path);
    write_raw(f.path, std::vector<unsigned char>(gz.begin(), gz.begin() + gz.size() / 2));
    require_clear_error(error_of(f.path), f.path, "truncated");
  }
  SECTION("gzip trailer missing") {
    TempFile f("trailer.gz");
    write_gz(f.path, bytes);
    const auto gz = read_raw(f.path);
    write_raw(f.path, std::vector<unsigned char>(gz.begin(), gz.end() - 4));
    require_clear_error(error_of(f.path), f.path, "truncated");
  }
  SECTION("header cut short") {
    TempFile f("header.idx");
    write_raw(f.path, std::vector<unsigned char>(bytes.begin(), bytes.begin() + 6));
    require_clear_error(error_of(f.path), f.path, "truncated header");
  }
  SECTION("bytes after the data") {
    TempFile f("long.gz");
    auto longer = bytes;
    longer.push_back(1);
    write_gz(f.path, longer);
    require_clear_error(error_of(f.path), f.path, "unexpected bytes");
  }
}

TEST_CASE("fashion-mnist loader checks shapes and labels", "[idx]") {
  TempDir dir;
  const std::string images = dir.path + "/train-images-idx3-ubyte.gz";
  const std::string labels = dir.path + "/train-labels-idx1-ubyte.gz";
  write_gz(images, idx_bytes({5, 28, 28}));

  SECTION("one label short") {
    write_gz(labels, idx_bytes({4}));
    require_clear_error(load_error(dir.path), labels, "one label per image");
  }
  SECTION("images of the wrong size") {
    write_gz(images, idx_bytes({5, 27, 28}));
    write_gz(labels, idx_bytes({5}));
    require_clear_error(load_error(dir.path), images, "(N, 28, 28)");
  }
  SECTION("a valid pair loads, normalised") {
    auto y = idx_bytes({5});
    for (std::size_t i = 8; i < y.size(); ++i) y[i] = static_cast<unsigned char>(i % 10);
    write_gz(labels, y);
    const nn::Dataset d = nn::load_fashion_mnist(dir.path, "train");
    CHECK(d.size() == 5);
    CHECK(d.images.extent(1) == 1);
    CHECK(d.images.extent(2) == 28);
  }
  std::remove(images.c_str());
  std::remove(labels.c_str());
}
