"""The losses kfac's sampled Fisher and self-tuning know (docs/self_tuning.md), in one table.

Each is PyTorch's loss of that name with the preconditioner's reduction ('mean': over every element
of the batch, as torch's default; 'sum'), seen as a per-sample loss c * l(z, y) on the outputs z
(one row per sample, every dimension after the first flattened): l is the negative log-likelihood
of the model's predictive distribution p(y | z) and c a constant weight. Its curvature at the
outputs (the Gauss-Newton matrix H) is then c times the Fisher of p, which is what the sampled
Fisher's output gradients estimate and what kfac::SelfTuning's LossCurvature computes:

| loss | torch | p(y given z) | l(z, y) | c ('mean' / 'sum') | H per sample |
|---|---|---|---|---|---|
| 'cross_entropy' | F.cross_entropy | categorical, softmax(z) | cross-entropy | 1 / 1 | diag(p) - pp^T |
| 'mse' | F.mse_loss | normal N(z, I/2) | squared error norm | 1/K / 1 | 2c I |
| 'bce' | F.binary_cross_entropy_with_logits | Bernoulli, sigmoid(z) | sum over K outputs | 1/K / 1 | c diag(p(1-p)) |

(K: the outputs per sample; the mean's 1/N over the batch is kfac's loss_reduction='mean'.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSSES = ('cross_entropy', 'mse', 'bce')

# The kfac::LossCurvature of each loss.
_CURVATURE = {'cross_entropy': 'softmax_cross_entropy', 'mse': 'squared_error', 'bce': 'sigmoid_cross_entropy'}


def check_loss(loss: str) -> str:
    if loss not in LOSSES:
        raise ValueError(f'loss = {loss!r}: expected one of {", ".join(map(repr, LOSSES))}')
    return loss


def rows(outputs: torch.Tensor) -> torch.Tensor:
    """The outputs as (samples, outputs per sample)."""
    if outputs.dim() < 1:
        raise ValueError(f'model outputs of shape {tuple(outputs.shape)}: expected a batch dimension')
    return outputs.reshape(outputs.size(0), -1)


def value(loss: str, outputs: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """The loss as PyTorch computes it."""
    if loss == 'cross_entropy':
        if outputs.dim() != 2:
            raise ValueError(
                f"loss='cross_entropy': model outputs of shape {tuple(outputs.shape)}; "
                'expected logits (batch, classes)',
            )
        return F.cross_entropy(outputs, targets, reduction=reduction)
    if loss == 'mse':
        return F.mse_loss(outputs, targets, reduction=reduction)
    return F.binary_cross_entropy_with_logits(outputs, targets, reduction=reduction)


def weight(loss: str, outputs: torch.Tensor, reduction: str) -> float:
    """c: the per-sample loss over the negative log-likelihood (table above)."""
    if loss == 'cross_entropy' or reduction == 'sum':
        return 1.0
    return 1.0 / rows(outputs).size(1)


def curvature(loss: str, outputs: torch.Tensor, reduction: str) -> tuple[str, float]:
    """kfac::SelfTuning's LossCurvature and loss_scale for these outputs (its squared error is
    1/2 ||z - t||^2, so the scale of 'mse' is 2c)."""
    c = weight(loss, outputs, reduction)
    return _CURVATURE[loss], 2.0 * c if loss == 'mse' else c


def sample(loss: str, outputs: torch.Tensor) -> torch.Tensor:
    """Targets drawn from the model's predictive distribution p(y | z) (torch's global generator)."""
    z = outputs.detach()
    if loss == 'cross_entropy':
        return torch.multinomial(torch.softmax(z, dim=1), 1).squeeze(1)
    if loss == 'mse':
        return z + math.sqrt(0.5) * torch.randn_like(z)
    return torch.bernoulli(torch.sigmoid(z))


def sampled_objective(loss: str, outputs: torch.Tensor, reduction: str) -> torch.Tensor:
    """A scalar whose gradient with respect to the outputs is, per sample, sqrt(c) times the
    gradient of l at targets drawn from p, with the reduction's 1/N: its outer products average to
    c times the Fisher of p, the loss's curvature H (the empirical loss's gradients are c times
    the gradient of l, whose outer products would give c^2 times the Fisher)."""
    y = sample(loss, outputs)
    c = weight(loss, outputs, reduction)
    if loss == 'cross_entropy':
        per_sample = F.cross_entropy(outputs, y, reduction='sum')
    elif loss == 'mse':
        per_sample = F.mse_loss(outputs, y, reduction='sum')
    else:
        per_sample = F.binary_cross_entropy_with_logits(outputs, y, reduction='sum')
    n = outputs.size(0) if reduction == 'mean' else 1
    return per_sample * (math.sqrt(c) / n)
