"""What the kfac-pytorch side-by-side scripts share (compare_kfac_pytorch.py,
overhead_vs_kfac_pytorch.py): finding both packages, and running a worker process with one of
them first on the path, since both are imported as `kfac`."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any
from typing import Iterator


def find_packages(kfac_pytorch: str | None, what: str) -> tuple[str, str] | None:
    """(our package's folder, kfac-pytorch's checkout), or None after a NOT RUN line naming
    `what` when no kfac-pytorch checkout was given. Ours is the first PYTHONPATH entry holding it."""
    theirs = pathlib.Path(kfac_pytorch) if kfac_pytorch else None
    if theirs is None or not (theirs / 'kfac' / 'base_preconditioner.py').exists():
        print(f'{what}: NOT RUN (give --kfac-pytorch DIR, a checkout holding its kfac/ package)')
        return None
    here = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    ours = next((p for p in here if (pathlib.Path(p) / 'kfac' / 'preconditioner.py').exists()), None)
    if ours is None:
        raise SystemExit('put our package on PYTHONPATH (e.g. PYTHONPATH=build/python)')
    return ours, str(theirs)


@contextlib.contextmanager
def kfac_pytorch_metadata() -> Iterator[str]:
    """A folder holding the distribution metadata kfac-pytorch's __init__ reads (its version): a
    checkout run out of tree needs it beside it, and nothing else of an installation."""
    with tempfile.TemporaryDirectory() as meta:
        info = pathlib.Path(meta) / 'kfac_pytorch-0.0.0.dist-info'
        info.mkdir()
        (info / 'METADATA').write_text('Metadata-Version: 2.1\nName: kfac-pytorch\nVersion: 0.0.0\n')
        yield meta


def run_worker(script: str, path_first: list[str], job: Any, args: list[str], env: dict[str, str]) -> Any:
    """`script --worker *args` with `path_first` ahead of PYTHONPATH and `env` added, `job` as
    JSON on its stdin; its last stdout line, parsed as JSON."""
    full = dict(os.environ, **env)
    full['PYTHONPATH'] = os.pathsep.join([*path_first, full.get('PYTHONPATH', '')])
    out = subprocess.run([sys.executable, script, '--worker', *args], input=json.dumps(job), capture_output=True,
                         text=True, env=full, check=False)
    if out.returncode != 0:
        raise SystemExit(f'worker with {path_first[0]} first on the path failed:\n{out.stderr[-4000:]}')
    return json.loads(out.stdout.strip().splitlines()[-1])
