"""kfac.methods: the C++ core's per-module methods as Python objects (docs/python.md, "Methods").

Each class mirrors one C++ method object, its settings under the C++ names and with the C++
defaults (except Cholesky's pi_damping: off, kfac-pytorch's INVERSE). Pass them to
``KFACPreconditioner(methods={regex or module: method})``. The objects are frozen; each checks
its arguments when built and raises a ValueError naming the one that is wrong. Pass the settings
by keyword (``RandomizedEigen(rank=32)``).

The K-FAC methods, UnitWiseFisher and EmbeddingFisher take ``factor_dtype`` (storage of the running factors:
float16, i.e. kfac::Half, binary16; float32; float64) and ``inv_dtype`` (decompositions and the
preconditioning arithmetic: float32, float64); None takes KFACPreconditioner's, whose None is the
parameters' dtype (see ``precision``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar

import torch

__all__ = [
    'Cholesky',
    'DiagonalFisher',
    'EmbeddingFisher',
    'Eigen',
    'Method',
    'NGSGD',
    'NewtonSchulz',
    'RandomizedEigen',
    'UnitWiseFisher',
    'precision',
]

_FACTOR_DTYPES = (torch.float16, torch.float32, torch.float64)
_INV_DTYPES = (torch.float32, torch.float64)
# (factor, decomposition) -> the kfac::Precision<F, D> the core instantiates.
_PRECISIONS = {
    (torch.float16, torch.float32): 'half_float',  # kfac::HalfPrecision
    (torch.float32, torch.float32): 'float_float',  # kfac::SinglePrecision
    (torch.float32, torch.float64): 'float_double',  # kfac::MixedPrecision
    (torch.float64, torch.float64): 'double_double',  # kfac::DoublePrecision
    (torch.float64, torch.float32): 'double_float',  # kfac::Precision<double, float>
}


def _check_dtype(owner: str, name: str, v: Any, allowed: tuple[torch.dtype, ...]) -> None:
    if v is None or v in allowed:
        return
    why = ''
    if v == torch.bfloat16:
        why = "; kfac's reduced-precision storage is IEEE binary16 (kfac::Half), there is no bfloat16 one"
    elif v == torch.float16:
        why = '; decompositions run in float32 or float64 (float16 is a storage type only: factor_dtype)'
    names = ', '.join(str(d) for d in allowed)
    raise ValueError(f'{owner}{name}={v}: expected None or one of {names}{why}')


def precision(factor_dtype: Any, inv_dtype: Any, params: torch.dtype, where: str = '') -> str:
    """The core's precision for these dtypes (None: the parameters' dtype; float16 factors are
    decomposed in float32 unless inv_dtype says otherwise): 'scalar' when both are the
    parameters', else one of kfac::HalfPrecision, SinglePrecision, MixedPrecision,
    DoublePrecision, Precision<double, float>. Other pairs are a ValueError naming the
    arguments (`where` prefixes it)."""
    _check_dtype(where, 'factor_dtype', factor_dtype, _FACTOR_DTYPES)
    _check_dtype(where, 'inv_dtype', inv_dtype, _INV_DTYPES)
    factor = factor_dtype or params
    inv = inv_dtype or (torch.float32 if factor == torch.float16 else params)
    if factor == params and inv == params:
        return 'scalar'
    if (factor, inv) not in _PRECISIONS:
        pairs = ', '.join(f'({f}, {d})' for f, d in _PRECISIONS)
        raise ValueError(
            f'{where}factor_dtype={factor}, inv_dtype={inv}: kfac has the precisions (factor_dtype, inv_dtype) in '
            f'{pairs} (float16 factors are decomposed in float32: kfac::HalfPrecision)',
        )
    return _PRECISIONS[(factor, inv)]


def _int(owner: str, name: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f'{owner}: {name} must be an int >= {low} (got {v!r})')


def _real(owner: str, name: str, v: Any, ok: Any, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(float(v)):
        raise ValueError(f'{owner}: {name} must be {what} (got {v!r})')


def _flag(owner: str, name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f'{owner}: {name} must be True or False (got {v!r})')


class Method:
    """Base of the method objects: what the core is told (``_core_spec``)."""

    kind: ClassVar[str]
    cpp: ClassVar[str]  # the C++ object, for messages and docs
    modules: ClassVar[tuple[str, ...]] = ('linear', 'conv2d')  # the module types it applies to (the core's)
    applies_to: ClassVar[str] = 'Linear and Conv2d'  # the same, for messages
    has_precision: ClassVar[bool] = True

    def _core_spec(self, default_factor: Any, default_inv: Any, params: torch.dtype) -> dict[str, Any]:
        """The settings under the C++ names, the precision resolved against the defaults."""
        spec = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        factor, inv = spec.pop('factor_dtype', None), spec.pop('inv_dtype', None)
        spec['kind'] = self.kind
        if self.has_precision:
            where = f'{type(self).__name__}: ' if factor is not None or inv is not None else ''
            spec['precision'] = precision(factor or default_factor, inv or default_inv, params, where)
        return spec



@dataclasses.dataclass(frozen=True)
class _WithPrecision(Method):
    """The precision fields of the K-FAC methods, UnitWiseFisher and EmbeddingFisher (first in
    positional order: pass every setting by keyword)."""

    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        owner = f'{type(self).__name__}: '
        _check_dtype(owner, 'factor_dtype', self.factor_dtype, _FACTOR_DTYPES)
        _check_dtype(owner, 'inv_dtype', self.inv_dtype, _INV_DTYPES)


@dataclasses.dataclass(frozen=True)
class Eigen(_WithPrecision):
    """K-FAC with eigendecompositions, damping added to the eigenvalue products: kfac::KFAC<>
    (kfac::Eigendecomposition<>); the default for Linear and Conv2d (compute_method EIGEN)."""

    jacobi_sweeps: int = 60
    refresh_tolerance: float = 0.0
    kind: ClassVar[str] = 'eigen'
    cpp: ClassVar[str] = 'kfac::KFAC<Symmetric, Eigendecomposition<>, Prec>'

    def __post_init__(self) -> None:
        _int('Eigen', 'jacobi_sweeps', self.jacobi_sweeps, 1)
        _real('Eigen', 'refresh_tolerance', self.refresh_tolerance, lambda v: 0 <= v < 1, 'in [0, 1)')
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class RandomizedEigen(_WithPrecision):
    """K-FAC with randomized low-rank-plus-identity factors (Puiu 2022):
    kfac::KFAC<Symmetric, RandomizedEigen<>>. A factor with n <= rank, or rank + oversampling
    >= n, is decomposed exactly (as Eigen)."""

    rank: int = 64
    oversampling: int = 16
    power_iterations: int = 1
    warm_start: bool = True
    factored_damping: bool = False
    seed: int = 0x6B666163
    kind: ClassVar[str] = 'randomized_eigen'
    cpp: ClassVar[str] = 'kfac::KFAC<Symmetric, RandomizedEigen<>, Prec>'

    def __post_init__(self) -> None:
        _int('RandomizedEigen', 'rank', self.rank, 1)
        _int('RandomizedEigen', 'oversampling', self.oversampling, 0)
        _int('RandomizedEigen', 'power_iterations', self.power_iterations, 0)
        _flag('RandomizedEigen', 'warm_start', self.warm_start)
        _flag('RandomizedEigen', 'factored_damping', self.factored_damping)
        _int('RandomizedEigen', 'seed', self.seed, 0)
        if self.seed >= 2**64:
            raise ValueError(f'RandomizedEigen: seed must be < 2**64 (got {self.seed})')
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class Cholesky(_WithPrecision):
    """K-FAC with damped inverses by Cholesky: kfac::KFAC<Symmetric, Cholesky<>> (compute_method
    INVERSE). pi_damping: pi from the factors' traces (Martens & Grosse 2015, 6.3); off by default,
    kfac-pytorch's form (the C++ object's default is on). damping_on_each_factor: add the damping
    to each factor (kfac-pytorch's INVERSE) instead of its square root; None: the conventions'
    (on under 'kfac-pytorch', off under 'kfac')."""

    pi_damping: bool = False
    damping_on_each_factor: bool | None = None
    kind: ClassVar[str] = 'cholesky'
    cpp: ClassVar[str] = 'kfac::KFAC<Symmetric, Cholesky<>, Prec>'

    def __post_init__(self) -> None:
        _flag('Cholesky', 'pi_damping', self.pi_damping)
        if self.damping_on_each_factor is not None:
            _flag('Cholesky', 'damping_on_each_factor', self.damping_on_each_factor)
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class NewtonSchulz(_WithPrecision):
    """K-FAC with damped inverses by Newton-Schulz iterations (GEMMs only):
    kfac::KFAC<Symmetric, NewtonSchulz>; the damping form of Cholesky with the damping's square
    root on each factor. tolerance 0: 1e-14 (float64), 1e-6 (float32)."""

    max_iterations: int = 100
    tolerance: float = 0.0
    pi_damping: bool = True
    kind: ClassVar[str] = 'newton_schulz'
    cpp: ClassVar[str] = 'kfac::KFAC<Symmetric, NewtonSchulz, Prec>'

    def __post_init__(self) -> None:
        _int('NewtonSchulz', 'max_iterations', self.max_iterations, 1)
        _real('NewtonSchulz', 'tolerance', self.tolerance, lambda v: 0 <= v < float('inf'), 'finite and >= 0')
        _flag('NewtonSchulz', 'pi_damping', self.pi_damping)
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class NGSGD(Method):
    """Kaldi's online natural gradient (Povey et al. 2015): kfac::NGSGD, Kaldi's defaults
    (docs/ngsgd.md). rank sets rank_in and rank_out; None: min(20, (in + 1) / 2) and
    min(80, (out + 1) / 2). Its estimates are kept in the parameters' dtype (no precision)."""

    rank: int | None = None
    rank_in: int | None = None
    rank_out: int | None = None
    update_period: int = 4
    initial_updates: int = 11
    init_iterations: int = 0
    num_samples_history: float = 2000.0
    alpha: float = 4.0
    epsilon: float = 1e-10
    delta: float = 5e-4
    eta_cap: float = 0.9
    symmetry_breaker: float = 1.1
    relative_d_floor: bool = True
    kind: ClassVar[str] = 'ngsgd'
    cpp: ClassVar[str] = 'kfac::NGSGD'
    has_precision: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ('rank', 'rank_in', 'rank_out'):
            if getattr(self, name) is not None:
                _int('NGSGD', name, getattr(self, name), 0)
        if self.rank is not None and (self.rank_in is not None or self.rank_out is not None):
            raise ValueError('NGSGD: rank sets both rank_in and rank_out; pass either rank or rank_in/rank_out')
        _int('NGSGD', 'update_period', self.update_period, 1)
        _int('NGSGD', 'initial_updates', self.initial_updates, 0)
        _int('NGSGD', 'init_iterations', self.init_iterations, 0)
        _real('NGSGD', 'num_samples_history', self.num_samples_history, lambda v: v > 0, '> 0')
        _real('NGSGD', 'alpha', self.alpha, lambda v: v >= 0, '>= 0')
        _real('NGSGD', 'epsilon', self.epsilon, lambda v: v > 0, '> 0')
        _real('NGSGD', 'delta', self.delta, lambda v: 0 < v < 1, 'in (0, 1)')
        _real('NGSGD', 'eta_cap', self.eta_cap, lambda v: 0 < v <= 1, 'in (0, 1]')
        _real('NGSGD', 'symmetry_breaker', self.symmetry_breaker, lambda v: v > 0, '> 0')
        _flag('NGSGD', 'relative_d_floor', self.relative_d_floor)

    def _core_spec(self, default_factor: Any, default_inv: Any, params: torch.dtype) -> dict[str, Any]:
        spec = super()._core_spec(default_factor, default_inv, params)
        rank = spec.pop('rank')
        if rank is not None:
            spec.update(rank_in=rank, rank_out=rank)
        return spec


@dataclasses.dataclass(frozen=True)
class UnitWiseFisher(_WithPrecision):
    """The unit-wise Fisher of BatchNorm2d (a 2 x 2 block per channel) and LayerNorm (per feature):
    kfac::UnitWiseFisher<UnitWise, Prec>; their only method (registered under conventions='kfac')."""

    kind: ClassVar[str] = 'unit_wise_fisher'
    cpp: ClassVar[str] = 'kfac::UnitWiseFisher<UnitWise, Prec>'
    modules: ClassVar[tuple[str, ...]] = ('batch_norm', 'layer_norm')
    applies_to: ClassVar[str] = 'BatchNorm2d and LayerNorm'

    def __post_init__(self) -> None:
        _no_half_factors(self, 'the unit-wise Fisher')
        super().__post_init__()

    def _core_spec(self, default_factor: Any, default_inv: Any, params: torch.dtype) -> dict[str, Any]:
        """A float16 default (KFACPreconditioner's factor_dtype) is for the Kronecker modules:
        BatchNorm2d keeps float32, the decomposition type of kfac::HalfPrecision."""
        return super()._core_spec(_no_half(default_factor), default_inv, params)


@dataclasses.dataclass(frozen=True)
class EmbeddingFisher(_WithPrecision):
    """The Fisher of an Embedding, diag(A) from token counts times G from output gradients
    (K-FAC-expand with one-hot inputs, docs/transformers.md): kfac::EmbeddingFisher<Symmetric,
    Eigendecomposition<>, Prec>, G decomposed with jacobi_sweeps and refresh_tolerance (as Eigen's);
    diagonal=True keeps only diag(G) (kfac::EmbeddingFisher<Diagonal>: nothing to decompose).
    The only method of Embedding modules (registered under conventions='kfac')."""

    diagonal: bool = False
    jacobi_sweeps: int = 60
    refresh_tolerance: float = 0.0
    kind: ClassVar[str] = 'embedding_fisher'
    cpp: ClassVar[str] = 'kfac::EmbeddingFisher<Symmetric or Diagonal, Eigendecomposition<>, Prec>'
    modules: ClassVar[tuple[str, ...]] = ('embedding',)
    applies_to: ClassVar[str] = 'Embedding'

    def __post_init__(self) -> None:
        _flag('EmbeddingFisher', 'diagonal', self.diagonal)
        _int('EmbeddingFisher', 'jacobi_sweeps', self.jacobi_sweeps, 1)
        _real('EmbeddingFisher', 'refresh_tolerance', self.refresh_tolerance, lambda v: 0 <= v < 1, 'in [0, 1)')
        _no_half_factors(self, "an Embedding's factors")
        super().__post_init__()

    def _core_spec(self, default_factor: Any, default_inv: Any, params: torch.dtype) -> dict[str, Any]:
        """As UnitWiseFisher: a float16 default factor_dtype is for the Kronecker modules."""
        return super()._core_spec(_no_half(default_factor), default_inv, params)


@dataclasses.dataclass(frozen=True)
class DiagonalFisher(_WithPrecision):
    """The generic fallback: one parameter's damped diagonal Fisher, the running (sum_n g_n)^2 / N
    from its batch gradient (kfac::DiagonalFisher<Prec>, docs/transformers.md). Any module with
    parameters can be given it (conventions='kfac'): each of its parameters is then registered on
    its own. KFACPreconditioner(fallback='diagonal') gives it to every module kfac has no layer
    type for."""

    kind: ClassVar[str] = 'diagonal_fisher'
    cpp: ClassVar[str] = 'kfac::DiagonalFisher<Prec>'
    modules: ClassVar[tuple[str, ...]] = ('parameter',)
    applies_to: ClassVar[str] = 'any module with parameters'

    def __post_init__(self) -> None:
        _no_half_factors(self, 'the diagonal Fisher')
        super().__post_init__()

    def _core_spec(self, default_factor: Any, default_inv: Any, params: torch.dtype) -> dict[str, Any]:
        """As UnitWiseFisher: a float16 default factor_dtype is for the Kronecker modules."""
        return super()._core_spec(_no_half(default_factor), default_inv, params)


def _no_half_factors(method: _WithPrecision, what: str) -> None:
    if method.factor_dtype == torch.float16:
        raise ValueError(
            f'{type(method).__name__}: factor_dtype=torch.float16: half-precision storage is for Kronecker factors '
            f'(kfac::Half); {what} is kept in float32 or float64',
        )


def _no_half(default_factor: Any) -> Any:
    """KFACPreconditioner's factor_dtype for a method without half-precision factors: float32,
    the decomposition type of kfac::HalfPrecision, for float16."""
    return torch.float32 if default_factor == torch.float16 else default_factor
