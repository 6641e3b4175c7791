"""The diagonal-Fisher fallback (kfac.methods.DiagonalFisher, fallback='diagonal'): registration
lists, every parameter preconditioned against an independent float64 reference of the diagonal
step, MultiheadAttention, tied weights, and a TransformerEncoder language model that trains."""

from __future__ import annotations

import pytest
import torch

import kfac


class Scale(torch.nn.Module):
    """A module kfac has no layer type for: y = x * s + t, with a matrix parameter besides."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.s = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.t = torch.nn.Parameter(torch.zeros(d))
        self.m = torch.nn.Parameter(torch.eye(d) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.s + self.t) @ self.m


class Encoder(torch.nn.Module):
    """kfac-pytorch's language-model shape: embedding, TransformerEncoder, linear decoder."""

    def __init__(self, vocabulary: int = 12, d: int = 16, tied: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocabulary, d)
        self.pos = torch.nn.Parameter(torch.zeros(1, 8, d))
        layer = torch.nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1)
        self.head = torch.nn.Linear(d, vocabulary)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x) + self.pos[:, : x.size(1)]))


def covered(model: torch.nn.Module, p: kfac.KFACPreconditioner) -> set[int]:
    """The parameters the registered names precondition: a parameter's own name, or a module's."""
    mods = dict(model.named_modules())
    params = {f'{m or "root"}.{n}': q for m, mod in mods.items() for n, q in mod.named_parameters(recurse=False)}
    out: set[int] = set()
    for name in p.modules():
        if name in params:
            out.add(id(params[name]))
        else:
            out.update(id(q) for q in mods['' if name == 'root' else name].parameters(recurse=False))
    return out


def test_fallback_registers_every_parameter_of_a_transformer_encoder() -> None:
    model = Encoder()
    p = kfac.KFACPreconditioner(model, conventions='kfac', fallback='diagonal', token_reduction='expand')
    attn = 'encoder.layers.0.self_attn'
    assert p.modules() == [
        'root.pos', 'emb', f'{attn}.in_proj_weight', f'{attn}.in_proj_bias', f'{attn}.out_proj.weight',
        f'{attn}.out_proj.bias', 'encoder.layers.0.linear1', 'encoder.layers.0.linear2', 'encoder.layers.0.norm1',
        'encoder.layers.0.norm2', 'head',
    ]
    assert p.skipped() == []
    assert covered(model, p) == {id(q) for q in model.parameters()}


def test_without_the_fallback_attention_is_left_whole_and_named() -> None:
    p = kfac.KFACPreconditioner(Encoder(), conventions='kfac', token_reduction='expand')
    assert not any('self_attn' in m or m == 'root' for m in p.modules())  # never half-registered
    left = p.skipped()
    assert any(s.startswith('encoder.layers.0.self_attn (torch.nn.MultiheadAttention, no kfac layer type')
               and "fallback='diagonal' preconditions it" in s for s in left), left
    assert any(s.startswith('encoder.layers.0.self_attn.out_proj ') for s in left), left


def test_kfac_pytorchs_conventions_refuse_the_fallback_by_name() -> None:
    with pytest.raises(ValueError, match="fallback='diagonal' is one of kfac's conventions"):
        kfac.KFACPreconditioner(Encoder(), fallback='diagonal')
    with pytest.raises(ValueError, match="fallback must be None or 'diagonal'"):
        kfac.KFACPreconditioner(Encoder(), conventions='kfac', fallback='adam')
    with pytest.raises(ValueError, match=r"methods\['head'\]: DiagonalFisher is one of kfac's conventions"):
        kfac.KFACPreconditioner(Encoder(), methods={'head': kfac.methods.DiagonalFisher()})
    with pytest.raises(ValueError, match='half-precision storage is for Kronecker factors'):
        kfac.methods.DiagonalFisher(factor_dtype=torch.float16)


