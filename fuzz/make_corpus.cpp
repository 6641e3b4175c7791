// Writes the seed corpus of the checkpoint fuzzer: valid checkpoints of the fuzzer's fixed
// registration at several points of training, and damaged variants that stop at each check of
// the reader (envelope damage as is; body damage with a recomputed checksum, so it reaches the
// body parser). Usage: make_corpus <folder>. scripts/fuzz.sh --make-corpus rebuilds fuzz/corpus.
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>

#include "checkpoint_fuzz_common.hpp"

using namespace kfac_fuzz;

namespace {

/// Body offsets (after the 20-byte envelope header): 5 step counters (i64), world size (i32),
/// rank (i32), flags (u32), layer count (u32), then the first layer's name length (u32).
constexpr std::size_t kWorld = kHeader + 40, kRank = kHeader + 44, kLayers = kHeader + 52,
                      kFirstName = kHeader + 56;

template <class T>
T read(const std::string& bytes, std::size_t at) {
  T v;
  std::memcpy(&v, &bytes[at], sizeof(T));
  return v;
}

/// Offsets in the first layer's record: its first factor value and its decomposition damping.
struct FirstLayer {
  std::size_t first_value = 0, damping = 0;
};
FirstLayer first_layer(const std::string& bytes) {
  std::size_t at = kFirstName;
  at += 4 + read<std::uint32_t>(bytes, at);  // name
  at += 4 + read<std::uint32_t>(bytes, at);  // signature
  at += 32;                                  // the layer's schedule (version 2)
  at += 1;                                   // has factors
  const std::uint32_t buffers = read<std::uint32_t>(bytes, at);
  at += 4;
  FirstLayer f;
  for (std::uint32_t k = 0; k < buffers; ++k) {
    const std::size_t size = read<std::uint8_t>(bytes, at);
    const std::uint64_t count = read<std::uint64_t>(bytes, at + 1);
    at += 9;
    if (k == 0) f.first_value = at;
    at += size * count;
  }
  f.damping = at + 1;  // after the decomposition flag
  return f;
}

template <class T>
std::string patched(std::string bytes, std::size_t at, T value, bool fix_checksum = true) {
  std::memcpy(&bytes[at], &value, sizeof(T));
  return fix_checksum ? rewrapped(bytes) : bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus folder>\n", argv[0]);
    return 2;
  }
  int kargc = 1;
  char name[] = "make_corpus";
  char* kargv[] = {name, nullptr};
  Kokkos::initialize(kargc, kargv);
  std::map<std::string, std::string> seeds;
  {
    Pre pre(options());
    register_layers(pre);
    seeds["valid_step0_no_factors"] = saved(pre);
    train_step(pre, 0);
    seeds["valid_step1_after_decomposition"] = saved(pre);
    train_step(pre, 1);
    train_step(pre, 2);
    const std::string good = saved(pre);
    seeds["valid_step3"] = good;
    seeds["valid_step3_without_decompositions"] = saved(pre, false);
    seeds["valid_step3_world2_rank1"] =
        patched(patched(good, kWorld, std::int32_t(2)), kRank, std::int32_t(1));

    // Envelope damage (the checksum is left as it is).
    seeds["bad_truncated_in_header"] = good.substr(0, 14);
    seeds["bad_truncated_in_body"] = good.substr(0, good.size() / 2);
    seeds["bad_truncated_in_checksum"] = good.substr(0, good.size() - 3);
    std::string flipped = good;
    flipped[good.size() / 3] ^= 0x10;
    seeds["bad_checksum"] = flipped;
    seeds["bad_version"] = patched(good, 8, std::uint32_t(3), false);
    seeds["bad_magic"] = "KFACCKPX" + good.substr(8);
    seeds["bad_huge_body_size"] = patched(good, 12, std::uint64_t(1) << 50, false);

    // Body damage behind a valid checksum.
    seeds["body_layer_count"] = patched(good, kLayers, std::uint32_t(5));
    seeds["body_name_length"] = patched(good, kFirstName, std::uint32_t(0xfffffff0u));
    seeds["body_negative_step"] = patched(good, kHeader, std::int64_t(-4));
    // step, next factor step and next decomposition step just below 2^63
    const auto huge = std::numeric_limits<std::int64_t>::max() - 1;
    seeds["body_huge_step"] =
        patched(patched(patched(good, kHeader, huge), kHeader + 8, huge), kHeader + 16, huge);
    const FirstLayer fc = first_layer(good);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    seeds["body_nan_factor"] = patched(good, fc.first_value, nan);
    seeds["body_nan_damping"] = patched(good, fc.damping, nan);
    std::string renamed = good;
    renamed[kFirstName + 4] = 'F';  // "fc" -> "Fc"
    seeds["body_renamed_layer"] = rewrapped(renamed);
    std::string trailing = good;
    trailing.insert(good.size() - kTrailer, 1, '\0');
    seeds["body_trailing_byte"] = rewrapped(trailing);
    std::string shortened = good;
    shortened.erase(good.size() - kTrailer - 4, 1);
    seeds["body_short_by_one"] = rewrapped(shortened);
  }
  Kokkos::finalize();
  std::size_t total = 0;
  for (const auto& [file, bytes] : seeds) {
    std::ofstream os(std::string(argv[1]) + "/" + file, std::ios::binary);
    os.write(bytes.data(), std::streamsize(bytes.size()));
    if (!os) {
      std::fprintf(stderr, "make_corpus: cannot write %s/%s\n", argv[1], file.c_str());
      return 1;
    }
    total += bytes.size();
  }
  std::printf("make_corpus: %zu seeds, %zu bytes in %s\n", seeds.size(), total, argv[1]);
  return 0;
}
