// Self-tuning K-FAC (kfac/adaptive/): the settings, the 2x2 solve and the Levenberg-Marquardt rule
// against closed forms written here, the quadratic model against the true loss change (exact on a
// quadratic objective, to second order on a small network), the protocol with a host whose
// products are finite differences, checkpoint resume bit for bit, and bad input refused by name
// with nothing changed.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <kfac/kfac.hpp>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "adaptive_net.hpp"

using namespace kfac_test::adaptive;
using kfac_test::Rng;
using Host = Kokkos::DefaultHostExecutionSpace;
using Tuning = kfac::SelfTuning<double, Host>;
using Products = kfac::OutputProducts<double, Host>;
using Pre = kfac::Preconditioner<double, Host>;

namespace {

bool close(long double got, long double want, long double rel) {
  return std::fabs(double(got - want)) <= double(rel) * std::max(1.0, std::fabs(double(want)));
}
std::string bits(const Flat& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double));
}
template <class V>
Flat flat_of(const V& v) {
  return Flat(v.data(), v.data() + v.span());
}
M random_matrix(int r, int c, Rng& rng, double scale = 1) {
  M m("m", r, c);
  for (std::size_t i = 0; i < m.span(); ++i) m.data()[i] = scale * rng.uniform();
  return m;
}
void fill(const M& m, const Flat& v) { std::copy(v.begin(), v.end(), m.data()); }
void fill(const Vec& m, const Flat& v) { std::copy(v.begin(), v.end(), m.data()); }

/// Everything a refused call must leave as it was.
struct Snapshot {
  double lambda;
  long solves, updates;
  bool wants;
  std::string buffers, previous;
  static Snapshot of(const Tuning& t, const std::vector<Flat>& bufs, const std::vector<std::string>& names) {
    Snapshot s{t.lambda(), t.solves(), t.damping_updates(), t.wants_loss_change(), "", ""};
    for (const auto& b : bufs) s.buffers += bits(b);
    for (const auto& n : names) s.previous += bits(flat_of(t.previous_update(n)));
    return s;
  }
  bool operator==(const Snapshot& o) const {
    return std::memcmp(&lambda, &o.lambda, sizeof(double)) == 0 && solves == o.solves && updates == o.updates &&
           wants == o.wants && buffers == o.buffers && previous == o.previous;
  }
};

}  // namespace

TEST_CASE("Adaptive settings: defaults, omega, validation names the setting", "[adaptive][settings]") {
  const kfac::Adaptive a;
  CHECK(a.initial_damping == 1e-3);
  CHECK(a.update_interval == 5);
  CHECK(a.omega() == std::pow(0.95, 5.0));
  CHECK(kfac::Adaptive{}.with_update_interval(3).omega() == std::pow(0.95, 3.0));
  const auto refuses = [](const kfac::Adaptive& s, const std::string& name) {
    try {
      s.validate();
      FAIL("accepted a bad " << name);
    } catch (const kfac::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("Adaptive::" + name));
    }
  };
  refuses(kfac::Adaptive{}.with_initial_damping(-1), "initial_damping");
  refuses(kfac::Adaptive{}.with_initial_damping(1e-9), "initial_damping");  // below min_damping
  refuses(kfac::Adaptive{}.with_damping_bounds(1, 0.5), "max_damping");
  refuses(kfac::Adaptive{}.with_update_interval(0), "update_interval");
  refuses(kfac::Adaptive{}.with_damping_decay(1.0), "damping_decay");
  refuses(kfac::Adaptive{}.with_thresholds(0.8, 0.2), "upper_threshold");
  refuses(kfac::Adaptive{}.with_weight_decay(-0.1), "weight_decay");
  CHECK_THROWS_AS(Tuning(kfac::Adaptive{}.with_damping_decay(0)), kfac::Error);
}

