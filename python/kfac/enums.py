"""Named choices of kfac.KFACPreconditioner, spelled as in kfac-pytorch's kfac.enums."""

from __future__ import annotations

import enum


class AllreduceMethod(enum.Enum):
    """How factors are averaged across ranks, as kfac-pytorch names it: one collective per factor
    (ALLREDUCE, allreduce_bucket_cap_mb=0) or factors packed into buckets (ALLREDUCE_BUCKETED).
    kfac's communicator always packs; allreduce_bucket_cap_mb=0 bounds a bucket at one byte, so
    each factor travels alone."""

    ALLREDUCE = 1
    ALLREDUCE_BUCKETED = 2


class ComputeMethod(enum.Enum):
    """How each Linear/Conv2d layer's second-order information is kept.

    EIGEN: eigendecompositions of A and G; the damping is added to the products of their
    eigenvalues (kfac-pytorch's EIGEN, kfac's default). INVERSE: explicit inverses of A and G by
    Cholesky, with factored damping (see docs/python.md for the damping forms).
    """

    EIGEN = 1
    INVERSE = 2


class AssignmentStrategy(enum.Enum):
    """What KAISA's greedy placement balances: COMPUTE (n^3) or MEMORY (n^2)."""

    COMPUTE = 1
    MEMORY = 2


class DistributedStrategy(enum.Enum):
    """Named gradient-worker fractions: COMM_OPT = 1, HYBRID_OPT = 0.5, MEM_OPT = 1/world."""

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3