def reference_step(grads: list[torch.Tensor], f: list[torch.Tensor] | None, n: int, damping: float,
                   decay: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The diagonal step from its definition, in float64: f_hat = N g^2 for a mean loss's gradient g
    over N samples, the running average, and g / (f + damping)."""
    fhat = [n * g.double() ** 2 for g in grads]
    f = fhat if f is None else [decay * a + (1 - decay) * b for a, b in zip(f, fhat)]
    return [g.double() / (a + damping) for g, a in zip(grads, f)], f


@pytest.mark.parametrize('through', ['fallback', 'methods'])
def test_every_parameter_preconditioned_against_a_float64_reference(through: str) -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(Scale(4), torch.nn.Tanh(), Scale(4)).double()
    damping, decay = 0.05, 0.7
    kwargs = {'fallback': 'diagonal'} if through == 'fallback' else {'methods': {'.': kfac.methods.DiagonalFisher()}}
    p = kfac.KFACPreconditioner(model, conventions='kfac', damping=damping, factor_decay=decay, kl_clip=None,
                                **kwargs)
    assert p.modules() == ['0.s', '0.t', '0.m', '2.s', '2.t', '2.m']
    f = None
    for step in range(3):
        x = torch.randn(6, 4, dtype=torch.float64)
        model.zero_grad()
        model(x).square().sum(1).mean().backward()
        grads = [q.grad.clone() for q in model.parameters()]
        # the batch gradient from the per-sample gradients, computed independently
        per_sample = []
        model.eval()  # no hook counts these calls (the model computes the same in both modes)
        for k in range(6):
            g = torch.autograd.grad(model(x[k:k + 1]).square().sum(), list(model.parameters()))
            per_sample.append(g)
        model.train()
        mean = [torch.stack([ps[j] for ps in per_sample]).mean(0) for j in range(len(grads))]
        for a, b in zip(grads, mean):
            torch.testing.assert_close(a, b)
        expect, f = reference_step(mean, f, 6, damping, decay)
        p.step()
        for q, e in zip(model.parameters(), expect):
            torch.testing.assert_close(q.grad, e, rtol=1e-12, atol=0)


def test_multihead_attention_gets_the_diagonal_on_each_packed_parameter() -> None:
    torch.manual_seed(2)
    attn = torch.nn.MultiheadAttention(8, 2).double()  # (tokens, batch, d): the batch is dim 1
    model = torch.nn.Sequential()
    model.add_module('attn', attn)
    p = kfac.KFACPreconditioner(model, conventions='kfac', fallback='diagonal', kl_clip=None, damping=0.1)
    assert p.modules() == ['attn.in_proj_weight', 'attn.in_proj_bias', 'attn.out_proj.weight', 'attn.out_proj.bias']
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    attn(x, x, x)[0].square().mean().backward()
    grads = [q.grad.clone() for q in attn.parameters()]
    expect, _ = reference_step(grads, None, 3, 0.1, 0.95)
    p.step()
    for q, e in zip(attn.parameters(), expect):
        torch.testing.assert_close(q.grad, e, rtol=1e-12, atol=0)


def test_tied_weights_are_preconditioned_once_by_the_first_owner() -> None:
    torch.manual_seed(3)
    model = Encoder(tied=True).double()
    p = kfac.KFACPreconditioner(model, conventions='kfac', fallback='diagonal', token_reduction='expand',
                                kl_clip=None, damping=0.1)
    assert 'emb.weight' in p.modules() and 'head.bias' in p.modules()
    assert 'emb' not in p.modules() and 'head' not in p.modules() and 'head.weight' not in p.modules()
    assert "head.weight (torch.nn.Linear parameter, tied weights: preconditioned once, as 'emb.weight')" in p.skipped()
    assert covered(model, p) == {id(q) for q in model.parameters()}
    x = torch.randint(0, 12, (4, 6))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    g = model.emb.weight.grad.clone()  # the sum of both modules' contributions
    (expect,), _ = reference_step([g], None, 4, 0.1, 0.95)
    p.step()
    torch.testing.assert_close(model.emb.weight.grad, expect, rtol=1e-12, atol=0)
    # without the fallback: refused by name (each module would precondition the shared gradient for its own factors)
    with pytest.raises(kfac.KFACError, match=r"'head'.*tied weights"):
        kfac.KFACPreconditioner(Encoder(tied=True), conventions='kfac', token_reduction='expand')


def test_a_transformer_encoder_language_model_trains_with_every_parameter_preconditioned() -> None:
    torch.manual_seed(0)
    model = Encoder()
    p = kfac.KFACPreconditioner(model, conventions='kfac', fallback='diagonal', token_reduction='expand',
                                damping=0.01, lr=0.05)
    assert covered(model, p) == {id(q) for q in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randint(0, 12, (16, 8))
    y = torch.roll(x, 1, dims=1)  # copy the previous token
    losses = []
    for _ in range(120):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        p.step()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses[::10]
