"""Registration: every supported module, the rest left to the optimizer (or refused by name with
strict=True), skip_layers, frozen modules, and kfac-pytorch's argument checks."""

from __future__ import annotations

import pytest
import torch

import kfac


class Supported(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=1)
        self.conv_same = torch.nn.Conv2d(4, 4, 3, padding='same', dilation=2, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.bn_plain = torch.nn.BatchNorm2d(4, affine=False)  # no parameters: ignored
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5), torch.nn.Linear(5, 2, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.bn_plain(self.bn(self.conv_same(self.conv(x))))))


BN_LEFT = "kfac-pytorch's conventions: left to the optimizer (conventions='kfac' preconditions it)"


@pytest.mark.parametrize('conventions', ['kfac-pytorch', 'kfac'])
def test_every_supported_module_is_registered(conventions: str) -> None:
    model = Supported()
    p = kfac.KFACPreconditioner(model, conventions=conventions)
    if conventions == 'kfac':
        assert p.modules() == ['conv', 'conv_same', 'bn', 'head.1', 'head.2']
        assert p.skipped() == []
    else:  # kfac-pytorch registers Linear and Conv2d only
        assert p.modules() == ['conv', 'conv_same', 'head.1', 'head.2']
        assert p.skipped() == [f'bn (torch.nn.BatchNorm2d, {BN_LEFT})']
    # and it runs
    torch.nn.functional.cross_entropy(model(torch.randn(6, 3, 8, 8)), torch.randint(0, 2, (6,))).backward()
    p.step()
    assert p.steps == 1


class Custom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))


class Unsupported(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.grouped = torch.nn.Conv2d(4, 4, 3, groups=2)
        self.depthwise = torch.nn.Conv2d(4, 4, 3, groups=4)
        self.reflect = torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode='reflect')
        self.asym = torch.nn.Conv2d(4, 4, 2, padding='same')
        self.emb = torch.nn.Embedding(10, 4)
        self.bag = torch.nn.EmbeddingBag(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.up = torch.nn.ConvTranspose2d(4, 4, 3)
        self.custom = Custom()
        self.fc = torch.nn.Linear(4, 2)


def test_the_rest_is_refused_by_name_when_strict() -> None:
    with pytest.raises(kfac.KFACError) as info:
        kfac.KFACPreconditioner(Unsupported(), strict=True)
    text = str(info.value)
    assert text.startswith('kfac: modules kfac cannot handle: ')
    for name, why in [
        ('grouped', 'grouped convolutions (groups = 2)'),
        ('depthwise', 'depthwise convolutions (groups = in_channels = 4)'),
        ('reflect', 'only zero padding is supported (padding_mode reflect)'),
        ('asym', "padding 'same' with an even dilated kernel pads asymmetrically"),
        ('bag', '(torch.nn.EmbeddingBag) owns parameters but kfac has no layer type'),
        ('up', '(torch.nn.ConvTranspose2d)'),
        ('custom', 'Custom) owns parameters'),
    ]:
        assert f"'{name}'" in text and why in text, (name, text)
    assert "'fc'" not in text
    assert "'norm'" not in text  # kfac-pytorch's conventions leave LayerNorm to the optimizer, as BatchNorm2d
    assert "'emb'" not in text  # and Embedding
    assert isinstance(info.value, RuntimeError)


def test_one_refused_module_is_the_errors_layer() -> None:
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4), torch.nn.Linear(4, 2))
    with pytest.raises(kfac.KFACError) as info:
        kfac.KFACPreconditioner(model, strict=True)
    assert info.value.layer == '0'
    # The C++ core's text, as kfac::Error writes it.
    assert str(info.value) == (
        "kfac: layer '0': (torch.nn.EmbeddingBag) owns parameters but kfac has no layer type for it "
        '(supported: torch.nn.Linear, torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.Embedding); '
        'add its name or class to '
        'skip_layers to leave it to the optimizer alone'
    )


LEFT = 'no kfac layer type: left to the optimizer'


