// Reduced-precision factor averaging over long runs with a drifting statistic, and MPI message
// chunking (MpiComm::with_max_message_bytes), at 2, 3 and 4 ranks; the payload conversion kernels
// against the former host loops, and sums of payloads converted in the data's memory against
// MpiComm's host sums, bit for bit.
#include "mpi_harness.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kfac/distributed/staging.hpp>
#include <limits>
#include <string>
#include <vector>

using namespace kfac_test;
using namespace kfac_test::mpi;

namespace {

using Block = kfac::KFAC<>::block_type<kfac::Dense, double, Host>;

constexpr int kIn = 4, kOut = 3, kBatch = 8;
constexpr long kUpdates = 320;
constexpr double kDecay = 0.95;

/// The input at `step`: entries +-sqrt(m) with random signs, different on every rank, so that
/// the second moment (A's diagonal) is exactly m, moving linearly from 1 (step 0) to 1.44 (the
/// last step), and the off-diagonal entries are noise.
V2 drifting_input(long step, int rank) {
  const double m = 1.0 + 0.44 * double(step) / double(kUpdates - 1);
  Rng rng(811u + unsigned(step) * 37u + unsigned(rank) * 100003u);
  V2 x("x", kBatch, kIn);
  for (std::size_t i = 0; i < x.span(); ++i) x.data()[i] = rng.uniform() < 0 ? -std::sqrt(m) : std::sqrt(m);
  return x;
}
V2 output_grad(long step, int rank) {
  Rng rng(919u + unsigned(step) * 41u + unsigned(rank) * 7919u);
  return random_view<double>(kBatch, kOut, rng);
}

/// max |a - b| over the upper triangle, relative to the largest |b| there.
template <class M>
double rel_max(const M& a, const M& b) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < b.extent(0); ++i)
    for (std::size_t j = i; j < b.extent(1); ++j) {
      d = std::max(d, std::abs(double(a(i, j)) - double(b(i, j))));
      s = std::max(s, std::abs(double(b(i, j))));
    }
  return d / s;
}

kfac::Options drift_options() {
  return kfac::Options{}.with_factor_decay(kDecay).with_inv_update_steps(1000).with_damping(1e-2)
      .with_kl_clip(0.0).with_loss_reduction(kfac::LossReduction::sum);
}
kfac::Kaisa sums_in(kfac::CommPrecision p) { return kfac::Kaisa{}.with_comm_precision(p); }

}  // namespace

