"""kfac.SelfTuning (docs/self_tuning.md, Python): the products against finite differences, alpha and mu
against the 2x2 solve built here from the model's full Jacobian and the loss's Hessian (float64), a
training run, checkpoints, refusals, and 2 gloo processes against one."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.utils.stateless import functional_call

import kfac

SETTINGS = dict(conventions='kfac', kl_clip=None, factor_decay=0.9, factor_update_steps=1, inv_update_steps=1)


def _mlp(seed: int = 3, width: int = 7, classes: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, classes)).double()


def _targets(loss: str, n: int, classes: int = 3) -> torch.Tensor:
    if loss == 'cross_entropy':
        return torch.randint(0, classes, (n,))
    if loss == 'mse':
        return torch.randn(n, classes, dtype=torch.float64)
    return torch.bernoulli(torch.full((n, classes), 0.4, dtype=torch.float64))


def _backward(model: torch.nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor) -> float:
    model.zero_grad()
    value = kfac.losses.value(loss, model(x), y, 'mean')
    value.backward()
    return float(value)


def test_products_match_central_differences() -> None:
    """J v by forward mode equals (f(theta + e v) - f(theta - e v)) / 2e in float64."""
    model = _mlp()
    tune = kfac.SelfTuning(kfac.KFACPreconditioner(model, **SETTINGS))
    x = torch.randn(6, 4, dtype=torch.float64)
    v = [torch.randn_like(p) for p in model.parameters()]
    z, jv = tune._jvp((x,), v)
    assert torch.equal(z, model(x).detach())
    eps = 1e-6
    names = [n for n, _ in model.named_parameters()]

    def at(sign: float) -> torch.Tensor:
        params = {n: p.detach() + sign * eps * d for (n, p), d in zip(model.named_parameters(), v)}
        return functional_call(model, params, (x,)).detach()

    fd = (at(1) - at(-1)) / (2 * eps)
    assert len(names) == 4
    torch.testing.assert_close(jv, fd, rtol=1e-7, atol=1e-9)


def _reference(model, loss, x, y, g, proposal, previous, lam):
    """alpha, mu from the exact GGN J^T H J of the batch loss (J the outputs' full Jacobian in the
    flat parameters, H the loss's Hessian in the outputs, both by autograd), solved with numpy."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def outputs(flat: torch.Tensor) -> torch.Tensor:
        params, k = {}, 0
        for n, s in zip(names, shapes):
            params[n] = flat[k:k + s.numel()].view(s)
            k += s.numel()
        return functional_call(model, params, (x,)).reshape(-1)

    z = outputs(theta).detach()
    jac = torch.autograd.functional.jacobian(outputs, theta).numpy()  # (N K, D)
    shape = model(x).shape
    hess = torch.autograd.functional.hessian(
        lambda flat_z: kfac.losses.value(loss, flat_z.view(shape), y, 'mean'), z).numpy()  # (N K, N K)
    ggn = jac.T @ hess @ jac
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts]).numpy()  # noqa: E731
    gv, pv = flat(g), flat(proposal)
    c = ggn + lam * np.eye(len(gv))
    if previous is None:
        return pv @ gv / (pv @ c @ pv), 0.0
    uv = flat(previous)
    a = np.array([[pv @ c @ pv, pv @ c @ uv], [uv @ c @ pv, uv @ c @ uv]])
    alpha, mu = np.linalg.solve(a, np.array([gv @ pv, gv @ uv]))
    return alpha, mu