def test_the_rest_is_left_to_the_optimizer_by_default() -> None:
    """kfac-pytorch's rule: a module kfac has no layer type for is ignored and named by skipped();
    a known type configured in a way kfac cannot handle is still refused, by name."""
    p = kfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4), torch.nn.LayerNorm(4), Custom(),
                                                    torch.nn.ConvTranspose2d(4, 4, 3), torch.nn.Linear(4, 2)))
    assert p.modules() == ['4']
    skipped = p.skipped()
    by_convention = "kfac-pytorch's conventions: left to the optimizer (conventions='kfac' preconditions it)"
    assert skipped[:2] == [f'0 (torch.nn.EmbeddingBag, {LEFT})', f'1 (torch.nn.LayerNorm, {by_convention})']
    assert skipped[2].startswith('2 (') and skipped[2].endswith(f'.Custom, {LEFT})'), skipped[2]
    assert skipped[3:] == [f'3 (torch.nn.ConvTranspose2d, {LEFT})']
    with pytest.raises(kfac.KFACError, match="layer 'grouped'.*grouped convolutions"):
        kfac.KFACPreconditioner(torch.nn.ModuleDict({'grouped': torch.nn.Conv2d(4, 4, 3, groups=2),
                                                     'fc': torch.nn.Linear(4, 2)}))
    with pytest.raises(kfac.KFACError, match=r'no module to precondition \(layer types: torch\.nn\.Linear, '):
        kfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Embedding(10, 4)))


def test_left_modules_keep_their_gradients() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Flatten(),
                                torch.nn.Linear(12, 2))
    p = kfac.KFACPreconditioner(model)
    assert p.modules() == ['3']
    model(torch.randint(0, 10, (5, 3))).square().sum().backward()
    before = {n: q.grad.clone() for n, q in model.named_parameters()}
    p.step()
    for n, q in model.named_parameters():
        assert torch.equal(q.grad, before[n]) == (not n.startswith('3.')), n


