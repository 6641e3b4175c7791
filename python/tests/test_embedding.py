"""Embedding under kfac's conventions: the preconditioned gradient against a float64 reference
written here from the per-token output gradients (diag(A) from the ids' counts, G from the output
gradients with Dense's expand scaling, the dense (A ⊗ G + γI) solve); left to the optimizer under
kfac-pytorch's conventions; the modules and methods it cannot take refused by name; a tiny
character model (Embedding, LayerNorm, Linear over tokens) trains; a checkpoint round trip."""

from __future__ import annotations

import copy

import pytest
import torch

import kfac

VOCABULARY, DIM, CLASSES = 7, 4, 3


class Tagger(torch.nn.Module):
    """A class per token: an Embedding, then a Linear head over the tokens."""

    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCABULARY, DIM, padding_idx=padding_idx)
        self.head = torch.nn.Linear(DIM, CLASSES)


def reference(ids: torch.Tensor, out_grad: torch.Tensor, grad: torch.Tensor, padding_idx: int | None,
              damping: float, diagonal: bool = False) -> torch.Tensor:
    """(diag(A) ⊗ G + γI)^{-1} vec(grad) in float64, W's rows by A and its columns by G, for a loss
    that is the mean over the N samples: A = diag(count_v) / (N T) over the tokens that are not
    padding; G = (1/N) Σ_{n,t} (N g_nt)(N g_nt)^T, g_nt the output gradient of token t of sample n
    (kfac multiplies the mean loss's by N, as for a Linear over tokens, K-FAC-expand)."""
    n = ids.shape[0]
    tokens = ids[0].numel()
    flat, g = ids.reshape(-1), out_grad.reshape(-1, DIM).double()
    kept = torch.ones_like(flat, dtype=torch.bool) if padding_idx is None else flat != padding_idx
    counts = torch.bincount(flat[kept], minlength=VOCABULARY).double()
    a = torch.diag(counts / (n * tokens))
    g = g[kept] * n
    fisher_g = g.T @ g / n
    if diagonal:
        fisher_g = torch.diag(torch.diagonal(fisher_g))
    # Row-major vec: (A ⊗ G) vec(X) = vec(A X G^T).
    m = torch.kron(a, fisher_g) + damping * torch.eye(VOCABULARY * DIM, dtype=torch.float64)
    return torch.linalg.solve(m, grad.reshape(-1).double()).reshape(VOCABULARY, DIM)


@pytest.mark.parametrize('shape', [(6,), (3, 4), (2, 2, 3)])  # (B, T1, T2): one run of T1 T2 tokens
@pytest.mark.parametrize('padding_idx', [None, 0])
@pytest.mark.parametrize('diagonal', [False, True])
def test_embedding_fisher_against_the_dense_kronecker_solve(shape: tuple[int, ...], padding_idx: int | None,
                                                            diagonal: bool) -> None:
    torch.manual_seed(11)
    model = Tagger(padding_idx).double()
    damping = 0.01
    methods = {'emb': kfac.methods.EmbeddingFisher(diagonal=True)} if diagonal else None
    p = kfac.KFACPreconditioner(model, conventions='kfac', token_reduction='expand', damping=damping, kl_clip=None,
                                methods=methods)
    assert p.modules() == ['emb', 'head']
    ids = torch.randint(0, VOCABULARY, shape)
    ids.view(-1)[:2] = torch.tensor([0, 3])  # a padding token and a repeated id at least
    ids.view(-1)[-1] = 3
    y = torch.randint(0, CLASSES, shape)
    out = model.emb(ids)
    out.retain_grad()  # the per-token output gradients, by autograd
    logits = model.head(torch.tanh(out))
    torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1)).backward()  # mean over tokens
    grad = model.emb.weight.grad.clone()
    p.step()
    want = reference(ids, out.grad, grad, padding_idx, damping, diagonal)
    got = model.emb.weight.grad
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-14), (got, want)
    if padding_idx is not None:
        assert torch.count_nonzero(got[padding_idx]) == 0
    assert not torch.allclose(got, grad, rtol=1e-3)


def test_factor_and_decomposition_dtypes_are_honoured() -> None:
    """float32 statistics of a float64 model: the reference up to float32's rounding, not bit for bit;
    a float16 factor_dtype is for the Kronecker modules (the Embedding keeps float32)."""
    grads = {}
    for name, kwargs in [('float64', {}), ('float32', {'factor_dtype': torch.float32, 'inv_dtype': torch.float32}),
                         ('half', {'factor_dtype': torch.float16})]:
        torch.manual_seed(5)
        model = Tagger(0).double()
        p = kfac.KFACPreconditioner(model, conventions='kfac', token_reduction='expand', damping=0.01, kl_clip=None,
                                    **kwargs)
        ids = torch.randint(0, VOCABULARY, (4, 5))
        out = model.head(torch.tanh(model.emb(ids)))
        torch.nn.functional.cross_entropy(out.reshape(-1, CLASSES), torch.randint(0, CLASSES, (20,))).backward()
        p.step()
        grads[name] = model.emb.weight.grad.clone()
    assert not torch.equal(grads['float32'], grads['float64'])
    assert torch.allclose(grads['float32'], grads['float64'], rtol=1e-4, atol=1e-6)
    assert torch.allclose(grads['half'], grads['float32'], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match='EmbeddingFisher: factor_dtype=torch.float16: half-precision storage'):
        kfac.methods.EmbeddingFisher(factor_dtype=torch.float16)