TEST_CASE("The Levenberg-Marquardt rule against its closed form", "[adaptive][lm]") {
  const auto s = kfac::Adaptive{}.with_update_interval(5).with_damping_bounds(1e-4, 10.0);
  const double w = 0.95 * 0.95 * 0.95 * 0.95 * 0.95;  // omega_1 = (19/20)^T1, to the last bit or so
  CHECK(kfac::impl::levenberg_marquardt(0.5, 0.9, s) == Approx(0.5 * w).epsilon(1e-15));  // rho > 3/4: lambda omega
  CHECK(kfac::impl::levenberg_marquardt(0.5, 0.1, s) == Approx(0.5 / w).epsilon(1e-15));  // rho < 1/4: lambda / omega
  CHECK(kfac::impl::levenberg_marquardt(0.5, 0.5, s) == 0.5);                             // in between: unchanged
  CHECK(kfac::impl::levenberg_marquardt(0.5, 0.75, s) == 0.5);  // the thresholds themselves: unchanged
  CHECK(kfac::impl::levenberg_marquardt(0.5, 0.25, s) == 0.5);
  CHECK(kfac::impl::levenberg_marquardt(0.5, std::nan(""), s) ==
        Approx(0.5 / w).epsilon(1e-15));                         // a blown-up loss raises it
  CHECK(kfac::impl::levenberg_marquardt(1e-4, 2.0, s) == 1e-4);  // clipped below
  CHECK(kfac::impl::levenberg_marquardt(9.0, -1.0, s) == 10.0);  // clipped above
}

TEST_CASE("The 2x2 solve against Cramer's rule in long double, every loss curvature", "[adaptive][solve]") {
  const int n = 6, k = 4;
  Rng rng(3);
  for (const auto loss : {kfac::LossCurvature::softmax_cross_entropy, kfac::LossCurvature::squared_error,
                          kfac::LossCurvature::sigmoid_cross_entropy}) {
    for (const auto reduction : {kfac::LossReduction::mean, kfac::LossReduction::sum}) {
      const double lambda = 0.03, eta = 0.01, scale = loss == kfac::LossCurvature::squared_error ? 2.0 : 1.0;
      Tuning tune(kfac::Adaptive{}.with_initial_damping(lambda).with_weight_decay(eta));
      M w("w", 3, 5);
      Vec b("b", 3);
      tune.add_parameter("w", w);
      tune.add_parameter("b", b);
      Flat prev_u;
      for (int step = 0; step < 3; ++step) {
        INFO("loss " << kfac::to_string(loss) << ", step " << step);
        const Flat g = flat_of(random_matrix(1, 18, rng)), p = flat_of(random_matrix(1, 18, rng));
        fill(w, Flat(g.begin(), g.begin() + 15));
        fill(b, Flat(g.begin() + 15, g.end()));
        tune.capture_gradient();
        fill(w, Flat(p.begin(), p.begin() + 15));
        fill(b, Flat(p.begin() + 15, p.end()));
        const M z = random_matrix(n, k, rng, 3), jp = random_matrix(n, k, rng), ju = random_matrix(n, k, rng);
        CHECK(tune.needs_previous_product() == (step > 0));
        Products prod;
        prod.loss = loss;
        prod.reduction = reduction;
        prod.loss_scale = scale;
        prod.outputs = z;
        prod.along_proposal = jp;
        if (tune.needs_previous_product()) prod.along_previous = ju;
        const auto st = tune.solve(prod);
        // The forms with an explicit H per sample.
        const auto form = [&](const M& a, const M& c) -> long double {
          if (loss == kfac::LossCurvature::softmax_cross_entropy) return softmax_form(z, a, c);
          long double s = 0;
          for (int i = 0; i < n; ++i)
            for (int o = 0; o < k; ++o) {
              const long double q = loss == kfac::LossCurvature::squared_error
                                        ? 1.0L
                                        : 1.0L / (1 + std::exp(-(long double)z(i, o))) *
                                              (1 - 1.0L / (1 + std::exp(-(long double)z(i, o))));
              s += (long double)a(i, o) * q * (long double)c(i, o);
            }
          return s;
        };
        const long double norm = reduction == kfac::LossReduction::mean ? n : 1;
        const Closed c = closed_form(scale * form(jp, jp) / norm, scale * form(jp, ju) / norm,
                                     scale * form(ju, ju) / norm, g, p, step > 0 ? &prev_u : nullptr, lambda, eta);
        CHECK(st.momentum == (step > 0));
        CHECK(close(st.alpha, c.alpha, 1e-12));
        CHECK(close(st.mu, c.mu, 1e-12));
        CHECK(close(st.linear_term, c.linear, 1e-12));
        CHECK(close(st.curvature_term, c.curvature, 1e-12));
        CHECK(close(st.damping_term, c.damping, 1e-12));
        CHECK(close(st.predicted, c.linear + c.curvature + c.damping, 1e-12));
        CHECK(st.predicted < 0);
        // The buffers hold U = alpha P + mu U0, which is the next U0.
        Flat u = flat_of(w);
        u.insert(u.end(), b.data(), b.data() + 3);
        for (std::size_t i = 0; i < u.size(); ++i)
          CHECK(close(u[i], c.alpha * p[i] + c.mu * (step > 0 ? prev_u[i] : 0.0), 1e-12));
        Flat stored = flat_of(tune.previous_update("w"));
        const Flat sb = flat_of(tune.previous_update("b"));
        stored.insert(stored.end(), sb.begin(), sb.end());
        CHECK(bits(stored) == bits(u));
        prev_u = u;
      }
    }
  }
}

