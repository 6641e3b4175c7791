"""Numbers: equal to the C++ TorchPreconditioner on the same model and batches, to a dense
Kronecker solve for one Linear layer, k micro-batches equal to one batch, and a state_dict
round trip that resumes bit for bit."""

from __future__ import annotations

import io
import math

import pytest
import torch

import kfac
from _nets import ConvLinear, RefNet, grads, ref_batch

# kfac's conventions (the C++ adapter's); kfac-pytorch's are tested in test_kfac_pytorch_conventions.py.
SETTINGS = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1,
                conventions='kfac')


@pytest.mark.parametrize(('dtype', 'rtol'), [(torch.float64, 1e-10), (torch.float32, 1e-6)])
def test_equal_to_the_cpp_adapter(dtype: torch.dtype, rtol: float) -> None:
    torch.manual_seed(11)
    model = RefNet().to(dtype)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = [ref_batch(7, dtype) for _ in range(4)]
    reference = kfac._kfac._cpp_adapter_steps(params, batches, dict(SETTINGS, precompute_reciprocal=True))
    p = kfac.KFACPreconditioner(model, compute_eigenvalue_outer_product=True, **SETTINGS)
    assert p.modules() == ['conv1', 'bn1', 'conv2', 'fc1', 'fc2']
    clipped = 0
    for step, ((x, y), (ref_grads, ref_scale)) in enumerate(zip(batches, reference)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raw = grads(model)
        where = {n: q.grad.data_ptr() for n, q in model.named_parameters()}
        p.step()
        got = grads(model)
        # written in place: kfac viewed each contiguous .grad without a copy
        assert where == {n: q.grad.data_ptr() for n, q in model.named_parameters()}
        assert set(got) == set(ref_grads)
        for name, g in got.items():
            scale = ref_grads[name].abs().max().item()
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= rtol * scale, (step, name, diff, scale)
            assert not torch.equal(g, raw[name])  # preconditioning changed it
        assert p.last_kl_scale == pytest.approx(ref_scale, rel=rtol)
        clipped += p.last_kl_scale < 1
    assert clipped > 0  # the KL clip took part


@pytest.mark.parametrize('loss_reduction', ['mean', 'sum'])
def test_one_linear_layer_against_a_dense_kronecker_solve(loss_reduction: str) -> None:
    """K-FAC for one Linear layer written out: A = mean x~ x~^T (x~ = [x; 1]); G = N^2 mean g g^T
    with loss_reduction='mean' (g the hook's gradient of the mean loss: per-sample G), or
    kfac-pytorch's mean g g^T with 'sum'; first update = the batch estimate;
    V = (G (x) A + damping I)^-1 vec(grad); then the KL clip."""
    torch.manual_seed(5)
    n, din, dout, kl_clip, lr = 9, 4, 3, 1e-4, 0.1
    damping = 0.05 if loss_reduction == 'mean' else 1e-4
    layer = torch.nn.Linear(din, dout).double()
    p = kfac.KFACPreconditioner(
        layer, damping=damping, kl_clip=kl_clip, lr=lr, compute_eigenvalue_outer_product=False, loss_reduction=loss_reduction,
        conventions='kfac',
    )
    x = torch.randn(n, din, dtype=torch.float64)
    y = torch.randint(0, dout, (n,))
    out = layer(x)
    out.retain_grad()
    torch.nn.functional.cross_entropy(out, y).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    xt = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    a = xt.T @ xt / n
    g = (n * n if loss_reduction == 'mean' else 1) * (out.grad.T @ out.grad) / n
    v = torch.linalg.solve(torch.kron(g, a) + damping * torch.eye(dout * (din + 1), dtype=torch.float64), grad.reshape(-1))
    v = v.reshape(dout, din + 1)
    nu = min(1.0, math.sqrt(kl_clip / (lr * lr * (v * grad).sum().item())))
    p.step()
    assert nu < 1  # clipped: the scale is checked too
    assert torch.allclose(layer.weight.grad, nu * v[:, :din], rtol=1e-9, atol=1e-12)
    assert torch.allclose(layer.bias.grad, nu * v[:, din], rtol=1e-9, atol=1e-12)
    assert p.last_kl_scale == pytest.approx(nu, rel=1e-9)


def test_accumulated_micro_batches_equal_one_batch() -> None:
    torch.manual_seed(19)
    k, micro = 3, 4
    big, acc = ConvLinear().double(), ConvLinear().double()
    acc.load_state_dict(big.state_dict())
    settings = dict(SETTINGS, factor_update_steps=1, inv_update_steps=1)
    p_big = kfac.KFACPreconditioner(big, **settings)
    p_acc = kfac.KFACPreconditioner(acc, accumulation_steps=k, **settings)
    for _ in range(3):
        x = torch.randn(k * micro, 2, 5, 4, dtype=torch.float64)
        y = torch.randint(0, 4, (k * micro,))
        big.zero_grad()
        torch.nn.functional.cross_entropy(big(x), y).backward()
        p_big.step()
        acc.zero_grad()
        for m in range(k):
            rows = slice(m * micro, (m + 1) * micro)
            (torch.nn.functional.cross_entropy(acc(x[rows]), y[rows]) / k).backward()
        p_acc.step()
        gb, ga = grads(big), grads(acc)
        for name in gb:
            assert torch.allclose(ga[name], gb[name], rtol=1e-9, atol=1e-12), name
        assert p_acc.last_kl_scale == pytest.approx(p_big.last_kl_scale, rel=1e-9)
    # One micro-batch short is named.
    acc.zero_grad()
    (torch.nn.functional.cross_entropy(acc(x[:micro]), y[:micro]) / k).backward()
    with pytest.raises(kfac.KFACError, match="'conv' observed 1 times, not a multiple of accumulation_steps = 3"):
        p_acc.step()


def _train(model, p, batches, opt):
    out = []
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        p.step()
        opt.step()
        out.append(grads(model))
    return out


@pytest.mark.filterwarnings('ignore:It is suggested that inv_update_steps')
def test_state_dict_round_trip_resumes_bit_for_bit() -> None:
    torch.manual_seed(23)
    settings = dict(SETTINGS, factor_update_steps=2, inv_update_steps=3, damping=lambda s: 0.01 * 0.9**s)
    model = RefNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    p = kfac.KFACPreconditioner(model, **settings)
    batches = [ref_batch(6, torch.float64) for _ in range(8)]
    _train(model, p, batches[:4], opt)
    buf = io.BytesIO()
    torch.save({'model': model.state_dict(), 'opt': opt.state_dict(), 'kfac': p.state_dict()}, buf)
    after = _train(model, p, batches[4:], opt)

    buf.seek(0)
    saved = torch.load(buf)
    assert saved['kfac']['steps'] == 4 and 'damping' not in saved['kfac']  # a callable is not saved
    model2 = RefNet().double()
    model2.load_state_dict(saved['model'])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved['opt'])
    p2 = kfac.KFACPreconditioner(model2, **settings)
    p2.load_state_dict(saved['kfac'])
    assert p2.steps == 4
    resumed = _train(model2, p2, batches[4:], opt2)
    for a, b in zip(after, resumed):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # Without kfac's checkpoint the step counter cannot follow.
    with pytest.raises(ValueError, match='no kfac checkpoint'):
        kfac.KFACPreconditioner(RefNet().double()).load_state_dict(p.state_dict(include_factors=False))


