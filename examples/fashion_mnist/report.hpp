#pragma once
/// \file report.hpp
/// \brief What the demo prints and writes: the progress line, the CSV log, the summary table
/// and the gnuplot figure.

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

namespace demo {

/// \brief One test-set evaluation during a run.
struct EvalPoint {
  int epoch;          ///< 1-based epoch it happened in; 0 before training
  long step;          ///< optimizer steps taken so far
  double wall_s;      ///< training time so far (evaluation excluded)
  double train_loss;  ///< mean training loss since the previous evaluation; NaN before training
  double test_acc;
};

struct RunSummary {
  std::string optimizer;
  double lr = 0.0;
  unsigned long long seed = 0;
  int steps_per_epoch = 1;
  std::vector<EvalPoint> evals;
  double train_s = 0.0;  ///< training only
  double total_s = 0.0;  ///< training and evaluation
  /// Process CPU time of the training steps, all threads: on a shared machine with one BLAS
  /// thread it shows what the wall time would be without the other load.
  double train_cpu_s = 0.0;
  bool stopped = false;  ///< ended early: non-finite loss or a failed step

  double final_acc() const { return evals.empty() ? 0.0 : evals.back().test_acc; }
  double best_acc() const {
    double b = 0.0;
    for (const auto& e : evals) b = e.test_acc > b ? e.test_acc : b;
    return b;
  }
  /// \brief Training time at the first evaluation reaching `target`; NaN if none did.
  double time_to(double target) const {
    for (const auto& e : evals)
      if (e.test_acc >= target) return e.wall_s;
    return std::numeric_limits<double>::quiet_NaN();
  }
  /// \brief Epochs trained (fractional) at the first evaluation reaching `target`; NaN if none did.
  double epochs_to(double target) const {
    for (const auto& e : evals)
      if (e.test_acc >= target) return double(e.step) / double(steps_per_epoch);
    return std::numeric_limits<double>::quiet_NaN();
  }
};

/// \brief "0.05", "0.001": a learning rate as the log, the plot and the tables write it.
inline std::string format_lr(double lr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", lr);
  return buf;
}

/// \brief Mean and sample standard deviation (0 for fewer than two values).
struct Spread {
  double mean = std::numeric_limits<double>::quiet_NaN(), sd = 0.0;
  int n = 0;
};
inline Spread spread(const std::vector<double>& v) {
  Spread s;
  s.n = int(v.size());
  if (v.empty()) return s;
  double sum = 0.0;
  for (double x : v) sum += x;
  s.mean = sum / double(v.size());
  if (v.size() > 1) {
    double sq = 0.0;
    for (double x : v) sq += (x - s.mean) * (x - s.mean);
    s.sd = std::sqrt(sq / double(v.size() - 1));
  }
  return s;
}

inline std::string format_seconds(double s) {
  char buf[32];
  if (!std::isfinite(s)) return "-";
  if (s < 60) std::snprintf(buf, sizeof buf, "%.1fs", s);
  else std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  return buf;
}

/// \brief A status line that redraws in place on a terminal and prints once per call to
/// finish() otherwise, so that logs piped to a file stay readable.
class Progress {
 public:
  Progress() : tty_(isatty(fileno(stdout)) != 0) {}

  bool is_tty() const { return tty_; }

  /// \brief Shows `line` now if on a terminal (at most every 0.1 s of `clock_s`).
  void update(const std::string& line, double clock_s) {
    if (!tty_ || clock_s - last_draw_ < 0.1) return;
    last_draw_ = clock_s;
    std::printf("\r%s\033[K", line.c_str());
    std::fflush(stdout);
  }

  /// \brief Leaves `line` on the screen as a finished line.
  void finish(const std::string& line) {
    std::printf(tty_ ? "\r%s\033[K\n" : "%s\n", line.c_str());
    std::fflush(stdout);
    last_draw_ = -1.0;
  }

 private:
  bool tty_;
  double last_draw_ = -1.0;
};

/// \brief Creates `dir` and every missing folder above it (an existing one is fine); throws
/// naming the folder when it cannot, before any training starts.
inline void make_output_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir))
    throw std::runtime_error("cannot create the output folder " + dir + (ec ? ": " + ec.message() : std::string()));
}

