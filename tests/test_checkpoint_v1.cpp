// Checkpoints in format version 1 (written by commit 1859ea4, see fixtures/make_v1_fixtures.cpp)
// keep loading: the restored run has the recorded counters, continues bit for bit as itself
// restored again, and as the code that wrote them did and as a replay from scratch does to the
// rounding of another BLAS kernel (checkpoint_fixture.hpp); damaged v1 files are refused without
// changing anything.
#include <kfac/kfac.hpp>
#include <string>
#include <vector>

#ifndef KFAC_FIXTURE_DIR
#define KFAC_FIXTURE_DIR "tests/fixtures/checkpoint_v1"
#endif

#include "checkpoint_fixture.hpp"
#include "fixtures/v1_scenario.hpp"

using namespace kfac_v1;
using namespace kfac_fixture;

// DoubleNet's "mixed" layer keeps float factors.
template <>
struct kfac_fixture::statistics_scalar<DoubleNet> {
  using type = float;
};

namespace {

/// Loads the scenario's v1 file into a registered preconditioner.
template <class Net>
auto v1_file(const Scenario& sc) {
  return [&sc](typename Net::Pre& pre) { load(pre, fixture(std::string(sc.name) + ".kfacckpt")); };
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

TEST_CASE("v1 checkpoints load and resume as the code that wrote them did", "[checkpoint][v1]") {
  for (const auto& sc : double_scenarios) check_fixture<DoubleNet>(sc, v1_file<DoubleNet>(sc), "commit 1859ea4");
  for (const auto& sc : float_scenarios) check_fixture<FloatNet>(sc, v1_file<FloatNet>(sc), "commit 1859ea4");
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
