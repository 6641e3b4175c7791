#!/usr/bin/env python3
"""Reads the runs of scripts/batch_scaling.sh and prints its table, plot and target lines.

  batch_scaling_report.py --report DIR [--quick]   table, DIR/epochs_to_target.png, targets
  batch_scaling_report.py --best RUNDIR TARGET     the best learning rate in one run folder
"""
import csv
import math
import os
import re
import shutil
import statistics
import subprocess
import sys

TARGET = {"mlp": 0.88, "cnn": 0.91}
HEADER = re.compile(r"^\[(\S+)\] lr (\S+), seed (\d+), (\d+) steps/epoch")
STOPPED = re.compile(r"^\[(\S+)\] stopped at step (\d+): (.*)")
# A row of the demo's runs table: name, lr, seed, final, best, time to target, epochs to target,
# train time, train CPU (process CPU time of the steps, all threads), maybe "(stopped early)".
RUNROW = re.compile(r"^(\S+\+lb)\s+(\S+)\s+(\d+)\s+[\d.]+%\s+[\d.]+%\s+.*\s(\S+)\s+(\S+?)(\s+\(stopped early\))?$")


def seconds(text):
    m = re.match(r"^(?:(\d+)m)?([\d.]+)s$", text)
    return (60 * int(m.group(1) or 0) + float(m.group(2))) if m else float("nan")


class Run:
    def __init__(self, model, batch, opt, lr, seed, spe):
        self.model, self.batch, self.opt, self.lr, self.seed, self.spe = model, batch, opt, lr, seed, spe
        self.evals = []  # (step, wall_s, train_loss or None, acc)
        self.stopped = None
        self.cpu_s = float("nan")

    def target(self):
        return TARGET[self.model]

    def reached(self):
        for step, wall, _, acc in self.evals:
            if acc >= self.target():
                return step / self.spe, step, wall
        return None

    def final_acc(self):
        return self.evals[-1][3] if self.evals else 0.0

    def best_acc(self):
        return max((e[3] for e in self.evals), default=0.0)

    def trained(self):
        """Epochs and training seconds of the whole run."""
        if not self.evals:
            return 0.0, 0.0
        step, wall = self.evals[-1][0], self.evals[-1][1]
        return step / self.spe, wall

    def s_per_epoch(self):
        epochs, wall = self.trained()
        return wall / epochs if epochs > 0 else float("nan")

    def cpu_per_epoch(self):
        epochs, _ = self.trained()
        return self.cpu_s / epochs if epochs > 0 else float("nan")

    def diverged(self):
        """Stopped on a non-finite loss or a failed step, or accuracy collapsed late in the run."""
        if self.stopped:
            return "stopped: " + self.stopped
        losses = [e[2] for e in self.evals if e[2] is not None]
        if any(not math.isfinite(x) for x in losses):
            return "non-finite training loss"
        if self.evals and self.best_acc() > 0.3 and self.final_acc() < 0.5 * self.best_acc():
            return "accuracy collapsed from %.1f%% to %.1f%%" % (100 * self.best_acc(), 100 * self.final_acc())
        if self.evals and self.final_acc() < 0.2 and len(self.evals) > 3:
            return "accuracy at chance (%.1f%%)" % (100 * self.final_acc())
        return None


def read_dir(d):
    name = os.path.basename(d.rstrip("/"))
    m = re.match(r"(mlp|cnn)_b(\d+)_(sgd|adam|kfac)_s", name)
    if not m:
        return []
    model, batch, opt = m.group(1), int(m.group(2)), m.group(3)
    runs, current = {}, None
    try:
        with open(os.path.join(d, "stdout.txt"), errors="replace") as f:
            for line in f:
                line = line.rstrip("\n").split("\r")[-1]
                h = HEADER.match(line)
                if h:
                    key = (h.group(1), h.group(2), int(h.group(3)))
                    current = runs.setdefault(key, Run(model, batch, opt, float(h.group(2)), int(h.group(3)), int(h.group(4))))
                s = STOPPED.match(line)
                if s and current is not None:
                    current.stopped = "step %s: %s" % (s.group(2), s.group(3))
                row = RUNROW.match(line)
                if row and (row.group(1), row.group(2), int(row.group(3))) in runs:
                    runs[(row.group(1), row.group(2), int(row.group(3)))].cpu_s = seconds(row.group(5))
    except FileNotFoundError:
        return []
    log = os.path.join(d, "log.csv")
    if os.path.exists(log):
        with open(log) as f:
            for row in csv.DictReader(f):
                key = (row["optimizer"], row["lr"], int(row["seed"]))
                if key not in runs:
                    continue
                loss = row["train_loss"]
                runs[key].evals.append((int(row["step"]), float(row["wall_s"]),
                                        float(loss) if loss not in ("", None) else None, float(row["test_acc"])))
    return list(runs.values())


