"""The default conventions ('kfac-pytorch') against kfac-pytorch's formulas, written out here in
float64 (no kfac-pytorch needed; benchmarks/python/compare_kfac_pytorch.py runs kfac-pytorch
itself): its factor scalings for Linear and Conv2d, factors that start at the identity,
micro-batches' factors averaged as they come, EIGEN with eigenvalues clamped at 0, INVERSE as
inv(F + damping I), the KL clip, the bias as the last column."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kfac


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(3 * 3 * 3, 4)
        self.out = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(torch.relu(self.conv(x)).flatten(1))))


class Tokens(torch.nn.Module):
    """Linear layers over (batch, tokens, features): kfac-pytorch flattens the tokens into rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 4)
        self.out = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [model.conv, model.fc, model.out] if isinstance(model, Net) else [model.fc, model.out]


def rows_a(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """kfac-pytorch's rows of A: the input (im2col patches divided by the T locations for a
    convolution, its bias 1 included; a Linear's leading dimensions flattened) with a trailing 1
    for a bias."""
    if isinstance(m, torch.nn.Conv2d):
        patches = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)  # (N, C k k, T)
        t = patches.shape[-1]
        r = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=r.dtype)], 1) if m.bias is not None else r
        return r / t
    x = x.reshape(-1, x.shape[-1])
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1) if m.bias is not None else x


def rows_g(m: torch.nn.Module, g: torch.Tensor) -> torch.Tensor:
    if isinstance(m, torch.nn.Conv2d):
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) / (g.shape[2] * g.shape[3])
    return g.reshape(-1, g.shape[-1])


def cov(r: torch.Tensor) -> torch.Tensor:
    return r.T @ r / r.shape[0]


def grad_matrix(m: torch.nn.Module) -> torch.Tensor:
    w = m.weight.grad.reshape(m.weight.shape[0], -1)
    return torch.cat([w, m.bias.grad[:, None]], 1) if m.bias is not None else w


