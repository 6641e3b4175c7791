// libFuzzer target for Preconditioner::load (the checkpoint reader). Build and run it with
// scripts/fuzz.sh.
//
// Each input is tried twice: as given (exercising the envelope: magic, version, size, checksum),
// and with the envelope's size and checksum rewritten to fit the bytes between them, so that
// mutations of the body reach the body parser instead of stopping at the checksum.
//
// Every try starts from a fresh preconditioner (the fixed registration of
// checkpoint_fuzz_common.hpp) that has loaded a valid trained checkpoint, so a successful load
// always overwrites a state with factors and decompositions. Recreating it per try keeps inputs
// independent, which makes every crash reproducible from its input alone. Oracles, each a crash
// when violated:
//   1. load() throws nothing but kfac::Error (any other exception, a crash, a sanitizer report,
//      or an allocation over libFuzzer's -malloc_limit_mb is a bug);
//   2. a refused load changes nothing: save() gives the bytes it gave before;
//   3. an accepted load gives the same state over a trained preconditioner as into a fresh one
//      (nothing of the old state survives), and that state saves and reloads to the same bytes;
//   4. after an accepted load, two training steps either work or throw kfac::Error.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

#include "checkpoint_fuzz_common.hpp"

namespace {

using namespace kfac_fuzz;

std::string& baseline() {  // a trained state's checkpoint; every try starts from it
  static std::string b;
  return b;
}

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "kfac checkpoint fuzzer: %s%s%s\n", what, detail.empty() ? "" : ": ",
               detail.c_str());
  std::abort();
}

std::unique_ptr<Pre> make(bool trained) {
  auto p = std::make_unique<Pre>(options());
  register_layers(*p);
  if (trained) {
    std::istringstream is(baseline(), std::ios::binary);
    p->load(is);
  }
  return p;
}

/// load() that reports anything but kfac::Error as a bug; true when the bytes were accepted.
bool try_load(Pre& pre, const std::string& bytes, std::string* why = nullptr) {
  std::istringstream is(bytes, std::ios::binary);
  try {
    pre.load(is);
    return true;
  } catch (const kfac::Error& e) {
    if (why) *why = e.what();
    return false;
  } catch (const std::exception& e) {
    fail("load() threw something other than kfac::Error", e.what());
  } catch (...) {
    fail("load() threw a non-std exception");
  }
}

void check(const std::string& bytes) {
  auto pre = make(true);
  if (!try_load(*pre, bytes)) {
    if (saved(*pre) != baseline()) fail("a refused load changed the preconditioner");
    return;
  }
  const std::string state = saved(*pre);
  auto fresh = make(false);
  std::string why;
  if (!try_load(*fresh, bytes, &why))
    fail("accepted over a trained state, refused into a fresh one", why);
  if (saved(*fresh) != state) fail("a load left part of the previous state behind");
  auto again = make(false);
  if (!try_load(*again, state, &why)) fail("a saved state does not load back", why);
  if (saved(*again) != state) fail("a saved state does not reload to the same bytes");
  try {
    train_step(*pre, 11);
    train_step(*pre, 12);
  } catch (const kfac::Error&) {
    // A corrupt but well-formed state (say, a factor that is not positive definite) may be
    // refused by step(); it must only be refused cleanly.
  } catch (const std::exception& e) {
    fail("step() after a load threw something other than kfac::Error", e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  int argc = 1;
  char name[] = "checkpoint_fuzzer";
  char* argv[] = {name, nullptr};
  Kokkos::initialize(argc, argv);
  std::atexit([] { Kokkos::finalize(); });  // every View is gone by then: none outlives a try
  Pre pre(options());
  register_layers(pre);
  for (std::uint64_t s = 0; s < 3; ++s) train_step(pre, s);  // step 3 lies between decompositions
  baseline() = saved(pre);
  if (saved(*make(true)) != baseline())
    fail("the baseline checkpoint does not reload to the same bytes");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  check(bytes);
  const std::string fixed = rewrapped(bytes);
  if (fixed != bytes) check(fixed);
  return 0;
}
