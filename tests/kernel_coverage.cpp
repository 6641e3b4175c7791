// kernel_coverage: the CUDA leg's compile-only unit for the labelled kernels and allocations ("kfac::<area>::<op>"
// in include/kfac) that fashion_mnist and test_backend_equivalence do not instantiate, so that those three units
// together compile every label the Serial suite compiles (scripts/kernel_labels.sh check). Each part drives one
// area through the public API: FDG pipeline buffers, NG-SGD with parameter averaging, KAISA's reduced-precision
// factor sums (blocking and overlapped), the portable Jacobi and Cholesky solvers, packed symmetric factors, Conv2d
// output-gradient rows, Dense over tokens, LayerNorm, Embedding and the diagonal Fisher, the randomized eigensolver,
// the Eigen adapter's copies, self-tuning K-FAC's solve and the cost model. The preconditioner parts run on
// Kokkos::DefaultExecutionSpace and, where that is a device, on the host space as well (its LAPACK paths).
// Nothing here launches a kernel of its own: data is filled on the host and copied.
// Serial builds also run it, at 1 and 2 MPI ranks; it checks shapes only, and prints "kernel_coverage: ok".
#include <mpi.h>

#include <Eigen/Dense>
#include <Kokkos_Core.hpp>
#include <kfac/adapters/eigen.hpp>
#include <kfac/adapters/raw.hpp>
#include <kfac/distributed/mpi_comm.hpp>
#include <kfac/distributed/parameter_averager.hpp>
#include <kfac/kfac.hpp>
#include <kfac/methods/ngsgd/ngsgd.hpp>
#include <kfac/pipeline/pipeline.hpp>
#include <kfac/planning/calibration.hpp>
#include <kfac/planning/cost_model.hpp>

#include "reference.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using Device = Kokkos::DefaultExecutionSpace;  // the GPU on the CUDA leg, Serial here
using Host = Kokkos::DefaultHostExecutionSpace;

template <class Space>
using V1 = Kokkos::View<double*, typename Space::memory_space>;
template <class Space>
using V2 = Kokkos::View<double**, Kokkos::LayoutRight, typename Space::memory_space>;
template <class Space>
using V4 = Kokkos::View<double****, Kokkos::LayoutRight, typename Space::memory_space>;

constexpr int kBatch = 8;

using Numbers = kfac_test::Rng;  // the tests' fixed stream of uniform(-1, 1) values

/// A view of the given extents, filled from `rng` through a host mirror.
template <class View, class... Extents>
View filled(Numbers& rng, Extents... extents) {
  View v("kernel_coverage::data", std::size_t(extents)...);
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < h.span(); ++i) h.data()[i] = rng.uniform();
  Kokkos::deep_copy(v, h);
  return v;
}

/// Gradients handed to set_gradient(), kept alive until step() has returned.
template <class Space>
struct Kept {
  std::vector<V1<Space>> v;
  std::vector<V2<Space>> m;
  std::vector<V4<Space>> t;
};

/// Observes a Dense layer (when its statistics are due) from `data` and hands it a gradient from `grads`.
template <class Pre>
void feed_dense(Pre& pre, const std::string& name, int in, int out, Numbers& data, Numbers& grads,
                Kept<typename Pre::execution_space>& kept) {
  using Space = typename Pre::execution_space;
  if (pre.wants_observations(name)) {
    pre.observe_input(name, filled<V2<Space>>(data, kBatch, in));
    pre.observe_output_grad(name, filled<V2<Space>>(data, kBatch, out));
  }
  kept.m.push_back(filled<V2<Space>>(grads, out, in));
  kept.v.push_back(filled<V1<Space>>(grads, out));
  pre.set_gradient(name, kept.m.back(), kept.v.back());
}

void require(bool ok, const std::string& what) {
  if (!ok) throw kfac::Error("", "kernel_coverage: " + what);
}

// ---- KAISA over MpiComm, with the K-FAC inversions and layers whose kernels the other units leave out ----------

