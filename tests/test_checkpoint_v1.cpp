// Checkpoints in format version 1 (written by commit 1859ea4, see fixtures/make_v1_fixtures.cpp)
// keep loading: the restored run continues exactly as the code that wrote them did and exactly
// as a replay from scratch does, and damaged v1 files are refused without changing anything.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <kfac/kfac.hpp>
#include <limits>
#include <string>
#include <vector>

#include "fixtures/v1_scenario.hpp"

#ifndef KFAC_FIXTURE_DIR
#define KFAC_FIXTURE_DIR "tests/fixtures/checkpoint_v1"
#endif

using namespace kfac_v1;

namespace {

std::string fixture(const std::string& file) {
  const std::string path = std::string(KFAC_FIXTURE_DIR) + "/" + file;
  std::ifstream f(path, std::ios::binary);
  INFO("fixture " << path);
  REQUIRE(f.good());
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

Expected expected(const Scenario& sc) {
  Expected e;
  INFO("fixture " << sc.name << ".expected");
  REQUIRE(decode_expected(fixture(std::string(sc.name) + ".expected"), e));
  REQUIRE(e.steps.size() == std::size_t(resumed_steps));
  return e;
}

template <class T>
T value_at(const std::string& bytes, std::size_t i) {
  T v;
  std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}

/// Empty when the two steps' gradients have the same bits, else where they first differ.
template <class T>
std::string first_difference(const std::string& got, const std::string& want) {
  if (got.size() != want.size())
    return std::to_string(got.size() / sizeof(T)) + " values, expected " +
           std::to_string(want.size() / sizeof(T));
  for (std::size_t i = 0; i < got.size() / sizeof(T); ++i)
    if (std::memcmp(got.data() + i * sizeof(T), want.data() + i * sizeof(T), sizeof(T)) != 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "value %zu is %a, expected %a", i,
                    double(value_at<T>(got, i)), double(value_at<T>(want, i)));
      return buf;
    }
  return {};
}

/// Largest difference relative to the largest expected magnitude of the step.
template <class T>
double relative_difference(const std::string& got, const std::string& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < got.size() / sizeof(T); ++i) {
    diff = std::max(diff, std::abs(double(value_at<T>(got, i)) - double(value_at<T>(want, i))));
    scale = std::max(scale, std::abs(double(value_at<T>(want, i))));
  }
  return scale > 0 ? diff / scale : diff;
}

template <class T>
constexpr double tolerance() { return std::is_same<T, float>::value ? 1e-4 : 1e-10; }

template <class Pre>
void check_counters(const Pre& pre, const long (&want)[3]) {
  CHECK(pre.step_count() == want[0]);
  CHECK(pre.last_factor_step() == want[1]);
  CHECK(pre.last_decomposition_step() == want[2]);
}

template <class Net>
void check_steps_equal(const std::vector<std::string>& got, const std::vector<std::string>& want,
                       const Scenario& sc) {
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("resumed step " << sc.saved_at + long(k));
    CHECK(first_difference<typename Net::scalar_type>(got[k], want[k]) == "");
  }
}

/// Registers the scenario's layers in a fresh `pre` and loads its v1 file.
template <class Net>
void load_fixture(typename Net::Pre& pre, const Scenario& sc) {
  Net::register_layers(pre);
  load(pre, fixture(std::string(sc.name) + ".kfacckpt"));
}

template <class Net>
void check_bitwise(const Scenario& sc) {
  INFO("scenario " << sc.name);
  const Expected e = expected(sc);
  REQUIRE(e.scalar_size == sizeof(typename Net::scalar_type));
  typename Net::Pre pre(Net::options());
  load_fixture<Net>(pre, sc);
  check_counters(pre, e.counters);
  check_steps_equal<Net>(resume<Net>(pre, sc), e.steps, sc);
}

template <class Net>
void check_against_replay(const Scenario& sc) {
  using T = typename Net::scalar_type;
  INFO("scenario " << sc.name);
  const Expected e = expected(sc);
  typename Net::Pre loaded(Net::options());
  load_fixture<Net>(loaded, sc);
  check_counters(loaded, e.counters);

  typename Net::Pre twin(Net::options());
  Net::register_layers(twin);
  replay<Net>(twin, sc);
  check_counters(twin, e.counters);
  {
    INFO("the loaded state, saved again, is the replayed state");
    const bool same_state = saved(loaded, true) == saved(twin, true);
    CHECK(same_state);
  }

  // A preconditioner with a history of its own: the load must replace all of it.
  typename Net::Pre used(Net::options());
  Net::register_layers(used);
  for (long s = 0; s < 4; ++s) Net::run_step(used, 100 + s);
  load(used, fixture(std::string(sc.name) + ".kfacckpt"));
  check_counters(used, e.counters);

  const auto got = resume<Net>(loaded, sc);
  {
    INFO("loaded from the v1 file vs replayed from scratch");
    check_steps_equal<Net>(got, resume<Net>(twin, sc), sc);
  }
  {
    INFO("loaded into a used preconditioner vs into a fresh one");
    check_steps_equal<Net>(resume<Net>(used, sc), got, sc);
  }
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("resumed step " << sc.saved_at + long(k) << " vs what commit 1859ea4 computed");
    CHECK(relative_difference<T>(got[k], e.steps[k]) <= tolerance<T>());
  }
}