@pytest.mark.parametrize('loss', ['cross_entropy', 'mse', 'bce'])
def test_alpha_mu_equal_an_independent_float64_solve(loss: str) -> None:
    model = _mlp()
    pre = kfac.KFACPreconditioner(model, **SETTINGS)
    tune = kfac.SelfTuning(pre, loss=loss, initial_damping=0.05, update_interval=2)
    proposals = []
    stepped = pre.step

    def step_and_record() -> None:  # the proposal P the solve sees, as the test reads it
        stepped()
        proposals.append([p.grad.clone() for p in model.parameters()])

    pre.step = step_and_record
    torch.manual_seed(5)
    for step in range(3):
        x, y = torch.randn(8, 4, dtype=torch.float64), _targets(loss, 8)
        _backward(model, loss, x, y)
        g = [p.grad.clone() for p in model.parameters()]
        previous = list(tune.previous_update().values()) if tune.needs_previous_product() else None
        lam = tune.damping
        theta = [p.detach().clone() for p in model.parameters()]
        r = tune.step(x, y)
        for p, t, u in zip(model.parameters(), theta, [p.grad for p in model.parameters()]):
            assert torch.equal(p.detach(), t - u)
        alpha, mu = _reference(model_at(model, theta), loss, x, y, g, proposals[-1], previous, lam)
        assert (previous is not None) == (step > 0) == r['momentum']
        assert r['alpha'] == pytest.approx(alpha, rel=1e-9)
        assert r['mu'] == pytest.approx(mu, rel=1e-9, abs=1e-12)
        assert r['alpha'] > 0
        for u, pr, pv in zip([p.grad for p in model.parameters()], proposals[-1], previous or [0] * 4):
            torch.testing.assert_close(u, r['alpha'] * pr + r['mu'] * pv, rtol=1e-12, atol=1e-15)


