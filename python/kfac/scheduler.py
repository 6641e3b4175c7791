"""kfac.scheduler.LambdaParamScheduler: kfac-pytorch's multiplicative hyperparameter schedules."""

from __future__ import annotations

from typing import Any
from typing import Callable

# The two intervals stay integers after each multiplication (truncated, as kfac-pytorch does).
_INTEGER = ('factor_update_steps', 'inv_update_steps')


class LambdaParamScheduler:
    """Multiplies a preconditioner's constant hyperparameters by factors that depend on the step.

    Each `<name>_lambda` is a callable f(step) -> factor; every scheduler.step() sets
    hyperparameter <- hyperparameter * f(step), where step is the preconditioner's `steps` unless
    given (e.g. an epoch number). factor_update_steps and inv_update_steps are truncated to int.
    Call it after preconditioner.step(). A hyperparameter that the preconditioner was given as a
    callable already has a schedule: giving it a lambda too is a ValueError.

    Example:
        >>> scheduler = kfac.scheduler.LambdaParamScheduler(preconditioner, damping_lambda=lambda s: 0.5)
        >>> scheduler.step(step=epoch)   # halves the damping every call
    """

    def __init__(
        self,
        preconditioner: Any,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        given = {
            'factor_update_steps': factor_update_steps_lambda,
            'inv_update_steps': inv_update_steps_lambda,
            'damping': damping_lambda,
            'factor_decay': factor_decay_lambda,
            'kl_clip': kl_clip_lambda,
            'lr': lr_lambda,
        }
        self._preconditioner = preconditioner
        self._lambdas = {name: f for name, f in given.items() if f is not None}
        for name in self._lambdas:
            if callable(getattr(preconditioner, '_' + name)):
                raise ValueError(
                    f'preconditioner.{name} is already a callable of the step: '
                    f'a LambdaParamScheduler cannot also scale it ({name}_lambda)',
                )

    def step(self, step: int | None = None) -> None:
        """Scales each scheduled hyperparameter by its lambda at `step` (default: the
        preconditioner's step count)."""
        at = self._preconditioner.steps if step is None else step
        for name, f in self._lambdas.items():
            value = getattr(self._preconditioner, '_' + name) * f(at)
            if name in _INTEGER:
                value = int(value)
            setattr(self._preconditioner, '_' + name, value)
