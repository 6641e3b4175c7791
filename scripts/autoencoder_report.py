#!/usr/bin/env python3
"""The table, plots and target lines of scripts/autoencoder_benchmark.sh, from runs.csv (the rows
examples/autoencoder prints: optimizer,lr,damping,seed,step,seconds,train_error,train_loss).

  autoencoder_report.py --best runs.csv      each optimizer's best configuration at seed 1, as the
                                             program's arguments (one line per optimizer)
  autoencoder_report.py runs.csv --out DIR   DIR/summary.md, DIR/error_steps.svg, DIR/error_time.svg
                                             and the target lines
A configuration is an optimizer with its learning rate (and K-FAC's damping); self-tuned K-FAC
(kfac+adaptive) has one. The best is the lowest final training error at seed 1 (a run that
stopped on a non-finite loss counts as infinite). Standard library only."""

import argparse
import csv
import math
import pathlib
import statistics
import sys

OPTIMIZERS = ['sgd', 'adam', 'kfac', 'kfac+adaptive']


def load(path):
    """{(optimizer, config): {seed: [(step, seconds, error), ...]}}"""
    runs = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            opt = row['optimizer']
            config = '' if opt == 'kfac+adaptive' else f"lr {row['lr']}" + (
                f", damping {row['damping']}" if opt == 'kfac' else '')
            curve = runs.setdefault((opt, config), {}).setdefault(int(row['seed']), [])
            error = float(row['train_error'])
            curve.append((int(row['step']), float(row['seconds']), error if math.isfinite(error) else math.inf))
    return runs


def final(curve):
    return curve[-1][2] if curve else math.inf


def best_configs(runs):
    """{optimizer: config} by the final error at seed 1."""
    best = {}
    for (opt, config), seeds in runs.items():
        if 1 in seeds and (opt not in best or final(seeds[1]) < final(runs[(opt, best[opt])][1])):
            best[opt] = config
    return best


def args_of(opt, config):
    if opt == 'kfac+adaptive':
        return '--optimizer kfac --adaptive'
    parts = dict(p.split(' ') for p in config.split(', '))
    text = f"--optimizer {opt} --lr {parts['lr']}"
    return text + (f" --damping {parts['damping']}" if 'damping' in parts else '')


def time_to(curve, goal):
    """Seconds of the first evaluation at or below `goal`, or None."""
    for _, seconds, error in curve:
        if error <= goal:
            return seconds
    return None


def svg(path, curves, xlabel, ylabel):
    """Curves {name: [(x, y)]} as a line plot, y on a log scale; drawn by hand (no matplotlib here)."""
    width, height, margin = 680, 420, 56
    points = {n: [(x, math.log10(y)) for x, y in c if y > 0 and math.isfinite(y)] for n, c in curves.items()}
    xs = [x for c in points.values() for x, _ in c]
    ys = [y for c in points.values() for _, y in c]
    if not xs:
        return
    x_hi = max(xs) or 1.0
    y_lo, y_hi = min(ys), max(ys)
    y_hi = y_hi if y_hi > y_lo else y_lo + 1

    def px(x):
        return margin + x / x_hi * (width - 2 * margin)

    def py(y):
        return height - margin - (y - y_lo) / (y_hi - y_lo) * (height - 2 * margin)

    palette = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd']
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" y2="{height - margin}" '
             'stroke="black"/>',
             f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 14}" text-anchor="middle">{xlabel} (0 to {x_hi:.4g})</text>',
             f'<text x="10" y="{margin - 18}">{ylabel}, log scale ({10 ** y_lo:.4g} to {10 ** y_hi:.4g})</text>']
    for i, (name, c) in enumerate(points.items()):
        color = palette[i % len(palette)]
        coords = ' '.join(f'{px(x):.1f},{py(y):.1f}' for x, y in c)
        lines.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        lines.append(f'<text x="{width - margin - 210}" y="{margin + 16 * i}" fill="{color}">{name}</text>')
    pathlib.Path(path).write_text('\n'.join(lines + ['</svg>']) + '\n')


