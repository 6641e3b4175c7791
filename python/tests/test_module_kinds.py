"""Module kinds as an open seam, from Python: a module class defined here alone is registered with
kfac.register_module onto one of the core's kinds ('layer_norm': the unit-wise Fisher of a scale
per feature) with its own translation of observations (a scale observes its input itself, not a
normalized one). What this shows: the Python side maps a new module class onto a core kind, with
its own settings and observations, without editing the package; a new layer policy (new rows of A
and G) needs C++ (tests/test_torch_kinds.cpp registers one through the LibTorch front end).
Checked against per-sample gradients that autograd computes in float64 one sample at a time."""

from __future__ import annotations

import pytest
import torch

import kfac
from kfac import preconditioner as kfac_preconditioner


class Scale(torch.nn.Module):
    """y = x * weight over the last dimension: a per-feature scale without shift."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.scale = Scale(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(torch.tanh(self.fc(x)))


@pytest.fixture
def scale_registered():
    before = list(kfac_preconditioner._MODULE_KINDS)
    kfac.register_module(
        Scale,
        'layer_norm',
        lambda m, conventions: {'num_features': m.weight.numel(), 'eps': 0.0},
        input=lambda m, x: x.reshape(x.size(0), -1, x.size(-1)) if x.dim() > 2 else x,
    )
    yield
    kfac_preconditioner._MODULE_KINDS[:] = before


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)  # the mean over every sample, token and feature


@pytest.mark.parametrize('tokens', [1, 5])
def test_a_module_class_mapped_onto_a_core_kind_takes_the_per_sample_fisher(scale_registered, tokens: int) -> None:
    torch.manual_seed(11)
    model = Net().double()
    with torch.no_grad():
        model.scale.weight.uniform_(0.5, 1.5)
    damping = 0.01
    p = kfac.KFACPreconditioner(
        model, conventions='kfac', token_reduction='expand', damping=damping, kl_clip=None, factor_decay=0.5,
    )
    assert p.modules() == ['fc', 'scale']
    n = 6
    x = torch.randn(n, tokens, 3, dtype=torch.float64)
    y = torch.randn(n, tokens, 4, dtype=torch.float64)
    per_sample = []
    model.eval()  # the hooks record nothing out of training mode
    for i in range(n):
        model.zero_grad()
        loss_of(model, x[i:i + 1], y[i:i + 1]).backward()
        per_sample.append(model.scale.weight.grad.clone())
    model.train()
    fisher = torch.stack(per_sample).square().mean(0)
    model.zero_grad()
    loss_of(model, x, y).backward()
    grad = model.scale.weight.grad.clone()
    p.step()
    want = grad / (fisher + damping)
    assert torch.allclose(model.scale.weight.grad, want, rtol=1e-10, atol=1e-14), (model.scale.weight.grad, want)
    assert not torch.allclose(grad, want, rtol=1e-3)


def test_without_its_registration_the_module_is_left_to_the_optimizer() -> None:
    p = kfac.KFACPreconditioner(Net(), conventions='kfac')
    assert p.modules() == ['fc']
    assert p.skipped() == ["scale (test_module_kinds.Scale, no kfac layer type: left to the optimizer "
                           "(fallback='diagonal' preconditions it))"]


def test_register_module_refuses_what_it_cannot_map() -> None:
    with pytest.raises(ValueError, match="kind 'scale' is not one of the core's kinds"):
        kfac.register_module(Scale, 'scale', lambda m, conventions: {})
    with pytest.raises(TypeError, match='is not a torch.nn.Module class'):
        kfac.register_module(int, 'linear', lambda m, conventions: {})


def test_the_refusal_names_the_module_classes_registered_now() -> None:
    """The core's refusal of a module no kind takes lists the classes registered at that moment."""
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4), torch.nn.Linear(4, 2))

    def refusal() -> str:
        with pytest.raises(kfac.KFACError) as info:
            kfac.KFACPreconditioner(model, strict=True)
        return str(info.value)

    assert '.Scale' not in refusal()
    before = list(kfac_preconditioner._MODULE_KINDS)
    try:
        kfac.register_module(Scale, 'layer_norm', lambda m, conventions: {'num_features': m.weight.numel(), 'eps': 0.0})
        text = refusal()
    finally:
        kfac_preconditioner._MODULE_KINDS[:] = before
    assert '(supported: torch.nn.Linear, torch.nn.Conv2d, ' in text, text
    assert f'torch.nn.Embedding, {Scale.__module__}.Scale); ' in text, text
