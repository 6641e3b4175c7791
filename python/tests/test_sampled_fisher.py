"""fisher='sampled' (docs/self_tuning.md, "The sampled Fisher"): the output gradients kfac folds, averaged
over many draws on a fixed model, match the analytic Fisher (closed forms in float64) of G and of a layer's
whole Fisher block; sampling from another distribution fails the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kfac

N, K, S = 6, 3, 2000  # samples, outputs, draws


class Recorder:
    """Stands in for the preconditioner's core: records what the hooks hand it, then passes it on."""

    def __init__(self, core):
        self.core, self.inputs, self.grads = core, {}, {}

    def observe_input(self, i, x):
        self.inputs.setdefault(i, []).append(x.detach().clone())
        return self.core.observe_input(i, x)

    def observe_output_grad(self, i, g):
        self.grads.setdefault(i, []).append(g.detach().clone())
        return self.core.observe_output_grad(i, g)

    def __getattr__(self, name):
        return getattr(self.core, name)


def _model() -> torch.nn.Module:
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, K)).double()


def _targets(loss: str, z: torch.Tensor) -> torch.Tensor:
    return {'cross_entropy': torch.zeros(N, dtype=torch.long), 'mse': torch.zeros_like(z),
            'bce': torch.ones_like(z)}[loss]


def _hessians(loss: str, z: np.ndarray) -> list[np.ndarray]:
    """Per sample, the curvature of the (mean-reduced) loss at the outputs, times N: closed forms."""
    if loss == 'cross_entropy':
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        return [np.diag(q) - np.outer(q, q) for q in p]
    if loss == 'mse':
        return [2.0 / K * np.eye(K) for _ in z]
    s = 1 / (1 + np.exp(-z))
    return [np.diag(q * (1 - q)) / K for q in s]


