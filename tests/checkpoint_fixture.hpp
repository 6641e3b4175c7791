#pragma once
/// \file checkpoint_fixture.hpp
/// \brief What test_checkpoint_v1 and test_checkpoint_v2 share: reading a fixture file of
/// KFAC_FIXTURE_DIR (set per test in tests/CMakeLists.txt) and the `.expected` files of
/// fixtures/v1_scenario.hpp, comparing resumed steps bit for bit or to a tolerance, and the two
/// checks of a fixture: against the recorded continuation and against a replay from scratch.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "fixtures/v1_scenario.hpp"

#ifndef KFAC_FIXTURE_DIR
#error "define KFAC_FIXTURE_DIR (the folder of the test's fixture files) before including checkpoint_fixture.hpp"
#endif

namespace kfac_fixture {

using kfac_v1::Expected;
using kfac_v1::Scenario;

inline std::string fixture(const std::string& file) {
  const std::string path = std::string(KFAC_FIXTURE_DIR) + "/" + file;
  std::ifstream f(path, std::ios::binary);
  INFO("fixture " << path);
  REQUIRE(f.good());
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline Expected expected(const Scenario& sc) {
  Expected e;
  INFO("fixture " << sc.name << ".expected");
  REQUIRE(kfac_v1::decode_expected(fixture(std::string(sc.name) + ".expected"), e));
  REQUIRE(e.steps.size() == std::size_t(kfac_v1::resumed_steps));
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

/// The fixture of `sc`, loaded by `load_into(pre)` into a fresh registered preconditioner,
/// resumes with the recorded counters and the recorded gradients, bit for bit.
template <class Net, class LoadInto>
void check_bitwise(const Scenario& sc, LoadInto&& load_into) {
  INFO("scenario " << sc.name);
  const Expected e = expected(sc);
  REQUIRE(e.scalar_size == sizeof(typename Net::scalar_type));
  typename Net::Pre pre(Net::options());
  Net::register_layers(pre);
  load_into(pre);
  check_counters(pre, e.counters);
  check_steps_equal<Net>(kfac_v1::resume<Net>(pre, sc), e.steps, sc);
}

/// The fixture of `sc`, loaded by `load_into(pre)` into a fresh and into a used preconditioner,
/// is the state of a replay from scratch: the same counters, the same state saved again, the
/// same continuation bit for bit; and that continuation is within tolerance of what `writer`
/// computed. Returns the continuation.
template <class Net, class LoadInto>
std::vector<std::string> check_against_replay(const Scenario& sc, LoadInto&& load_into, const char* writer) {
  INFO("scenario " << sc.name);
  const Expected e = expected(sc);
  typename Net::Pre loaded(Net::options());
  Net::register_layers(loaded);
  load_into(loaded);
  check_counters(loaded, e.counters);

  typename Net::Pre twin(Net::options());
  Net::register_layers(twin);
  kfac_v1::replay<Net>(twin, sc);
  check_counters(twin, e.counters);
  {
    INFO("the loaded state, saved again, is the replayed state");
    const bool same_state = kfac_v1::saved(loaded, true) == kfac_v1::saved(twin, true);
    CHECK(same_state);
  }

  // A preconditioner with a history of its own (with a decomposition_delay, a decomposition
  // in flight of its own): the load must replace all of it.
  typename Net::Pre used(Net::options());
  Net::register_layers(used);
  for (long s = 0; s < 4; ++s) Net::run_step(used, 100 + s);
  load_into(used);
  check_counters(used, e.counters);

  const auto got = kfac_v1::resume<Net>(loaded, sc);
  {
    INFO("loaded from the fixture vs replayed from scratch");
    check_steps_equal<Net>(got, kfac_v1::resume<Net>(twin, sc), sc);
  }
  {
    INFO("loaded into a used preconditioner vs into a fresh one");
    check_steps_equal<Net>(kfac_v1::resume<Net>(used, sc), got, sc);
  }
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("resumed step " << sc.saved_at + long(k) << " vs what " << writer << " computed");
    using T = typename Net::scalar_type;
    CHECK(relative_difference<T>(got[k], e.steps[k]) <= tolerance<T>());
  }
  return got;
}

}  // namespace kfac_fixture