def mean(values):
    return statistics.fmean(values) if values else math.nan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('runs')
    ap.add_argument('--best', action='store_true')
    ap.add_argument('--out')
    ap.add_argument('--seeds', type=int, default=1)
    ap.add_argument('--budget', type=float, default=0)
    ap.add_argument('--quick', action='store_true')
    a = ap.parse_args()
    runs = load(a.runs)
    best = best_configs(runs)
    if a.best:
        for opt in OPTIMIZERS:
            if opt in best:
                print(args_of(opt, best[opt]))
        return
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    # The best first-order optimizer: the lower mean final error of SGD's and Adam's best.
    def finals(opt):
        return [final(c) for c in runs[(opt, best[opt])].values()] if opt in best else []

    first_order = [o for o in ('sgd', 'adam') if o in best]
    reference = min(first_order, key=lambda o: mean(finals(o))) if first_order else None
    goal = mean(finals(reference)) if reference else math.nan
    goal_time = mean([c[-1][1] for c in runs[(reference, best[reference])].values()]) if reference else math.nan

    rows = ['| optimizer | configuration | seeds | final training error (mean) | min | max | steps (mean) '
             '| seconds (mean) | seconds to the goal (mean; seeds reaching it) |', '|---' * 9 + '|']
    for (opt, config), seeds in sorted(runs.items()):
        f = [final(c) for c in seeds.values()]
        reach = [time_to(c, goal) for c in seeds.values()]
        hit = [t for t in reach if t is not None]
        mark = ' (best)' if best.get(opt) == config else ''
        rows.append(f'| {opt}{mark} | {config or "defaults"} | {len(seeds)} | {mean(f):.3f} | {min(f):.3f} | '
                    f'{max(f):.3f} | {mean([c[-1][0] for c in seeds.values()]):.0f} | '
                    f'{mean([c[-1][1] for c in seeds.values()]):.1f} | '
                    f'{(f"{mean(hit):.1f}" if hit else "-")} ({len(hit)}/{len(seeds)}) |')
    head = [f'# Deep autoencoder on Fashion-MNIST ({"--quick" if a.quick else "full run"})', '',
            f'{a.seeds} seed(s), {a.budget:g} s of training per run. Training error: squared error summed over '
            'the 784 pixels, averaged over the evaluated training images. Goal: the best first-order '
            f'optimizer\'s final error, {reference} ({best.get(reference, "")}): {goal:.3f} '
            f'after {goal_time:.1f} s.', '']
    (out / 'summary.md').write_text('\n'.join(head + rows) + '\n')
    for axis, label in ((0, 'steps'), (1, 'time')):
        curves = {f'{o} {best[o]}'.strip(): [(p[axis], p[2]) for p in runs[(o, best[o])][min(runs[(o, best[o])])]]
                  for o in OPTIMIZERS if o in best}
        svg(out / f'error_{label}.svg', curves, 'step' if axis == 0 else 'training seconds', 'training error')
    print('\n'.join(head + rows))

    def target(name, value, bound, why_not=None, missed=None):
        if a.quick or why_not:
            shown = '' if math.isnan(value) else f'; indicative {value:.3g}'
            return f'target {name}: NOT MEASURED ({why_not or "--quick: one seed, short runs"}{shown})'
        if missed:
            return f'target {name}: MISSED ({missed})'
        return f'target {name}: MET ({value:.3g})' if value <= bound else \
            f'target {name}: MISSED by {value / bound:.2f}x ({value:.3g})'

    def seconds_to_goal(opt):
        """Each seed's seconds to the goal (None where it never got there); [] without opt."""
        return [time_to(c, goal) for c in runs[(opt, best[opt])].values()] if opt in best else []

    def all_reached(t):
        return mean(t) if t and all(x is not None for x in t) else None

    self_times = seconds_to_goal('kfac+adaptive')
    self_t, tuned_t = all_reached(self_times), all_reached(seconds_to_goal('kfac'))
    few = None if a.seeds >= 3 else f'{a.seeds} seed(s), 3 needed'
    missed = None
    if not a.quick and not few and self_times and self_t is None:  # measured, and a seed missed the goal
        hit = [x for x in self_times if x is not None]
        missed = f'reached it on {len(hit)} of {len(self_times)} seeds'
    r1 = self_t / goal_time if self_t is not None and goal_time > 0 else math.nan
    shown = f'; on those, {mean(hit) / goal_time:.3g} of the first-order time' if missed and hit else ''
    print(target('autoencoder self-tuned K-FAC time to the best first-order final error / its time <= 0.3',
                 r1 if self_t is not None else math.inf, 0.3,
                 few or (None if self_t is not None or missed else 'self-tuned K-FAC did not reach it'),
                 missed and missed + shown))
    r2 = self_t / tuned_t if self_t is not None and tuned_t else math.nan
    print(target('autoencoder self-tuned / tuned K-FAC time to that error <= 1.25', r2, 1.25,
                 few or (None if (self_t is not None and tuned_t) or missed else 'not both reached it'),
                 missed and 'self-tuned ' + missed))
    return 0


if __name__ == '__main__':
    sys.exit(main())