TEST_CASE("reduced-precision factor averaging tracks native averaging over 320 drifting updates", "[mpi][precision]") {
  const int rank = rank_in(), world = size_of();
  Pre native(drift_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), sums_in(kfac::CommPrecision::native));
  Pre bf16(drift_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), sums_in(kfac::CommPrecision::bfloat16));
  Pre f32(drift_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), sums_in(kfac::CommPrecision::float32));
  for (Pre* p : {&native, &bf16, &f32}) p->register_layer("fc", kfac::Dense(kIn, kOut), kfac::KFAC<>{});

  // The scheme before the fix, emulated: each rank updates its running A in double, then the
  // running A itself is averaged in bf16 and written back (MpiComm::sum directly). `exact` is
  // the same recurrence averaged in double.
  const int n = kIn + 1;
  std::vector<double> old_a(std::size_t(n * n), 0.0), exact(std::size_t(n * n), 0.0);
  kfac::MpiComm comm(MPI_COMM_WORLD);
  auto old_scheme_step = [&](const V2& x, long step) {
    std::vector<double> stat(std::size_t(n * n), 0.0);
    for (int s = 0; s < kBatch; ++s)
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
          stat[std::size_t(i * n + j)] += (i < kIn ? x(s, i) : 1.0) * (j < kIn ? x(s, j) : 1.0) / kBatch;
    for (auto* f : {&old_a, &exact}) {
      for (std::size_t k = 0; k < stat.size(); ++k) (*f)[k] = step == 0 ? stat[k] : kDecay * (*f)[k] + (1 - kDecay) * stat[k];
      comm.sum(f->data(), f->size(), 8, f == &old_a ? kfac::CommPrecision::bfloat16 : kfac::CommPrecision::native);
      for (double& v : *f) v /= world;
    }
  };
  auto old_rel = [&] {
    double d = 0, s = 0;
    for (std::size_t k = 0; k < exact.size(); ++k) {
      d = std::max(d, std::abs(old_a[k] - exact[k]));
      s = std::max(s, std::abs(exact[k]));
    }
    return d / s;
  };

  double worst_bf16 = 0, worst_f32 = 0, first_bf16 = 0;
  for (long step = 0; step < kUpdates; ++step) {
    const V2 x = drifting_input(step, rank), g = output_grad(step, rank);
    Rng gr(5u + unsigned(step));
    const V2 w0 = random_view<double>(kOut, kIn, gr);
    const V1 b0 = random_vector<double>(kOut, gr);
    for (Pre* p : {&native, &bf16, &f32}) {
      V2 w("w", kOut, kIn);
      V1 b("b", kOut);
      Kokkos::deep_copy(w, w0);
      Kokkos::deep_copy(b, b0);
      p->observe_input("fc", x);
      p->observe_output_grad("fc", g);
      p->set_gradient("fc", w, b);
      p->step();
    }
    old_scheme_step(x, step);
    const auto& ref = native.layer_as<Block>("fc");
    const auto& lo = bf16.layer_as<Block>("fc");
    const auto& mid = f32.layer_as<Block>("fc");
    const double eb = std::max(rel_max(lo.factor_a(), ref.factor_a()), rel_max(lo.factor_g(), ref.factor_g()));
    const double ef = std::max(rel_max(mid.factor_a(), ref.factor_a()), rel_max(mid.factor_g(), ref.factor_g()));
    worst_bf16 = std::max(worst_bf16, eb);
    worst_f32 = std::max(worst_f32, ef);
    if (step == 0) first_bf16 = eb;
    if (step % 64 == 63 || step == kUpdates - 1) {  // several points, and the end
      INFO("update " << step + 1 << ": bf16 " << eb << ", float32 " << ef << ", old bf16 scheme " << old_rel());
      CHECK(eb <= 5e-3);
      CHECK(ef <= 1e-5);
      CHECK(same_everywhere(std::to_string(eb) + std::to_string(ef)));
    }
  }
  // The A factor's bias entry is exactly 1 at every update; its other diagonal entries follow
  // the second moment to about 1.44.
  const auto& a = native.layer_as<Block>("fc").factor_a();
  CHECK(std::abs(a(0, 0) - 1.44) < 0.1);
  // What the old scheme gave on the same data: increments below bf16's resolution round away,
  // and the averaged running factor stalls a few percent low (measured: about 3-5% here; the
  // issue's probe: 1.367 instead of 1.440, 5.1%). The new scheme stays below 0.5% throughout.
  INFO("worst over the run: bf16 " << worst_bf16 << ", float32 " << worst_f32 << "; old bf16 scheme at the end " << old_rel());
  CHECK(old_rel() > 1e-2);
  CHECK(worst_bf16 <= 5e-3);
  CHECK(worst_f32 <= 1e-5);
  if (rank == 0 && std::getenv("KFAC_PRINT_FAULTS"))
    std::printf("[precision] %d ranks: first update bf16 %.3g, worst bf16 %.3g, worst float32 %.3g, old bf16 scheme %.3g\n",
                world, first_bf16, worst_bf16, worst_f32, old_rel());
}