class Reference:
    """kfac-pytorch's step, from its formulas, in float64."""

    def __init__(self, model: torch.nn.Module, method: str, k: int, **h: float) -> None:
        self.layers = layers(model)
        self.method, self.k, self.h = method, k, h
        self.seen: dict[torch.nn.Module, list] = {m: [] for m in self.layers}
        self.a: dict = {}
        self.g: dict = {}
        self.inv: dict = {}
        for m in self.layers:
            m.register_forward_pre_hook(lambda mod, inp: self.seen[mod].append([inp[0].detach(), None]))
            m.register_full_backward_hook(lambda mod, gi, go: self._grad(mod, go[0]))

    def _grad(self, m: torch.nn.Module, g: torch.Tensor) -> None:
        self.seen[m][-1][1] = g.detach()

    def step(self, s: int) -> float:
        h = self.h
        vs, vg = {}, 0.0
        for m in self.layers:
            if s % h['factor_update_steps'] == 0:
                # the micro-batches' covariances averaged (kfac-pytorch's accumulation)
                a_new = sum(cov(rows_a(m, x)) for x, _ in self.seen[m]) / self.k
                g_new = sum(cov(rows_g(m, g)) for _, g in self.seen[m]) / self.k
                a_old = self.a.get(m, torch.eye(a_new.shape[0], dtype=a_new.dtype))
                g_old = self.g.get(m, torch.eye(g_new.shape[0], dtype=g_new.dtype))
                self.a[m] = h['factor_decay'] * a_old + (1 - h['factor_decay']) * a_new
                self.g[m] = h['factor_decay'] * g_old + (1 - h['factor_decay']) * g_new
            self.seen[m] = []
            d = h['damping']
            if s % h['inv_update_steps'] == 0:
                if self.method == 'eigen':
                    da, qa = torch.linalg.eigh(self.a[m])
                    dg, qg = torch.linalg.eigh(self.g[m])
                    self.inv[m] = (qa, da.clamp(min=0), qg, dg.clamp(min=0))
                else:
                    eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
                    self.inv[m] = (torch.linalg.inv(self.a[m] + d * eye(self.a[m].shape[0])),
                                   torch.linalg.inv(self.g[m] + d * eye(self.g[m].shape[0])))
            x = grad_matrix(m)
            if self.method == 'eigen':
                qa, da, qg, dg = self.inv[m]
                v = qg @ ((qg.T @ x @ qa) / (torch.outer(dg, da) + d)) @ qa.T
            else:
                ainv, ginv = self.inv[m]
                v = ginv @ x @ ainv
            vs[m] = v
            vg += float((v * x).sum()) * h['lr'] ** 2
        return min(1.0, (h['kl_clip'] / abs(vg)) ** 0.5)


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
@pytest.mark.parametrize('accumulation', [1, 2])
@pytest.mark.parametrize('model', ['cnn', 'tokens'])
def test_default_conventions_are_kfac_pytorchs_formulas(method: str, accumulation: int, model: str) -> None:
    torch.manual_seed(3)
    h = dict(factor_update_steps=1, inv_update_steps=2, damping=0.003, factor_decay=0.9, kl_clip=0.001, lr=0.1)
    make = Net if model == 'cnn' else Tokens
    ours, theirs = make().double(), make().double()
    theirs.load_state_dict(ours.state_dict())
    p = kfac.KFACPreconditioner(ours, compute_method=method, accumulation_steps=accumulation, **h)
    ref = Reference(theirs, method, accumulation, **h)
    scales = []
    for s in range(5):
        x = torch.randn(*((8, 2, 6, 6) if model == 'cnn' else (8, 5, 2)), dtype=torch.float64)
        y = torch.randint(0, 3, (8,) if model == 'cnn' else (8, 5))
        for net in (ours, theirs):
            net.zero_grad()
            for xm, ym in zip(x.chunk(accumulation), y.chunk(accumulation)):
                (F.cross_entropy(net(xm).reshape(-1, 3), ym.reshape(-1)) / accumulation).backward()
        p.step()
        # the reference's preconditioned gradients, scaled by its KL clip, against ours
        nu = ref.step(s)
        scales.append(nu)
        assert p.last_kl_scale == pytest.approx(nu, rel=1e-9), s
        for m_ours, m_ref in zip(layers(ours), ref.layers):
            v = ref.inv[m_ref]
            x_ref = grad_matrix(m_ref)
            if method == 'eigen':
                qa, da, qg, dg = v
                want = nu * (qg @ ((qg.T @ x_ref @ qa) / (torch.outer(dg, da) + h['damping'])) @ qa.T)
            else:
                want = nu * (v[1] @ x_ref @ v[0])
            got = grad_matrix(m_ours)
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-9, (s, m_ref, err)
        # both take the same step, so that the next step starts from the same weights
        with torch.no_grad():
            for a, b in zip(ours.parameters(), theirs.parameters()):
                a -= 0.1 * a.grad
                b.copy_(a)
    assert min(scales) < 1.0  # the KL clip engaged


def test_conventions_are_checked() -> None:
    with pytest.raises(ValueError, match="conventions must be one of 'kfac-pytorch', 'kfac'"):
        kfac.KFACPreconditioner(torch.nn.Linear(3, 2), conventions='kaisa')
    with pytest.raises(ValueError, match="loss_reduction is one of kfac's conventions"):
        kfac.KFACPreconditioner(torch.nn.Linear(3, 2), loss_reduction='mean')
    assert kfac.KFACPreconditioner(torch.nn.Linear(3, 2), loss_reduction='mean', conventions='kfac').modules()


def test_factor_and_inverse_dtypes_are_honoured_or_refused_by_name() -> None:
    """kfac-pytorch's dtype arguments (their numbers: test_methods.py)."""
    model = torch.nn.Linear(3, 2)
    assert kfac.KFACPreconditioner(model, factor_dtype=torch.float32, inv_dtype=torch.float32).modules() == ['root']
    # kfac-pytorch's inv_dtype default on a float64 model: float64 factors, float32 decompositions
    assert kfac.KFACPreconditioner(torch.nn.Linear(3, 2).double(), inv_dtype=torch.float32).modules() == ['root']
    with pytest.raises(ValueError, match=r'^factor_dtype=torch.bfloat16: .*no bfloat16'):
        kfac.KFACPreconditioner(model, factor_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r'^inv_dtype=torch.float16: .*storage type only'):
        kfac.KFACPreconditioner(model, inv_dtype=torch.float16)
