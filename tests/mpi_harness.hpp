#pragma once
// Helpers of the distributed reliability tests (test_mpi_faults, test_mpi_comm_precision,
// test_mpi_load, test_mpi_restart, test_mpi_skip): cross-rank comparisons that never hang, a
// small network of Dense (K-FAC) and toy layers fed from (seed, step, rank), and a guard that
// runs one fault and reports what every rank saw.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/kfac.hpp>

#include "reference.hpp"
#include "toy_method.hpp"

namespace kfac_test {
namespace mpi {

using Host = Kokkos::DefaultHostExecutionSpace;
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using V1 = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;
using Pre = kfac::Preconditioner<double, Host, kfac::MpiComm>;

inline int rank_in(MPI_Comm c = MPI_COMM_WORLD) { int r; MPI_Comm_rank(c, &r); return r; }
inline int size_of(MPI_Comm c = MPI_COMM_WORLD) { int s; MPI_Comm_size(c, &s); return s; }

/// True on every rank of `c` when `b` holds on every rank.
inline bool everywhere(bool b, MPI_Comm c = MPI_COMM_WORLD) {
  int v = b ? 1 : 0, r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT, MPI_MIN, c);
  return r == 1;
}
/// True on every rank of `c` when every rank passed the same bytes (max and min of a hash).
inline bool same_everywhere(const std::string& bytes, MPI_Comm c = MPI_COMM_WORLD) {
  const std::uint64_t h = kfac::impl::fnv1a(bytes);
  unsigned long long v[2] = {h, ~h}, r[2] = {0, 0};
  MPI_Allreduce(v, r, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX, c);
  return r[0] == ~r[1];
}
inline std::string bytes_of(const std::vector<double>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double));
}
/// `s` on `root`, on every rank of `c`.
inline std::string from_rank(const std::string& s, int root, MPI_Comm c = MPI_COMM_WORLD) {
  unsigned long long n = s.size();
  MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG_LONG, root, c);
  std::string r = rank_in(c) == root ? s : std::string(std::size_t(n), '\0');
  if (n > 0) MPI_Bcast(&r[0], int(n), MPI_CHAR, root, c);
  return r;
}

template <class P>
std::string saved(const P& pre) {
  std::ostringstream os(std::ios::binary);
  pre.save(os);
  return os.str();
}
template <class P>
bool loaded(P& pre, const std::string& bytes) {
  std::istringstream is(bytes, std::ios::binary);
  return pre.load(is);
}

/// A Dense layer of the test network, under K-FAC or under the toy method (toy_method.hpp).
struct Layer {
  std::string name;
  int in, out;
  bool toy;
};
template <class P>
void register_net(P& pre, const std::vector<Layer>& net) {
  for (const auto& l : net) {
    if (l.toy) pre.register_layer(l.name, kfac::Dense(l.in, l.out), ScaledIdentity{}.with_damping(0.5));
    else pre.register_layer(l.name, kfac::Dense(l.in, l.out), kfac::KFAC<>{});
  }
}

/// One step's gradients, one per layer (they must live until step() returns).
struct Grads {
  std::vector<V2> w;
  std::vector<V1> b;
  std::vector<double> flat() const {
    std::vector<double> out;
    for (std::size_t l = 0; l < w.size(); ++l) {
      out.insert(out.end(), w[l].data(), w[l].data() + w[l].span());
      out.insert(out.end(), b[l].data(), b[l].data() + b[l].span());
    }
    return out;
  }
};

/// Layer l's observations at `step` on data shard `shard` (`batch` samples).
inline std::pair<V2, V2> observations(const Layer& l, std::size_t index, unsigned seed, long step, int shard,
                                      int batch = 4) {
  Rng rng(seed * 100003u + unsigned(step) * 1009u + unsigned(shard) * 17u + unsigned(index));
  V2 x = random_view<double>(batch, l.in, rng);
  V2 g = random_view<double>(batch, l.out, rng);
  return {x, g};
}
/// Layer l's gradient at `step`: the same on every rank, as after a data-parallel allreduce.
inline std::pair<V2, V1> gradient(const Layer& l, std::size_t index, unsigned seed, long step) {
  Rng rng(seed * 7919u + unsigned(step) * 31u + unsigned(index));
  V2 w = random_view<double>(l.out, l.in, rng);
  V1 b = random_vector<double>(l.out, rng);
  return {w, b};
}

/// Observes and hands over the gradients of every layer of `net` except `no_gradient` (a name).
template <class P>
Grads feed(P& pre, const std::vector<Layer>& net, unsigned seed, long step, int shard,
           const std::string& no_gradient = "") {
  Grads gr;
  for (std::size_t i = 0; i < net.size(); ++i) {
    if (pre.wants_observations(net[i].name)) {
      const auto o = observations(net[i], i, seed, step, shard);
      pre.observe_input(net[i].name, o.first);
      pre.observe_output_grad(net[i].name, o.second);
    }
    const auto g = gradient(net[i], i, seed, step);
    gr.w.push_back(g.first);
    gr.b.push_back(g.second);
    if (net[i].name != no_gradient) pre.set_gradient(net[i].name, g.first, g.second);
  }
  return gr;
}
template <class P>
std::vector<double> step_once(P& pre, const std::vector<Layer>& net, unsigned seed, long step, int shard) {
  const Grads g = feed(pre, net, seed, step, shard);
  pre.step();
  return g.flat();
}

/// What one rank saw when it ran a faulty call.
struct Outcome {
  bool threw = false;
  bool kfac_error = false;
  std::string what;
  double seconds = 0;
};
template <class F>
Outcome attempt(F&& f) {
  Outcome o;
  const double t0 = MPI_Wtime();
  try {
    f();
  } catch (const kfac::Error& e) {
    o.threw = o.kfac_error = true;
    o.what = e.what();
  } catch (const std::exception& e) {
    o.threw = true;
    o.what = std::string("(not a kfac::Error) ") + e.what();
  }
  o.seconds = MPI_Wtime() - t0;
  return o;
}
/// With KFAC_PRINT_FAULTS set, rank `who` prints a fault's message (for the docs' catalogue).
inline void report(const char* fault, const Outcome& o, int who = 0) {
  if (rank_in() == who && std::getenv("KFAC_PRINT_FAULTS"))
    std::printf("[fault] %s at %d ranks, rank %d: %s (%.3f s)\n", fault, size_of(), who, o.what.c_str(), o.seconds);
}

}  // namespace mpi
}  // namespace kfac_test