TEST_CASE("half-precision factors average across ranks: bit-identical, tracking the global average", "[mpi][precision][half]") {
  // Precision<Half, float>: every rank stores binary16 factors, which travel as float (native
  // payload) or as bfloat16 increments. The reference is the double recurrence on the global
  // statistic (the average of every rank's batch: the single-process result on the concatenated
  // batch), computed here from every rank's inputs.
  const int rank = rank_in(), world = size_of();
  using HalfBlock = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
                                         kfac::HalfPrecision, double, Host>;
  using FloatBlock = kfac::KroneckerBlock<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>,
                                          kfac::SinglePrecision, double, Host>;
  const long updates = 200;
  for (auto payload : {kfac::CommPrecision::native, kfac::CommPrecision::bfloat16}) {
    INFO("payload " << int(payload));
    Pre half(drift_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), sums_in(payload));
    Pre single(drift_options(), Host{}, kfac::MpiComm(MPI_COMM_WORLD), sums_in(payload));
    half.register_layer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::HalfPrecision>("fc", kfac::Dense(kIn, kOut));
    single.register_layer<kfac::Dense, kfac::Symmetric, kfac::Eigendecomposition<>, kfac::SinglePrecision>("fc", kfac::Dense(kIn, kOut));
    const int n = kIn + 1;
    std::vector<double> ref(std::size_t(n * n), 0.0);
    double worst = 0;
    std::size_t half_bytes = 0, single_bytes = 0;
    for (long step = 0; step < updates; ++step) {
      std::vector<double> stat(ref.size(), 0.0);
      for (int r = 0; r < world; ++r) {
        const V2 x = drifting_input(step, r);
        for (int q = 0; q < kBatch; ++q)
          for (int i = 0; i < n; ++i)
            for (int j = 0; j < n; ++j)
              stat[std::size_t(i * n + j)] += (i < kIn ? x(q, i) : 1.0) * (j < kIn ? x(q, j) : 1.0) / (kBatch * world);
      }
      for (std::size_t k = 0; k < ref.size(); ++k) ref[k] = step == 0 ? stat[k] : kDecay * ref[k] + (1 - kDecay) * stat[k];
      const V2 x = drifting_input(step, rank), g = output_grad(step, rank);
      for (Pre* p : {&half, &single}) {
        V2 w("w", kOut, kIn);
        V1 b("b", kOut);
        const std::size_t before = p->communicator().bytes_sent();
        p->observe_input("fc", x);
        p->observe_output_grad("fc", g);
        p->set_gradient("fc", w, b);
        p->step();
        (p == &half ? half_bytes : single_bytes) += p->communicator().bytes_sent() - before;
      }
      const auto& a = half.layer_as<HalfBlock>("fc").factor_a();
      double d = 0, m = 0;
      for (int i = 0; i < n; ++i)
        for (int j = i; j < n; ++j) {
          d = std::max(d, std::abs(double(float(a(i, j))) - ref[std::size_t(i * n + j)]));
          m = std::max(m, std::abs(ref[std::size_t(i * n + j)]));
        }
      worst = std::max(worst, d / m);
      if (step % 50 == 49) {
        std::string bits(reinterpret_cast<const char*>(a.data()), a.span() * 2);
        CHECK(same_everywhere(bits));
      }
    }
    INFO("worst relative error against the double recurrence " << worst);
    // Two roundings to binary16 per update (each rank's update, then the average), a running
    // average with decay 0.95: at most ~2 * 2^-11 / (1 - 0.95) = 2% in the worst case.
    CHECK(worst <= 2e-2);
    CHECK(worst > 1e-5);  // it is binary16, not float
    CHECK(same_everywhere(std::to_string(worst)));
    // Half factors travel in the same payload as float factors.
    CHECK(half_bytes == single_bytes);
    const auto& fa = single.layer_as<FloatBlock>("fc").factor_a();
    const auto& ha = half.layer_as<HalfBlock>("fc").factor_a();
    double d = 0, m = 0;
    for (int i = 0; i < n; ++i)
      for (int j = i; j < n; ++j) {
        d = std::max(d, std::abs(double(float(ha(i, j))) - double(fa(i, j))));
        m = std::max(m, std::abs(double(fa(i, j))));
      }
    CHECK(d / m < 2e-2);
    if (rank == 0 && std::getenv("KFAC_PRINT_FAULTS"))
      std::printf("[half] %d ranks, payload %d: worst vs the double recurrence %.3g, vs float factors at the end %.3g, %zu bytes\n",
                  world, int(payload), worst, d / m, half_bytes);
  }
}

