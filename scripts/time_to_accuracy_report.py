#!/usr/bin/env python3
"""The table and target lines of scripts/time_to_accuracy.sh, from the demo's stdout and log.csv.

  time_to_accuracy_report.py DIR [--epochs N] [--target 0.88]
"""
import csv
import re
import statistics
import sys

HEADER = re.compile(r"^\[(\S+)\] lr (\S+), seed (\d+), (\d+) steps/epoch")


def spread(values, fmt="{:.2f}"):
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return (fmt + " ± " + fmt).format(statistics.mean(values), statistics.stdev(values))


def mean(values):
    return statistics.mean(values) if values else float("nan")


def main(argv):
    folder = argv[1]
    epochs = int(argv[argv.index("--epochs") + 1]) if "--epochs" in argv else 8
    target = float(argv[argv.index("--target") + 1]) if "--target" in argv else 0.88
    steps_per_epoch = {}
    with open(folder + "/stdout.txt") as f:
        for line in f:
            m = HEADER.match(line)
            if m:
                steps_per_epoch[(m.group(1), m.group(3))] = int(m.group(4))
    evals = {}  # (optimizer, seed) -> [(step, wall_s, acc)]
    with open(folder + "/log.csv") as f:
        for row in csv.DictReader(f):
            evals.setdefault((row["optimizer"], row["seed"]), []).append(
                (int(row["step"]), float(row["wall_s"]), float(row["test_acc"])))
    groups = {}  # optimizer -> per-seed figures
    for (name, seed), rows in evals.items():
        spe = steps_per_epoch[(name, seed)]
        last_step, last_wall, last_acc = rows[-1]
        hit = next((r for r in rows if r[2] >= target), None)
        g = groups.setdefault(name, {"seeds": 0, "epochs": [], "time": [], "s_epoch": [], "final": [], "complete": 0})
        g["seeds"] += 1
        g["s_epoch"].append(last_wall / (last_step / spe))
        if last_step == spe * epochs:
            g["final"].append(100 * last_acc)
            g["complete"] += 1
        if hit:
            g["epochs"].append(hit[0] / spe)
            g["time"].append(hit[1])
    families = ["sgd", "adam", "kfac", "ngsgd"]
    order = sorted(groups, key=lambda n: families.index(n.split("+")[0]) if n.split("+")[0] in families else len(families))
    sgd = groups.get("sgd")
    print(f"Fashion-MNIST MLP, batch 256, {epochs} epochs; target {100 * target:.0f}% test accuracy; "
          "mean ± sample standard deviation over seeds")
    print(f"{'optimizer':<14} {'reached':>7} {'epochs to target':>17} {'s/epoch':>13} {'time to target':>16} "
          f"{'final acc':>15} {'step / SGD':>10} {'time / SGD':>10}")
    for name in order:
        g = groups[name]
        step_ratio = mean(g["s_epoch"]) / mean(sgd["s_epoch"]) if sgd else float("nan")
        time_ratio = mean(g["time"]) / mean(sgd["time"]) if sgd and sgd["time"] and g["time"] else float("nan")
        print(f"{name:<14} {str(len(g['time'])) + '/' + str(g['seeds']):>7} {spread(g['epochs']):>17} "
              f"{spread(g['s_epoch']):>13} {spread(g['time'], '{:.1f}'):>16} {spread(g['final']):>15} "
              f"{step_ratio:>10.2f} {time_ratio:>10.2f}")

    exact = groups.get("kfac+cholesky")
    low = next((groups[n] for n in order if n == "kfac" or n.startswith("kfac+rank")), None)
    if not (sgd and exact and low):
        print("targets: NOT MEASURED (the SGD, exact K-FAC or low-rank K-FAC runs are missing)")
        return 0

    def line(what, value, limit, fmt="{:.2f}"):
        ok = value <= limit
        print(f"target {what} <= {fmt.format(limit)}: {fmt.format(value)} "
              + ("MET" if ok else f"MISSED by {fmt.format(value - limit)}"))

    every = len(low["time"]) == low["seeds"] and len(exact["time"]) == exact["seeds"]
    line("low-rank K-FAC s/epoch / SGD's", mean(low["s_epoch"]) / mean(sgd["s_epoch"]), 1.3)
    if every:
        line("low-rank K-FAC epochs to target / exact K-FAC's", mean(low["epochs"]) / mean(exact["epochs"]), 1.1)
        line("low-rank K-FAC time to target / SGD's", mean(low["time"]) / mean(sgd["time"]) if sgd["time"] else 99, 0.35)
    else:
        print("target epochs and time to target: MISSED (a K-FAC run did not reach the target)")
    if low["final"] and exact["final"]:
        line("exact K-FAC final accuracy - low-rank's (points)", mean(exact["final"]) - mean(low["final"]), 0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
