"""What a user does (ctest python_pip_install): a fresh virtual environment that sees the system's
torch, `pip install --no-build-isolation --no-index` of the source tree, then, from outside the
source tree, kfac imported from that environment trains a small model.

    python3 pip_check.py SOURCE_DIR WORK_DIR

WORK_DIR (in the build tree) holds the environment and pip's build (KFAC_PIP_BUILD_DIR), so the
source tree is left as it was. KFAC_BUILD_OPT defaults to -O0 here: the shortest compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

TRAIN = """
import kfac, torch
assert kfac.__file__.startswith({venv!r}), kfac.__file__
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
preconditioner = kfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
losses = []
for _ in range(10):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    preconditioner.step()
    optimizer.step()
    losses.append(loss.item())
# kfac-pytorch's defaults (KL clip 0.001 at lr 0.1) take small steps: a steady decrease
assert losses[-1] < 0.97 * losses[0] and losses == sorted(losses, reverse=True), losses
print(f'pip kfac ok: {{preconditioner.steps}} steps, loss {{losses[0]:.3f}} -> {{losses[-1]:.3f}}')
"""


def run(what: str, args: list[str], **kw) -> None:
    start = time.monotonic()
    subprocess.run(args, check=True, **kw)
    print(f'{what}: {time.monotonic() - start:.1f} s', flush=True)


def main() -> None:
    source, work = (os.path.abspath(a) for a in sys.argv[1:3])
    shutil.rmtree(work, ignore_errors=True)
    venv = os.path.join(work, 'venv')
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}  # not the build tree's package
    env.update(PYTHONNOUSERSITE='1', KFAC_PIP_BUILD_DIR=os.path.join(work, 'build'))
    env.setdefault('KFAC_BUILD_OPT', '-O0')
    run('venv', [sys.executable, '-m', 'venv', '--system-site-packages', venv], env=env)
    run(f'pip install ({env["KFAC_BUILD_OPT"]})', [
        os.path.join(venv, 'bin', 'pip'), 'install', '--no-build-isolation', '--no-index', '--no-cache-dir',
        '--disable-pip-version-check', '-q', source
    ], env=env)
    run('train', [os.path.join(venv, 'bin', 'python'), '-c', TRAIN.format(venv=venv)], env=env, cwd='/')


if __name__ == '__main__':
    main()