def model_at(model: torch.nn.Module, theta: list[torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` at the parameters `theta` (the point the solve was made at)."""
    twin = _mlp()
    with torch.no_grad():
        for p, t in zip(twin.parameters(), theta):
            p.copy_(t)
    return twin


def _problem(seed: int = 0, n: int = 512):
    """A classification problem a small MLP can fit: labels of a random two-layer teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    w1, w2 = torch.randn(4, 16, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g, dtype=torch.float64)
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def test_training_without_a_learning_rate_lowers_the_loss_and_moves_lambda() -> None:
    x, y = _problem()
    model = _mlp(seed=1, width=16)
    pre = kfac.KFACPreconditioner(model, **dict(SETTINGS, inv_update_steps=5, factor_decay=0.95))
    tune = kfac.SelfTuning(pre, initial_damping=1.0, update_interval=5)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        start = float(torch.nn.functional.cross_entropy(model(x), y))
    lambdas = set()
    for _ in range(200):
        rows = torch.randint(0, len(x), (64,), generator=g)
        _backward(model, 'cross_entropy', x[rows], y[rows])
        r = tune.step(x[rows], y[rows])
        assert np.isfinite(r['alpha']) and np.isfinite(r['mu'])
        lambdas.add(tune.damping)
        assert pre.damping == tune.damping  # the preconditioner's damping follows lambda
    with torch.no_grad():
        end = float(torch.nn.functional.cross_entropy(model(x), y))
    assert end < 0.25 * start, (start, end)
    assert tune.damping_updates == 40 and len(lambdas) > 3 and min(lambdas) < 0.5, sorted(lambdas)


def _run(model, pre, tune, batches):
    out = []
    for x, y in batches:
        _backward(model, 'cross_entropy', x, y)
        r = tune.step(x, y)
        out.append(([p.detach().clone() for p in model.parameters()], r['alpha'], r['mu'], tune.damping))
    return out


def test_state_dict_resumes_bit_for_bit() -> None:
    torch.manual_seed(9)
    batches = [(torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))) for _ in range(10)]
    settings = dict(SETTINGS, inv_update_steps=4, factor_update_steps=2)
    model = _mlp()
    pre = kfac.KFACPreconditioner(model, **settings)
    tune = kfac.SelfTuning(pre, initial_damping=0.1, update_interval=2, weight_decay=1e-3)
    _run(model, pre, tune, batches[:5])
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, pre.state_dict(), tune.state_dict())
    straight = _run(model, pre, tune, batches[5:])

    model2 = _mlp(seed=11)
    pre2 = kfac.KFACPreconditioner(model2, **settings)
    tune2 = kfac.SelfTuning(pre2, initial_damping=0.1, update_interval=2, weight_decay=1e-3)
    model2.load_state_dict(saved[0])
    pre2.load_state_dict(saved[1])
    tune2.load_state_dict(saved[2])
    assert tune2.solves == 5 and pre2.damping == tune2.damping + 1e-3
    resumed = _run(model2, pre2, tune2, batches[5:])
    for (pa, aa, ma, la), (pb, ab, mb, lb) in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))
        assert (aa, ma, la) == (ab, mb, lb)


def test_refusals_name_the_problem_and_change_nothing() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="conventions='kfac'"):
        kfac.SelfTuning(kfac.KFACPreconditioner(_mlp(), kl_clip=None))
    pre = kfac.KFACPreconditioner(model, **SETTINGS)
    with pytest.raises(kfac.KFACError, match='initial_damping'):
        kfac.SelfTuning(pre, initial_damping=-1.0)
    with pytest.raises(ValueError, match="loss = 'hinge'"):
        kfac.SelfTuning(pre, loss='hinge')
    tune = kfac.SelfTuning(pre, update_interval=1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    _backward(model, 'cross_entropy', x, y)
    tune.step(x, y)

    def state():
        return ([p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()],
                pre.steps, tune.solves, tune.damping, tune.state_dict()['self_tuning'])

    def same(a, b):
        return all(torch.equal(u, v) for u, v in zip(a[0] + a[1], b[0] + b[1])) and a[2:] == b[2:]

    # A non-finite model prediction, or input (tanh saturates: finite outputs, NaN products): refused
    # before anything moves.
    _backward(model, 'cross_entropy', x, y)
    before = state()
    bias = model[2].bias
    with torch.no_grad():
        bias[1] = float('nan')
    with pytest.raises(ValueError, match='the model outputs have 8 non-finite values'):
        tune.step(x, y)
    with torch.no_grad():
        bias[1] = before[0][3][1]
    assert same(before, state())
    for value in (float('nan'), float('inf')):
        bad = x.clone()
        bad[3, 1] = value
        with pytest.raises(ValueError, match='input 0 has non-finite values'):
            tune.step((bad,), y)
        assert same(before, state())

    # The protocol by hand: a missing product is refused, naming it, and changes nothing.
    tune.capture_gradient()
    pre.step()
    assert tune.needs_previous_product()
    z, jp = tune._jvp((x,), [p.grad for p in model.parameters()])
    before = state()
    with pytest.raises(kfac.KFACError, match='along_previous is missing'):
        tune.solve(z, jp, None)
    assert same(before, state())
    with pytest.raises(kfac.KFACError, match='along_proposal is missing'):
        tune.solve(z, None, jp)
    nan = z.clone()
    nan[0, 0] = float('nan')
    with pytest.raises(kfac.KFACError, match='outputs has 1 non-finite'):
        tune.solve(nan, jp, jp)
    assert same(before, state())
    _, ju = tune._jvp((x,), list(tune.previous_update().values()))
    r = tune.solve(z, jp, ju)
    assert r['momentum'] and tune.solves == before[3] + 1
    with pytest.raises(ValueError, match="no 'self_tuning'"):
        tune.load_state_dict({})


# ---- 2 gloo processes against one ------------------------------------------------------------------

WORLD, PER_RANK, STEPS = 2, 8, 6


def _gloo_batches():
    torch.manual_seed(21)
    return [(torch.randn(WORLD * PER_RANK, 4, dtype=torch.float64), torch.randint(0, 3, (WORLD * PER_RANK,)))
            for _ in range(STEPS)]


def _gloo_run(model, tune, rows=slice(None)):
    out = []
    for x, y in _gloo_batches():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        r = tune.step(x[rows], y[rows])
        params = [p.detach().clone() for p in model.parameters()]
        out.append((params, r['alpha'], r['mu'], tune.damping, r.get('rho')))
    return out


def _gloo_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=WORLD)
    model = torch.nn.parallel.DistributedDataParallel(_mlp())
    tune = kfac.SelfTuning(kfac.KFACPreconditioner(model, **SETTINGS), initial_damping=0.05, update_interval=2)
    torch.save(_gloo_run(model, tune, slice(rank * PER_RANK, (rank + 1) * PER_RANK)), f'{out}/rank{rank}.pt')
    dist.destroy_process_group()


def test_two_gloo_processes_equal_one_process(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f'rank{r}.pt') for r in range(WORLD)]
    model = _mlp()
    one = _gloo_run(model, kfac.SelfTuning(kfac.KFACPreconditioner(model, **SETTINGS), initial_damping=0.05,
                                           update_interval=2))
    for a, b in zip(*ranks):  # the ranks agree bit for bit
        assert all(torch.equal(u, v) for u, v in zip(a[0], b[0])) and a[1:] == b[1:]
    for step, (a, b) in enumerate(zip(ranks[0], one)):
        for u, v in zip(a[0], b[0]):
            torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12, msg=f'step {step}')
        assert a[1:4] == pytest.approx(b[1:4], rel=1e-9), step
        assert (a[4] is None) == (b[4] is None) and (a[4] is None or a[4] == pytest.approx(b[4], rel=1e-7))


def test_solve_interval_reuses_the_mean_alpha_and_mu_between_solves() -> None:
    x, y = _problem()
    model = _mlp(seed=1, width=16)
    pre = kfac.KFACPreconditioner(model, **dict(SETTINGS, inv_update_steps=5, factor_decay=0.95))
    tune = kfac.SelfTuning(pre, initial_damping=1.0, update_interval=5, solve_interval=3, solve_warmup=3)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        start = float(torch.nn.functional.cross_entropy(model(x), y))
    wanted = []
    solved = []  # (alpha, mu) of each solve
    for step in range(30):
        rows = torch.randint(0, len(x), (64,), generator=g)
        _backward(model, 'cross_entropy', x[rows], y[rows])
        wanted.append(tune.wants_products())
        if step == 4:  # by hand: alpha P + mu U0 with the solves' weighted means, the first left out
            weights = [0.9 ** (len(solved) - 1 - j) for j in range(1, len(solved))]
            alpha = sum(w * a for w, (a, _) in zip(weights, solved[1:])) / sum(weights)
            mu = sum(w * m for w, (_, m) in zip(weights, solved[1:])) / sum(weights)
            u0 = tune.previous_update()
            pre.step()
            p = {n: q.grad.clone() for n, q in model.named_parameters()}
            r = tune.apply_last()
            assert r['alpha'] == pytest.approx(alpha, rel=1e-12) and r['mu'] == pytest.approx(mu, rel=1e-12, abs=1e-15)
            assert r['alpha'] != solved[-1][0]
            for n, q in model.named_parameters():
                torch.testing.assert_close(q.grad, alpha * p[n] + mu * u0[n], rtol=1e-6, atol=1e-7)
            with torch.no_grad():
                for q in model.parameters():
                    q.sub_(q.grad)
        else:
            solves = tune.solves
            r = tune.step(x[rows], y[rows])
            if tune.solves > solves:
                solved.append((r['alpha'], r['mu']))
    assert wanted == [True] * 4 + [False, False, True] * 8 + [False, False]
    assert tune.solves == 12 and tune.steps == 30 and tune.damping_updates == 2
    with torch.no_grad():
        end = float(torch.nn.functional.cross_entropy(model(x), y))
    assert end < 0.5 * start, (start, end)
    with pytest.raises(kfac.KFACError, match="this step's solve is due"):
        tune.apply_last()