using JacobiKfac = kfac::KFAC<kfac::Symmetric, kfac::Eigendecomposition<kfac::PortableBackend>>;
using Randomized = kfac::RandomizedEigen<>;

/// Three steps under each of two KAISA settings: bfloat16 payloads, summed as overlapped nonblocking collectives
/// (the in-flight staging buffer) at step 1, the step that updates the factors without decomposing them; then
/// float32 payloads summed one bucket at a time (the blocking staging buffer). Either way a kernel packs the
/// payload (at one rank nothing is summed, but all of it is compiled).
/// Layers: the portable Jacobi eigensolver, the portable Cholesky inverse, the vendor Cholesky, Newton-Schulz
/// (its diagonal shift), the randomized eigensolver, diagonal K-FAC, and a Conv2d (its output-gradient rows). One
/// Dense layer is fed from column-major Eigen matrices through the adapter's row-major copies and written back.
template <class Space>
void kaisa_and_inversions(const kfac::MpiComm& comm) {
  using Pre = kfac::Preconditioner<double, Space, kfac::MpiComm>;
  using Mem = typename Space::memory_space;
  const kfac::Kaisa settings[2] = {
      kfac::Kaisa{}.with_comm_precision(kfac::CommPrecision::bfloat16).with_bucket_bytes(256),
      kfac::Kaisa{}.with_comm_precision(kfac::CommPrecision::float32).with_overlap_communication(false)};
  for (const kfac::Kaisa& kaisa : settings) {
    Pre pre(kfac::Options{}.with_damping(0.1).with_kl_clip(1e-3).with_inv_update_steps(2), Space{}, comm, kaisa);
    pre.register_layer("jacobi", kfac::Dense(5, 4), JacobiKfac{});
    pre.register_layer("cholesky", kfac::Dense(4, 3),
                       kfac::KFAC<kfac::Symmetric, kfac::Cholesky<kfac::PortableBackend>>{});
    pre.register_layer("vendor", kfac::Dense(4, 3), kfac::KFAC<kfac::Symmetric, kfac::Cholesky<>>{});
    pre.register_layer("newton", kfac::Dense(3, 2), kfac::KFAC<kfac::Full, kfac::NewtonSchulz>{});
    pre.register_layer("randomized", kfac::Dense(12, 10),
                       kfac::KFAC<kfac::Symmetric, Randomized>(Randomized{}.with_rank(2).with_oversampling(2)));
    pre.register_layer("conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1), kfac::KFAC<>{});
    pre.register_layer("diagonal", kfac::Dense(4, 3), kfac::KFAC<kfac::Diagonal>{});
    Numbers data{std::uint64_t(11 + comm.rank())}, grads{23};  // each rank its own data, the same gradients
    for (int step = 0; step < 3; ++step) {
      Kept<Space> kept;
      feed_dense(pre, "jacobi", 5, 4, data, grads, kept);
      feed_dense(pre, "cholesky", 4, 3, data, grads, kept);
      feed_dense(pre, "newton", 3, 2, data, grads, kept);
      feed_dense(pre, "randomized", 12, 10, data, grads, kept);
      feed_dense(pre, "diagonal", 4, 3, data, grads, kept);
      if (pre.wants_observations("conv")) {
        pre.observe_input("conv", filled<V4<Space>>(data, kBatch, 2, 4, 4));
        pre.observe_output_grad("conv", filled<V4<Space>>(data, kBatch, 3, 4, 4));
      }
      kept.t.push_back(filled<V4<Space>>(grads, 3, 2, 3, 3));
      kept.v.push_back(filled<V1<Space>>(grads, 3));
      pre.set_gradient("conv", kept.t.back(), kept.v.back());

      // The "vendor" layer's data as a framework built on Eigen holds it: column-major, on the host.
      Eigen::MatrixXd x(kBatch, 4), g(kBatch, 3), w(3, 4);
      Eigen::VectorXd b(3);
      for (Eigen::MatrixXd* e : {&x, &g})
        for (Eigen::Index i = 0; i < e->size(); ++i) e->data()[i] = data.uniform();
      for (Eigen::Index i = 0; i < w.size(); ++i) w.data()[i] = grads.uniform();
      for (Eigen::Index i = 0; i < b.size(); ++i) b(i) = grads.uniform();
      const auto w_rows = kfac::adapters::to_row_major_view(w);
      const auto w_space = Kokkos::create_mirror_view_and_copy(Mem(), w_rows);
      const auto b_space = Kokkos::create_mirror_view_and_copy(Mem(), kfac::adapters::from_eigen(b));
      if (pre.wants_observations("vendor")) {
        pre.observe_input("vendor", Kokkos::create_mirror_view_and_copy(Mem(), kfac::adapters::to_row_major_view(x)));
        pre.observe_output_grad("vendor",
                                Kokkos::create_mirror_view_and_copy(Mem(), kfac::adapters::to_row_major_view(g)));
      }
      pre.set_gradient("vendor", w_space, b_space);

      pre.step();
      Kokkos::deep_copy(w_rows, w_space);  // the preconditioned gradient, back into the Eigen matrix
      kfac::adapters::copy_back(w_rows, w);
    }
    // The packed upper triangle of A (5 inputs and the bias column: 6 x 6), as distribution sends it.
    using JacobiBlock = typename JacobiKfac::template block_type<kfac::Dense, double, Space>;
    const auto packed = pre.template layer_as<JacobiBlock>("jacobi").packed_factor(0);
    require(packed.extent(0) == 21, "the packed factor of a 6 x 6 A holds 21 values");
  }
}

// ---- NG-SGD per rank, with the parameters averaged across ranks (Kaldi's recipe) ------------------------------

/// A Dense layer preconditioned by NG-SGD under kfac::Independent (nothing sent per step), its parameters averaged
/// over the ranks every other step by a ParameterAverager in the same memory space.
template <class Space>
void ngsgd_with_averaging(const kfac::MpiComm& comm) {
  using Pre = kfac::Preconditioner<double, Space, kfac::MpiComm, kfac::Independent>;
  Pre pre(kfac::Options{}.with_kl_clip(0.0), Space{}, comm);
  pre.register_layer("fc", kfac::Dense(6, 5), kfac::NGSGD{}.with_rank(2).with_update_period(1));
  Numbers data{std::uint64_t(31 + comm.rank())};
  const auto weight = filled<V2<Space>>(data, 5, 6);  // this rank's parameters, which the averager makes equal
  const auto bias = filled<V1<Space>>(data, 5);
  kfac::ParameterAverager<kfac::MpiComm, Space> averager(comm, 2);
  averager.add(weight);
  averager.add(bias);
  for (int step = 0; step < 4; ++step) {
    Kept<Space> kept;
    feed_dense(pre, "fc", 6, 5, data, data, kept);
    pre.step();
    averager.maybe_average(step);
  }
  require(averager.averages() == 2, "two averages in four steps, every second step");
}

// ---- sequence layers: Dense over tokens (K-FAC-reduce), LayerNorm and Embedding ----------------------------------

template <class Space>
using V3 = Kokkos::View<double***, Kokkos::LayoutRight, typename Space::memory_space>;

/// Two steps of a Dense layer over (batch, tokens, in) with Tokens::reduce (its averaged input rows and summed
/// output-gradient rows), of a LayerNorm over (batch, tokens, D) (its per-feature products), and of two Embeddings
/// over (batch, tokens) ids (the ids' check and counts, the masked output-gradient rows, G's eigenbasis apply; a
/// diagonal G's closed form).
template <class Space>
void sequence_layers(const kfac::MpiComm& comm) {
  using Pre = kfac::Preconditioner<double, Space, kfac::MpiComm>;
  Pre pre(kfac::Options{}.with_kl_clip(0.0), Space{}, comm);
  pre.register_layer("seq", kfac::Dense(4, 3).with_tokens(kfac::Dense::Tokens::reduce));
  pre.register_layer("norm", kfac::LayerNorm(4));
  pre.register_layer("tok", kfac::Embedding(6, 4).with_padding_index(0));
  pre.register_layer("tok_diag", kfac::Embedding(6, 4), kfac::EmbeddingFisher<kfac::Diagonal>{});
  pre.register_layer("param", kfac::Parameter(6, 4));  // the diagonal Fisher's square, update and solve
  V2<Space> ids("kernel_coverage::ids", kBatch, 5);  // valid ids, from the host
  const auto host_ids = Kokkos::create_mirror_view(ids);
  for (std::size_t i = 0; i < host_ids.span(); ++i) host_ids.data()[i] = double((i + std::size_t(comm.rank())) % 6);
  Kokkos::deep_copy(ids, host_ids);
  Numbers data{std::uint64_t(41 + comm.rank())};
  for (int step = 0; step < 2; ++step) {
    Kept<Space> kept;
    const auto x = filled<V3<Space>>(data, kBatch, 5, 4);
    pre.observe_input("seq", x);
    pre.observe_output_grad("seq", filled<V3<Space>>(data, kBatch, 5, 3));
    pre.observe_input("norm", x);
    pre.observe_output_grad("norm", filled<V3<Space>>(data, kBatch, 5, 4));
    kept.m.push_back(filled<V2<Space>>(data, 3, 4));
    kept.v.push_back(filled<V1<Space>>(data, 3));
    pre.set_gradient("seq", kept.m.back(), kept.v.back());
    kept.v.push_back(filled<V1<Space>>(data, 4));
    kept.v.push_back(filled<V1<Space>>(data, 4));
    pre.set_gradient("norm", kept.v[1], kept.v[2]);
    for (const char* name : {"tok", "tok_diag"}) {
      pre.observe_input(name, ids);
      pre.observe_output_grad(name, filled<V3<Space>>(data, kBatch, 5, 4));
      kept.m.push_back(filled<V2<Space>>(data, 6, 4));
      pre.set_gradient(name, kept.m.back());
    }
    pre.observe_output_grad("param", filled<V1<Space>>(data, kBatch));
    kept.m.push_back(filled<V2<Space>>(data, 6, 4));
    pre.set_gradient("param", kept.m.back());
    pre.step();
  }
  require(pre.step_count() == 2, "two steps of the sequence layers");
}

// ---- the FDG pipeline (host memory only) ----------------------------------------------------------------------

/// The smallest stage kfac::Pipeline accepts: y = s x over 3 features, s trained by plain SGD.
struct ScaleStage {
  using scalar_type = double;
  using tensor = kfac::StageTensor<double>;

  double scale = 1.0, grad = 0.0;
  int input_features() const { return 3; }
  int output_features() const { return 3; }
  tensor forward(long, const tensor& x) {
    tensor y("kernel_coverage::y", x.extent(0), x.extent(1));
    for (std::size_t i = 0; i < x.span(); ++i) y.data()[i] = scale * x.data()[i];
    return y;
  }
  tensor backward(long, const tensor& x, const tensor& dy, bool need_input_grad) {
    grad = 0.0;
    for (std::size_t i = 0; i < x.span(); ++i) grad += x.data()[i] * dy.data()[i];
    if (!need_input_grad) return tensor();
    tensor dx("kernel_coverage::dx", dy.extent(0), dy.extent(1));
    for (std::size_t i = 0; i < dy.span(); ++i) dx.data()[i] = scale * dy.data()[i];
    return dx;
  }
  void apply_update(long) { scale -= 0.01 * grad; }
};

/// One epoch of 4 batches through a pipeline of one stage per rank, under FDG and under the synchronous schedule.
void pipeline(const kfac::MpiComm& comm) {
  using Tensor = ScaleStage::tensor;
  for (const auto schedule : {kfac::PipelineSchedule::fdg, kfac::PipelineSchedule::synchronous}) {
    ScaleStage stage;
    kfac::Pipeline<ScaleStage> pipe(comm, stage,
                                    kfac::PipelineOptions{}.with_batch_size(4).with_beta(0.5).with_schedule(schedule));
    const auto input = [](long batch) {
      Numbers rng(std::uint64_t(41 + batch));
      Tensor x("kernel_coverage::x", 4, 3);
      for (std::size_t i = 0; i < x.span(); ++i) x.data()[i] = rng.uniform();
      return x;
    };
    const auto loss = [](long, const Tensor& y) {  // the gradient of |y|^2 / 2
      Tensor dy("kernel_coverage::dy", y.extent(0), y.extent(1));
      Kokkos::deep_copy(dy, y);
      return dy;
    };
    require(pipe.train(4, input, loss).batches == 4, "the pipeline ran 4 batches");
  }
}

// ---- the cost model --------------------------------------------------------------------------------------------

/// Layers described by the blocks register_layer would build (the randomized eigensolver's stated work
/// included), priced with machine figures measured by the library's own linear algebra at the smallest size.
void cost_model(const kfac::MpiComm& comm) {
  kfac::CostModel model;
  model.add("fc", kfac::Dense(5, 4), kfac::KFAC<>{});
  model.add("randomized", kfac::Dense(40, 30),
            kfac::KFAC<kfac::Symmetric, Randomized>(Randomized{}.with_rank(8).with_oversampling(4)));
  model.add("conv", kfac::Conv2d(2, 3, 3, 3).with_padding(1, 1), kfac::KFAC<>{});
  model.add("ngsgd", kfac::Dense(6, 5), kfac::NGSGD{}.with_rank(2));
  const kfac::MachineFigures figures = kfac::measure_machine_figures(Device(), comm, 64, 1);
  const auto prediction = kfac::CostModel(model.layers(), figures).predict(comm.size());
  require(prediction.ranks.size() == std::size_t(comm.size()), "one cost per rank");
}

/// Self-tuning K-FAC: two solves (the second with momentum) from products of every loss curvature, a
/// damping update, over the ranks.
template <class Space>
void self_tuning(const kfac::MpiComm& comm, Numbers& data) {
  kfac::SelfTuning<double, Space, kfac::MpiComm> tune(kfac::Adaptive{}.with_update_interval(1), Space(), comm);
  auto w = filled<V2<Space>>(data, 4, 3);
  auto b = filled<V1<Space>>(data, 4);
  tune.add_parameter("w", w);
  tune.add_parameter("b", b);
  const kfac::LossCurvature kinds[2] = {kfac::LossCurvature::softmax_cross_entropy,
                                        kfac::LossCurvature::sigmoid_cross_entropy};
  for (int step = 0; step < 2; ++step) {
    tune.capture_gradient();
    kfac::OutputProducts<double, Space> prod;
    prod.loss = kinds[step];
    prod.outputs = filled<V2<Space>>(data, kBatch, 3);
    prod.along_proposal = filled<V2<Space>>(data, kBatch, 3);
    if (tune.needs_previous_product()) prod.along_previous = filled<V2<Space>>(data, kBatch, 3);
    tune.solve(prod);
    tune.update_damping(1.0, 0.5);
  }
  require(tune.solves() == 2 && tune.damping_updates() == 2, "two solves and damping updates");
}

/// The preconditioner parts in one execution space.
template <class Space>
void preconditioners(const kfac::MpiComm& comm) {
  kaisa_and_inversions<Space>(comm);
  ngsgd_with_averaging<Space>(comm);
  sequence_layers<Space>(comm);
  Numbers data(71);
  self_tuning<Space>(comm, data);
}

}  // namespace

int main(int argc, char* argv[]) {
  int provided = 0, rank = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Kokkos::initialize(argc, argv);
  try {
    const kfac::MpiComm comm(MPI_COMM_WORLD);
    preconditioners<Device>(comm);
    if constexpr (!std::is_same<Device, Host>::value) preconditioners<Host>(comm);
    pipeline(comm);
    cost_model(comm);
  } catch (const std::exception& e) {
    // Another rank may be waiting in a collective: stop them all.
    std::fprintf(stderr, "kernel_coverage: rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  Kokkos::finalize();
  if (rank == 0) std::printf("kernel_coverage: ok\n");
  MPI_Finalize();
  return 0;
}
