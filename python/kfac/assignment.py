"""Who does which part of the work across ranks (kfac-pytorch's kfac.assignment).

In kfac the placement itself (KAISA: which rank decomposes each factor, which ranks precondition
each layer's gradient) is decided inside the C++ core; what lives here is kfac-pytorch's
interface for such a placement, WorkAssignment, for code that annotates or implements one, and
the reading of kfac-pytorch's grad_worker_fraction argument (grad_worker_layout) that
KFACPreconditioner uses.
"""

from __future__ import annotations

import abc
import warnings

import torch.distributed as dist

from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy


class WorkAssignment(abc.ABC):
    """The questions a distributed K-FAC step asks of a placement, per layer name and factor
    name ('A' or 'G'). kfac's own preconditioner does not take one (its KAISA placement is the
    core's); the interface is kept so that kfac-pytorch code written against it still imports."""

    @abc.abstractmethod
    def broadcast_gradients(self) -> bool:
        """Whether preconditioned gradients are sent from gradient workers to receivers."""

    @abc.abstractmethod
    def broadcast_inverses(self) -> bool:
        """Whether decompositions are sent from the rank that computed them to other ranks."""

    @abc.abstractmethod
    def get_layers(self) -> tuple[str, ...]:
        """The names of the layers placed."""

    @abc.abstractmethod
    def get_factors(self, layer: str) -> tuple[str, ...]:
        """The names of one layer's factors."""

    @abc.abstractmethod
    def inv_worker(self, layer: str, factor: str) -> int:
        """The rank that decomposes (or inverts) this factor."""

    @abc.abstractmethod
    def is_grad_worker(self, layer: str) -> bool:
        """Whether this rank preconditions the layer's gradient itself."""

    @abc.abstractmethod
    def src_grad_worker(self, layer: str) -> int:
        """The rank this one gets the layer's preconditioned gradient from (itself if it is a
        gradient worker)."""

    @abc.abstractmethod
    def factor_group(self, layer: str, factor: str) -> dist.ProcessGroup | None:
        """The group over which this factor is averaged (None: the default group)."""

    @abc.abstractmethod
    def grad_worker_group(self, layer: str) -> dist.ProcessGroup | None:
        """The group that receives the layer's decompositions."""

    @abc.abstractmethod
    def grad_receiver_group(self, layer: str) -> dist.ProcessGroup | None:
        """The group that receives the layer's preconditioned gradient."""


def grad_worker_layout(
    grad_worker_fraction: DistributedStrategy | float,
    world_size: int,
    *,
    colocate_factors: bool,
    compute_method: ComputeMethod,
    compute_eigenvalue_outer_product: bool,
) -> tuple[float, DistributedStrategy, bool]:
    """(fraction, strategy, colocate_factors) for kfac-pytorch's KAISA arguments, with its checks.

    A DistributedStrategy names a fraction (COMM_OPT 1, HYBRID_OPT 1/2, MEM_OPT 1/world); a number
    in [0, 1] names its strategy (1: COMM_OPT, <= 1/world: MEM_OPT, else HYBRID_OPT) and 0 means
    1/world. The gradient-worker groups must be of equal size, and the eigenvalue outer product
    needs a layer's two factors decomposed on one rank: otherwise ValueError. MEM_OPT with
    colocate_factors=False warns and colocates, as kfac-pytorch does.
    """
    if compute_method == ComputeMethod.EIGEN and compute_eigenvalue_outer_product and not colocate_factors:
        raise ValueError('compute_eigenvalue_outer_product needs colocate_factors=True')
    if isinstance(grad_worker_fraction, DistributedStrategy):
        strategy = grad_worker_fraction
        fraction = {
            DistributedStrategy.COMM_OPT: 1.0,
            DistributedStrategy.HYBRID_OPT: 0.5,
            DistributedStrategy.MEM_OPT: 1.0 / world_size,
        }[strategy]
    else:
        if not 0 <= grad_worker_fraction <= 1:
            # kfac-pytorch's words
            raise ValueError(f'grad_worker_fraction must in [0, 1] (got {grad_worker_fraction})')
        fraction = float(grad_worker_fraction) if grad_worker_fraction > 0 else 1.0 / world_size
        workers = max(1, round(world_size * fraction))
        if world_size % workers != 0:
            raise ValueError(
                f'grad_worker_fraction={grad_worker_fraction} gives groups of {workers} gradient workers, '
                f'which do not divide the {world_size} ranks into groups of equal size',
            )
        if fraction == 1:
            strategy = DistributedStrategy.COMM_OPT
        elif fraction <= 1 / world_size:
            strategy = DistributedStrategy.MEM_OPT
        else:
            strategy = DistributedStrategy.HYBRID_OPT
    if strategy == DistributedStrategy.MEM_OPT and not colocate_factors:
        warnings.warn(
            'grad_worker_fraction 1/world_size (MEM_OPT) decomposes both factors of a layer on its one '
            'gradient worker: colocate_factors is set to True',
            stacklevel=3,
        )
        colocate_factors = True
    return max(fraction, 1.0 / world_size), strategy, colocate_factors