TEST_CASE("The curvature forms a host computes itself give the same solve", "[adaptive][solve]") {
  Rng rng(5);
  const int n = 7, k = 3;
  Tuning a, b;
  M wa("wa", 4, 2), wb("wb", 4, 2);
  a.add_parameter("w", wa);
  b.add_parameter("w", wb);
  for (int step = 0; step < 2; ++step) {
    const M g = random_matrix(4, 2, rng), p = random_matrix(4, 2, rng);
    const M z = random_matrix(n, k, rng), jp = random_matrix(n, k, rng), ju = random_matrix(n, k, rng);
    Kokkos::deep_copy(wa, g);
    Kokkos::deep_copy(wb, g);
    a.capture_gradient();
    b.capture_gradient();
    Kokkos::deep_copy(wa, p);
    Kokkos::deep_copy(wb, p);
    Products prod;
    prod.outputs = z;
    prod.along_proposal = jp;
    if (step > 0) prod.along_previous = ju;
    kfac::CurvatureForms f;
    f.batch = n;
    f.proposal = double(softmax_form(z, jp, jp) / n);
    if (step > 0) {
      f.cross = double(softmax_form(z, jp, ju) / n);
      f.previous = double(softmax_form(z, ju, ju) / n);
    }
    const auto sa = a.solve(prod), sb = b.solve(f);
    CHECK(close(sa.alpha, sb.alpha, 1e-12));
    CHECK(close(sa.mu, sb.mu, 1e-12));
    CHECK(close(sa.predicted, sb.predicted, 1e-12));
  }
}