def best_lr(runs):
    """The rate whose seed-1 run reached the target fastest, else the best final accuracy."""
    ok = [r for r in runs if not r.diverged()]
    reached = [r for r in ok if r.reached()]
    if reached:
        return min(reached, key=lambda r: r.reached()[2]).lr
    pool = ok or runs
    return max(pool, key=lambda r: r.final_acc()).lr if pool else None


def mean(v):
    return statistics.mean(v) if v else float("nan")


def fmt(x, digits=2, unit=""):
    return "-" if x is None or not math.isfinite(x) else ("%.*f%s" % (digits, x, unit))


def report(out, quick):
    runs = []
    rd = os.path.join(out, "runs")
    for name in sorted(os.listdir(rd)):
        runs += read_dir(os.path.join(rd, name))
    if not runs:
        print("no runs found under", rd)
        return 1

    print("\nEvery run (diverged runs are marked; epochs, steps and time to the target are of the first "
          "evaluation reaching it; times are training-step wall clock, evaluation excluded)")
    print("%-5s %6s %-5s %8s %4s %10s %8s %9s %9s %9s  %s" % ("model", "batch", "opt", "lr@256", "seed", "ep->tgt",
                                                             "steps", "time", "s/epoch", "final", "status"))
    for r in sorted(runs, key=lambda r: (r.model, r.batch, r.opt, r.lr, r.seed)):
        hit = r.reached()
        status = r.diverged()
        print("%-5s %6d %-5s %8g %4d %10s %8s %9s %9s %8.2f%%  %s" % (
            r.model, r.batch, r.opt, r.lr, r.seed, fmt(hit[0]) if hit else "not reached", str(hit[1]) if hit else "-",
            fmt(hit[2], 1, "s") if hit else "-", fmt(r.s_per_epoch(), 2, "s"), 100 * r.final_acc(),
            "DIVERGED (" + status + ")" if status else "ok"))

    # One row per model, batch and optimizer at its best rate (chosen on seed 1).
    groups = {}
    for r in runs:
        groups.setdefault((r.model, r.batch, r.opt), []).append(r)
    rows = {}
    for key, rs in groups.items():
        lr = best_lr([r for r in rs if r.seed == 1] or rs)
        chosen = [r for r in rs if r.lr == lr]
        hits = [r.reached() for r in chosen if r.reached() and not r.diverged()]
        rows[key] = {
            "lr": lr, "runs": chosen, "n": len(chosen), "reached": len(hits),
            "epochs": mean([h[0] for h in hits]), "steps": mean([h[1] for h in hits]), "time": mean([h[2] for h in hits]),
            # cost per epoch counts every run, diverged or not: the steps cost the same
            "spe": mean([r.s_per_epoch() for r in chosen if r.trained()[0] > 0]),
            "cpu": mean([r.cpu_per_epoch() for r in chosen if r.trained()[0] > 0]),
            "train": mean([r.trained()[1] for r in chosen if not r.diverged()]),
            "all_diverged": all(r.diverged() for r in chosen),
            "epochs_run": mean([r.trained()[0] for r in chosen]),
            "diverged": sum(1 for r in rs if r.diverged()), "all": len(rs),
        }

    print("\nBest learning rate per model, batch and optimizer (chosen on seed 1; means over the seeds that "
          "reached the target). Ratios: epochs to those at batch 256 (same optimizer), time and s/epoch to SGD's "
          "(same batch)")
    print("%-5s %6s %-5s %8s %7s %8s %8s %9s %9s %9s %10s %9s %11s %11s  %s" % (
        "model", "batch", "opt", "lr@256", "reached", "epochs", "steps", "time", "s/epoch", "CPU s/ep", "ep/ep@256",
        "time/SGD", "s/ep / SGD", "CPU / SGD", "diverged runs (all rates)"))
    for key in sorted(rows, key=lambda k: (k[0], k[1], ["sgd", "adam", "kfac"].index(k[2]))):
        model, batch, opt = key
        row = rows[key]
        base = rows.get((model, 256, opt))
        sgd = rows.get((model, batch, "sgd"))
        ep_ratio = row["epochs"] / base["epochs"] if base else float("nan")
        t_ratio = row["time"] / sgd["time"] if sgd else float("nan")
        s_ratio = row["spe"] / sgd["spe"] if sgd else float("nan")
        c_ratio = row["cpu"] / sgd["cpu"] if sgd else float("nan")
        print("%-5s %6d %-5s %8g %7s %8s %8s %9s %9s %9s %10s %9s %11s %11s  %s" % (
            model, batch, opt, row["lr"], "%d/%d" % (row["reached"], row["n"]), fmt(row["epochs"]), fmt(row["steps"], 0),
            fmt(row["time"], 1, "s"), fmt(row["spe"], 2, "s"), fmt(row["cpu"], 2, "s"), fmt(ep_ratio), fmt(t_ratio),
            fmt(s_ratio), fmt(c_ratio),
            "%d of %d" % (row["diverged"], row["all"]) if row["diverged"] else "none"))

    plot(out, rows)

    # The targets.
    lines = []

    def get(model, batch, opt):
        return rows.get((model, batch, opt))

    def check(name, value, limit, detail=""):
        if value is None or not math.isfinite(value):
            lines.append("target %s: NOT MEASURED%s" % (name, " (" + detail + ")" if detail else ""))
        elif value <= limit:
            lines.append("target %s: MET (%.2f%s)" % (name, value, "; " + detail if detail else ""))
        else:
            lines.append("target %s: MISSED by %.2f (%.2f against %.2f%s)" % (name, value - limit, value, limit,
                                                                              "; " + detail if detail else ""))

    def epochs_ratio(batch):
        a, b = get("mlp", batch, "kfac"), get("mlp", 256, "kfac")
        if not a or not b:
            return None, "not run" + (" (--quick)" if quick else "")
        if a["reached"] == 0:
            return None, "K-FAC did not reach 88% at batch %d" % batch
        return a["epochs"] / b["epochs"], "%.2f / %.2f epochs" % (a["epochs"], b["epochs"])

    v, d = epochs_ratio(4096)
    check("MLP K-FAC epochs to 88% at batch 4096 <= 1.5x at 256", v, 1.5, d)
    v, d = epochs_ratio(16384)
    check("MLP K-FAC epochs to 88% at batch 16384 <= 2.5x at 256 (goal)", v, 2.5, d)
    k, s = get("mlp", 4096, "kfac"), get("mlp", 4096, "sgd")
    if k and s and k["reached"] and s["reached"]:
        check("MLP batch 4096 K-FAC time to 88% <= 0.35x SGD's", k["time"] / s["time"], 0.35,
              "%.1fs / %.1fs" % (k["time"], s["time"]))
    elif k and s and k["reached"] and s["all_diverged"]:
        lines.append("target MLP batch 4096 K-FAC time to 88%% <= 0.35x SGD's: NOT MEASURED (SGD diverged at every "
                     "rate tried)")
    elif k and s and k["reached"]:
        # SGD's time to the target exceeds its whole training time: an upper bound of the ratio.
        bound = k["time"] / s["train"]
        if bound <= 0.35:
            lines.append("target MLP batch 4096 K-FAC time to 88%% <= 0.35x SGD's: MET (< %.2f: SGD did not reach 88%% "
                         "in %.0f epochs)" % (bound, s["epochs_run"]))
        else:
            lines.append("target MLP batch 4096 K-FAC time to 88%% <= 0.35x SGD's: NOT MEASURED (SGD did not reach 88%% "
                         "in %.0f epochs; ratio < %.2f)" % (s["epochs_run"], bound))
    else:
        check("MLP batch 4096 K-FAC time to 88% <= 0.35x SGD's", None, 0.35,
              "K-FAC did not reach 88%" if k and s else "not run")
    check("MLP batch 4096 K-FAC s/epoch <= 1.3x SGD's (wall clock)", k["spe"] / s["spe"] if k and s else None, 1.3,
          "%.2fs / %.2fs; CPU time %.2fs / %.2fs = %.2fx" % (k["spe"], s["spe"], k["cpu"], s["cpu"], k["cpu"] / s["cpu"])
          if k and s else "not run")
    c, cs = get("cnn", 4096, "kfac"), get("cnn", 4096, "sgd")
    if c:
        within = [r for r in c["runs"] if r.reached() and r.reached()[0] <= 10 and not r.diverged()]
        seeds = len(set(r.seed for r in c["runs"]))
        if len(within) == len(c["runs"]) and seeds >= 3:
            lines.append("target CNN batch 4096 K-FAC 91%% within 10 epochs on each of 3 seeds: MET (epochs %s)" %
                         ", ".join(fmt(r.reached()[0]) for r in within))
        else:
            lines.append("target CNN batch 4096 K-FAC 91%% within 10 epochs on each of 3 seeds: MISSED by %d of %d seeds "
                         "(best accuracies %s)" % (len(c["runs"]) - len(within), len(c["runs"]),
                                                   ", ".join("%.2f%%" % (100 * r.best_acc()) for r in c["runs"])))
    else:
        check("CNN batch 4096 K-FAC 91% within 10 epochs on each of 3 seeds", None, 0, "not run" + (" (--quick)" if quick else ""))
    check("CNN batch 4096 K-FAC s/epoch <= 1.3x SGD's (wall clock)", c["spe"] / cs["spe"] if c and cs else None, 1.3,
          "%.2fs / %.2fs; CPU time %.2fs / %.2fs = %.2fx" % (c["spe"], cs["spe"], c["cpu"], cs["cpu"], c["cpu"] / cs["cpu"])
          if c and cs else "not run" + (" (--quick)" if quick else ""))
    diverged = [r for r in runs if r.diverged()]
    lines.append("target no run diverges silently: MET (%d of %d runs diverged, each marked DIVERGED above)" %
                 (len(diverged), len(runs)))
    print()
    print("\n".join(lines))
    return 0


