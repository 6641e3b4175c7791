// impl::StartedCollectives, the one holder of started work (core/started.hpp), with a request
// that records what happens to it: the ordering rule (a sum starts its broadcast only after every
// sum started before it has started its own), completion in start order by kind and layer, and
// the broadcasts still to start when it is destroyed.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "kfac/core/started.hpp"

namespace {

using Log = std::vector<std::string>;

/// A request that is complete once `ready` is set (or when waited for); it logs its waits.
struct FakeRequest {
  std::string name;
  std::shared_ptr<Log> log;
  std::shared_ptr<bool> ready = std::make_shared<bool>(false);
  bool test() { return name.empty() || *ready; }
  void wait() {
    if (name.empty()) return;
    *ready = true;
    log->push_back("wait " + name);
  }
};

struct Fixture {
  std::shared_ptr<Log> log = std::make_shared<Log>();
  FakeRequest request(const std::string& name) { return {name, log}; }
  /// A sum whose broadcast, when started, logs "start <name>.b" and returns its request.
  kfac::impl::StartedSum<FakeRequest> sum(const std::string& name, std::shared_ptr<bool>& ready) {
    kfac::impl::StartedSum<FakeRequest> s{request(name), nullptr};
    ready = s.reduce.ready;
    auto l = log;
    s.broadcast = [l, name] {
      l->push_back("start " + name + ".b");
      return FakeRequest{name + ".b", l};
    };
    return s;
  }
};

}  // namespace

TEST_CASE("started sums start their broadcasts in start order", "[started]") {
  using kfac::impl::Started;
  Fixture f;
  kfac::impl::StartedCollectives<FakeRequest> c;
  std::shared_ptr<bool> r1, r2;
  c.add(f.sum("s1", r1));
  c.add(f.sum("s2", r2));
  c.add(Started::gradient, 3, f.request("g3"));

  c.progress();  // no reduce complete: nothing starts
  CHECK(f.log->empty());
  *r2 = true;
  c.progress();  // s2's reduce is complete, but s1 has not started its broadcast: s2 waits
  CHECK(f.log->empty());
  *r1 = true;
  c.progress();  // s1 starts, and then s2 may
  CHECK(*f.log == Log{"start s1.b", "start s2.b"});

  c.complete_where([](Started k, std::size_t) { return k == Started::sum; });
  CHECK(*f.log == Log{"start s1.b", "start s2.b", "wait s1.b", "wait s2.b"});
  c.complete_all();
  CHECK(f.log->back() == "wait g3");
  f.log->clear();
  c.complete_all();  // nothing left
  CHECK(f.log->empty());
}

TEST_CASE("completing a sum waits for its reduce, then starts and waits for its broadcast", "[started]") {
  using kfac::impl::Started;
  Fixture f;
  kfac::impl::StartedCollectives<FakeRequest> c;
  std::shared_ptr<bool> r1;
  c.add(Started::unit, 1, f.request("u1"));
  c.add(f.sum("s1", r1));
  c.add(Started::unit, 2, f.request("u2"));
  c.complete_where([](Started k, std::size_t l) { return k == Started::unit && l == 2; });
  CHECK(*f.log == Log{"wait u2"});
  c.complete_where([](Started k, std::size_t) { return k == Started::sum; });
  CHECK(*f.log == Log{"wait u2", "wait s1", "start s1.b", "wait s1.b"});
  c.complete_all();
  CHECK(*f.log == Log{"wait u2", "wait s1", "start s1.b", "wait s1.b", "wait u1"});
}

TEST_CASE("destroyed with broadcasts still to start, it starts them", "[started]") {
  Fixture f;
  {
    kfac::impl::StartedCollectives<FakeRequest> c;
    std::shared_ptr<bool> r1, r2;
    c.add(f.sum("s1", r1));
    c.add(f.sum("s2", r2));
    *r1 = true;
    c.progress();  // s1's broadcast started; s2's is still to start
    CHECK(*f.log == Log{"start s1.b"});
  }
  // No rank may leave a broadcast the others have started unmatched.
  CHECK(*f.log == Log{"start s1.b", "wait s2", "start s2.b"});
}
