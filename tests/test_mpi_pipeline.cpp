// The FDG pipeline (kfac/pipeline/pipeline.hpp) against references written here: K = 1 is plain
// back-propagation bit for bit; at K = 2 and 3 every stage calls forward/backward/update in the
// order of a hand-written delay table and every update equals a single-process simulation of
// the authors' training loop (ZHUANGHP/FDG) with beta, in their update order (update, then
// forward: the default) and in kfac 0.1's (forward first); the synchronous schedule is plain back-propagation;
// a slow stage, a stage that throws and bad input never hang and give the same kfac::Error on
// every rank. Run at 2 and 3 ranks under a ctest timeout.
#include <kfac/pipeline/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <tuple>
#include <stdexcept>
#include <thread>

#include "mpi_harness.hpp"

using namespace kfac_test;
using namespace kfac_test::mpi;

namespace {

using T2 = kfac::StageTensor<double>;
constexpr long kBatch = 3;
constexpr double kLr = 0.1;

/// y = act(x W^T + b), act = tanh or the identity.
struct DenseTanh {
  int in, out;
  bool tanh;
  std::vector<double> w, b;
};

T2 layer_forward(const DenseTanh& l, const T2& x) {
  T2 y("y", x.extent(0), l.out);
  for (std::size_t i = 0; i < x.extent(0); ++i)
    for (int o = 0; o < l.out; ++o) {
      double z = l.b[o];
      for (int j = 0; j < l.in; ++j) z += x(i, j) * l.w[std::size_t(o) * l.in + j];
      y(i, o) = l.tanh ? std::tanh(z) : z;
    }
  return y;
}
/// Parameter gradients (dW then db, appended to `grad`) and the input gradient, from the layer's
/// input x, its output y and dLoss/dy, through the layer's current weights.
T2 layer_backward(const DenseTanh& l, const T2& x, const T2& y, const T2& gy, std::vector<double>& grad) {
  const std::size_t n = x.extent(0);
  T2 gz("gz", n, l.out), gx("gx", n, l.in);
  for (std::size_t i = 0; i < n; ++i)
    for (int o = 0; o < l.out; ++o) gz(i, o) = l.tanh ? gy(i, o) * (1.0 - y(i, o) * y(i, o)) : gy(i, o);
  for (int o = 0; o < l.out; ++o)
    for (int j = 0; j < l.in; ++j) {
      double s = 0;
      for (std::size_t i = 0; i < n; ++i) s += gz(i, o) * x(i, j);
      grad.push_back(s);
    }
  for (int o = 0; o < l.out; ++o) {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += gz(i, o);
    grad.push_back(s);
  }
  for (std::size_t i = 0; i < n; ++i)
    for (int j = 0; j < l.in; ++j) {
      double s = 0;
      for (int o = 0; o < l.out; ++o) s += gz(i, o) * l.w[std::size_t(o) * l.in + j];
      gx(i, j) = s;
    }
  return gx;
}
void sgd(std::vector<DenseTanh>& layers, const std::vector<double>& grad) {
  std::size_t at = 0;
  for (auto& l : layers) {
    for (double& v : l.w) v -= kLr * grad[at++];
    for (double& v : l.b) v -= kLr * grad[at++];
  }
}
std::vector<double> flat(const std::vector<DenseTanh>& layers) {
  std::vector<double> p;
  for (const auto& l : layers) {
    p.insert(p.end(), l.w.begin(), l.w.end());
    p.insert(p.end(), l.b.begin(), l.b.end());
  }
  return p;
}

/// Widths of the whole network; stage k of K holds layers [first(k), first(k + 1)).
const std::vector<int> kWidths = {4, 5, 6, 3, 2};
std::vector<DenseTanh> make_layers(int first, int last, unsigned seed) {
  std::vector<DenseTanh> ls;
  for (int i = first; i < last; ++i) {
    Rng rng(seed * 977u + unsigned(i));
    DenseTanh l{kWidths[i], kWidths[i + 1], i + 2 < int(kWidths.size()), {}, {}};
    for (int j = 0; j < l.in * l.out; ++j) l.w.push_back(0.7 * rng.uniform());
    for (int j = 0; j < l.out; ++j) l.b.push_back(0.1 * rng.uniform());
    ls.push_back(l);
  }
  return ls;
}
/// Layers of stage k of K (4 layers: K = 1: all; K = 2: 2 + 2; K = 3: 1 + 2 + 1).
std::pair<int, int> stage_layers(int k, int stages) {
  static const std::vector<std::vector<int>> cuts = {{0, 4}, {0, 2, 4}, {0, 1, 3, 4}};
  return {cuts[stages - 1][k], cuts[stages - 1][k + 1]};
}

T2 input_of(long batch) {
  Rng rng(1000u + unsigned(batch));
  return random_view<double>(int(kBatch), kWidths.front(), rng);
}
/// dLoss/dy of L = 1/(2N) sum ||y - target||^2.
T2 loss_grad(long batch, const T2& y) {
  Rng rng(5000u + unsigned(batch));
  const T2 target = random_view<double>(int(kBatch), kWidths.back(), rng);
  T2 g("g", y.extent(0), y.extent(1));
  for (std::size_t i = 0; i < y.extent(0); ++i)
    for (std::size_t j = 0; j < y.extent(1); ++j) g(i, j) = (y(i, j) - target(i, j)) / double(kBatch);
  return g;
}

/// A stage over some of the layers: keeps each in-flight batch's activations (taken at forward
/// time) and back-propagates through its current weights. Logs its calls ("F3 B1 U1 ...") and
/// the parameters after every update; can be slowed down or made to throw.
struct TestStage {
  using scalar_type = double;
  std::vector<DenseTanh> layers;
  std::map<long, std::vector<T2>> acts;  ///< per batch: each layer's output
  std::vector<double> grad;
  std::string log;
  std::vector<std::vector<double>> after_update;
  int sleep_ms = 0;
  long throw_in_forward = -1, throw_in_update = -1;
  int in_override = 0;

