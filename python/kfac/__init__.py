"""kfac for PyTorch: K-FAC gradient preconditioning through kfac's C++ core.

    import kfac
    preconditioner = kfac.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
    ...
    loss.backward()
    preconditioner.step()      # between backward() and optimizer.step()
    optimizer.step()

See docs/python.md. Kokkos starts when the first preconditioner is built (not at import: programs
fork after import) and is finalized at interpreter exit.
"""

from __future__ import annotations

import atexit

# kfac-pytorch's modules, reachable as attributes as there (kfac.enums.ComputeMethod, ...).
import kfac.assignment as assignment
import kfac.base_preconditioner as base_preconditioner
import kfac.enums as enums
import kfac.hyperparams as hyperparams
import kfac.losses as losses
import kfac.methods as methods
import kfac.preconditioner as preconditioner
import kfac.scheduler as scheduler
import kfac.tracing as tracing
import kfac.warnings as warnings
from kfac import _kfac
from kfac._kfac import KFACError
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.enums import AllreduceMethod
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.preconditioner import KFACPreconditioner
from kfac.preconditioner import register_module
from kfac.scheduler import LambdaParamScheduler
from kfac.self_tuning import SelfTuning

atexit.register(_kfac.finalize)
atexit.register(_kfac.release_self_tuning)  # runs first (last registered): kfac state before Kokkos

__all__ = [
    'AllreduceMethod',
    'AssignmentStrategy',
    'BaseKFACPreconditioner',
    'ComputeMethod',
    'DistributedStrategy',
    'KFACError',
    'KFACPreconditioner',
    'LambdaParamScheduler',
    'SelfTuning',
    'register_module',
]
