/// \file main.cpp
/// \brief Fashion-MNIST with LibTorch: a CNN with BatchNorm trained by torch::optim::SGD, by
/// the same SGD with kfac's LibTorch adapter preconditioning the gradients, and by Adam, from
/// the same initialisation and batch order; the same progress line, CSV log, summary and plot
/// as the main demo (examples/fashion_mnist).
///
/// What K-FAC adds to a LibTorch training loop is marked "kfac:" below: one object built from the
/// model, observed() around the modules' calls in forward(), precondition() after backward().

#include <kfac/adapters/torch.hpp>

#include "common/idx_reader.hpp"
#include "fashion_mnist/report.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

/// The main demo's CNN (examples/common/network.hpp, make_cnn) in LibTorch.
struct CnnImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr};
  CnnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(32));
    fc = register_module("fc", torch::nn::Linear(32 * 7 * 7, 10));
  }
  at::Tensor forward(at::Tensor x) {
    using kfac::adapters::observed;  // kfac: observed(m, x) instead of m(x)
    x = torch::max_pool2d(torch::relu(observed(bn1, observed(conv1, x))), 2);
    x = torch::max_pool2d(torch::relu(observed(bn2, observed(conv2, x))), 2);
    return observed(fc, x.flatten(1));
  }
};
TORCH_MODULE(Cnn);

struct Args {
  std::string optimizer = "sgd,adam,kfac";
  int epochs = 3;
  int batch = 256;
  std::map<std::string, std::vector<double>> lrs{{"sgd", {0.05}}, {"adam", {1e-3}}, {"kfac", {0.05}}};
  double momentum = 0.9;
  double damping = 0.1, kl_clip = 1e-3, factor_decay = 0.95;
  long factor_every = 10, inv_every = 100;
  std::vector<std::uint64_t> seeds{1};
  int threads = 0;
  std::string out = "results_libtorch";
  std::string data = "/usr/share/datasets/fashion-mnist";
  int train_subset = 0, test_subset = 0;
  double target_acc = 0.88;
};

void usage() {
  std::printf(
      "usage: libtorch_fashion_mnist [options]\n"
      "  --optimizer LIST           comma list of sgd, adam, kfac (default sgd,adam,kfac)\n"
      "  --epochs N                 epochs per run (default 3)\n"
      "  --batch N                  samples per step (default 256)\n"
      "  --lr-sgd L --lr-adam L --lr-kfac L   comma lists (defaults 0.05, 1e-3, 0.05)\n"
      "  --momentum X               SGD and SGD+kfac momentum (default 0.9)\n"
      "  --damping X --kl-clip X --factor-decay X --factor-every N --inv-every N\n"
      "                             kfac settings (default 0.1, 1e-3, 0.95, 10, 100)\n"
      "  --seeds A,B,...            initialisation and batch-order seeds (default 1)\n"
      "  --threads N                LibTorch and OpenBLAS threads (default: LibTorch's choice)\n"
      "  --out DIR                  log.csv and accuracy.png (default results_libtorch)\n"
      "  --data DIR                 Fashion-MNIST files (default /usr/share/datasets/fashion-mnist)\n"
      "  --train-subset N --test-subset N   the first N samples only\n"
      "  --target-acc X             accuracy for the time-to-target columns (default 0.88)\n"
      "  -h, --help                 this text\n");
}

std::vector<double> numbers(const std::string& key, const std::string& v) {
  std::vector<double> out;
  std::stringstream in(v);
  for (std::string item; std::getline(in, item, ',');) {
    std::size_t used = 0;
    double x = 0;
    try {
      x = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size()) throw std::invalid_argument(key + ": '" + item + "' is not a number");
    out.push_back(x);
  }
  if (out.empty()) throw std::invalid_argument(key + " needs a value");
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (key == "-h" || key == "--help") {
      usage();
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::invalid_argument(key + " needs a value");
    const std::string v = argv[++i];
    const double x = key == "--optimizer" || key == "--out" || key == "--data" || key == "--seeds" || key.rfind("--lr-", 0) == 0
                         ? 0.0 : numbers(key, v).front();
    if (key == "--optimizer") a.optimizer = v;
    else if (key == "--epochs") a.epochs = int(x);
    else if (key == "--batch") a.batch = int(x);
    else if (key == "--lr-sgd") a.lrs["sgd"] = numbers(key, v);
    else if (key == "--lr-adam") a.lrs["adam"] = numbers(key, v);
    else if (key == "--lr-kfac") a.lrs["kfac"] = numbers(key, v);
    else if (key == "--momentum") a.momentum = x;
    else if (key == "--damping") a.damping = x;
    else if (key == "--kl-clip") a.kl_clip = x;
    else if (key == "--factor-decay") a.factor_decay = x;
    else if (key == "--factor-every") a.factor_every = long(x);
    else if (key == "--inv-every") a.inv_every = long(x);
    else if (key == "--seeds") {
      a.seeds.clear();
      for (double s : numbers(key, v)) a.seeds.push_back(std::uint64_t(s));
    } else if (key == "--threads") a.threads = int(x);
    else if (key == "--out") a.out = v;
    else if (key == "--data") a.data = v;
    else if (key == "--train-subset") a.train_subset = int(x);
    else if (key == "--test-subset") a.test_subset = int(x);
    else if (key == "--target-acc") a.target_acc = x;
    else throw std::invalid_argument("unknown option " + key + " (see --help)");
  }
  if (a.epochs < 1 || a.batch < 1) throw std::invalid_argument("--epochs and --batch must be >= 1");
  return a;
}