  TestStage(int k, int stages, unsigned seed) {
    const auto r = stage_layers(k, stages);
    layers = make_layers(r.first, r.second, seed);
  }
  int input_features() const { return in_override ? in_override : layers.front().in; }
  int output_features() const { return layers.back().out; }
  void note(char c, long batch) { log += (log.empty() ? "" : " ") + std::string(1, c) + std::to_string(batch); }

  T2 forward(long batch, const T2& x) {
    note('F', batch);
    if (sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    if (batch == throw_in_forward) throw std::runtime_error("test stage refused to forward");
    std::vector<T2>& a = acts[batch];
    a.clear();  // left over from an epoch that stopped on an error
    T2 h = x;
    for (const auto& l : layers) a.push_back(h = layer_forward(l, h));
    return h;
  }
  T2 backward(long batch, const T2& x, const T2& gy, bool need_input_grad) {
    note('B', batch);
    std::vector<T2>& a = acts.at(batch);
    std::vector<std::vector<double>> per(layers.size());
    T2 g = gy;
    for (std::size_t i = layers.size(); i-- > 0;) g = layer_backward(layers[i], i ? a[i - 1] : x, a[i], g, per[i]);
    grad.clear();
    for (const auto& p : per) grad.insert(grad.end(), p.begin(), p.end());
    acts.erase(batch);
    return need_input_grad ? g : T2();
  }
  void apply_update(long batch) {
    note('U', batch);
    if (batch == throw_in_update) throw kfac::Error("fc9", "test stage refused to update");
    sgd(layers, grad);
    after_update.push_back(flat(layers));
  }
};

kfac::PipelineOptions options(int stages, double beta = 1.0) {
  return kfac::PipelineOptions{}.with_stages(stages).with_batch_size(kBatch).with_beta(beta);
}
template <class S>
kfac::PipelineReport run(kfac::Pipeline<S>& p, long batches) {
  return p.train(batches, input_of, loss_grad);
}

/// What the simulation of an FDG run gives per stage: the parameters after each update, and for
/// each update how many updates of that stage came between the batch's forward and it.
struct Simulated {
  std::vector<std::vector<std::vector<double>>> after_update;
  std::vector<std::vector<long>> staleness;
};

/// Single-process simulation of K modules trained as the authors' code trains them
/// (ZHUANGHP/FDG, FDG.py `TrainDg` and the loop around it; DG_models.py `BuildDG`), one
/// iteration at a time, with no batch arithmetic of the pipeline's:
/// - a module below the last keeps its forwarded batches in a queue; when a gradient from the
///   module above has arrived it back-propagates its oldest batch with beta times that gradient
///   and steps the optimizer, then forwards the newest input (update_first), or forwards first
///   and then back-propagates and steps (kfac 0.1's order);
/// - the last module steps with the gradient of its previous iteration, forwards, takes the
///   loss and back-propagates (the same weights as forward, backward, step in one iteration);
/// - after every module has run, each module's new output goes to the module above and each
///   input gradient to the module below, for the next iteration.
/// An epoch feeds `batches` inputs and then iterates until every gradient is applied (kfac's
/// drain; the authors' code carries on into the next epoch instead).
Simulated simulate(int stages, double beta, long batches, int epochs, unsigned seed, bool update_first = true) {
  std::vector<TestStage> s;
  for (int k = 0; k < stages; ++k) s.emplace_back(k, stages, seed);
  Simulated out;
  out.staleness.resize(stages);
  std::vector<long> updates(stages, 0);
  for (int e = 0; e < epochs; ++e) {
    struct Message {
      long batch = -1;
      T2 data;
    };
    std::map<int, Message> act_in, grad_in;  // by module: what arrived for this iteration (none: batch -1)
    std::vector<std::deque<long>> forwarded(stages);        // each module's batches awaiting a gradient
    std::vector<std::map<long, T2>> inputs(stages);
    std::vector<std::map<long, long>> updates_at_forward(stages);
    long pending_last = -1;  // the batch whose gradient the last module holds
    long next = 0, applied = 0, iterations = 0;
    auto update = [&](int k, long b) {
      s[k].apply_update(b);
      out.staleness[k].push_back(updates[k]++ - updates_at_forward[k].at(b));
      if (k == 0) ++applied;
    };
    while (applied < batches) {
      std::map<int, Message> act_out, grad_out;  // by module: what it sends after this iteration
      for (int k = 0; k < stages; ++k) {
        Message in = k == 0 ? (next < batches ? Message{next, input_of(next)} : Message{}) : act_in[k];
        auto forward = [&] {
          if (in.batch < 0) return;
          inputs[k][in.batch] = in.data;
          updates_at_forward[k][in.batch] = updates[k];
          act_out[k] = Message{in.batch, s[k].forward(in.batch, in.data)};
        };
        if (k + 1 == stages) {
          if (pending_last >= 0) update(k, pending_last);
          pending_last = -1;
          if (in.batch < 0) continue;
          forward();
          const T2 g = loss_grad(in.batch, act_out[k].data);
          const T2 gx = s[k].backward(in.batch, inputs[k].at(in.batch), g, k > 0);
          grad_out[k] = Message{in.batch, gx};
          pending_last = in.batch;
          continue;
        }
        auto backward_and_step = [&] {
          const Message& r = grad_in[k];
          if (r.batch < 0) return;
          REQUIRE(!forwarded[k].empty());
          const long b = forwarded[k].front();
          forwarded[k].pop_front();
          REQUIRE(b == r.batch);  // the gradient belongs to the oldest batch forwarded
          T2 g("g", r.data.extent(0), r.data.extent(1));
          for (std::size_t i = 0; i < g.span(); ++i) g.data()[i] = r.data.data()[i] * beta;
          const T2 gx = s[k].backward(b, inputs[k].at(b), g, k > 0);
          update(k, b);
          if (k > 0) grad_out[k] = Message{b, gx};
        };
        if (update_first) backward_and_step();
        forward();
        if (in.batch >= 0) forwarded[k].push_back(in.batch);
        if (!update_first) backward_and_step();
      }
      if (next < batches) ++next;
      for (int k = 0; k < stages; ++k) {
        act_in[k] = act_out[k - 1];   // module -1 sends nothing: the input comes from the data
        grad_in[k] = grad_out[k + 1];  // module K sends nothing: the last takes the loss
      }
      REQUIRE(++iterations < 4 * (batches + 2 * stages));  // never loops forever
    }
    if (pending_last >= 0) update(stages - 1, pending_last);  // the drain's last step
  }
  for (auto& st : s) out.after_update.push_back(st.after_update);
  return out;
}

/// Plain back-propagation through all four layers, one batch after another.
std::vector<std::vector<double>> plain_bp(long batches, int epochs, unsigned seed) {
  std::vector<DenseTanh> ls = make_layers(0, 4, seed);
  std::vector<std::vector<double>> after;
  for (int e = 0; e < epochs; ++e)
    for (long i = 0; i < batches; ++i) {
      std::vector<T2> y;
      T2 h = input_of(i);
      for (const auto& l : ls) y.push_back(h = layer_forward(l, h));
      T2 g = loss_grad(i, h);
      std::vector<std::vector<double>> per(ls.size());
      for (std::size_t j = ls.size(); j-- > 0;) g = layer_backward(ls[j], j ? y[j - 1] : input_of(i), y[j], g, per[j]);
      std::vector<double> grad;
      for (const auto& p : per) grad.insert(grad.end(), p.begin(), p.end());
      sgd(ls, grad);
      after.push_back(flat(ls));
    }
  return after;
}

/// The parameters of the layers [first, last) inside a whole-network parameter vector.
std::vector<double> slice(const std::vector<double>& all, int first, int last) {
  std::size_t begin = 0, end = 0;
  for (int i = 0; i < last; ++i) {
    const std::size_t n = std::size_t(kWidths[i]) * kWidths[i + 1] + kWidths[i + 1];
    if (i < first) begin += n;
    end += n;
  }
  return std::vector<double>(all.begin() + long(begin), all.begin() + long(end));
}

}  // namespace

TEST_CASE("one stage is plain back-propagation, bit for bit", "[mpi][pipeline]") {
  TestStage st(0, 1, 11);
  kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(1));
  CHECK(everywhere(p.active() == (rank_in() == 0)));
  CHECK(everywhere(p.stages() == 1));
  for (int e = 0; e < 2; ++e) run(p, 5);
  if (rank_in() == 0) {
    const auto ref = plain_bp(5, 2, 11);
    // The FDG simulation at K = 1 is plain back-propagation too, in either order.
    for (bool update_first : {true, false}) {
      const auto sim = simulate(1, 1.0, 5, 2, 11, update_first).after_update.front();
      REQUIRE(sim.size() == ref.size());
      for (std::size_t i = 0; i < ref.size(); ++i) CHECK(bytes_of(sim[i]) == bytes_of(ref[i]));
    }
    REQUIRE(st.after_update.size() == ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) CHECK(bytes_of(st.after_update[i]) == bytes_of(ref[i]));
    CHECK(st.log == "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4");
  } else {
    CHECK(st.log.empty());
  }
}

