"""kfac.base_preconditioner.BaseKFACPreconditioner: kfac-pytorch's base class, as the public
surface of kfac.KFACPreconditioner (docs/python.md, "kfac-pytorch's public API").

kfac-pytorch builds its preconditioner from Python layer objects, a work assignment and a
communicator, and does the K-FAC step in Python. In kfac the step is the C++ core's, so this class
keeps what code written against kfac-pytorch reads and writes on a preconditioner: the step
count, the hyperparameters (constants or callables of the step) with their private spellings
that kfac-pytorch's LambdaParamScheduler and scripts assign, and the names of the methods. It is
not built directly: its __init__ takes kfac-pytorch's arguments and says so.
"""

from __future__ import annotations

import logging
from typing import Any

#: kfac-pytorch's hyperparameters, each a constant or a callable of the step.
HYPERPARAMETERS = ('factor_update_steps', 'inv_update_steps', 'damping', 'factor_decay', 'kl_clip', 'lr')


def _at(value: Any, step: int) -> Any:
    return value(step) if callable(value) else value


def _private(name: str) -> property:
    """kfac-pytorch's private spelling `_name` of a hyperparameter: the value as given (constant or
    callable); assigning it replaces the hyperparameter from the next step() on."""

    def get(self: BaseKFACPreconditioner) -> Any:
        return self._hyperparameter(name)

    def set_(self: BaseKFACPreconditioner, value: Any) -> None:
        self._set_hyperparameter(name, value)

    return property(get, set_, doc=f'The {name} hyperparameter as given: a constant or a callable of the step.')


def _current(name: str) -> property:
    def get(self: BaseKFACPreconditioner) -> Any:
        return _at(self._hyperparameter(name), self.steps)

    return property(get, doc=f'{name} at the current step (a callable is evaluated at `steps`).')


class BaseKFACPreconditioner:
    """What kfac-pytorch's scripts, schedulers and tests see of a K-FAC preconditioner.

    Subclasses (kfac.KFACPreconditioner) provide `steps`, `step()`, the state dict and the two
    hyperparameter accessors below; everything else here is written in terms of them.
    """

    def __init__(self, layers: dict[Any, tuple[str, Any]], *, assignment: Any, tdc: Any, **kwargs: Any) -> None:
        """kfac-pytorch's signature (layers, assignment, communicator, then the hyperparameters of
        KFACPreconditioner); refused."""
        raise NotImplementedError(
            "kfac's BaseKFACPreconditioner is not built from kfac-pytorch's layer objects, work assignment "
            "and communicator: kfac's layers, placement and communication live in its C++ core. "
            'Build kfac.KFACPreconditioner(model, ...) instead.',
        )

    # ---- what a subclass provides ----------------------------------------------------------

    @property
    def steps(self) -> int:
        """The number of step() calls so far."""
        raise NotImplementedError

    def _hyperparameter(self, name: str) -> Any:
        """The hyperparameter `name` (one of HYPERPARAMETERS) as given: constant or callable."""
        raise NotImplementedError

    def _set_hyperparameter(self, name: str, value: Any) -> None:
        """Replaces the hyperparameter `name` from the next step() on."""
        raise NotImplementedError

    def step(self) -> None:
        """Preconditions the gradients in place; between backward() and optimizer.step()."""
        raise NotImplementedError

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """The step count, the constant hyperparameters and (include_factors) the factors."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restores a state_dict()."""
        raise NotImplementedError

    # ---- kfac-pytorch's hyperparameter views: `damping` (its value now) and `_damping` (as given),
    # ---- and so on for each of HYPERPARAMETERS, are added below the class ------------------------

    def _set_steps(self, value: int) -> None:
        """Sets the step counter (the C++ core's, with the schedule it drives)."""
        raise NotImplementedError

    @property
    def _steps(self) -> int:
        """kfac-pytorch's private step counter: the C++ core's. Assigning it sets the core's
        counter: hyperparameters that are callables read the new step, and every module takes
        statistics and a decomposition at the next step()."""
        return self.steps

    @_steps.setter
    def _steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f'_steps: expected an int >= 0, got {value!r}')
        if value != self.steps:
            self._set_steps(value)

    # ---- kfac-pytorch's methods kfac has no counterpart for ------------------------------------

    def reset_batch(self) -> None:
        """kfac-pytorch: drops the observations of the current batch. Not available in kfac."""
        raise NotImplementedError(
            "reset_batch(): kfac's core has no way to drop a batch's observations from Python",
        )

    def memory_usage(self) -> dict[str, int]:
        """kfac-pytorch: bytes held for factors and decompositions. Not available in kfac."""
        raise NotImplementedError("memory_usage(): kfac's core does not report its memory to Python")


for _name in HYPERPARAMETERS:
    setattr(BaseKFACPreconditioner, _name, _current(_name))
    setattr(BaseKFACPreconditioner, '_' + _name, _private(_name))
del _name
