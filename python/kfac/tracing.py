"""Wall-clock timing of decorated functions, kept per function name in this process
(kfac-pytorch's kfac.tracing).

    @kfac.tracing.trace()
    def train_step(...): ...

    kfac.tracing.get_trace()           # {'train_step': mean seconds per call}
    kfac.tracing.log_trace()           # the same through logging, one line per function
    kfac.tracing.clear_trace()
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any
from typing import Callable
from typing import TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)

R = TypeVar('R')

# Function name -> seconds of each recorded call, oldest first.
_durations: dict[str, list[float]] = {}


def trace(sync: bool = False) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A decorator that records how long each call of the function takes, under its __name__.

    With sync=True every rank of torch.distributed's default group waits at a barrier before
    and after the call, so that the time measured is that of the slowest rank.
    """

    def decorate(func: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> R:
            if sync:
                dist.barrier()
            start = time.perf_counter()
            result = func(*args, **kwargs)
            if sync:
                dist.barrier()
            _durations.setdefault(func.__name__, []).append(time.perf_counter() - start)
            return result

        return timed

    return decorate


def get_trace(average: bool = True, max_history: int | None = None) -> dict[str, float]:
    """Seconds per traced function: the mean over its calls (average=True) or their total,
    over the last max_history calls only when given."""
    out: dict[str, float] = {}
    for name, times in _durations.items():
        recent = times if max_history is None else times[-max_history:]
        total = sum(recent)
        out[name] = total / len(recent) if average else total
    return out


def log_trace(average: bool = True, max_history: int | None = None, loglevel: int = logging.INFO) -> None:
    """Logs get_trace(average, max_history) at loglevel, one 'name: seconds' line per function."""
    for name, seconds in get_trace(average, max_history).items():
        logger.log(loglevel, f'{name}: {seconds}')


def clear_trace() -> None:
    """Forgets every recorded call."""
    _durations.clear()