TEST_CASE("K = 2 and K = 3 follow the delayed-gradient table and the authors' order, with beta", "[mpi][pipeline]") {
  // Each stage's calls over one epoch of 6 batches: stage k forwards batch t - k at step t and
  // applies at step t the gradient of the batch it forwarded 2(K - k - 1) steps before; a stage
  // below the last updates before it forwards (the authors' order, the default) or after.
  using Order = kfac::FdgUpdateOrder;
  const std::map<std::tuple<Order, int, int>, std::string> table = {
      {{Order::update_then_forward, 2, 0}, "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 F4 B3 U3 F5 B4 U4 B5 U5"},
      {{Order::update_then_forward, 2, 1}, "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5"},
      {{Order::update_then_forward, 3, 0}, "F0 F1 F2 F3 B0 U0 F4 B1 U1 F5 B2 U2 B3 U3 B4 U4 B5 U5"},
      {{Order::update_then_forward, 3, 1}, "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 F4 B3 U3 F5 B4 U4 B5 U5"},
      {{Order::update_then_forward, 3, 2}, "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5"},
      {{Order::forward_then_update, 2, 0}, "F0 F1 F2 B0 U0 F3 B1 U1 F4 B2 U2 F5 B3 U3 B4 U4 B5 U5"},
      {{Order::forward_then_update, 2, 1}, "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5"},
      {{Order::forward_then_update, 3, 0}, "F0 F1 F2 F3 F4 B0 U0 F5 B1 U1 B2 U2 B3 U3 B4 U4 B5 U5"},
      {{Order::forward_then_update, 3, 1}, "F0 F1 F2 B0 U0 F3 B1 U1 F4 B2 U2 F5 B3 U3 B4 U4 B5 U5"},
      {{Order::forward_then_update, 3, 2}, "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5"}};
  // Updates between a batch's forward and its gradient's update, pipeline full (the paper's
  // staleness: 1 for stage 0 at K = 2 in the authors' order, 2 with the forward first).
  const std::map<std::tuple<Order, int, int>, long> stale = {
      {{Order::update_then_forward, 2, 0}, 1}, {{Order::update_then_forward, 2, 1}, 0},
      {{Order::update_then_forward, 3, 0}, 3}, {{Order::update_then_forward, 3, 1}, 1},
      {{Order::update_then_forward, 3, 2}, 0}, {{Order::forward_then_update, 2, 0}, 2},
      {{Order::forward_then_update, 2, 1}, 0}, {{Order::forward_then_update, 3, 0}, 4},
      {{Order::forward_then_update, 3, 1}, 2}, {{Order::forward_then_update, 3, 2}, 0}};
  for (Order order : {Order::update_then_forward, Order::forward_then_update})
    for (int stages = 2; stages <= std::min(3, size_of()); ++stages)
      for (double beta : {1.0, 0.5}) {
        const bool authors = order == Order::update_then_forward;
        INFO((authors ? "update_then_forward" : "forward_then_update") << ", K = " << stages << ", beta = " << beta
                                                                      << ", rank " << rank_in());
        const int k = rank_in();
        TestStage st(k < stages ? k : 0, stages, 7);
        // The default is the authors' order; the other is asked for by name.
        const auto opt = authors ? options(stages, beta) : options(stages, beta).with_update_order(order);
        kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, opt);
        CHECK(everywhere(p.stage_index() == (k < stages ? k : -1)));
        CHECK(everywhere(k >= stages || p.delay() == 2L * (stages - k - 1)));
        CHECK(everywhere(k >= stages || p.staleness() == stale.at({order, stages, k})));
        const auto rep = run(p, 6);
        CHECK(everywhere(k >= stages || st.log == table.at({order, stages, k})));
        CHECK(everywhere(k >= stages || rep.steps == 6 + 2 * (stages - 1)));
        run(p, 6);  // a second epoch after the drain
        const Simulated ref = simulate(stages, beta, 6, 2, 7, authors);
        bool same = true;
        if (k < stages) {
          // The simulation's own staleness, once full, is the one the pipeline reports.
          const auto& sk = ref.staleness[k];
          CHECK(*std::max_element(sk.begin(), sk.end()) == stale.at({order, stages, k}));
          same = st.after_update.size() == 12 && ref.after_update[k].size() == 12;
          for (std::size_t i = 0; same && i < 12; ++i) same = bytes_of(st.after_update[i]) == bytes_of(ref.after_update[k][i]);
        }
        CHECK(everywhere(same));
        // The two orders differ on every stage below the last (its forwards see other weights),
        // and beta shrinks those stages' gradients; the last stage's first update (made before
        // any stage below it has updated) is unaffected by either.
        const Simulated other = simulate(stages, beta, 6, 2, 7, !authors);
        const Simulated unshrunk = simulate(stages, 1.0, 6, 2, 7, authors);
        if (k + 1 < stages) {
          CHECK(bytes_of(ref.after_update[k].back()) != bytes_of(other.after_update[k].back()));
          if (beta != 1.0) CHECK(bytes_of(ref.after_update[k].back()) != bytes_of(unshrunk.after_update[k].back()));
        }
        if (k + 1 == stages) CHECK(bytes_of(ref.after_update[k].front()) == bytes_of(unshrunk.after_update[k].front()));
      }
}