TEST_CASE("The quadratic model equals the true loss change on a quadratic objective", "[adaptive][model]") {
  // A linear model y = W x with a squared error and weight decay: h is exactly quadratic and the
  // Gauss-Newton matrix is its Hessian, so the model's change (linear + curvature terms) is the
  // loss change, and rho (without the damping term) is 1.
  const int n = 9, d = 4, k = 3;
  const double eta = 0.05;
  Rng rng(11);
  const M x = random_matrix(n, d, rng), t = random_matrix(n, k, rng);
  M w = random_matrix(k, d, rng), grad("grad", k, d);
  const auto h = [&](const M& W) {
    long double s = 0, r = 0;
    for (int i = 0; i < n; ++i)
      for (int o = 0; o < k; ++o) {
        long double y = 0;
        for (int j = 0; j < d; ++j) y += (long double)W(o, j) * x(i, j);
        s += 0.5L * (y - t(i, o)) * (y - t(i, o));
      }
    for (std::size_t i = 0; i < W.span(); ++i) r += (long double)W.data()[i] * W.data()[i];
    return double(s / n + 0.5L * eta * r);
  };
  Tuning tune(kfac::Adaptive{}
                  .with_initial_damping(0.1)
                  .with_weight_decay(eta)
                  .with_update_interval(1)
                  .with_rho_including_damping(false));
  tune.add_parameter("w", grad);
  double expected = 0.1;
  for (int step = 0; step < 4; ++step) {
    INFO("step " << step);
    for (int o = 0; o < k; ++o)
      for (int j = 0; j < d; ++j) {
        double g = eta * w(o, j);
        for (int i = 0; i < n; ++i) {
          double y = 0;
          for (int c = 0; c < d; ++c) y += w(o, c) * x(i, c);
          g += (y - t(i, o)) * x(i, j) / n;
        }
        grad(o, j) = g;
      }
    tune.capture_gradient();
    for (std::size_t i = 0; i < grad.span(); ++i) grad.data()[i] *= 1.0 + 0.5 * rng.uniform();  // some proposal P
    const auto along = [&](const Kokkos::View<const double*, Kokkos::HostSpace>& v) {
      M jv("jv", n, k);
      for (int i = 0; i < n; ++i)
        for (int o = 0; o < k; ++o)
          for (int j = 0; j < d; ++j) jv(i, o) += v(o * d + j) * x(i, j);
      return jv;
    };
    Products prod;
    prod.loss = kfac::LossCurvature::squared_error;
    prod.along_proposal = along(Kokkos::View<const double*, Kokkos::HostSpace>(grad.data(), grad.span()));
    if (tune.needs_previous_product()) prod.along_previous = along(tune.previous_update("w"));
    const double before = h(w);
    const auto st = tune.solve(prod);
    for (std::size_t i = 0; i < w.span(); ++i) w.data()[i] -= grad.data()[i];
    const double after = h(w);
    CHECK(close(after - before, st.linear_term + st.curvature_term, 1e-12));
    const auto u = tune.update_damping(before, after);
    CHECK(std::fabs(u.rho - 1) < 1e-10);
    expected *= 0.95;  // rho > 3/4 each time: lambda omega, omega = 0.95 with T1 = 1
    CHECK(u.damping == Approx(expected).epsilon(1e-15));
  }
}

TEST_CASE("The quadratic model on a small network: exact second order of the linearised outputs", "[adaptive][model]") {
  // Softmax cross-entropy over a two-layer tanh network, products by central differences. The
  // Gauss-Newton model is the second-order expansion of the loss of the linearised network, so
  // along t U its error there is O(t^3); on the network itself the first-order term is exact and
  // the error is O(t^2) (the Hessian's residual term, which the GGN leaves out).
  Net net(5, 6, 4, 21);
  const Batch b(16, 5, 4, 22);
  Tuning tune(kfac::Adaptive{}.with_initial_damping(0.5));
  tune.add_parameter("W1", net.dW1);
  tune.add_parameter("b1", net.db1);
  tune.add_parameter("W2", net.dW2);
  tune.add_parameter("b2", net.db2);
  const double h0 = net.backward(b);
  tune.capture_gradient();
  Rng rng(23);
  for (const auto& part : net.grads())
    for (std::size_t i = 0; i < part.second; ++i) part.first[i] *= 1.0 + 0.5 * rng.uniform();
  M z("z", b.n(), 4);
  Kokkos::deep_copy(z, net.forward(b.x));
  Products prod;
  prod.outputs = z;
  prod.along_proposal = net.jvp(b.x, Net::flat(net.grads()));
  const auto st = tune.solve(prod);
  const Flat u = Net::flat(net.grads()), theta = Net::flat(net.params());
  const M ju = net.jvp(b.x, u);
  const auto linearised_error = [&](double t) {
    M zt("zt", b.n(), 4);
    for (std::size_t i = 0; i < zt.span(); ++i) zt.data()[i] = z.data()[i] - t * ju.data()[i];
    return std::fabs(Net::loss(zt, b.y) - h0 - (t * st.linear_term + t * t * st.curvature_term));
  };
  const auto network_error = [&](double t) {
    Flat moved(theta);
    for (std::size_t i = 0; i < moved.size(); ++i) moved[i] -= t * u[i];
    Net::assign(net.params(), moved);
    const double e = std::fabs(net.loss_at(b) - h0 - (t * st.linear_term + t * t * st.curvature_term));
    Net::assign(net.params(), theta);
    return e;
  };
  for (double t : {0.4, 0.2, 0.1}) {
    INFO("t = " << t << ": linearised errors " << linearised_error(t) << ", " << linearised_error(t / 2)
                << "; network errors " << network_error(t) << ", " << network_error(t / 2));
    const double r3 = linearised_error(t) / linearised_error(t / 2), r2 = network_error(t) / network_error(t / 2);
    CHECK(r3 > 6.5);  // O(t^3): halving t divides the error by about 8
    CHECK(r3 < 9.5);
    CHECK(r2 > 3.2);  // O(t^2): by about 4
    CHECK(network_error(t) < 0.1 * std::fabs(t * st.linear_term));
  }
}

