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

/// Largest relative_difference allowed between a continuation and the same steps computed with
/// other BLAS kernels (the fixture writer's machine, or a replay here), by the precision of the
/// run's statistics, T. Worst over the Prescott, Sandybridge, Haswell and Zen kernels
/// (OPENBLAS_CORETYPE, 2026-12-06), against the `.expected` files and a replay: float statistics
/// 2.5e-6 with a float Scalar and 5.8e-7 with a double one (float factors of a MixedPrecision
/// layer, which reach every value through the KL clip's shared scale); double statistics 1.5e-15.
template <class T>
constexpr double tolerance() { return std::is_same<T, float>::value ? 1e-4 : 1e-10; }

/// The scalar of a Net's lowest-precision statistics, for tolerance(): its Scalar unless the
/// test says some layer keeps float factors.
template <class Net>
struct statistics_scalar {
  using type = typename Net::scalar_type;
};
template <class Net>
constexpr double tolerance_of() { return tolerance<typename statistics_scalar<Net>::type>(); }

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

/// The continuation of a run interrupted after `k` of the resumed steps: `pre` runs them,
/// saves (in the current format, with decompositions), and a fresh preconditioner loads the
/// file and runs the rest.
template <class Net>
std::vector<std::string> resume_interrupted(typename Net::Pre& pre, const Scenario& sc, long k) {
  std::vector<std::string> out;
  for (long s = sc.saved_at; s < sc.saved_at + k; ++s) out.push_back(kfac_v1::bytes_of(Net::run_step(pre, s)));
  typename Net::Pre next(Net::options());
  Net::register_layers(next);
  kfac_v1::load(next, kfac_v1::saved(pre, true));
  for (long s = sc.saved_at + k; s < sc.saved_at + kfac_v1::resumed_steps; ++s)
    out.push_back(kfac_v1::bytes_of(Net::run_step(next, s)));
  return out;
}

/// Checks the fixture of `sc`, loaded by `load_into(pre)`, in three kinds of claims (tests/README.md):
///  - what the file pins whatever the BLAS: it loads, into a fresh and into a used
///    preconditioner, with the recorded step counters; saved again, its state has the size of a
///    replay's (the same layers, factors and decompositions); a file saved before any step holds
///    no BLAS result and is then the replay's state bit for bit;
///  - bit for bit, runs on this machine: the continuation loaded into a used preconditioner and
///    loaded into a fresh one; the loaded run interrupted after 2 steps, saved and restored, and
///    the same run uninterrupted;
///  - to tolerance_of<Net>(), results of other BLAS kernels: the continuation and what `writer`
///    computed on its machine (the `.expected` file), and a replay from scratch here (its state
///    is computed by this machine's kernels, the file's by the writer's).
/// Returns the continuation.
template <class Net, class LoadInto>
std::vector<std::string> check_fixture(const Scenario& sc, LoadInto&& load_into, const char* writer) {
  using T = typename Net::scalar_type;
  INFO("scenario " << sc.name);
  const Expected e = expected(sc);
  REQUIRE(e.scalar_size == sizeof(T));
  typename Net::Pre loaded(Net::options());
  Net::register_layers(loaded);
  load_into(loaded);
  check_counters(loaded, e.counters);

  typename Net::Pre twin(Net::options());
  Net::register_layers(twin);
  kfac_v1::replay<Net>(twin, sc);
  check_counters(twin, e.counters);
  {
    const std::string mine = kfac_v1::saved(loaded, true), replayed = kfac_v1::saved(twin, true);
    INFO("the loaded state, saved again, has the layout of the replayed state");
    CHECK(mine.size() == replayed.size());
    if (sc.saved_at == 0) {
      const bool same_state = mine == replayed;
      CHECK(same_state);
    }
  }

  // A preconditioner with a history of its own (with a decomposition_delay, a decomposition
  // in flight of its own): the load must replace all of it.
  typename Net::Pre used(Net::options());
  Net::register_layers(used);
  for (long s = 0; s < 4; ++s) Net::run_step(used, 100 + s);
  load_into(used);
  check_counters(used, e.counters);
  typename Net::Pre interrupted(Net::options());
  Net::register_layers(interrupted);
  load_into(interrupted);

  const auto got = kfac_v1::resume<Net>(loaded, sc);
  {
    INFO("loaded into a used preconditioner vs into a fresh one");
    check_steps_equal<Net>(kfac_v1::resume<Net>(used, sc), got, sc);
  }
  {
    INFO("loaded, interrupted after 2 steps and restored vs uninterrupted");
    check_steps_equal<Net>(resume_interrupted<Net>(interrupted, sc, 2), got, sc);
  }
  const auto replayed = kfac_v1::resume<Net>(twin, sc);
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("resumed step " << sc.saved_at + long(k));
    {
      INFO("vs what " << writer << " computed");
      CHECK(relative_difference<T>(got[k], e.steps[k]) <= tolerance_of<Net>());
    }
    {
      INFO("vs replayed from scratch");
      CHECK(relative_difference<T>(got[k], replayed[k]) <= tolerance_of<Net>());
    }
  }
  return got;
}

}  // namespace kfac_fixture