namespace {
/// A network whose factor traffic is known: Dense(3, 2) without bias (A 3 x 3, G 2 x 2, packed:
/// 6 + 3 doubles in one bucket).
std::vector<double> run_small(Pre& pre, long steps, std::vector<std::size_t>& messages_per_step) {
  std::vector<double> out;
  for (long s = 0; s < steps; ++s) {
    const std::size_t before = pre.communicator().messages();
    Rng d(17u + unsigned(s) * 3u + unsigned(rank_in()) * 1001u), gr(23u + unsigned(s));
    const V2 x = random_view<double>(4, 3, d), g = random_view<double>(4, 2, d);
    V2 w = random_view<double>(2, 3, gr);
    pre.observe_input("fc", x);
    pre.observe_output_grad("fc", g);
    pre.set_gradient("fc", w);
    pre.step();
    out.insert(out.end(), w.data(), w.data() + w.span());
    messages_per_step.push_back(pre.communicator().messages() - before);
  }
  return out;
}
}  // namespace

TEST_CASE("tiny MPI messages: sums and broadcasts in pieces, same bits and bytes, counted calls", "[mpi][chunking]") {
  const int rank = rank_in();
  // A known payload, directly: 100 doubles summed in 64-byte pieces are 13 reduce + 13 bcast
  // calls; 1000 bytes broadcast are 16 calls; 100 doubles in bf16 (200 bytes) are 4 + 4.
  kfac::MpiComm tiny = kfac::MpiComm(MPI_COMM_WORLD).with_max_message_bytes(64), plain(MPI_COMM_WORLD);
  std::vector<double> a(100), b(100);
  for (int i = 0; i < 100; ++i) a[std::size_t(i)] = b[std::size_t(i)] = std::sin(1.0 + i + 100.0 * rank);
  tiny.sum(a.data(), a.size(), 8, kfac::CommPrecision::native);
  plain.sum(b.data(), b.size(), 8, kfac::CommPrecision::native);
  CHECK(a == b);
  CHECK(tiny.messages() == 26);
  CHECK(plain.messages() == 2);
  CHECK(tiny.bytes_sent() == plain.bytes_sent());
  CHECK(tiny.bytes_sent() == 1600);
  std::vector<char> bytes(1000, char(rank)), same(1000, char(rank));
  tiny.broadcast(bytes.data(), bytes.size(), 0);
  plain.broadcast(same.data(), same.size(), 0);
  CHECK(bytes == same);
  CHECK(bytes == std::vector<char>(1000, char(0)));
  CHECK(tiny.messages() == 26 + 16);
  CHECK(tiny.bytes_sent() == plain.bytes_sent());
  tiny.sum(a.data(), a.size(), 8, kfac::CommPrecision::bfloat16);
  plain.sum(b.data(), b.size(), 8, kfac::CommPrecision::bfloat16);
  CHECK(a == b);
  CHECK(tiny.messages() == 26 + 16 + 8);

  // A preconditioner: the same bits and bytes as with the default limit, at every strategy;
  // COMM-OPT on the known network: a factor update is 2 calls (72 bytes: 2 pieces at 64 ->
  // 4 calls); a decomposition adds Q_A (72 bytes), lambda_A (24), Q_G (32), lambda_G (16):
  // 4 broadcasts -> 5 pieces.
  for (double f : {1.0, 1.0 / size_of()}) {
    INFO("grad_worker_fraction " << f);
    const auto o = kfac::Options{}.with_inv_update_steps(3).with_damping(1e-2);
    const auto k = kfac::Kaisa{}.with_grad_worker_fraction(f);
    Pre small(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD).with_max_message_bytes(64), k);
    Pre dflt(o, Host{}, kfac::MpiComm(MPI_COMM_WORLD), k);
    for (Pre* p : {&small, &dflt}) p->register_layer("fc", kfac::Dense(3, 2, false), kfac::KFAC<>{});
    std::vector<std::size_t> ms, md;
    const auto rs = run_small(small, 7, ms), rd = run_small(dflt, 7, md);
    double diff = 0;
    for (std::size_t k = 0; k < rs.size(); ++k) diff = std::max(diff, std::abs(rs[k] - rd[k]) / std::abs(rd[k]));
    if (rank == 0 && std::getenv("KFAC_PRINT_FAULTS")) std::printf("[chunking] f=%g %d ranks: max rel diff %.3g\n", f, size_of(), diff);
    // Bit-identical at 2 and 4 ranks. At 3 ranks Open MPI's MPI_Reduce associates the sum
    // differently for different message sizes (1 ulp, 3.6e-16 measured; reported), so there the
    // bits are only reported and the results checked to 1e-14.
    const bool bits = everywhere(bytes_of(rs) == bytes_of(rd)), states = everywhere(saved(small) == saved(dflt));
    if ((size_of() & (size_of() - 1)) == 0) {
      CHECK(bits);
      CHECK(states);
    } else {
      CHECK_NOFAIL(bits);
      CHECK_NOFAIL(states);
    }
    CHECK(everywhere(diff <= 1e-14));
    CHECK(everywhere(small.communicator().bytes_sent() == dflt.communicator().bytes_sent()));
    CHECK(everywhere(small.communicator().messages() > dflt.communicator().messages()));
    if (f == 1.0) {
      const std::vector<std::size_t> expect_small = {9, 4, 4, 9, 4, 4, 9}, expect_dflt = {6, 2, 2, 6, 2, 2, 6};
      CHECK(ms == expect_small);
      CHECK(md == expect_dflt);
    }
  }
}