namespace {

/// The protocol end to end: a K-FAC preconditioner whose damping is the tuner's, a host that
/// computes its products by central differences, the closed form checked at every solve.
struct Trainer {
  Net net{5, 6, 4, 31};
  Tuning tune;
  Pre pre;
  long steps = 0;
  std::vector<double> alphas, mus;
  explicit Trainer(const kfac::Adaptive& a = kfac::Adaptive{}.with_initial_damping(0.5).with_update_interval(2))
      : tune(a), pre(kfac::Options{}.with_damping(tune.damping()).with_kl_clip(0.0).with_inv_update_steps(1)) {
    pre.register_layer("fc1", kfac::Dense(5, 6));
    pre.register_layer("fc2", kfac::Dense(6, 4));
    tune.add_parameter("fc1.weight", net.dW1);
    tune.add_parameter("fc1.bias", net.db1);
    tune.add_parameter("fc2.weight", net.dW2);
    tune.add_parameter("fc2.bias", net.db2);
  }
  /// One step on batch `steps`; returns the loss before it.
  double step(bool check) {
    const Batch b(16, 5, 4, 100 + std::uint64_t(steps));
    const double before = net.backward(b);
    CHECK(pre.options().damping(pre.step_count()) == tune.lambda());  // the preconditioner's damping is lambda
    pre.observe_input("fc1", b.x);
    pre.observe_output_grad("fc1", net.dpre1);
    pre.observe_input("fc2", net.hidden);
    pre.observe_output_grad("fc2", net.dlogits);
    pre.set_gradient("fc1", net.dW1, net.db1);
    pre.set_gradient("fc2", net.dW2, net.db2);
    const Flat g = Net::flat(net.grads());
    const bool products = tune.wants_products();
    if (products) tune.capture_gradient();
    pre.step();
    const Flat p = Net::flat(net.grads());
    if (!products) return reuse(before, p);
    M z("z", b.n(), 4);
    Kokkos::deep_copy(z, net.forward(b.x));
    Products prod;
    prod.outputs = z;
    const M jp = net.jvp(b.x, p);
    prod.along_proposal = jp;
    Flat u0;
    M ju;
    if (tune.needs_previous_product()) {
      for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
        const auto v = tune.previous_update(name);
        u0.insert(u0.end(), v.data(), v.data() + v.size());
      }
      ju = net.jvp(b.x, u0);
      prod.along_previous = ju;
    }
    const double lambda = tune.lambda();
    const auto st = tune.solve(prod);
    alphas.push_back(st.alpha);
    mus.push_back(st.mu);
    if (check) {
      const long double n = b.n();
      const bool two = !u0.empty();
      const Closed c = closed_form(softmax_form(z, jp, jp) / n, two ? softmax_form(z, jp, ju) / n : 0.0L,
                                   two ? softmax_form(z, ju, ju) / n : 0.0L, g, p, two ? &u0 : nullptr, lambda, 0);
      CHECK(close(st.alpha, c.alpha, 1e-10));
      CHECK(close(st.mu, c.mu, 1e-10));
      CHECK(close(st.predicted, c.linear + c.curvature + c.damping, 1e-10));
    }
    const Flat u = Net::flat(net.grads());
    Flat theta = Net::flat(net.params());
    for (std::size_t i = 0; i < theta.size(); ++i) theta[i] -= u[i];
    Net::assign(net.params(), theta);
    if (tune.wants_loss_change()) {
      const double after = net.loss_at(b);
      const double old = tune.lambda();
      const auto upd = tune.update_damping(before, after);
      CHECK(upd.rho == (after - before) / st.predicted);
      CHECK(upd.damping == kfac::impl::levenberg_marquardt(old, upd.rho, tune.settings()));
    }
    ++steps;
    return before;
  }
  /// The mean of v[1..] with weight 0.9^(later entries) (SelfTuning's reused step), in long double.
  static long double weighted_mean(const std::vector<double>& v) {
    long double sum = 0, weight = 0;
    for (std::size_t j = 1; j < v.size(); ++j) {
      const long double w = std::pow(0.9L, (long double)(v.size() - 1 - j));
      sum += w * v[j];
      weight += w;
    }
    return sum / weight;
  }
  /// A step without products (Adaptive::solve_interval): apply_last() gives alpha P + mu U0 with
  /// alpha, mu the weighted means of the solves after the first, and no damping update follows.
  double reuse(double before, const Flat& p) {
    Flat u0;
    for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
      const auto v = tune.previous_update(name);
      u0.insert(u0.end(), v.data(), v.data() + v.size());
    }
    const long solves = tune.solves(), updates = tune.damping_updates();
    const auto st = tune.apply_last();
    const long double alpha = weighted_mean(alphas), mu = weighted_mean(mus);
    CHECK(close(st.alpha, double(alpha), 1e-13));
    CHECK(close(st.mu, double(mu), 1e-13));
    CHECK(st.alpha != alphas.back());  // not the last solve's
    const Flat u = Net::flat(net.grads());
    for (std::size_t i = 0; i < u.size(); ++i) CHECK(close(u[i], double(alpha * p[i] + mu * u0[i]), 1e-12));
    CHECK(tune.solves() == solves);
    CHECK(!tune.wants_loss_change());
    CHECK(tune.damping_updates() == updates);
    Flat theta = Net::flat(net.params());
    for (std::size_t i = 0; i < theta.size(); ++i) theta[i] -= u[i];
    Net::assign(net.params(), theta);
    ++steps;
    return before;
  }
};

}  // namespace