struct Data {
  at::Tensor x, y;  ///< (N, 1, 28, 28) float normalised; (N) int64
  int size() const { return int(y.size(0)); }
};

/// The IDX files through the main demo's reader, normalised with the training set's mean and
/// standard deviation as the main demo does.
Data load(const std::string& dir, const std::string& split, int limit) {
  const nn::IdxArray im = nn::read_idx(dir + "/" + split + "-images-idx3-ubyte.gz");
  const nn::IdxArray lb = nn::read_idx(dir + "/" + split + "-labels-idx1-ubyte.gz");
  if (im.dims.size() != 3 || im.dims[1] != 28 || im.dims[2] != 28 || lb.dims.size() != 1 || lb.dims[0] != im.dims[0])
    throw std::runtime_error(dir + ": unexpected Fashion-MNIST shapes; " + nn::detail::idx_install_hint);
  int64_t n = int64_t(im.dims[0]);
  if (limit > 0 && limit < n) n = limit;
  Data d;
  d.x = torch::from_blob(const_cast<std::uint8_t*>(im.data.data()), {n, 1, 28, 28}, at::kByte).to(at::kFloat);
  d.x = (d.x / 255.0f - 0.2860f) / 0.3530f;
  d.y = torch::from_blob(const_cast<std::uint8_t*>(lb.data.data()), {n}, at::kByte).to(at::kLong);
  return d;
}

double evaluate(Cnn& model, const Data& test) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0;
  for (int64_t b = 0; b < test.size(); b += 1000) {
    const int64_t e = std::min<int64_t>(b + 1000, test.size());
    correct += model->forward(test.x.slice(0, b, e)).argmax(1).eq(test.y.slice(0, b, e)).sum().item<int64_t>();
  }
  model->train();
  return double(correct) / double(test.size());
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