/// \brief The CSV log: optimizer,seed,lr,epoch,step,wall_s,train_loss,test_acc (train_loss is
/// empty on the row written before training).
class CsvLog {
 public:
  CsvLog(const std::string& path, bool append) : path_(path) {
    bool has_header = false;
    if (append) {
      std::ifstream in(path);
      std::string first;
      has_header = bool(std::getline(in, first)) && first == header();
    }
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) throw std::runtime_error("cannot write " + path);
    if (append && !has_header && std::ifstream(path).peek() != std::ifstream::traits_type::eof())
      throw std::runtime_error(path + " has another format; remove it or write to another --out");
    if (!has_header) out_ << header() << "\n";
    out_.flush();
  }

  static std::string header() { return "optimizer,seed,lr,epoch,step,wall_s,train_loss,test_acc"; }

  void row(const RunSummary& run, const EvalPoint& e) {
    char buf[256];
    char loss[32] = "";
    if (std::isfinite(e.train_loss)) std::snprintf(loss, sizeof loss, "%.6f", e.train_loss);
    std::snprintf(buf, sizeof buf, "%s,%llu,%s,%d,%ld,%.4f,%s,%.6f\n", run.optimizer.c_str(), run.seed,
                  format_lr(run.lr).c_str(), e.epoch, e.step, e.wall_s, loss, e.test_acc);
    out_ << buf;
    out_.flush();
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

/// \brief One row per run: accuracy, time and epochs to `target`, training time.
inline void print_runs(const std::vector<RunSummary>& runs, double target) {
  std::printf("\nRuns (train time: wall clock of the training steps only, evaluation excluded)\n");
  char to_target[32], ep_target[32];
  std::snprintf(to_target, sizeof to_target, "time to %.1f%%", 100 * target);
  std::snprintf(ep_target, sizeof ep_target, "epochs to %.1f%%", 100 * target);
  std::printf("%-9s %8s %5s %10s %10s %14s %15s %11s %11s\n", "optimizer", "lr", "seed", "final acc", "best acc",
              to_target, ep_target, "train time", "train CPU");
  for (const auto& r : runs) {
    const double t = r.time_to(target), ep = r.epochs_to(target);
    char epochs[32] = "-";
    if (std::isfinite(ep)) std::snprintf(epochs, sizeof epochs, "%.2f", ep);
    std::printf("%-9s %8s %5llu %9.2f%% %9.2f%% %14s %15s %11s %11s%s\n", r.optimizer.c_str(), format_lr(r.lr).c_str(),
                r.seed, 100 * r.final_acc(), 100 * r.best_acc(),
                std::isfinite(t) ? format_seconds(t).c_str() : "not reached", epochs,
                format_seconds(r.train_s).c_str(), format_seconds(r.train_cpu_s).c_str(),
                r.stopped ? "  (stopped early)" : "");
  }
}

/// \brief The runs of one optimizer at one learning rate (over seeds).
struct Group {
  std::string optimizer;
  double lr = 0.0;
  std::vector<const RunSummary*> runs;
  int reached(double target) const {
    int n = 0;
    for (const auto* r : runs) n += std::isfinite(r->time_to(target)) ? 1 : 0;
    return n;
  }
  Spread time_to(double target) const {
    std::vector<double> v;
    for (const auto* r : runs)
      if (std::isfinite(r->time_to(target))) v.push_back(r->time_to(target));
    return spread(v);
  }
  Spread epochs_to(double target) const {
    std::vector<double> v;
    for (const auto* r : runs)
      if (std::isfinite(r->epochs_to(target))) v.push_back(r->epochs_to(target));
    return spread(v);
  }
  Spread final_acc() const {
    std::vector<double> v;
    for (const auto* r : runs) v.push_back(r->final_acc());
    return spread(v);
  }
  Spread seconds_per_epoch() const {
    std::vector<double> v;
    for (const auto* r : runs)
      if (!r->evals.empty() && r->evals.back().step > 0)
        v.push_back(r->train_s * double(r->steps_per_epoch) / double(r->evals.back().step));
    return spread(v);
  }
};

inline std::vector<Group> group_runs(const std::vector<RunSummary>& runs) {
  std::vector<Group> groups;
  for (const auto& r : runs) {
    Group* g = nullptr;
    for (auto& x : groups)
      if (x.optimizer == r.optimizer && x.lr == r.lr) g = &x;
    if (!g) {
      groups.push_back({r.optimizer, r.lr, {}});
      g = &groups.back();
    }
    g->runs.push_back(&r);
  }
  return groups;
}

/// \brief The best learning rate of `optimizer`: every seed reached the target, and the mean
/// time to it is the smallest; nullptr when no learning rate got every seed there.
inline const Group* best_group(const std::vector<Group>& groups, const std::string& optimizer, double target) {
  const Group* best = nullptr;
  for (const auto& g : groups) {
    if (g.optimizer != optimizer || g.reached(target) != int(g.runs.size())) continue;
    if (!best || g.time_to(target).mean < best->time_to(target).mean) best = &g;
  }
  return best;
}

inline std::string format_spread(const Spread& s, const char* unit, double scale = 1.0, int digits = 1) {
  if (s.n == 0) return "-";
  char buf[64];
  if (s.n == 1) std::snprintf(buf, sizeof buf, "%.*f%s", digits, scale * s.mean, unit);
  else std::snprintf(buf, sizeof buf, "%.*f ± %.*f%s", digits, scale * s.mean, digits, scale * s.sd, unit);
  return buf;
}

/// \brief Means over seeds per optimizer and learning rate, the best learning rate of each
/// optimizer, and K-FAC's time to the target against the better of SGD and Adam.
inline void print_summary(const std::vector<RunSummary>& runs, double target) {
  print_runs(runs, target);
  const std::vector<Group> groups = group_runs(runs);
  std::printf("\nSummary over seeds (mean ± sample standard deviation; times and epochs of the runs that reached "
              "%.1f%%)\n", 100 * target);
  std::printf("%-9s %8s %6s %9s %18s %15s %16s %12s\n", "optimizer", "lr", "seeds", "reached", "time to target",
              "epochs to target", "final acc", "s/epoch");
  for (const auto& g : groups) {
    char reached[16];
    std::snprintf(reached, sizeof reached, "%d/%d", g.reached(target), int(g.runs.size()));
    std::printf("%-9s %8s %6d %9s %18s %15s %16s %12s\n", g.optimizer.c_str(), format_lr(g.lr).c_str(),
                int(g.runs.size()), reached, format_spread(g.time_to(target), "s").c_str(),
                format_spread(g.epochs_to(target), "", 1.0, 2).c_str(), format_spread(g.final_acc(), "%", 100.0, 2).c_str(),
                format_spread(g.seconds_per_epoch(), "s", 1.0, 2).c_str());
  }
  const Group* kfac = best_group(groups, "kfac", target);
  const Group* sgd = best_group(groups, "sgd", target);
  const Group* adam = best_group(groups, "adam", target);
  const Group* ngsgd = best_group(groups, "ngsgd", target);
  const Group* rival = sgd && adam ? (sgd->time_to(target).mean <= adam->time_to(target).mean ? sgd : adam)
                                   : (sgd ? sgd : adam);
  std::printf("\n");
  for (const Group* g : {sgd, adam, kfac, ngsgd})
    if (g) std::printf("best lr of %s: %s (time to %.1f%%: %s)\n", g->optimizer.c_str(), format_lr(g->lr).c_str(),
                       100 * target, format_spread(g->time_to(target), "s").c_str());
  if (kfac && rival)
    std::printf("K-FAC reaches %.1f%% in %.2fx the time of %s (best lr of each, means over seeds)\n", 100 * target,
                kfac->time_to(target).mean / rival->time_to(target).mean, rival->optimizer.c_str());
  if (ngsgd && sgd)
    std::printf("NG-SGD reaches %.1f%% in %.2f epochs against SGD's %.2f, %.2fx its time; s/epoch %.2fx SGD's "
                "(best lr of each, means over seeds)\n", 100 * target, ngsgd->epochs_to(target).mean,
                sgd->epochs_to(target).mean, ngsgd->time_to(target).mean / sgd->time_to(target).mean,
                ngsgd->seconds_per_epoch().mean / sgd->seconds_per_epoch().mean);
}

/// \brief Writes `dir/accuracy.gp` and runs gnuplot on it to draw `dir/accuracy.png`: test
/// accuracy and training loss against training wall time, one line per run in `runs`.
/// \return false (after printing why) if gnuplot is missing or failed; the run still counts.
inline bool plot(const std::string& dir, const std::string& csv, const std::vector<const RunSummary*>& runs,
                 const std::string& title) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::printf("note: gnuplot not found, skipping %s/accuracy.png (apt-get install gnuplot-nox)\n", dir.c_str());
    return false;
  }
  const std::string script = dir + "/accuracy.gp", png = dir + "/accuracy.png";
  std::ofstream gp(script);
  if (!gp) {
    std::printf("note: cannot write %s, skipping the plot\n", script.c_str());
    return false;
  }
  // Rows before training (step 0) carry no loss, and their chance-level accuracy would squash the
  // accuracy axis, so both panels start at the first evaluation after training began.
  auto series = [&](const char* column) {
    std::string s;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      s += (i ? ", \\\n     " : "plot ");
      const std::string lr = format_lr(runs[i]->lr);
      s += "'" + csv + "' using 6:((strcol(1) eq '" + runs[i]->optimizer + "' && $2 == " +
           std::to_string(runs[i]->seed) + " && strcol(3) eq '" + lr + "' && $5 > 0) ? $" + column +
           " : 1/0) with linespoints pt 7 ps 0.5 lw 2 title '" + runs[i]->optimizer + " (lr " + lr + ")'";
    }
    return s + "\n";
  };
  gp << "# Generated by fashion_mnist; rerun with: gnuplot " << script << "\n"
     << "set terminal pngcairo size 1000,900 noenhanced\n"
     << "set output '" << png << "'\n"
     << "set datafile separator ','\n"
     << "set multiplot layout 2,1 title '" << title << "'\n"
     << "set grid\nset key bottom right\nset xrange [0:*]\n"
     << "set xlabel 'training wall time [s] (evaluation excluded)'\n"
     << "set ylabel 'test accuracy'\n"
     << series("8")
     << "set key top right\nset logscale y\nset ylabel 'training loss'\n"
     << series("7")
     << "unset multiplot\n";
  gp.close();
  if (std::system(("gnuplot '" + script + "'").c_str()) != 0) {
    std::printf("note: gnuplot failed on %s; the log is still in %s\n", script.c_str(), csv.c_str());
    return false;
  }
  std::printf("plot: %s\n", png.c_str());
  return true;
}

}  // namespace demo