TEST_CASE("The protocol with a finite-difference host and a K-FAC preconditioner", "[adaptive][protocol]") {
  Trainer tr;
  const Batch probe(64, 5, 4, 999);
  const double first = tr.net.loss_at(probe);
  for (int s = 0; s < 12; ++s) tr.step(true);
  CHECK(tr.tune.solves() == 12);
  CHECK(tr.tune.damping_updates() == 6);  // T1 = 2
  CHECK(tr.net.loss_at(probe) < first);
  CHECK(tr.tune.lambda() != 0.5);
}

TEST_CASE("Checkpoint resume with the adaptive state is bit for bit", "[adaptive][checkpoint]") {
  Trainer straight;
  for (int s = 0; s < 9; ++s) straight.step(false);
  Trainer first;
  for (int s = 0; s < 5; ++s) first.step(false);
  std::stringstream pre_ckpt, tune_ckpt;
  first.pre.save(pre_ckpt);
  first.tune.save(tune_ckpt);
  const Flat theta = Net::flat(first.net.params());
  Trainer resumed;
  Net::assign(resumed.net.params(), theta);
  resumed.pre.load(pre_ckpt);
  resumed.tune.load(tune_ckpt);
  resumed.steps = 5;
  CHECK(resumed.tune.lambda() == first.tune.lambda());
  CHECK(resumed.tune.solves() == 5);
  for (int s = 5; s < 9; ++s) resumed.step(false);
  CHECK(bits(Net::flat(resumed.net.params())) == bits(Net::flat(straight.net.params())));
  CHECK(resumed.tune.lambda() == straight.tune.lambda());
  CHECK(resumed.alphas == std::vector<double>(straight.alphas.begin() + 5, straight.alphas.end()));
  // Another registration or other settings are refused, and change nothing.
  Tuning other(kfac::Adaptive{}.with_initial_damping(0.5).with_update_interval(3));
  M w("w", 6, 5);
  other.add_parameter("fc1.weight", w);
  tune_ckpt.clear();
  tune_ckpt.seekg(0);
  CHECK_THROWS_WITH(other.load(tune_ckpt), Catch::Contains("settings differ"));
  CHECK(other.lambda() == 0.5);
  Tuning fewer(kfac::Adaptive{}.with_initial_damping(0.5).with_update_interval(2));
  fewer.add_parameter("fc1.weight", w);
  tune_ckpt.clear();
  tune_ckpt.seekg(0);
  CHECK_THROWS_WITH(fewer.load(tune_ckpt), Catch::Contains("holds 4 parameters"));
  CHECK(fewer.solves() == 0);
}