def plot(out, rows):
    data = os.path.join(out, "epochs_to_target.dat")
    series = []
    with open(data, "w") as f:
        for model in ("mlp", "cnn"):
            for opt in ("sgd", "adam", "kfac"):
                pts = sorted((b, r["epochs"]) for (m, b, o), r in rows.items()
                             if m == model and o == opt and math.isfinite(r["epochs"]))
                if not pts:
                    continue
                f.write("# %s %s\n" % (model, opt))
                for b, e in pts:
                    f.write("%d %.4f\n" % (b, e))
                f.write("\n\n")
                series.append("%s %s (%.0f%%)" % (model.upper(), opt, 100 * TARGET[model]))
    png = os.path.join(out, "epochs_to_target.png")
    if not series:
        return
    if not shutil.which("gnuplot"):
        print("note: gnuplot not found; the plot's data is in", data)
        return
    script = os.path.join(out, "epochs_to_target.gp")
    with open(script, "w") as f:
        f.write("set terminal pngcairo size 900,600 noenhanced\nset output '%s'\n" % png)
        f.write("set logscale x 2\nset xlabel 'batch (samples per step)'\nset ylabel 'epochs to target test accuracy'\n")
        f.write("set offsets graph 0.05, graph 0.05, graph 0.1, graph 0.1\nset yrange [0:*]\nset key top left\nset grid\nset title 'Fashion-MNIST, --recipe large-batch, best rate per optimizer'\n")
        f.write("plot " + ", ".join("'%s' index %d using 1:2 with linespoints lw 2 pt 7 ps 1.5 title '%s'" % (data, i, t)
                                    for i, t in enumerate(series)) + "\n")
    if subprocess.call(["gnuplot", script]) == 0:
        print("plot:", png)


def main(argv):
    if len(argv) >= 3 and argv[0] == "--best":
        runs = read_dir(argv[1])
        for r in runs:
            TARGET[r.model] = float(argv[2])
        lr = best_lr(runs)
        print("%g" % lr if lr is not None else "0.1")
        return 0
    if len(argv) >= 2 and argv[0] == "--report":
        return report(argv[1], "--quick" in argv)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
