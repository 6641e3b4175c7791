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

from kfac import _kfac
from kfac._kfac import KFACError
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.preconditioner import KFACPreconditioner

atexit.register(_kfac.finalize)

__all__ = [
    'AssignmentStrategy',
    'ComputeMethod',
    'DistributedStrategy',
    'KFACError',
    'KFACPreconditioner',
]