demo::RunSummary train_one(const Args& a, const std::string& name, double lr, std::uint64_t seed, const Data& train,
                           const Data& test, demo::CsvLog& log) {
  torch::manual_seed(seed);  // the same initialisation for every optimizer
  Cnn model;
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (name == "adam") opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(lr));
  else opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(lr).momentum(a.momentum));
  std::unique_ptr<kfac::adapters::TorchPreconditioner> kfac_pre;
  if (name == "kfac")  // kfac: built from the model
    kfac_pre = std::make_unique<kfac::adapters::TorchPreconditioner>(
        *model, kfac::Options{}.with_lr(lr).with_damping(a.damping).with_kl_clip(a.kl_clip)
                    .with_factor_decay(a.factor_decay).with_factor_update_steps(a.factor_every)
                    .with_inv_update_steps(a.inv_every));

  const int batch = std::min(a.batch, train.size());
  const int steps = train.size() / batch;
  const int per_epoch = std::min(steps, 4);
  std::printf("[%s] lr %g, seed %llu, %d steps/epoch of %d samples, test %d times per epoch\n", name.c_str(), lr,
              (unsigned long long)seed, steps, batch, per_epoch);
  demo::RunSummary run{name, lr, seed, steps, {}, 0.0, 0.0, 0.0, false};
  demo::Progress progress;
  const Clock::time_point start = Clock::now();
  double train_s = 0, loss_since = 0;
  long step = 0, since = 0;
  auto record = [&](int epoch) {
    run.evals.push_back({epoch, step, train_s, since ? loss_since / double(since) : std::numeric_limits<double>::quiet_NaN(),
                         evaluate(model, test)});
    log.row(run, run.evals.back());
    loss_since = 0;
    since = 0;
  };
  record(0);
  std::vector<int64_t> order(std::size_t(train.size()));
  const long total = long(steps) * a.epochs;
  for (int epoch = 1; epoch <= a.epochs && !run.stopped; ++epoch) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed * 1000003ULL + std::uint64_t(epoch)));
    const at::Tensor perm = torch::from_blob(order.data(), {int64_t(order.size())}, at::kLong);
    double epoch_loss = 0;
    int64_t epoch_correct = 0, epoch_seen = 0;
    for (int i = 0; i < steps; ++i) {
      const at::Tensor idx = perm.slice(0, int64_t(i) * batch, int64_t(i + 1) * batch);
      const at::Tensor x = train.x.index_select(0, idx), y = train.y.index_select(0, idx);
      const Clock::time_point t0 = Clock::now();
      const std::clock_t c0 = std::clock();
      std::string failure;
      double loss_value = 0;
      try {
        opt->zero_grad();
        const at::Tensor logits = model->forward(x);
        const at::Tensor loss = torch::nn::functional::cross_entropy(logits, y);
        loss.backward();
        if (kfac_pre) kfac_pre->precondition();  // kfac: between backward() and step()
        opt->step();
        loss_value = loss.item<double>();
        epoch_correct += logits.argmax(1).eq(y).sum().item<int64_t>();
        if (!std::isfinite(loss_value)) failure = "the training loss is not finite (try a smaller lr)";
      } catch (const std::exception& e) {
        failure = e.what();
      }
      train_s += seconds_since(t0);
      run.train_cpu_s += double(std::clock() - c0) / CLOCKS_PER_SEC;
      ++step;
      if (!failure.empty()) {
        progress.finish("[" + name + "] stopped at step " + std::to_string(step) + ": " + failure);
        run.stopped = true;
        break;
      }
      epoch_loss += loss_value;
      epoch_seen += batch;
      loss_since += loss_value;
      ++since;
      if ((i + 1) * per_epoch / steps != i * per_epoch / steps) record(epoch);
      const double wall = seconds_since(start);
      char line[256];
      std::snprintf(line, sizeof line,
                    "[%s] epoch %d/%d step %d/%d  loss %.4f  train acc %.2f%%  test acc %.2f%%  %.0f samples/s  train %s  ETA %s",
                    name.c_str(), epoch, a.epochs, i + 1, steps, epoch_loss / double(i + 1),
                    100.0 * double(epoch_correct) / double(epoch_seen), 100 * run.evals.back().test_acc,
                    double(step) * batch / train_s, demo::format_seconds(train_s).c_str(),
                    demo::format_seconds(wall / double(step) * double(total - step)).c_str());
      if (i + 1 == steps) progress.finish(line);
      else progress.update(line, wall);
    }
  }
  run.train_s = train_s;
  run.total_s = seconds_since(start);
  return run;
}

int run(const Args& a) {
  if (a.threads > 0) torch::set_num_threads(a.threads);
  demo::make_output_dir(a.out);
  const Data train = load(a.data, "train", a.train_subset), test = load(a.data, "t10k", a.test_subset);
  std::printf("Fashion-MNIST with LibTorch %s (CPU, %d threads): %d training and %d test images; CNN with BatchNorm, batch %d\n"
              "times count training steps only (test evaluations are excluded)\n",
              TORCH_VERSION, torch::get_num_threads(), train.size(), test.size(), a.batch);
  demo::CsvLog log(a.out + "/log.csv", false);
  std::vector<demo::RunSummary> runs;
  std::vector<std::string> names;
  std::stringstream in(a.optimizer);
  for (std::string n; std::getline(in, n, ',');) {
    if (n != "sgd" && n != "adam" && n != "kfac") throw std::invalid_argument("--optimizer: unknown '" + n + "'");
    names.push_back(n);
  }
  for (const auto& n : names)
    for (double lr : a.lrs.at(n))
      for (std::uint64_t seed : a.seeds) runs.push_back(train_one(a, n, lr, seed, train, test, log));
  demo::print_summary(runs, a.target_acc);
  std::printf("log: %s\n", log.path().c_str());
  const auto groups = demo::group_runs(runs);
  std::vector<const demo::RunSummary*> shown;
  for (const auto& n : names) {
    const demo::Group* g = demo::best_group(groups, n, a.target_acc);
    for (const auto& x : groups)
      if (!g && x.optimizer == n) g = &x;
    if (g) shown.push_back(g->runs.front());
  }
  demo::plot(a.out, log.path(), shown,
             "Fashion-MNIST, LibTorch CNN, batch " + std::to_string(a.batch) + ", seed " + std::to_string(a.seeds.front()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_fashion_mnist: %s\n", e.what());
    return 2;
  }
  int kokkos_argc = 1;  // Kokkos 3.4 would claim --threads as its own
  Kokkos::ScopeGuard kokkos(kokkos_argc, argv);
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
