"""kfac.methods: each method object against an independent float64 reference where one is cheap,
against each other where they must agree, factor and decomposition dtypes, and the checks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kfac
from kfac.methods import NGSGD, Cholesky, Eigen, NewtonSchulz, RandomizedEigen, UnitWiseFisher
from test_kfac_pytorch_conventions import Net, cov, grad_matrix, rows_a, rows_g

# One step of kfac-pytorch's conventions (the default): factors 0.5 I + 0.5 cov, no KL clip.
H = dict(factor_update_steps=1, inv_update_steps=1, damping=0.003, factor_decay=0.5, kl_clip=None)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [model.conv, model.fc, model.out]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _kfac_step(model: torch.nn.Module, batch, **kwargs) -> list[torch.Tensor]:
    """One preconditioned step of `model` (its dtype) on `batch`: the gradient matrices."""
    p = kfac.KFACPreconditioner(model, **{**H, **kwargs})
    x, y = batch
    model.zero_grad()
    F.cross_entropy(model(x.to(model.fc.weight.dtype)), y).backward()
    p.step()
    return [grad_matrix(m).double() for m in _layers(model)]


def _factors(model: torch.nn.Module, batch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Independent of kfac: each layer's (A, G, gradient matrix) in float64, from hooks."""
    ref = copy.deepcopy(model).double()
    seen: dict = {}
    hooks = []
    for m in _layers(ref):
        hooks.append(m.register_forward_pre_hook(lambda mod, inp: seen.__setitem__(mod, [inp[0].detach(), None])))
        hooks.append(m.register_full_backward_hook(lambda mod, gi, go: seen[mod].__setitem__(1, go[0].detach())))
    F.cross_entropy(ref(batch[0]), batch[1]).backward()
    for h in hooks:
        h.remove()
    out = []
    for m in _layers(ref):
        x, g = seen[m]
        a, gg = cov(rows_a(m, x)), cov(rows_g(m, g))
        d = H['factor_decay']
        a = d * torch.eye(len(a), dtype=a.dtype) + (1 - d) * a
        gg = d * torch.eye(len(gg), dtype=gg.dtype) + (1 - d) * gg
        out.append((a, gg, grad_matrix(m)))
    return out


def _eigen_reference(a, g, x, damping):
    da, qa = torch.linalg.eigh(a)
    dg, qg = torch.linalg.eigh(g)
    return qg @ ((qg.T @ x @ qa) / (torch.outer(dg.clamp(min=0), da.clamp(min=0)) + damping)) @ qa.T


def _pi_reference(a, g, x, damping, each):
    """Martens & Grosse's pi-damping: (G + s/pi I)^-1 X (A + s pi I)^-1, s = damping (added to each
    factor, kfac-pytorch's INVERSE) or its square root."""
    pi = ((a.trace() / len(a)) / (g.trace() / len(g))).sqrt()
    s = damping if each else damping**0.5
    if each:  # the damping on each factor: pi^2 and 1 / pi^2 of it
        ia, ig = a + s * pi * pi * torch.eye(len(a), dtype=a.dtype), g + s / (pi * pi) * torch.eye(len(g), dtype=g.dtype)
    else:
        ia, ig = a + s * pi * torch.eye(len(a), dtype=a.dtype), g + s / pi * torch.eye(len(g), dtype=g.dtype)
    return torch.linalg.solve(ig, x) @ torch.linalg.inv(ia)


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))


