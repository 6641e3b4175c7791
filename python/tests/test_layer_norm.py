"""LayerNorm under kfac's conventions: its unit-wise Fisher per feature against per-sample
gradients that autograd computes sample by sample in float64 (no formula of ours), over tokens;
left to the optimizer under kfac-pytorch's conventions; refused by name when it normalizes over
more than the last dimension."""

from __future__ import annotations

import pytest
import torch

import kfac


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.fc(x)))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)  # the mean over every sample, token and feature


@pytest.mark.parametrize('tokens', [1, 5])
def test_layer_norm_fisher_is_that_of_per_sample_gradients(tokens: int) -> None:
    torch.manual_seed(7)
    model = Block().double()
    with torch.no_grad():  # a scale and shift away from (1, 0), so that both matter
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    damping = 0.01
    p = kfac.KFACPreconditioner(
        model, conventions='kfac', token_reduction='expand', damping=damping, kl_clip=None, factor_decay=0.5,
    )
    assert p.modules() == ['fc', 'norm']
    n = 6
    x = torch.randn(n, tokens, 3, dtype=torch.float64)
    y = torch.randn(n, tokens, 4, dtype=torch.float64)
    # The per-sample gradients: each sample's own loss (the mean over its tokens and features,
    # so that N times the batch loss's gradient is their sum), by autograd, one sample at a time.
    per_sample = []
    for i in range(n):
        model.zero_grad()
        loss_of(model, x[i:i + 1], y[i:i + 1]).backward()
        per_sample.append(torch.stack([model.norm.weight.grad.clone(), model.norm.bias.grad.clone()], 1))
    g = torch.stack(per_sample)  # (n, D, 2)
    fisher = torch.einsum('ndi,ndj->dij', g, g) / n  # (D, 2, 2)
    model.zero_grad()
    loss_of(model, x, y).backward()
    grad = torch.stack([model.norm.weight.grad.clone(), model.norm.bias.grad.clone()], 1)  # (D, 2)
    p.step()
    want = torch.linalg.solve(fisher + damping * torch.eye(2, dtype=torch.float64), grad.unsqueeze(-1)).squeeze(-1)
    got = torch.stack([model.norm.weight.grad, model.norm.bias.grad], 1)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-14), (got, want)


def test_layer_norm_trains_for_hundreds_of_steps_and_is_left_alone_under_kfac_pytorchs_conventions() -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    theirs = kfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8)))
    assert theirs.modules() == ['0']
    assert theirs.skipped() == ["1 (torch.nn.LayerNorm, kfac-pytorch's conventions: left to the optimizer "
                                "(conventions='kfac' preconditions it))"]
    p = kfac.KFACPreconditioner(model, conventions='kfac', token_reduction='reduce', damping=0.01, lr=0.1)
    assert p.modules() == ['0', '1', '3']
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 4, 6)
    y = (x.sum(-1).mean(-1) > 0).long()  # a class per sequence: its tokens pooled
    losses = []
    for _ in range(200):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).mean(1), y)
        loss.backward()
        p.step()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.3 * losses[0], losses[::20]


def test_layer_norm_over_two_dimensions_is_refused_by_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm([3, 4]))
    with pytest.raises(kfac.KFACError, match="normalizes over its last 2 dimensions") as info:
        kfac.KFACPreconditioner(model, conventions='kfac')
    assert info.value.layer == '1'


def test_layer_norm_takes_the_unit_wise_fisher_and_refuses_kronecker_methods_by_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    p = kfac.KFACPreconditioner(model, conventions='kfac', methods={'1': kfac.methods.UnitWiseFisher()})
    assert p.modules() == ['0', '1']
    with pytest.raises(ValueError, match="Eigen is for Linear and Conv2d modules; module '1'"):
        kfac.KFACPreconditioner(model, conventions='kfac', methods={'1': kfac.methods.Eigen()})
