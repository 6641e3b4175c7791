"""Our package against kfac-pytorch itself: the same training runs, step by step.

    PYTHONPATH=build/python python3 benchmarks/python/compare_kfac_pytorch.py \
        --kfac-pytorch /path/to/kfac-pytorch [--steps 50] [--quick]

Both packages are imported as `kfac`, so each runs in its own process: this script starts one
worker with our package first on the path and one with kfac-pytorch's checkout (a directory
holding its `kfac/` package, v0.4.2 or later) first. Each worker trains every configuration from
the same seed and data (SGD, lr 0.1, float32, a Linear model and a Conv2d model) with
KFACPreconditioner given only kfac-pytorch's arguments, and reports the loss of every step and
the final parameters. A configuration matches when every step's loss is within 1e-4 relative of
kfac-pytorch's and every parameter tensor within 1e-3 (max abs difference / max abs value).
Without --kfac-pytorch (or when the directory has no kfac package) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from side_by_side import find_packages
from side_by_side import kfac_pytorch_metadata
from side_by_side import run_worker

LOSS_RTOL = 1e-4
PARAM_RTOL = 1e-3


def configurations(quick: bool) -> list[dict]:
    """kfac-pytorch's public arguments, crossed: the method and its eigenvalue option, the two
    update intervals, accumulation, the KL clip, where factors are updated, the damping."""
    out = []
    methods = [('eigen', True), ('eigen', False), ('inverse', True)]
    intervals = [(1, 1), (1, 10), (3, 6)] if not quick else [(1, 1), (3, 6)]
    for model, (method, outer), (fu, iu), accum, kl, in_hook in itertools.product(
        ['mlp', 'cnn'], methods, intervals, [1, 2], [0.001, 1.0], [True, False],
    ):
        if quick and (accum == 2 and kl == 1.0 or not in_hook and fu == 1):
            continue
        out.append(
            dict(
                model=model,
                compute_method=method,
                compute_eigenvalue_outer_product=outer,
                factor_update_steps=fu,
                inv_update_steps=iu,
                accumulation_steps=accum,
                kl_clip=kl,
                update_factors_in_hook=in_hook,
                damping=0.003,
                factor_decay=0.95,
                lr=0.1,
            ),
        )
    return out


def name_of(c: dict) -> str:
    return (
        f"{c['model']} {c['compute_method']}{'' if c['compute_eigenvalue_outer_product'] else '/no-outer'} "
        f"f{c['factor_update_steps']}/i{c['inv_update_steps']} acc{c['accumulation_steps']} "
        f"kl={c['kl_clip']} hook={int(c['update_factors_in_hook'])}"
    )


def build_model(kind: str, torch):
    nn = torch.nn
    if kind == 'mlp':
        return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5, bias=False))
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, stride=2, bias=False), nn.ReLU(),
        nn.Flatten(), nn.Linear(6 * 4 * 4, 5),
    )


def worker(configs: list[dict], steps: int) -> list[dict]:
    import torch

    import kfac
    from kfac.preconditioner import KFACPreconditioner

    torch.set_num_threads(int(os.environ.get('KFAC_COMPARE_THREADS', '1')))
    results = []
    for c in configs:
        c = dict(c)
        kind = c.pop('model')
        torch.manual_seed(0)
        model = build_model(kind, torch)
        gen = torch.Generator().manual_seed(1)
        shape = (20,) if kind == 'mlp' else (3, 9, 9)
        xs = torch.randn(4, 32, *shape, generator=gen)
        ys = torch.randint(0, 5, (4, 32), generator=gen)
        if c['compute_method'] == 'inverse':
            c['compute_method'] = kfac.enums.ComputeMethod.INVERSE
        else:
            c['compute_method'] = kfac.enums.ComputeMethod.EIGEN
        optimizer = torch.optim.SGD(model.parameters(), lr=c['lr'])
        p = KFACPreconditioner(model, **c)
        k = c['accumulation_steps']
        losses = []
        start = time.perf_counter()
        for s in range(steps):
            x, y = xs[s % 4], ys[s % 4]
            optimizer.zero_grad()
            total = 0.0
            for xm, ym in zip(x.chunk(k), y.chunk(k)):
                loss = torch.nn.functional.cross_entropy(model(xm), ym) / k
                loss.backward()
                total += loss.item()
            losses.append(total)
            p.step()
            optimizer.step()
        results.append(
            dict(
                losses=losses,
                params=[t.detach().tolist() for t in model.parameters()],
                seconds=time.perf_counter() - start,
            ),
        )
    return results


def run(path_first: list[str], configs: list[dict], steps: int, threads: int = 1) -> list[dict]:
    env = {'KFAC_COMPARE_THREADS': str(threads), 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS', '1')}
    return run_worker(__file__, path_first, configs, ['--steps', str(steps)], env)


def max_rel(a, b) -> float:
    import torch

    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((ta - tb).abs().max() / tb.abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--kfac-pytorch', help="directory holding kfac-pytorch's kfac/ package")
    ap.add_argument('--steps', type=int, default=50)
    ap.add_argument('--quick', action='store_true', help='a covering subset of the configurations')
    ap.add_argument('--control', action='store_true',
                    help='also run kfac-pytorch on 2 threads: how far its own runs move when only the rounding changes')
    ap.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(sys.stdin.read()), args.steps)))
        return
    found = find_packages(args.kfac_pytorch, 'kfac-pytorch')
    if found is None:
        return
    ours_dir, theirs_dir = found
    configs = configurations(args.quick)
    ours = run([ours_dir], configs, args.steps)
    with kfac_pytorch_metadata() as meta:
        theirs = run([theirs_dir, meta], configs, args.steps)
        control = run([theirs_dir, meta], configs, args.steps, threads=2) if args.control else None
    matched = 0
    t_ours = t_theirs = 0.0
    extra = ' kfac-pytorch 1 vs 2 threads: loss, param |' if control else ''
    print(f'| configuration | max loss rel. diff | max param rel. diff | final loss (kfac-pytorch) | match |{extra}')
    print('|---|---|---|---|---|' + ('---|' if control else ''))

    def diffs(a, b):
        loss_diff = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a['losses'], b['losses']))
        return loss_diff, max(max_rel(pa, pb) for pa, pb in zip(a['params'], b['params']))

    for i, (c, a, b) in enumerate(zip(configs, ours, theirs)):
        loss_diff, param_diff = diffs(a, b)
        ok = loss_diff <= LOSS_RTOL and param_diff <= PARAM_RTOL
        matched += ok
        t_ours += a['seconds']
        t_theirs += b['seconds']
        line = (f"| {name_of(c)} | {loss_diff:.2e} | {param_diff:.2e} | {b['losses'][-1]:.4f} | "
                f"{'yes' if ok else 'NO'} |")
        if control:
            line += ' {:.2e}, {:.2e} |'.format(*diffs(control[i], b))
        print(line)
    print(f'kfac-pytorch comparison: {matched} of {len(configs)} configurations match over {args.steps} steps '
          f'(losses within {LOSS_RTOL:g}, parameters within {PARAM_RTOL:g}); '
          f'training time ours {t_ours:.2f} s, kfac-pytorch {t_theirs:.2f} s')


if __name__ == '__main__':
    main()