namespace {

// The host conversions of kfac before the payload kernels (MpiComm::sum's loops), verbatim.
std::uint16_t host_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}
float host_from_bf16(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Values that stress the conversions: rounding ties and near-ties in bf16 and float, signed
/// zeros, subnormals of both types, values past float's range, infinities, NaNs; then random.
std::vector<double> hard_values(int rank) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> v = {0.0, -0.0, 1.0, -1.0, 1.0 + 1.0 / 256, 1.0 + 3.0 / 256, 1.0 + 1.0 / 512,
                           1.0 + 3.0 / 512, 1.0 + 1.0 / 512 + 1e-12, 1.0 + 0x1p-24, 1.0 + 0x1p-24 + 0x1p-40,
                           std::numeric_limits<float>::denorm_min(), std::numeric_limits<double>::denorm_min(),
                           1e-40, 3.4e38, 3.5e38, 1e300, -1e300, inf, -inf,
                           std::numeric_limits<double>::quiet_NaN(), 65504.0, 3.0e38};
  Rng rng(4242u + unsigned(rank));
  for (int i = 0; i < 200; ++i) v.push_back(rng.uniform() * std::pow(10.0, 6 * rng.uniform()));
  return v;
}

template <class T>
std::string bits_of(const T* p, std::size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n * sizeof(T));
}

}  // namespace