def _net(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(3)
    return Net().to(dtype)


# ---- against float64 references -----------------------------------------------------------------


@pytest.mark.parametrize('each', [True, False])
def test_cholesky_with_pi_damping_matches_a_float64_reference(each: bool) -> None:
    model, batch = _net(), _batch()
    want = [_pi_reference(a, g, x, H['damping'], each) for a, g, x in _factors(model, batch)]
    got = _kfac_step(model, batch, methods={'.*': Cholesky(pi_damping=True, damping_on_each_factor=each)})
    assert _rel(got, want) < 1e-9
    # pi changes the numbers (the reference would catch its absence)
    assert _rel(_kfac_step(_net(), batch, methods={'.*': Cholesky(damping_on_each_factor=each)}), want) > 1e-6


def test_eigen_matches_a_float64_reference_and_honours_the_dtypes() -> None:
    batch = _batch()
    factors = _factors(_net(), batch)
    want = [_eigen_reference(a, g, x, H['damping']) for a, g, x in factors]
    assert _rel(_kfac_step(_net(), batch, methods={'.*': Eigen()}), want) < 1e-9
    # float32 factors of a float64 model (kfac::MixedPrecision): float32's rounding, no more
    mixed = _rel(_kfac_step(_net(), batch, factor_dtype=torch.float32, inv_dtype=torch.float64), want)
    assert 1e-10 < mixed < 1e-4
    # float32 decompositions of float64 factors (kfac-pytorch's inv_dtype default): float32's rounding
    narrow = _rel(_kfac_step(_net(), batch, inv_dtype=torch.float32), want)
    assert 1e-10 < narrow < 1e-4
    # a float32 model with float64 decompositions (MixedPrecision), and all float32
    assert _rel(_kfac_step(_net(torch.float32), batch, methods={'.*': Eigen(inv_dtype=torch.float64)}), want) < 1e-4
    assert _rel(_kfac_step(_net(torch.float32), batch), want) < 1e-4


def test_float16_factors_are_close_to_float32() -> None:
    """factor_dtype=torch.float16: kfac::HalfPrecision (binary16 factors, float32 decompositions)."""
    batch = _batch()
    single = _kfac_step(_net(torch.float32), batch)
    half = _kfac_step(_net(torch.float32), batch, factor_dtype=torch.float16)
    per_module = _kfac_step(_net(torch.float32), batch, methods={'.*': Eigen(factor_dtype=torch.float16)})
    assert 1e-5 < _rel(half, single) < 2e-2  # binary16's rounding of the factors
    assert _rel(per_module, half) == 0
    cholesky = _kfac_step(_net(torch.float32), batch, methods={'.*': Cholesky(factor_dtype=torch.float16)})
    assert _rel(cholesky, _kfac_step(_net(torch.float32), batch, compute_method='inverse')) < 2e-2


# ---- methods against each other ---------------------------------------------------------------------


def test_the_objects_are_what_compute_method_and_the_strings_give() -> None:
    batch = _batch()
    assert _rel(_kfac_step(_net(), batch, methods={'.*': Eigen()}), _kfac_step(_net(), batch)) == 0
    inverse = _kfac_step(_net(), batch, compute_method='inverse', pi_damping=True)
    assert _rel(_kfac_step(_net(), batch, methods={'.*': Cholesky(pi_damping=True)}), inverse) == 0
    assert _rel(_kfac_step(_net(), batch, methods={'.*': 'inverse'}, pi_damping=True), inverse) == 0


@pytest.mark.parametrize(('conventions', 'each'), [('kfac-pytorch', True), ('kfac', False)])
def test_choleskys_damping_on_each_factor_defaults_to_the_conventions(conventions: str, each: bool) -> None:
    batch = _batch()
    default = _kfac_step(_net(), batch, methods={'.*': Cholesky()}, conventions=conventions)
    explicit = _kfac_step(_net(), batch, methods={'.*': Cholesky(damping_on_each_factor=each)}, conventions=conventions)
    other = _kfac_step(_net(), batch, methods={'.*': Cholesky(damping_on_each_factor=not each)}, conventions=conventions)
    assert _rel(default, explicit) == 0 and _rel(default, other) > 1e-6


def test_randomized_eigen_at_full_rank_equals_eigen() -> None:
    batch = _batch()
    eigen = _kfac_step(_net(), batch)
    assert _rel(_kfac_step(_net(), batch, methods={'.*': RandomizedEigen(rank=32)}), eigen) < 1e-12
    # rank 2 of fc's A (n = 28) and G (n = 4): the top pairs and the mean of the rest, not Eigen
    low = _kfac_step(_net(), batch, methods={'fc': RandomizedEigen(rank=2, oversampling=0, power_iterations=2)})
    assert _rel(low[:1] + low[2:], eigen[:1] + eigen[2:]) == 0  # conv and out keep Eigen
    assert 1e-6 < _rel(low[1:2], eigen[1:2]) < 1.0


def test_newton_schulz_equals_cholesky_with_the_same_damping() -> None:
    batch = _batch()
    for pi in (True, False):
        ns = _kfac_step(_net(), batch, methods={'.*': NewtonSchulz(pi_damping=pi, tolerance=1e-13)})
        ch = _kfac_step(_net(), batch, methods={'.*': Cholesky(pi_damping=pi, damping_on_each_factor=False)})
        assert _rel(ns, ch) < 1e-8


def test_ngsgd_runs_hundreds_of_steps_finite_with_its_settings() -> None:
    torch.manual_seed(5)
    model = Net()
    p = kfac.KFACPreconditioner(model, methods={model.fc: NGSGD(rank=2, update_period=2), 'conv|out': Eigen()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 2, 6, 6), torch.randint(0, 3, (64,))
    losses = []
    for step in range(300):
        i = (step * 16) % 64
        opt.zero_grad()
        loss = F.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
        loss.backward()
        p.step()
        assert all(torch.isfinite(q.grad).all() for q in model.parameters()), step
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) < 0.8 * sum(losses[:20])
    # its settings reach the core: another rank, other numbers
    batch = _batch()
    a = _kfac_step(_net(), batch, methods={'fc': NGSGD(rank_in=1)})
    b = _kfac_step(_net(), batch, methods={'fc': NGSGD(rank_in=8)})
    assert _rel(a[1:2], b[1:2]) > 1e-6 and _rel(a[:1], b[:1]) == 0
    both = _kfac_step(_net(), batch, methods={'fc': NGSGD(rank=1)})
    assert _rel(both[1:2], _kfac_step(_net(), batch, methods={'fc': NGSGD(rank_in=1, rank_out=1)})[1:2]) == 0
    assert _rel(both[1:2], a[1:2]) > 1e-6


def test_unit_wise_fisher_for_batchnorm_and_float16_for_the_kronecker_modules() -> None:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.Linear(48, 2))
    p = kfac.KFACPreconditioner(model, conventions='kfac', factor_dtype=torch.float16,
                                methods={model[1]: UnitWiseFisher(inv_dtype=torch.float64)})
    assert p.modules() == ['0', '1', '3']
    F.cross_entropy(model(torch.randn(4, 2, 6, 6)), torch.tensor([0, 1, 1, 0])).backward()
    p.step()
    assert all(torch.isfinite(q.grad).all() for q in model.parameters())


