// The LibTorch adapter under MPI (TorchOptions::with_mpi): data-parallel preconditioned gradients
// equal the single-process result on the whole batch; a module not observed on one rank is an
// error on every rank, never a hang (run under ctest's timeout).
#include <kfac/adapters/torch.hpp>
// LibTorch's logging (glog) defines CHECK; the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>
#include <mpi.h>

namespace {

int rank_in() { int r = 0; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int size_of() { int s = 1; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }
bool everywhere(bool b) {
  int mine = b ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

using kfac::adapters::observed;
using kfac::adapters::TorchOptions;
using kfac::adapters::TorchPreconditioner;

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 5));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(5, 3).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x, bool observe_fc2 = true) {
    const at::Tensor h = torch::relu(observed(fc1, x));
    return observe_fc2 ? observed(fc2, h) : fc2(h);
  }
};
TORCH_MODULE(Mlp);

kfac::Options options() { return kfac::Options{}.with_damping(3e-2).with_kl_clip(1e-2).with_inv_update_steps(2); }

Mlp make_model() {
  torch::manual_seed(21);  // the same initialisation everywhere
  Mlp m;
  m->to(at::kDouble);
  return m;
}

void average_gradients(torch::nn::Module& m, int world) {
  for (auto& p : m.parameters()) {
    at::Tensor g = p.grad();
    MPI_Allreduce(MPI_IN_PLACE, g.data_ptr<double>(), int(g.numel()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    g.div_(world);
  }
}

}  // namespace

TEST_CASE("torch adapter under MPI equals one process on the whole batch", "[torch][mpi]") {
  torch::set_num_threads(1);
  const int rank = rank_in(), world = size_of();
  const int per_rank = 4;
  Mlp dist = make_model(), whole = make_model();
  TorchPreconditioner kp(*dist, options(), TorchOptions{}.with_mpi(kfac::MpiComm(MPI_COMM_WORLD)));
  TorchPreconditioner ref(*whole, options());
  CHECK_NOTHROW(kp.preconditioner<double, kfac::MpiComm>());
  CHECK_THROWS_AS(kp.preconditioner<double>(), kfac::Error);
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);  // the same global batch on every rank
    const at::Tensor x = torch::randn({per_rank * world, 6}, at::kDouble);
    const at::Tensor y = torch::randint(0, 3, {per_rank * world}, at::kLong);
    dist->zero_grad();
    whole->zero_grad();
    const at::Tensor xs = x.slice(0, rank * per_rank, (rank + 1) * per_rank), ys = y.slice(0, rank * per_rank, (rank + 1) * per_rank);
    torch::nn::functional::cross_entropy(dist->forward(xs), ys).backward();
    average_gradients(*dist, world);  // = the whole batch's mean gradient
    kp.precondition();
    torch::nn::functional::cross_entropy(whole->forward(x), y).backward();
    ref.precondition();
    INFO("rank " << rank << ", step " << step);
    CHECK(torch::allclose(dist->fc1->weight.grad(), whole->fc1->weight.grad(), 1e-10, 1e-13));
    CHECK(torch::allclose(dist->fc1->bias.grad(), whole->fc1->bias.grad(), 1e-10, 1e-13));
    CHECK(torch::allclose(dist->fc2->weight.grad(), whole->fc2->weight.grad(), 1e-10, 1e-13));
  }
}

TEST_CASE("torch adapter under MPI: a module not observed on one rank fails on every rank", "[torch][mpi][errors]") {
  torch::set_num_threads(1);
  const int rank = rank_in(), world = size_of();
  Mlp m = make_model();
  TorchPreconditioner kp(*m, options(), TorchOptions{}.with_mpi(kfac::MpiComm(MPI_COMM_WORLD)));
  const bool faulty = rank == world - 1;
  torch::nn::functional::cross_entropy(m->forward(torch::randn({4, 6}, at::kDouble), !faulty), torch::randint(0, 3, {4}, at::kLong))
      .backward();
  average_gradients(*m, world);
  std::string what, layer = "(none)";
  try {
    kp.precondition();
  } catch (const kfac::Error& e) {
    what = e.what();
    layer = e.layer();
  }
  INFO(what);
  CHECK(everywhere(!what.empty()));
  if (faulty) CHECK(layer == "fc2");
  else CHECK(what.find("another rank") != std::string::npos);
  CHECK(kp.step_count() == 0);
  // The next step, observed everywhere, works everywhere.
  m->zero_grad();
  torch::nn::functional::cross_entropy(m->forward(torch::randn({4, 6}, at::kDouble)), torch::randint(0, 3, {4}, at::kLong)).backward();
  average_gradients(*m, world);
  CHECK_NOTHROW(kp.precondition());
  CHECK(kp.step_count() == 1);
}