TEST_CASE("payload kernels convert to the same bits as the former host loops", "[precision][payload]") {
  using Exec = Kokkos::DefaultExecutionSpace;
  using Mem = Exec::memory_space;
  const std::vector<double> v = hard_values(rank_in());
  const std::size_t n = v.size();
  // the host reference: double -> float, double -> float -> bf16, float -> bf16, and back
  std::vector<float> f32(n), asf(n), back_f(n);
  std::vector<std::uint16_t> bf_d(n), bf_f(n);
  std::vector<double> back_d32(n), back_d16(n);
  for (std::size_t i = 0; i < n; ++i) {
    f32[i] = float(v[i]);
    asf[i] = float(v[i]);
    bf_d[i] = host_to_bf16(float(v[i]));
    bf_f[i] = host_to_bf16(asf[i]);
    back_d32[i] = double(f32[i]);
    back_d16[i] = double(host_from_bf16(bf_d[i]));
    back_f[i] = host_from_bf16(bf_f[i]);
  }
  Kokkos::View<double*, Mem> d("d", n);
  Kokkos::View<float*, Mem> f("f", n), fout("fout", n);
  Kokkos::View<std::uint16_t*, Mem> h("h", n);
  Kokkos::deep_copy(d, Kokkos::View<const double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(v.data(), n));
  Kokkos::deep_copy(f, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(asf.data(), n));
  auto host = [](const auto& view) { return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, view); };
  const Exec exec;
  kfac::impl::pack_payload(exec, d.data(), n, 8, kfac::CommPrecision::float32, fout.data());
  CHECK(bits_of(host(fout).data(), n) == bits_of(f32.data(), n));
  kfac::impl::unpack_payload(exec, fout.data(), n, 8, kfac::CommPrecision::float32, d.data());
  CHECK(bits_of(host(d).data(), n) == bits_of(back_d32.data(), n));
  Kokkos::deep_copy(d, Kokkos::View<const double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(v.data(), n));
  kfac::impl::pack_payload(exec, d.data(), n, 8, kfac::CommPrecision::bfloat16, h.data());
  CHECK(bits_of(host(h).data(), n) == bits_of(bf_d.data(), n));
  kfac::impl::unpack_payload(exec, h.data(), n, 8, kfac::CommPrecision::bfloat16, d.data());
  CHECK(bits_of(host(d).data(), n) == bits_of(back_d16.data(), n));
  kfac::impl::pack_payload(exec, f.data(), n, 4, kfac::CommPrecision::bfloat16, h.data());
  CHECK(bits_of(host(h).data(), n) == bits_of(bf_f.data(), n));
  kfac::impl::unpack_payload(exec, h.data(), n, 4, kfac::CommPrecision::bfloat16, f.data());
  CHECK(bits_of(host(f).data(), n) == bits_of(back_f.data(), n));
}

TEST_CASE("sums of payloads converted in the data's memory equal MpiComm's host sums bit for bit",
          "[mpi][precision][payload]") {
  // Kokkos::DefaultExecutionSpace: on Serial/OpenMP the kernel conversions against MpiComm::sum's
  // host loops; on CUDA also the device buffers staged for MPI (bfloat16 always through the host).
  using Exec = Kokkos::DefaultExecutionSpace;
  using Mem = Exec::memory_space;
  const int rank = rank_in();
  kfac::MpiComm host_comm(MPI_COMM_WORLD), device_comm(MPI_COMM_WORLD);
  Kokkos::View<char*, Mem> scratch;
  for (auto payload : {kfac::CommPrecision::native, kfac::CommPrecision::float32, kfac::CommPrecision::bfloat16}) {
    INFO("payload " << int(payload));
    std::vector<double> ref = hard_values(rank);  // the same bytes in give the same bytes out, NaN too
    const std::size_t n = ref.size();
    std::vector<float> reff(ref.begin(), ref.end());
    Kokkos::View<double*, Mem> d("d", n);
    Kokkos::View<float*, Mem> f("f", n);
    Kokkos::deep_copy(d, Kokkos::View<const double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(ref.data(), n));
    Kokkos::deep_copy(f, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(reff.data(), n));
    host_comm.sum(ref.data(), n, 8, payload);
    host_comm.sum(reff.data(), n, 4, payload);
    kfac::impl::sum_payload(Exec{}, device_comm, d.data(), n, 8, payload, scratch);
    kfac::impl::sum_payload(Exec{}, device_comm, f.data(), n, 4, payload, scratch);
    auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, d);
    auto hf = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, f);
    CHECK(everywhere(bits_of(hd.data(), n) == bits_of(ref.data(), n)));
    CHECK(everywhere(bits_of(hf.data(), n) == bits_of(reff.data(), n)));
    CHECK(device_comm.bytes_sent() == host_comm.bytes_sent());
    CHECK(device_comm.messages() == host_comm.messages());
  }
  if (size_of() > 1) CHECK(scratch.extent(0) > 0);  // the converted payloads went through it
}
