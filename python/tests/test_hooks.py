"""Hooks: registered only for factor-update steps; a module not seen is named; Kokkos starts on
first use (a fork after import works) and is finalized at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kfac


class Counting(kfac.KFACPreconditioner):
    """Counts what the hooks record."""

    def __init__(self, *args, **kwargs) -> None:
        self.inputs = 0
        self.output_grads = 0
        super().__init__(*args, **kwargs)

    def _save_input(self, i, module, inputs) -> None:
        self.inputs += 1
        super()._save_input(i, module, inputs)

    def _save_grad_output(self, i, module, grad_input, grad_output) -> None:
        self.output_grads += 1
        super()._save_grad_output(i, module, grad_input, grad_output)


def _loss(model: torch.nn.Module, n: int = 6) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(torch.randn(n, 4)), torch.randint(0, 3, (n,)))


def test_hooks_fire_only_on_factor_update_steps() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    p = Counting(model, factor_update_steps=3, inv_update_steps=3)
    for step in range(7):
        hooked = [len(model[i]._forward_pre_hooks) + len(model[i]._backward_hooks) for i in (0, 2)]
        assert hooked == ([2, 2] if step % 3 == 0 else [0, 0]), step
        before = (p.inputs, p.output_grads)
        model.zero_grad()
        _loss(model).backward()
        with torch.no_grad():  # an evaluation pass records nothing
            model(torch.randn(2, 4))
        p.step()
        recorded = (p.inputs - before[0], p.output_grads - before[1])
        # On an update step the evaluation pass fires the two forward-pre hooks too, and they
        # record nothing: an input kept without its output gradient would make step() raise.
        assert recorded == ((4, 2) if step % 3 == 0 else (0, 0)), step
    # A schedule given as a callable of the step, with kfac-pytorch's meaning: statistics at the
    # steps s with s % f(s) == 0.
    q = Counting(model, factor_update_steps=lambda s: 1 if s < 2 else 4, inv_update_steps=4)
    updated = []
    for step in range(9):
        model.zero_grad()
        before = q.inputs
        _loss(model).backward()
        q.step()
        if q.inputs > before:
            updated.append(step)
    assert updated == [0, 1, 4, 8]

def test_a_module_not_seen_on_a_factor_update_step_is_named() -> None:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    p = kfac.KFACPreconditioner(model)
    x = torch.randn(5, 4)
    # The first Linear called functionally: its hook never fires.
    h = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
    torch.nn.functional.cross_entropy(model[2](torch.relu(h)), torch.randint(0, 3, (5,))).backward()
    before = [q.grad.clone() for q in model.parameters()]
    with pytest.raises(kfac.KFACError, match='not observed: its forward-pre hook did not fire') as info:
        p.step()
    assert info.value.layer == '0'
    assert p.steps == 0
    assert all(torch.equal(a, q.grad) for a, q in zip(before, model.parameters()))
    # The next complete step works.
    model.zero_grad()
    _loss(model).backward()
    p.step()
    assert p.steps == 1


def _run(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, '-c', textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=120,
    )


def test_kokkos_starts_on_first_use_and_a_fork_after_import_works() -> None:
    r = _run(
        """
        import os, torch, kfac
        assert not kfac._kfac.kokkos_initialized()      # import started nothing
        def train():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(4, 3))
            p = kfac.KFACPreconditioner(m)
            torch.nn.functional.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
            p.step()
            return m[0].weight.grad.sum().item()
        pid = os.fork()
        if pid == 0:
            ok = abs(train()) >= 0 and kfac._kfac.kokkos_initialized()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert not kfac._kfac.kokkos_initialized()       # the child's start is its own
        train()
        assert kfac._kfac.kokkos_initialized()
        print('ok')
        """,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == 'ok'


def test_finalized_at_exit_with_preconditioners_alive() -> None:
    r = _run(
        """
        import torch, kfac
        m = torch.nn.Linear(4, 3)
        p = kfac.KFACPreconditioner(m, inv_update_steps=2)
        torch.nn.functional.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
        p.step()
        kept = p      # still alive when atexit runs
        """,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ''


def test_a_dropped_preconditioner_leaves_no_hooks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    p = kfac.KFACPreconditioner(model)
    assert len(model[0]._forward_pre_hooks) == 1 and len(model[0]._backward_hooks) == 1
    del p  # the hooks hold it weakly: freed at once, its hooks removed
    assert len(model[0]._forward_pre_hooks) == 0 and len(model[0]._backward_hooks) == 0
    q = kfac.KFACPreconditioner(model)
    q.remove_hooks()
    assert len(model[2]._forward_pre_hooks) == 0
    _loss(model).backward()  # runs without hooks