def test_embedding_is_left_to_the_optimizer_under_kfac_pytorchs_conventions() -> None:
    model = Tagger(None)
    p = kfac.KFACPreconditioner(model, token_reduction='expand')
    assert p.modules() == ['head']
    assert p.skipped() == ["emb (torch.nn.Embedding, kfac-pytorch's conventions: left to the optimizer "
                           "(conventions='kfac' preconditions it))"]
    # strict=True does not refuse it: the conventions leave it, as kfac-pytorch does.
    assert kfac.KFACPreconditioner(model, strict=True).modules() == ['head']


def test_embeddings_and_methods_kfac_cannot_take_are_refused_by_name() -> None:
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(kfac.KFACError, match=r"\(torch.nn.Embedding\) sparse gradients") as info:
        kfac.KFACPreconditioner(sparse, conventions='kfac')
    assert info.value.layer == '0'
    by_freq = torch.nn.Sequential(torch.nn.Embedding(10, 4, scale_grad_by_freq=True), torch.nn.Linear(4, 2))
    with pytest.raises(kfac.KFACError, match='scale_grad_by_freq divides'):
        kfac.KFACPreconditioner(by_freq, conventions='kfac')
    assert kfac.KFACPreconditioner(sparse, conventions='kfac', skip_layers=['Embedding']).modules() == ['1']
    # float32 token ids are exact up to 2^24 (the weight left uninitialized: only its size matters)
    big = torch.nn.Embedding(2**24 + 1, 1, _weight=torch.empty(2**24 + 1, 1))
    with pytest.raises(kfac.KFACError, match='a vocabulary of 16777217 ids with float32 parameters') as info:
        kfac.KFACPreconditioner(big, conventions='kfac')
    assert info.value.layer == 'root'
    tied = Tagger(None)
    tied.head = torch.nn.Linear(DIM, VOCABULARY, bias=False)
    tied.head.weight = tied.emb.weight  # a language model's tied input and output embeddings
    with pytest.raises(kfac.KFACError, match=r"its weight is also a parameter of 'emb' \(tied weights\)") as info:
        kfac.KFACPreconditioner(tied, conventions='kfac')
    assert info.value.layer == 'head'
    assert kfac.KFACPreconditioner(tied, conventions='kfac', skip_layers=['head']).modules() == ['emb']
    model = Tagger(None)
    with pytest.raises(ValueError, match="Eigen is for Linear and Conv2d modules; module 'emb' is a torch.nn.Embed"):
        kfac.KFACPreconditioner(model, conventions='kfac', methods={'emb': kfac.methods.Eigen()})
    with pytest.raises(ValueError, match="EmbeddingFisher is for Embedding modules; module 'head' is a torch.nn.Lin"):
        kfac.KFACPreconditioner(model, conventions='kfac', methods={'head': kfac.methods.EmbeddingFisher()})
    with pytest.raises(ValueError, match='EmbeddingFisher: jacobi_sweeps must be an int >= 1'):
        kfac.methods.EmbeddingFisher(jacobi_sweeps=0)


TEXT = 'k-fac preconditions the embedding of every character. '


class CharModel(torch.nn.Module):
    """A character model without attention: token and position embeddings, a LayerNorm, an MLP
    over the tokens and a head predicting the next character."""

    def __init__(self, vocabulary: int, context: int, dim: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocabulary, dim)
        self.pos = torch.nn.Embedding(context, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 2 * dim)
        self.head = torch.nn.Linear(2 * dim, vocabulary)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        h = self.norm(self.tok(ids) + self.pos(positions))
        return self.head(torch.nn.functional.gelu(self.fc(h)))


def char_batches(batch: int, context: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT * 4])
    starts = torch.arange(batch) * 5 % len(TEXT)
    x = torch.stack([data[s:s + context] for s in starts])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts])
    return chars, x, y


def char_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # mean over tokens


def test_a_character_model_trains_with_its_embeddings_preconditioned() -> None:
    torch.manual_seed(2)
    context = 12
    chars, x, y = char_batches(16, context)
    model = CharModel(len(chars), context)
    p = kfac.KFACPreconditioner(model, conventions='kfac', token_reduction='expand', damping=0.01, lr=0.1,
                                inv_update_steps=5)
    assert p.modules() == ['tok', 'pos', 'norm', 'fc', 'head']
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(200):
        opt.zero_grad()
        loss = char_loss(model, x, y)
        loss.backward()
        p.step()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.25 * losses[0], losses[::20]


def test_state_dict_round_trip_continues_bit_for_bit() -> None:
    torch.manual_seed(4)
    context = 8
    chars, x, y = char_batches(6, context)
    settings = dict(conventions='kfac', token_reduction='expand', damping=0.01, inv_update_steps=2, factor_decay=0.9)
    model = CharModel(len(chars), context, dim=6)
    p = kfac.KFACPreconditioner(model, **settings)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        char_loss(model, x, y).backward()
        p.step()
        opt.step()
    twin = copy.deepcopy(model)
    restored = kfac.KFACPreconditioner(twin, **settings)
    restored.load_state_dict(p.state_dict())
    for m, q in [(model, p), (twin, restored)]:
        m.zero_grad()
        char_loss(m, x[:, :5], y[:, :5]).backward()
        q.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name
