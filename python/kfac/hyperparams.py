"""Ready-made hyperparameter schedules: callables of the preconditioner's step that can be passed
wherever KFACPreconditioner takes a callable (kfac-pytorch's kfac.hyperparams)."""

from __future__ import annotations

from typing import Callable


def exp_decay_factor_averaging(min_value: float = 0.95) -> Callable[[int], float]:
    """A factor_decay schedule: at step k the weight of the old factors is min(1 - 1/k, min_value).

    Early steps thus average the statistics seen so far with equal weights (Martens & Grosse 2015,
    section 5) before settling on an exponential moving average of weight min_value. Step 0 counts
    as step 1 (weight 0). A min_value <= 0, or a negative step given to the schedule, is a
    ValueError.
    """
    if min_value <= 0:
        raise ValueError(f'min_value must be greater than 0 (got {min_value})')

    def factor_decay(step: int) -> float:
        if step < 0:
            raise ValueError(f'the step of a factor_decay schedule must be >= 0 (got step={step})')
        k = max(step, 1)
        return float(min(1 - 1 / k, min_value))

    return factor_decay
