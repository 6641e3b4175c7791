"""torch.distributed (gloo, 2 processes on loopback, DistributedDataParallel): ranks end with the
same bits, equal to one process on the concatenated batch."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kfac
from _nets import ConvLinear, Sequence, TokenIds, grads

# kfac's conventions: factors of per-sample gradients, the same at any world size (kfac-pytorch's are not)
SETTINGS = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1,
                conventions='kfac')
STEPS, PER_RANK, WORLD = 3, 4, 2


# Conv2d + Linear; or a Linear over tokens (K-FAC-reduce), a LayerNorm and a head (kfac's new layer kinds); or
# an Embedding of (B, T) token ids (None: ids in [0, 9), not features)
NETS = {'conv': (ConvLinear, (2, 5, 4), ['conv', 'fc']), 'tokens': (Sequence, (5, 4), ['fc', 'norm', 'head']),
        'ids': (TokenIds, None, ['emb', 'head'])}


def _batches(net: str):
    torch.manual_seed(41)
    shape = NETS[net][1]
    inputs = (lambda: torch.randint(0, 9, (WORLD * PER_RANK, 6))) if shape is None else (
        lambda: torch.randn(WORLD * PER_RANK, *shape, dtype=torch.float64))
    return [(inputs(), torch.randint(0, 4, (WORLD * PER_RANK,))) for _ in range(STEPS)]


def _model(net: str):
    torch.manual_seed(43)
    return NETS[net][0]().double()


def _settings(net: str) -> dict:
    return dict(SETTINGS, token_reduction='reduce') if net == 'tokens' else SETTINGS


def _worker(rank: int, port: int, out: str, strategy: str, net: str) -> None:
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=WORLD)
    model = torch.nn.parallel.DistributedDataParallel(_model(net))
    p = kfac.KFACPreconditioner(model, grad_worker_fraction=kfac.DistributedStrategy[strategy], **_settings(net))
    assert p.modules() == [f'module.{m}' for m in NETS[net][2]], p.modules()
    steps = []
    for x, y in _batches(net):
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()  # DDP averages the gradients
        p.step()
        steps.append(({k.removeprefix('module.'): v for k, v in grads(model).items()}, p.last_kl_scale))
    torch.save(steps, f'{out}/rank{rank}.pt')
    dist.destroy_process_group()


@pytest.mark.parametrize(('strategy', 'net'),
                         [('COMM_OPT', 'conv'), ('MEM_OPT', 'conv'), ('COMM_OPT', 'tokens'), ('MEM_OPT', 'ids')])
def test_two_gloo_processes_equal_one_process_on_the_whole_batch(tmp_path, strategy: str, net: str) -> None:
    """COMM_OPT: every rank decomposes and preconditions; MEM_OPT (grad_worker_fraction 1/2):
    each layer's decompositions and preconditioning on one rank, its gradient broadcast."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path), strategy, net), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f'rank{r}.pt') for r in range(WORLD)]

    model = _model(net)
    p = kfac.KFACPreconditioner(model, **_settings(net))
    for step, (x, y) in enumerate(_batches(net)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        p.step()
        one = grads(model)
        for name, g in one.items():
            assert torch.equal(ranks[0][step][0][name], ranks[1][step][0][name]), (step, name)  # ranks bit-identical
            diff = (ranks[0][step][0][name] - g).abs().max().item()
            assert diff <= 1e-10 * g.abs().max().item(), (step, name, diff)
        assert ranks[0][step][1] == ranks[1][step][1]
        assert abs(ranks[0][step][1] - p.last_kl_scale) <= 1e-10