# ---- checks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ('make', 'match'),
    [
        (lambda: Eigen(jacobi_sweeps=0), 'Eigen: jacobi_sweeps must be an int >= 1'),
        (lambda: Eigen(refresh_tolerance=1.0), r'Eigen: refresh_tolerance must be in \[0, 1\)'),
        (lambda: RandomizedEigen(rank=0), 'RandomizedEigen: rank must be an int >= 1'),
        (lambda: RandomizedEigen(oversampling=-1), 'RandomizedEigen: oversampling must be an int >= 0'),
        (lambda: RandomizedEigen(power_iterations=1.5), 'RandomizedEigen: power_iterations must be an int'),
        (lambda: RandomizedEigen(warm_start=1), 'RandomizedEigen: warm_start must be True or False'),
        (lambda: Cholesky(pi_damping='yes'), 'Cholesky: pi_damping must be True or False'),
        (lambda: NewtonSchulz(max_iterations=0), 'NewtonSchulz: max_iterations must be an int >= 1'),
        (lambda: NewtonSchulz(tolerance=float('inf')), 'NewtonSchulz: tolerance must be finite'),
        (lambda: NGSGD(rank=-1), 'NGSGD: rank must be an int >= 0'),
        (lambda: NGSGD(rank=2, rank_in=3), 'NGSGD: rank sets both'),
        (lambda: NGSGD(eta_cap=0), r'NGSGD: eta_cap must be in \(0, 1\]'),
        (lambda: NGSGD(delta=1), r'NGSGD: delta must be in \(0, 1\)'),
        (lambda: Eigen(factor_dtype=torch.bfloat16), 'Eigen: factor_dtype=torch.bfloat16: .*no bfloat16'),
        (lambda: Eigen(inv_dtype=torch.float16), 'Eigen: inv_dtype=torch.float16: .*storage type only'),
        (lambda: UnitWiseFisher(factor_dtype=torch.float16), 'UnitWiseFisher: factor_dtype=torch.float16'),
    ],
)
def test_bad_arguments_are_named(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_combinations_are_named() -> None:
    model = Net()
    with pytest.raises(ValueError, match='factor_dtype=torch.bfloat16'):
        kfac.KFACPreconditioner(model, factor_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r'factor_dtype=torch.float16, inv_dtype=torch.float64: kfac has'):
        kfac.KFACPreconditioner(model, factor_dtype=torch.float16, inv_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"methods\['fc'\]: UnitWiseFisher is for BatchNorm2d and LayerNorm modules; module 'fc'"):
        kfac.KFACPreconditioner(model, methods={'fc': UnitWiseFisher()})
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    with pytest.raises(ValueError, match=r"methods\['1'\]: Eigen is for Linear and Conv2d modules; module '1'"):
        kfac.KFACPreconditioner(bn, methods={'1': Eigen()}, conventions='kfac')
    with pytest.raises(ValueError, match=r"methods\[<module 1>\]: module '1' \(torch.nn.BatchNorm2d\) is not"):
        kfac.KFACPreconditioner(bn, methods={bn[1]: UnitWiseFisher()})  # kfac-pytorch's conventions skip it
    with pytest.raises(ValueError, match=r"methods\[<module fc>\]: module 'fc' .* is not preconditioned \(skip"):
        kfac.KFACPreconditioner(model, methods={model.fc: Eigen()}, skip_layers=['fc'])
    with pytest.raises(ValueError, match=r"methods\['\^fc'\]: decides the method of no preconditioned module"):
        kfac.KFACPreconditioner(model, methods={'fc|out': Eigen(), '^fc': Cholesky()})
    with pytest.raises(ValueError, match="NGSGD: rank_out=3 for module 'out', whose output side has dimension 3"):
        kfac.KFACPreconditioner(model, methods={'out': NGSGD(rank_out=3)})
    with pytest.raises(ValueError, match='not a module of the model'):
        kfac.KFACPreconditioner(model, methods={torch.nn.Linear(2, 2): Eigen()})