def test_a_constant_from_the_state_dict_replaces_the_given_one() -> None:
    torch.manual_seed(29)
    runs = []
    for damping in (0.5, 0.01):
        model = ConvLinear().double()
        torch.manual_seed(31)
        for q in model.parameters():
            torch.nn.init.normal_(q)
        p = kfac.KFACPreconditioner(model, damping=damping, kl_clip=None)
        if damping == 0.5:
            p.load_state_dict({'steps': 0, 'damping': 0.01})
        assert p.damping == 0.01
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.ones(3, 2, 5, 4, dtype=torch.float64)), torch.tensor([0, 1, 2])).backward()
        p.step()
        runs.append(grads(model))
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name])


def test_a_float32_factor_past_lapackes_float_workspace_query() -> None:
    """LAPACKE_ssyevd's own workspace query returns 1 + 6n + 2n^2 as a float, rounded below the
    minimum from n = 2896 on (ssyevd: 'parameter number 8 had an illegal value'); kfac passes the
    sizes itself. A has n = 2895 + 1 (bias) here."""
    torch.manual_seed(7)
    layer = torch.nn.Linear(2895, 2)
    p = kfac.KFACPreconditioner(layer, damping=0.1)
    torch.nn.functional.cross_entropy(layer(torch.randn(4, 2895)), torch.tensor([0, 1, 1, 0])).backward()
    p.step()
    assert torch.isfinite(layer.weight.grad).all()


