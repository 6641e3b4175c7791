#pragma once
/// \file report.hpp
/// \brief What the demo prints and writes: the progress line, the CSV log, the summary table
/// and the gnuplot figure.

#include <cmath>
#include <cstdio>
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
};

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

/// \brief The CSV log: optimizer,seed,epoch,step,wall_s,train_loss,test_acc (train_loss is empty
/// on the row written before training).
class CsvLog {
 public:
  CsvLog(const std::string& path, bool append) : path_(path) {
    bool has_header = false;
    if (append) {
      std::ifstream in(path);
      std::string first;
      has_header = bool(std::getline(in, first)) && first.rfind("optimizer,", 0) == 0;
    }
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) throw std::runtime_error("cannot write " + path);
    if (!has_header) out_ << "optimizer,seed,epoch,step,wall_s,train_loss,test_acc\n";
    out_.flush();
  }

  void row(const std::string& optimizer, unsigned long long seed, const EvalPoint& e) {
    char buf[256];
    char loss[32] = "";
    if (std::isfinite(e.train_loss)) std::snprintf(loss, sizeof loss, "%.6f", e.train_loss);
    std::snprintf(buf, sizeof buf, "%s,%llu,%d,%ld,%.4f,%s,%.6f\n", optimizer.c_str(), seed, e.epoch, e.step,
                  e.wall_s, loss, e.test_acc);
    out_ << buf;
    out_.flush();
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

inline void print_summary(const std::vector<RunSummary>& runs, double target) {
  std::printf("\nSummary (train time: wall clock of the training steps only, evaluation excluded)\n");
  char to_target[32];
  std::snprintf(to_target, sizeof to_target, "time to %.1f%%", 100 * target);
  std::printf("%-10s %10s %10s %14s %12s %12s %12s\n", "optimizer", "final acc", "best acc", to_target,
              "train time", "train CPU", "total time");
  for (const auto& r : runs) {
    const double t = r.time_to(target);
    std::printf("%-10s %9.2f%% %9.2f%% %14s %12s %12s %12s%s\n", r.optimizer.c_str(), 100 * r.final_acc(),
                100 * r.best_acc(), std::isfinite(t) ? format_seconds(t).c_str() : "not reached",
                format_seconds(r.train_s).c_str(), format_seconds(r.train_cpu_s).c_str(),
                format_seconds(r.total_s).c_str(),
                r.stopped ? "  (stopped early)" : "");
  }
}

/// \brief Writes `dir/accuracy.gp` and runs gnuplot on it to draw `dir/accuracy.png`: test
/// accuracy and training loss against training wall time, one line per optimizer of this run.
/// \return false (after printing why) if gnuplot is missing or failed; the run still counts.
inline bool plot(const std::string& dir, const std::string& csv, const std::vector<RunSummary>& runs,
                 unsigned long long seed, const std::string& title) {
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
      s += "'" + csv + "' using 5:((strcol(1) eq '" + runs[i].optimizer + "' && $2 == " + std::to_string(seed) +
           " && $4 > 0) ? $" + column + " : 1/0) with linespoints pt 7 ps 0.5 lw 2 title '" + runs[i].optimizer + "'";
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
     << series("7")
     << "set key top right\nset logscale y\nset ylabel 'training loss'\n"
     << series("6")
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
