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
from _nets import ConvLinear, grads

# kfac's conventions: factors of per-sample gradients, the same at any world size (kfac-pytorch's are not)
SETTINGS = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1,
                conventions='kfac')
STEPS, PER_RANK, WORLD = 3, 4, 2


def _batches():
    torch.manual_seed(41)
    return [(torch.randn(WORLD * PER_RANK, 2, 5, 4, dtype=torch.float64), torch.randint(0, 4, (WORLD * PER_RANK,)))
            for _ in range(STEPS)]


def _model():
    torch.manual_seed(43)
    return ConvLinear().double()


def _worker(rank: int, port: int, out: str, strategy: str) -> None:
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=WORLD)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    p = kfac.KFACPreconditioner(model, grad_worker_fraction=kfac.DistributedStrategy[strategy], **SETTINGS)
    assert p.modules() == ['module.conv', 'module.fc'], p.modules()
    steps = []
    for x, y in _batches():
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()  # DDP averages the gradients
        p.step()
        steps.append(({k.removeprefix('module.'): v for k, v in grads(model).items()}, p.last_kl_scale))
    torch.save(steps, f'{out}/rank{rank}.pt')
    dist.destroy_process_group()


@pytest.mark.parametrize('strategy', ['COMM_OPT', 'MEM_OPT'])
def test_two_gloo_processes_equal_one_process_on_the_whole_batch(tmp_path, strategy: str) -> None:
    """COMM_OPT: every rank decomposes and preconditions; MEM_OPT (grad_worker_fraction 1/2):
    each layer's decompositions and preconditioning on one rank, its gradient broadcast."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path), strategy), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f'rank{r}.pt') for r in range(WORLD)]

    model = _model()
    p = kfac.KFACPreconditioner(model, **SETTINGS)
    for step, (x, y) in enumerate(_batches()):
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