class TinyLM(torch.nn.Module):
    """The shape of kfac-pytorch's language-model example: an embedding, a transformer encoder
    (whose attention's out_proj is a subclass of Linear that its forward never calls) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(8, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x)))


OUT_PROJ = "MultiheadAttention's out_proj, whose forward it never calls: left to the optimizer"


@pytest.mark.parametrize('conventions', ['kfac-pytorch', 'kfac'])
def test_a_transformer_encoder_trains_with_its_linears_preconditioned(conventions: str) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    p = kfac.KFACPreconditioner(model, token_reduction='expand', conventions=conventions)
    # kfac's conventions precondition the LayerNorms and the Embedding too (kfac-pytorch's leave them to the
    # optimizer).
    norms = conventions == 'kfac'
    per_layer = [('linear1', True), ('linear2', True), ('norm1', norms), ('norm2', norms)]
    assert p.modules() == [*(['emb'] if norms else []),
                           *[f'encoder.layers.{i}.{m}' for i in range(2) for m, on in per_layer if on], 'head']
    left = [s.split(' ')[0] for s in p.skipped()]
    per_layer = [('self_attn', True), ('self_attn.out_proj', True), ('norm1', not norms), ('norm2', not norms)]
    assert left == [*([] if norms else ['emb']),
                    *[f'encoder.layers.{i}.{m}' for i in range(2) for m, on in per_layer if on]]
    # A subclass of Linear (kfac-pytorch registers those) that its owner never calls.
    out_proj = [s for s in p.skipped() if s.startswith('encoder.layers.0.self_attn.out_proj ')]
    assert out_proj == [f'encoder.layers.0.self_attn.out_proj (torch.nn.NonDynamicallyQuantizableLinear, {OUT_PROJ})']
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randint(0, 20, (6, 5))
    y = torch.roll(x, 1, dims=1)  # a copying task: the previous token
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1))
        loss.backward()
        p.step()
        opt.step()
        losses.append(loss.item())
    assert p.steps == 30
    assert all(torch.isfinite(torch.tensor(losses)))
    # kfac-pytorch's G is that of the mean loss's gradients (N^2 smaller): the damping weighs more.
    assert losses[-1] < (0.8 if conventions == 'kfac' else 0.9) * losses[0], losses


def test_dtypes_and_devices_are_checked() -> None:
    with pytest.raises(kfac.KFACError, match='float32 and float64'):
        kfac.KFACPreconditioner(torch.nn.Linear(3, 2).half())
    mixed = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(kfac.KFACError, match='one model, one dtype'):
        kfac.KFACPreconditioner(mixed)
    # A meta tensor stands in for CUDA, which Debian's PyTorch has not.
    meta = torch.nn.Linear(3, 2, device='meta')
    with pytest.raises(kfac.KFACError, match='a parameter is on meta; .*CPU tensors only') as info:
        kfac.KFACPreconditioner(meta)
    assert info.value.layer == 'root'  # one problem per module: the error's layer


def test_skip_layers_by_name_and_class() -> None:
    model = Unsupported()
    p = kfac.KFACPreconditioner(
        model,
        skip_layers=['grouped', 'depth', 'reflect', 'asym', 'Embedding', 'LayerNorm', 'up', 'custom'],
    )
    assert p.modules() == ['fc']
    assert len(p.skipped()) == 9
    assert 'emb (torch.nn.Embedding, skip list)' in p.skipped()
    assert 'bag (torch.nn.EmbeddingBag, skip list)' in p.skipped()
    # A string is one pattern (kfac-pytorch accepts both).
    assert kfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)), skip_layers='0').modules() == ['1']


def test_a_skip_pattern_matching_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="'fc9', 'Conv3d' matches no module"):
        kfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(3, 2)), skip_layers=['fc9', 'Linear', 'Conv3d'])


def test_frozen_modules_are_skipped_and_untouched() -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.Embedding(2, 2))
    for param in model[0].parameters():
        param.requires_grad_(False)
    for param in model[3].parameters():  # frozen and unsupported: skipped too
        param.requires_grad_(False)
    w0 = model[0].weight.clone()
    p = kfac.KFACPreconditioner(model, lr=0.1)
    assert p.modules() == ['2']
    assert p.frozen() == ['0', '3']
    assert '0 (torch.nn.Linear, frozen: requires_grad = false)' in p.skipped()
    assert len(model[0]._forward_pre_hooks) == 0 and len(model[0]._backward_hooks) == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model[:3](torch.randn(6, 4)), torch.randint(0, 3, (6,))).backward()
        p.step()
        opt.step()
        assert model[0].weight.grad is None
    assert torch.equal(model[0].weight, w0)


def test_a_module_frozen_in_part_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    model[1].weight.requires_grad_(False)
    with pytest.raises(kfac.KFACError, match='its weight is frozen') as info:
        kfac.KFACPreconditioner(model)
    assert info.value.layer == '1'


@pytest.mark.parametrize(
    ('kwargs', 'message'),
    [
        ({'factor_update_steps': 0}, 'factor_update_steps must be > 0'),
        ({'inv_update_steps': -1}, 'inv_update_steps must be > 0'),
        ({'damping': 0.0}, 'damping must be > 0'),
        ({'factor_decay': 1.5}, 'factor_decay must be in'),
        ({'kl_clip': -1.0}, 'kl_clip must be > 0'),
        ({'lr': -0.1}, 'lr must be > 0'),
        ({'accumulation_steps': 0}, 'accumulation_steps must be > 0'),
        ({'allreduce_bucket_cap_mb': -1}, 'allreduce_bucket_cap_mb must be >= 0'),
        ({'grad_worker_fraction': 2.0}, 'grad_worker_fraction must in'),
    ],
)
def test_kfac_pytorch_argument_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kfac.KFACPreconditioner(torch.nn.Linear(3, 2), **kwargs)


def test_kfac_pytorch_names_and_strings_are_accepted() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning, match='integer multiple'):
        p = kfac.KFACPreconditioner(
            model,
            factor_update_steps=3,
            inv_update_steps=5,
            compute_method='inverse',
            assignment_strategy='memory',
            grad_worker_fraction=kfac.DistributedStrategy.MEM_OPT,
            kl_clip=None,
            symmetry_aware=True,
            update_factors_in_hook=False,
        )
    assert p.kl_clip is None and p.compute_method is kfac.ComputeMethod.INVERSE
    assert kfac.preconditioner.KFACPreconditioner is kfac.KFACPreconditioner
    assert kfac.enums.ComputeMethod.EIGEN is kfac.ComputeMethod.EIGEN