def _draws(loss: str):
    """One step's statistics with S draws: the model, each module's recorded inputs and output gradients."""
    model = _model()
    pre = kfac.KFACPreconditioner(model, conventions='kfac', fisher='sampled', fisher_samples=S)
    rec = pre._core = Recorder(pre._core)
    x = torch.randn(N, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    z = model(x)
    torch.manual_seed(12)
    pre.sample_fisher(z, loss)
    kfac.losses.value(loss, z, _targets(loss, z), 'mean').backward()
    pre.step()
    return model, x, rec


def _check(estimates: np.ndarray, exact: np.ndarray) -> tuple[bool, float]:
    """Mean of S independent estimates against the exact value, entry by entry within 5 standard
    errors (estimated from the draws) plus rounding: (within, the largest deviation in standard errors)."""
    mean, se = estimates.mean(0), estimates.std(0, ddof=1) / np.sqrt(len(estimates))
    z = np.abs(mean - exact) / (se + 1e-12)
    return bool((np.abs(mean - exact) <= 5 * se + 1e-12).all()), float(z.max())


def _exact_and_estimates(loss: str):
    model, x, rec = _draws(loss)
    w1, w2 = model[0].weight.detach().numpy(), model[2].weight.detach().numpy()
    h = torch.tanh(model[0](x)).detach().numpy()
    hs = _hessians(loss, model(x).detach().numpy())
    assert len(rec.grads[0]) == len(rec.grads[1]) == len(rec.inputs[1]) == S  # one per draw, none empirical
    g2 = np.stack([g.numpy() * N for g in rec.grads[1]])  # per-sample output gradients: kfac's x N (mean)
    g1 = np.stack([g.numpy() * N for g in rec.grads[0]])
    abar = np.concatenate([h, np.ones((N, 1))], 1)  # the last layer's input with the bias's 1
    exact, est = {}, {}
    # G of the last layer: E_y[g g^T] averaged over the batch = (1/N) sum_i H_i.
    exact['G2'] = sum(hs) / N
    est['G2'] = np.einsum('sni,snj->sij', g2, g2) / N
    # G of the hidden layer: J_i = dz_i/du_i = W2 diag(1 - h_i^2), (1/N) sum_i J_i^T H_i J_i.
    jac = [w2 * (1 - hi**2)[None, :] for hi in h]
    exact['G1'] = sum(j.T @ hh @ j for j, hh in zip(jac, hs)) / N
    est['G1'] = np.einsum('sni,snj->sij', g1, g1) / N
    # The last layer's whole Fisher block (weight and bias): (1/N) sum_i H_i kron abar_i abar_i^T.
    exact['F2'] = sum(np.kron(hh, np.outer(a, a)) for hh, a in zip(hs, abar)) / N
    v = np.einsum('sni,nj->snij', g2, abar).reshape(S, N, -1)
    est['F2'] = np.einsum('sni,snj->sij', v, v) / N
    assert np.allclose(rec.inputs[1][0].numpy(), h) and all(torch.equal(t, rec.inputs[1][0]) for t in rec.inputs[1])
    assert w1.shape == (5, 4)
    return exact, est


@pytest.mark.parametrize('loss', ['cross_entropy', 'mse', 'bce'])
def test_sampled_statistics_average_to_the_analytic_fisher(loss: str) -> None:
    exact, est = _exact_and_estimates(loss)
    for name in exact:
        ok, worst = _check(est[name], exact[name])
        assert ok, f'{name}: {worst:.1f} standard errors off'


@pytest.mark.parametrize('loss', ['cross_entropy', 'mse', 'bce'])
def test_a_wrong_distribution_fails_the_same_check(loss: str, monkeypatch) -> None:
    """The check has power: drawing from another distribution (uniform classes; N(z, I) instead of
    N(z, I/2); Bernoulli(1/2)) lands many standard errors away."""
    wrong = {'cross_entropy': lambda z: torch.randint(0, K, (z.size(0),)),
             'mse': lambda z: z.detach() + torch.randn_like(z),
             'bce': lambda z: torch.bernoulli(torch.full_like(z, 0.5))}[loss]
    monkeypatch.setattr(kfac.losses, 'sample', lambda _, z: wrong(z))
    exact, est = _exact_and_estimates(loss)
    assert not _check(est['G2'], exact['G2'])[0]


def test_parameter_gradients_stay_the_data_s_and_other_steps_cost_nothing() -> None:
    model = _model()
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, K, (N,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    empirical = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    pre = kfac.KFACPreconditioner(model, conventions='kfac', fisher='sampled', factor_update_steps=2,
                                  inv_update_steps=2)
    rec = pre._core = Recorder(pre._core)
    z = model(x)
    pre.sample_fisher(z, 'cross_entropy')
    torch.nn.functional.cross_entropy(z, y).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), empirical))
    assert len(rec.grads[0]) == 1  # the sampled draw's, not the data's
    pre.step()
    model.zero_grad()
    z = model(x)  # step 1 takes no statistics: no hook, no extra pass
    pre.sample_fisher(z, 'cross_entropy')
    torch.nn.functional.cross_entropy(z, y).backward()
    assert len(rec.grads[0]) == 1
    pre.step()


def test_refusals() -> None:
    with pytest.raises(ValueError, match="fisher='sampled' is one of kfac's conventions"):
        kfac.KFACPreconditioner(_model(), fisher='sampled')
    with pytest.raises(ValueError, match='fisher must be'):
        kfac.KFACPreconditioner(_model(), conventions='kfac', fisher='true')
    with pytest.raises(ValueError, match='fisher_samples'):
        kfac.KFACPreconditioner(_model(), conventions='kfac', fisher='sampled', fisher_samples=0)
    model = _model()
    pre = kfac.KFACPreconditioner(model, conventions='kfac', fisher='sampled')
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, K, (N,))
    z = model(x)
    with pytest.raises(ValueError, match="loss = 'nll'"):
        pre.sample_fisher(z, 'nll')
    torch.nn.functional.cross_entropy(z, y).backward()
    with pytest.raises(ValueError, match=r'sample_fisher\(outputs, loss\) was not called'):
        pre.step()
    assert pre.steps == 0
    model.zero_grad()
    z = model(x)
    pre.sample_fisher(z, 'cross_entropy')
    torch.nn.functional.cross_entropy(z, y).backward()
    pre.step()
    assert pre.steps == 1
    with pytest.raises(ValueError, match="fisher='empirical'"):
        kfac.KFACPreconditioner(_model(), conventions='kfac').sample_fisher(z, 'cross_entropy')