TEST_CASE("ranks that disagree on the update order, or pass none, are refused", "[mpi][pipeline][faults]") {
  const int size = size_of(), k = rank_in();
  if (size < 2) return;  // one rank cannot disagree with itself
  TestStage st(k, size, 1);
  const Outcome o = attempt([&] {
    kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st,
                                options(size).with_update_order(k ? kfac::FdgUpdateOrder::forward_then_update
                                                                  : kfac::FdgUpdateOrder::update_then_forward));
  });
  report("ranks disagree on the update order", o);
  CHECK(everywhere(o.kfac_error));
  CHECK(same_everywhere(o.what));
  CHECK(o.what.find("update_order") != std::string::npos);
  // A value that is no FdgUpdateOrder (a cast int) is refused by name, not run as one of them.
  const Outcome cast = attempt([&] {
    kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(size).with_update_order(kfac::FdgUpdateOrder(7)));
  });
  report("an update order that is none", cast);
  CHECK(everywhere(cast.kfac_error));
  CHECK(same_everywhere(cast.what));
  CHECK(cast.what.find("pipeline (rank 0): update_order is neither FdgUpdateOrder::update_then_forward") !=
        std::string::npos);
}

TEST_CASE("the synchronous schedule is plain back-propagation split over the ranks", "[mpi][pipeline]") {
  const int stages = std::min(3, size_of()), k = rank_in();
  TestStage st(k < stages ? k : 0, stages, 5);
  kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st,
                              options(stages).with_schedule(kfac::PipelineSchedule::synchronous));
  run(p, 4);
  const auto ref = plain_bp(4, 1, 5);
  bool same = true;
  if (k < stages) {
    const auto r = stage_layers(k, stages);
    same = st.after_update.size() == 4;
    for (std::size_t i = 0; same && i < 4; ++i) same = bytes_of(st.after_update[i]) == bytes_of(slice(ref[i], r.first, r.second));
  }
  CHECK(everywhere(same));
}

