"""Per-step cost of kfac.KFACPreconditioner (Python hooks) against the C++ adapter
(kfac::adapters::TorchPreconditioner through observed()) on the same model and batch.

    PYTHONPATH=build/python python3 benchmarks/python/step_cost.py [--repeats 7] [--steps 40]

The model is the tests' RefNet (python/tests/_nets.py; its LibTorch twin is in the extension),
on one batch; each repeat times, in turn, Python + kfac, C++ + kfac, Python alone, C++ alone
(interleaved, so that a loaded machine slows all four alike), and the medians are printed with
the ratios Python / C++ of the whole step and of kfac's part (step with kfac - step without).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / 'python' / 'tests'))
import kfac  # noqa: E402
from _nets import RefNet  # noqa: E402


def python_seconds(model, x, y, settings, warmup, steps, with_kfac):
    p = kfac.KFACPreconditioner(model, **settings) if with_kfac else None
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if p is not None:
            p.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--repeats', type=int, default=7)
    ap.add_argument('--steps', type=int, default=40)
    ap.add_argument('--warmup', type=int, default=5)
    ap.add_argument('--batch', type=int, default=64)
    ap.add_argument('--size', type=int, default=16, help='input H = W')
    ap.add_argument('--factor-every', type=int, default=1)
    ap.add_argument('--inv-every', type=int, default=10)
    ap.add_argument('--threads', type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    s = a.size
    flat = 5 * ((s + 2 - 2 - 1) // 2 + 1) * s  # conv1: stride (2, 1), padding (1, 2), dilation (1, 2)
    model = RefNet(flat=flat, classes=10)
    params = {n: q.detach().clone() for n, q in model.named_parameters()}
    x, y = torch.randn(a.batch, 3, s, s), torch.randint(0, 10, (a.batch,))
    settings = dict(factor_update_steps=a.factor_every, inv_update_steps=a.inv_every, damping=0.01,
                    factor_decay=0.95, kl_clip=0.001, lr=0.1)
    cpp_settings = dict(settings, precompute_reciprocal=True)
    runs = {k: [] for k in ('py_kfac', 'cpp_kfac', 'py_plain', 'cpp_plain')}
    for _ in range(a.repeats):
        runs['py_kfac'].append(python_seconds(model, x, y, settings, a.warmup, a.steps, True))
        runs['cpp_kfac'].append(kfac._kfac._cpp_adapter_seconds_per_step(params, x, y, cpp_settings, a.warmup, a.steps, True))
        runs['py_plain'].append(python_seconds(model, x, y, settings, a.warmup, a.steps, False))
        runs['cpp_plain'].append(kfac._kfac._cpp_adapter_seconds_per_step(params, x, y, cpp_settings, a.warmup, a.steps, False))
    med = {k: statistics.median(v) for k, v in runs.items()}
    step_ratios = [p / c for p, c in zip(runs['py_kfac'], runs['cpp_kfac'])]
    print(f'RefNet, batch {a.batch}, input 3x{s}x{s}, factors every {a.factor_every}, decompositions every '
          f'{a.inv_every}, {a.threads} thread(s), {a.repeats} repeats x {a.steps} steps (medians, ms/step)')
    print('| | Python | C++ adapter | Python / C++ |')
    print('|---|---|---|---|')
    print(f"| step with kfac | {med['py_kfac'] * 1e3:.3f} | {med['cpp_kfac'] * 1e3:.3f} | "
          f"{statistics.median(step_ratios):.3f} (range {min(step_ratios):.3f}-{max(step_ratios):.3f}) |")
    print(f"| step without kfac | {med['py_plain'] * 1e3:.3f} | {med['cpp_plain'] * 1e3:.3f} | "
          f"{med['py_plain'] / med['cpp_plain']:.3f} |")
    over_py, over_cpp = med['py_kfac'] - med['py_plain'], med['cpp_kfac'] - med['cpp_plain']
    print(f'| kfac part (with - without) | {over_py * 1e3:.3f} | {over_cpp * 1e3:.3f} | {over_py / over_cpp:.3f} |')


if __name__ == '__main__':
    main()