def test_ngsgd_per_module_keeps_the_gradient_norm() -> None:
    """methods={'fc': 'ngsgd'}: Kaldi's NG-SGD on that module (its scale gamma keeps the
    Frobenius norm of [W | b]'s gradient), kfac's K-FAC on the other."""
    torch.manual_seed(37)
    model = ConvLinear().double()
    p = kfac.KFACPreconditioner(model, methods={'^fc$': 'ngsgd'}, kl_clip=None, damping=0.01)
    for _ in range(3):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(6, 2, 5, 4, dtype=torch.float64)), torch.randint(0, 4, (6,))).backward()
        before = torch.cat([model.fc.weight.grad, model.fc.bias.grad[:, None]], 1).clone()
        conv_before = model.conv.weight.grad.clone()
        p.step()
        after = torch.cat([model.fc.weight.grad, model.fc.bias.grad[:, None]], 1)
        assert not torch.allclose(after, before)
        assert after.norm().item() == pytest.approx(before.norm().item(), rel=1e-10)
        assert not torch.allclose(model.conv.weight.grad.norm(), conv_before.norm())  # K-FAC changes it
    with pytest.raises(ValueError, match=r"methods\['fc'\] = 'adam': expected a kfac.methods object"):
        kfac.KFACPreconditioner(ConvLinear(), methods={'fc': 'adam'})


def _two_runs(make_loss_a, make_loss_b, kwargs_a, kwargs_b, steps=2):
    torch.manual_seed(47)
    a, b = ConvLinear().double(), ConvLinear().double()
    b.load_state_dict(a.state_dict())
    pa, pb = kfac.KFACPreconditioner(a, **kwargs_a), kfac.KFACPreconditioner(b, **kwargs_b)
    for _ in range(steps):
        x = torch.randn(6, 2, 5, 4, dtype=torch.float64)
        y = torch.randint(0, 4, (6,))
        for model, p, make_loss in ((a, pa, make_loss_a), (b, pb, make_loss_b)):
            model.zero_grad()
            make_loss(model, x, y)
            p.step()
        ga, gb = grads(a), grads(b)
        for name in ga:
            assert torch.allclose(ga[name], gb[name], rtol=1e-12, atol=1e-15), name


def test_grad_scaler_unscales_the_output_gradients() -> None:
    """AMP's recipe: the loss scaled by s, the gradients unscaled before step(); grad_scaler
    (a callable, or an object with get_scale()) divides the hooks' output gradients by s."""

    def plain(model, x, y):
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def scaled(model, x, y):
        (1024.0 * torch.nn.functional.cross_entropy(model(x), y)).backward()
        for q in model.parameters():
            q.grad /= 1024.0

    class Scaler:
        def get_scale(self) -> float:
            return 1024.0

    _two_runs(plain, scaled, SETTINGS, dict(SETTINGS, grad_scaler=lambda: 1024.0))
    _two_runs(plain, scaled, SETTINGS, dict(SETTINGS, grad_scaler=Scaler()))


def test_token_reduction_expand_is_k_fac_expand() -> None:
    """kfac's conventions: a Linear on (B, T, in) with token_reduction='expand' is K-FAC-expand
    (Eschenhagen et al. 2023): A over the B T token rows, G summed over the tokens and divided by
    B. That is the same Linear on the (B T, in) rows (A and G over B T) with output gradients
    divided by sqrt(T): its loss divided by sqrt(T), its parameter gradients multiplied back.
    Without a token reduction the module is named."""
    torch.manual_seed(53)
    a, b = torch.nn.Linear(3, 4).double(), torch.nn.Linear(3, 4).double()
    b.load_state_dict(a.state_dict())
    pa = kfac.KFACPreconditioner(a, token_reduction='expand', **SETTINGS)
    pb = kfac.KFACPreconditioner(b, **SETTINGS)
    root_t = 5.0**0.5
    for _ in range(2):
        x, y = torch.randn(2, 5, 3, dtype=torch.float64), torch.randint(0, 4, (10,))
        a.zero_grad()
        b.zero_grad()
        torch.nn.functional.cross_entropy(a(x).reshape(10, 4), y).backward()
        (torch.nn.functional.cross_entropy(b(x.reshape(10, 3)), y) / root_t).backward()
        for q in b.parameters():
            q.grad *= root_t
        pa.step()
        pb.step()
        assert torch.allclose(a.weight.grad, b.weight.grad, rtol=1e-12, atol=1e-15)
        assert torch.allclose(a.bias.grad, b.bias.grad, rtol=1e-12, atol=1e-15)
    c = torch.nn.Linear(3, 4)
    pc = kfac.KFACPreconditioner(c, conventions='kfac')
    with pytest.raises(kfac.KFACError, match="token_reduction='expand' or 'reduce'") as info:
        c(torch.randn(2, 5, 3)).sum().backward()
    assert info.value.layer == 'root'
    del pc
