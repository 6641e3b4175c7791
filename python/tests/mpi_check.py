"""Run under mpiexec (ctest python_mpi4py_np2): kfac's factors averaged over an mpi4py
communicator; every rank averages its gradients with MPI_Allreduce. The ranks end with the same
bits, equal to one process on the concatenated batch (rank 0 computes that itself)."""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

import kfac
from _nets import ConvLinear, grads

# kfac's conventions: the factors of per-sample gradients, the same at any world size
SETTINGS = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1,
                conventions='kfac')
STEPS, PER_RANK = 3, 4


def model() -> torch.nn.Module:
    torch.manual_seed(43)
    return ConvLinear().double()


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(41)
    batches = [(torch.randn(size * PER_RANK, 2, 5, 4, dtype=torch.float64), torch.randint(0, 4, (size * PER_RANK,)))
               for _ in range(STEPS)]
    net = model()
    p = kfac.KFACPreconditioner(net, mpi_comm=comm, **SETTINGS)
    mine = []
    for x, y in batches:
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
        for q in net.parameters():
            comm.Allreduce(MPI.IN_PLACE, q.grad.numpy(), op=MPI.SUM)
            q.grad /= size
        p.step()
        mine.append(grads(net))
    every = comm.gather(mine, root=0)
    if rank != 0:
        return 0
    one = model()
    q = kfac.KFACPreconditioner(one, **SETTINGS)
    for step, (x, y) in enumerate(batches):
        one.zero_grad()
        torch.nn.functional.cross_entropy(one(x), y).backward()
        q.step()
        for name, g in grads(one).items():
            for r in range(size):
                if not torch.equal(every[r][step][name], every[0][step][name]):
                    print(f'step {step} {name}: rank {r} differs from rank 0')
                    return 1
            diff = (every[0][step][name] - g).abs().max().item()
            if diff > 1e-10 * g.abs().max().item():
                print(f'step {step} {name}: {diff} from one process')
                return 1
    print(f'mpi4py ok: {size} ranks equal one process')
    return 0


if __name__ == '__main__':
    sys.exit(main())