/// Loading each of `bad` into a preconditioner that ran 2 steps throws kfac::Error (whose
/// message contains `what`) and leaves it as it was, down to the next step's bits.
template <class Net>
void check_refused(const std::vector<std::string>& bad, const std::string& what) {
  typename Net::Pre target(Net::options()), twin(Net::options());
  Net::register_layers(target);
  Net::register_layers(twin);
  for (long s = 0; s < 2; ++s) {
    Net::run_step(target, s);
    Net::run_step(twin, s);
  }
  const std::string before = saved(target, true);
  for (std::size_t i = 0; i < bad.size(); ++i) {
    INFO("damaged variant " << i << " (" << bad[i].size() << " bytes)");
    std::string message;
    try {
      load(target, bad[i]);
    } catch (const kfac::Error& err) {
      message = err.what();
    }
    INFO("message: " << message);
    CHECK(!message.empty());
    CHECK(message.find(what) != std::string::npos);
    CHECK(target.step_count() == 2);
    const bool unchanged = saved(target, true) == before;
    CHECK(unchanged);
  }
  CHECK(bytes_of(Net::run_step(target, 2)) == bytes_of(Net::run_step(twin, 2)));
}

template <class Net>
void check_damaged(const Scenario& sc) {
  INFO("scenario " << sc.name);
  const std::string good = fixture(std::string(sc.name) + ".kfacckpt");
  constexpr std::size_t header = 20, checksum = 8;  // magic, version, body size | FNV-1a
  REQUIRE(good.size() > header + checksum);
  {
    INFO("a flipped body byte, checksum left as it was");
    std::vector<std::string> bad;
    for (std::size_t at : {header, header + (good.size() - header - checksum) / 2,
                           good.size() - checksum - 1}) {
      bad.push_back(good);
      bad.back()[at] = char(bad.back()[at] ^ 0x40);
    }
    check_refused<Net>(bad, "checksum");
  }
  {
    INFO("truncated");
    std::vector<std::string> bad;
    for (std::size_t cut : {std::size_t(0), std::size_t(7), std::size_t(8), std::size_t(12),
                            header, header + 1, good.size() / 2, good.size() - checksum,
                            good.size() - 1})
      bad.push_back(good.substr(0, cut));
    check_refused<Net>(bad, "");
  }
  {
    INFO("an unknown format version");
    std::string bad = good;
    bad[8] = 9;
    check_refused<Net>({bad}, "");
  }
}

}  // namespace

TEST_CASE("v1 checkpoints resume bit for bit as the code that wrote them did",
          "[checkpoint][v1][bitwise]") {
  // Bitwise against files written on x86-64 with Debian 12's OpenBLAS: a BLAS/LAPACK that
  // rounds differently (another CPU kernel, another vendor) fails here only; "[v1]~[bitwise]"
  // then still checks the loader to a tolerance.
  for (const auto& sc : double_scenarios) check_bitwise<DoubleNet>(sc);
  for (const auto& sc : float_scenarios) check_bitwise<FloatNet>(sc);
}

TEST_CASE("v1 checkpoints load as a replay from scratch", "[checkpoint][v1]") {
  for (const auto& sc : double_scenarios) check_against_replay<DoubleNet>(sc);
  for (const auto& sc : float_scenarios) check_against_replay<FloatNet>(sc);
}

TEST_CASE("damaged v1 checkpoints are refused and change nothing", "[checkpoint][v1][errors]") {
  for (const auto& sc : double_scenarios) check_damaged<DoubleNet>(sc);
  for (const auto& sc : float_scenarios) check_damaged<FloatNet>(sc);
}

TEST_CASE("a v1 checkpoint of other layers is refused and changes nothing",
          "[checkpoint][v1][errors]") {
  SECTION("float layers into the double registration") {
    check_refused<DoubleNet>({fixture("float_step5.kfacckpt")}, "");
  }
  SECTION("double layers into the float registration") {
    check_refused<FloatNet>({fixture("double_step7.kfacckpt")}, "");
  }
}
