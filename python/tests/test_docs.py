"""Every ```python block of docs/python.md, docs/transformers.md and docs/self_tuning.md runs as printed."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / 'docs'
BLOCKS = [b for page in ('python.md', 'transformers.md', 'self_tuning.md')
          for b in re.findall(r'```python\n(.*?)```', (DOCS / page).read_text(), flags=re.S)]


def test_the_page_has_python_blocks() -> None:
    assert BLOCKS


@pytest.mark.parametrize('block', BLOCKS)
def test_block_runs(block: str) -> None:
    r = subprocess.run([sys.executable, '-c', block], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