TEST_CASE("a slow stage neither hangs the pipeline nor changes its result", "[mpi][pipeline]") {
  for (int slow : {0, size_of() - 1}) {
    const int stages = size_of(), k = rank_in();
    INFO("slow stage " << slow);
    TestStage st(k, stages, 9);
    if (k == slow) st.sleep_ms = 40;
    kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(stages, 0.8));
    const auto rep = run(p, 8);
    const auto ref = simulate(stages, 0.8, 8, 1, 9).after_update;
    CHECK(everywhere(st.after_update.size() == 8 && bytes_of(st.after_update.back()) == bytes_of(ref[k].back())));
    // The others waited for the slow one instead of running ahead or giving up.
    CHECK(everywhere(k == slow || rep.wait_seconds > 0.1));
  }
}

TEST_CASE("an error on one stage stops every stage with that error", "[mpi][pipeline][faults]") {
  const int stages = size_of(), k = rank_in();
  for (int bad : {0, stages - 1, stages / 2}) {
    for (int where : {0, 1}) {
      INFO("failing stage " << bad << (where ? " in apply_update" : " in forward") << ", rank " << k);
      TestStage st(k, stages, 3);
      if (k == bad) (where ? st.throw_in_update : st.throw_in_forward) = 3;
      kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(stages));
      const Outcome o = attempt([&] { run(p, 7); });
      report("stage throws", o);
      CHECK(everywhere(o.kfac_error));
      CHECK(same_everywhere(o.what));
      const std::string expect = "pipeline stage " + std::to_string(bad) + " (batch 3, step ";
      CHECK(o.what.find(expect) != std::string::npos);
      CHECK(o.what.find(where ? "layer 'fc9': test stage refused to update" : "test stage refused to forward") !=
            std::string::npos);
      CHECK(o.what.find("(the pipeline stopped on every stage)") != std::string::npos);
      CHECK(everywhere(o.seconds < 5.0));
      // Repaired, the same pipeline runs a full epoch again.
      st.throw_in_forward = st.throw_in_update = -1;
      const Outcome again = attempt([&] { run(p, 5); });
      CHECK(everywhere(!again.threw));
    }
  }
}