TEST_CASE("Bad input is a kfac::Error naming what is wrong, and changes nothing", "[adaptive][errors]") {
  Rng rng(41);
  const int n = 5, k = 3;
  Tuning tune(kfac::Adaptive{}.with_update_interval(1));
  M w("w", 2, 3);
  tune.add_parameter("w", w);
  const std::vector<std::string> names{"w"};
  const M z = random_matrix(n, k, rng), jp = random_matrix(n, k, rng), ju = random_matrix(n, k, rng);
  const auto refused = [&](const std::string& what, const std::function<void()>& call) {
    INFO(what);
    const Snapshot before = Snapshot::of(tune, {flat_of(w)}, names);
    try {
      call();
      FAIL("accepted");
    } catch (const kfac::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
    CHECK(Snapshot::of(tune, {flat_of(w)}, names) == before);
  };
  Products ok;
  ok.outputs = z;
  ok.along_proposal = jp;
  refused("no gradient was captured", [&] { tune.solve(ok); });
  refused("update_damping: no damping update is due", [&] { tune.update_damping(1.0, 0.5); });
  Kokkos::deep_copy(w, random_matrix(2, 3, rng));
  tune.capture_gradient();
  Kokkos::deep_copy(w, random_matrix(2, 3, rng));
  Products p = ok;
  p.along_proposal = Products::view_type();
  refused("OutputProducts::along_proposal is missing", [&] { tune.solve(p); });
  p = ok;
  p.outputs = Products::view_type();
  refused("OutputProducts::outputs is missing", [&] { tune.solve(p); });
  const M bad = random_matrix(n, k, rng);
  bad(2, 1) = std::numeric_limits<double>::quiet_NaN();
  p = ok;
  p.outputs = bad;
  refused("OutputProducts::outputs has 1 non-finite values", [&] { tune.solve(p); });
  p = ok;
  p.along_proposal = bad;
  refused("OutputProducts::along_proposal has 1 non-finite values", [&] { tune.solve(p); });
  p = ok;
  p.outputs = random_matrix(n, k + 1, rng);
  refused("OutputProducts::outputs is (5, 4), along_proposal (5, 3)", [&] { tune.solve(p); });
  p = ok;
  p.loss_scale = -1;
  refused("OutputProducts::loss_scale", [&] { tune.solve(p); });
  kfac::CurvatureForms f;
  f.batch = n;
  refused("CurvatureForms::proposal is missing", [&] { tune.solve(f); });
  f.proposal = -0.5;
  refused("a negative curvature product", [&] { tune.solve(f); });
  f.proposal = std::numeric_limits<double>::infinity();
  refused("CurvatureForms::proposal is not finite", [&] { tune.solve(f); });
  f.proposal = 1;
  f.batch = 0;
  refused("CurvatureForms::batch = 0", [&] { tune.solve(f); });
  // A proposal of zero: no curvature along it, no step to take.
  Kokkos::deep_copy(w, 0.0);
  refused("is not positive", [&] {
    kfac::CurvatureForms zero;
    zero.batch = n;
    zero.proposal = 0;
    tune.solve(zero);
  });
  // The first solve goes through; the second needs the product along the previous update.
  Kokkos::deep_copy(w, random_matrix(2, 3, rng));
  tune.solve(ok);
  refused("loss_before is not finite", [&] { tune.update_damping(std::nan(""), 1.0); });
  tune.update_damping(1.0, 0.9);
  Kokkos::deep_copy(w, random_matrix(2, 3, rng));
  tune.capture_gradient();
  Kokkos::deep_copy(w, random_matrix(2, 3, rng));
  refused("OutputProducts::along_previous is missing", [&] { tune.solve(ok); });
  f = kfac::CurvatureForms{};
  f.batch = n;
  f.proposal = 1;
  refused("CurvatureForms::cross is missing", [&] { tune.solve(f); });
  f.cross = 2;
  f.previous = 1;
  refused("a negative curvature product", [&] { tune.solve(f); });  // cross^2 > proposal previous
  p = ok;
  p.along_previous = ju;
  // A gradient holding NaN makes the model's prediction non-finite.
  Kokkos::deep_copy(w, std::numeric_limits<double>::quiet_NaN());
  refused("the quadratic model is not finite", [&] { tune.solve(p); });
  std::stringstream junk("not a checkpoint");
  refused("not a kfac checkpoint", [&] { tune.load(junk); });
  CHECK_THROWS_WITH(tune.add_parameter("late", w), Catch::Contains("after the first capture_gradient"));
}

TEST_CASE("Adaptive::solve_interval: products every k steps, the last alpha and mu reused in between",
          "[adaptive][interval]") {
  const auto every3 = kfac::Adaptive{}.with_initial_damping(0.5).with_update_interval(2).with_solve_interval(3)
                          .with_solve_warmup(3);
  Trainer tr(every3);
  const Batch probe(64, 5, 4, 999);
  const double first = tr.net.loss_at(probe);
  std::vector<bool> wanted;
  for (int s = 0; s < 12; ++s) {
    wanted.push_back(tr.tune.wants_products());
    tr.step(true);
  }
  // Warm-up: steps 0-2 solve; then every 3rd step.
  CHECK(wanted == std::vector<bool>{true, true, true, true, false, false, true, false, false, true, false, false});
  CHECK(tr.tune.solves() == 6);
  CHECK(tr.tune.steps() == 12);
  CHECK(tr.tune.damping_updates() == 3);  // after solves 2, 4 and 6 (T1 = 2 solves)
  // The interval's default, 1: every step solves, warm-up or not.
  Tuning every(kfac::Adaptive{}.with_solve_warmup(2));
  CHECK(every.wants_products());
  CHECK(tr.net.loss_at(probe) < first);

  // apply_last() when the solve is due, or before any solve: refused, nothing changed.
  CHECK(tr.tune.wants_products());
  const std::vector<std::string> names{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  const Snapshot before = Snapshot::of(tr.tune, {Net::flat(tr.net.grads())}, names);
  CHECK_THROWS_WITH(tr.tune.apply_last(), Catch::Contains("this step's solve is due"));
  CHECK(Snapshot::of(tr.tune, {Net::flat(tr.net.grads())}, names) == before);
  CHECK(tr.tune.steps() == 12);
  Tuning fresh(every3);
  M w("w", 2, 3);
  fresh.add_parameter("w", w);
  CHECK_THROWS_WITH(fresh.apply_last(), Catch::Contains("0 solves so far"));
  CHECK(fresh.steps() == 0);
  CHECK_THROWS_WITH(Tuning(kfac::Adaptive{}.with_solve_interval(0)), Catch::Contains("solve_interval"));
  CHECK_THROWS_WITH(Tuning(kfac::Adaptive{}.with_solve_warmup(1)), Catch::Contains("solve_warmup"));

  // A checkpoint taken between two solves resumes bit for bit.
  Trainer straight(every3);
  for (int s = 0; s < 8; ++s) straight.step(false);
  Trainer part(every3);
  for (int s = 0; s < 4; ++s) part.step(false);
  std::stringstream pre_ckpt, tune_ckpt;
  part.pre.save(pre_ckpt);
  part.tune.save(tune_ckpt);
  Trainer resumed(every3);
  Net::assign(resumed.net.params(), Net::flat(part.net.params()));
  resumed.pre.load(pre_ckpt);
  resumed.tune.load(tune_ckpt);
  resumed.steps = 4;
  resumed.alphas = part.alphas;  // the test's own record, for reuse()'s check
  resumed.mus = part.mus;
  CHECK(resumed.tune.steps() == 4);
  CHECK(!resumed.tune.wants_products());
  for (int s = 4; s < 8; ++s) resumed.step(false);
  CHECK(bits(Net::flat(resumed.net.params())) == bits(Net::flat(straight.net.params())));
  // Another interval is another setting: its checkpoint is refused.
  Tuning other(kfac::Adaptive{}.with_initial_damping(0.5).with_update_interval(2).with_solve_interval(2));
  tune_ckpt.clear();
  tune_ckpt.seekg(0);
  M w1("w1", 6, 5);
  other.add_parameter("fc1.weight", w1);
  CHECK_THROWS_WITH(other.load(tune_ckpt), Catch::Contains("solve_interval"));
}