TEST_CASE("bad input is the same kfac::Error on every rank", "[mpi][pipeline][faults]") {
  const int size = size_of(), k = rank_in();
  auto refused = [&](const char* what, const Outcome& o, const std::string& expect) {
    report(what, o);
    INFO(what << " on rank " << k << ": " << o.what);
    CHECK(everywhere(o.kfac_error));
    CHECK(same_everywhere(o.what));
    CHECK(o.what.find(expect) != std::string::npos);
  };
  TestStage st(k, size, 1);
  refused("more stages than ranks",
          attempt([&] { kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(size + 1)); }),
          std::to_string(size + 1) + " stages need " + std::to_string(size + 1) + " ranks; the communicator has " +
              std::to_string(size));
  for (double beta : {0.0, -0.5, 1.5, std::nan("")})
    refused("beta outside (0, 1]",
            attempt([&] {
              kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(size, k == 0 ? beta : 0.5));
            }),
            "pipeline (rank 0): beta = ");
  refused("ranks disagree on beta",
          attempt([&] { kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(size, k ? 0.5 : 0.6)); }),
          "passed different stages, beta, batch_size");
  {
    TestStage wrong(k, size, 1);
    if (k == 1) wrong.in_override = 7;
    refused("shape mismatch between stages",
            attempt([&] { kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), wrong, options(size)); }),
            "pipeline stage 0 outputs " + std::to_string(kWidths[stage_layers(0, size).second]) +
                " features per sample but stage 1 expects 7");
  }
  kfac::Pipeline<TestStage> p(kfac::MpiComm(MPI_COMM_WORLD), st, options(size));
  refused("a batch of another size",
          attempt([&] {
            p.train(6, [](long b) { return b == 4 ? T2("x", kBatch - 1, 4) : input_of(b); },
                    loss_grad);
          }),
          "pipeline stage 0 (batch 4, step 4): the input of batch 4 is (2, 4); the pipeline expects (3, 4)");
  refused("a loss gradient of another shape",
          attempt([&] { p.train(6, input_of, [](long b, const T2& y) { return b == 2 ? T2("g", 1, 2) : loss_grad(b, y); }); }),
          "pipeline stage " + std::to_string(size - 1) + " (batch 2, step " + std::to_string(2 + size - 1) +
              "): the loss gradient of batch 2 is (1, 2)");
  refused("different batch counts", attempt([&] { p.train(k == 0 ? 4 : 5, input_of, loss_grad); }),
          "different (or negative) batch counts");
  const Outcome fine = attempt([&] { run(p, 4); });
  CHECK(everywhere(!fine.threw));
}
