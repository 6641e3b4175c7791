"""kfac.KFACPreconditioner: kfac-pytorch's interface over kfac's C++ core (docs/python.md)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
import weakref
from typing import Any
from typing import Callable

import torch
import torch.distributed as dist

from kfac import _kfac
from kfac import losses
from kfac import methods as kfac_methods
from kfac.assignment import grad_worker_layout
from kfac.base_preconditioner import HYPERPARAMETERS
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.enums import AllreduceMethod
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy

logger = logging.getLogger(__name__)


def _own_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(module.parameters(recurse=False))


def _class_name(cls: type) -> str:
    """'torch.nn.Conv2d' for PyTorch's own modules, 'package.module.Class' for others."""
    where = 'torch.nn' if cls.__module__.startswith('torch.nn.modules.') else cls.__module__
    return f'{where}.{cls.__qualname__}'


def _type_name(module: torch.nn.Module) -> str:
    return _class_name(type(module))


_CONVENTIONS = ('kfac-pytorch', 'kfac')
_FALLBACKS = (None, 'diagonal')
_FISHERS = ('empirical', 'sampled')


def _sample_count(module: torch.nn.Module, inputs: tuple[Any, ...]) -> int | None:
    """The batch of one call of a module whose parameters have the diagonal fallback: its first
    tensor input's first extent (MultiheadAttention: its query's batch, as batch_first says; 1 for
    an unbatched query). None when no positional tensor came in."""
    x = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if x is None:
        return None
    if isinstance(module, torch.nn.MultiheadAttention):
        return (x.size(0) if module.batch_first else x.size(1)) if x.dim() == 3 else 1
    return x.size(0) if x.dim() >= 1 else 1


def _parameters_of(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a module's own call computes with: its own, and for MultiheadAttention its
    out_proj's too (it reads them in F.multi_head_attention_forward, never calling out_proj)."""
    own = list(module.named_parameters(recurse=False))
    if isinstance(module, torch.nn.MultiheadAttention):
        own += [(f'out_proj.{n}', p) for n, p in module.out_proj.named_parameters(recurse=False)]
    return own


@dataclasses.dataclass(frozen=True)
class _ModuleKind:
    """One module class kfac preconditions (register_module)."""

    module_type: type
    kind: str
    describe: Callable[[torch.nn.Module, str], dict[str, Any] | None]
    subclasses: bool
    input: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None
    output_grad: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None


_MODULE_KINDS: list[_ModuleKind] = []


def register_module(
    module_type: type,
    kind: str,
    describe: Callable[[torch.nn.Module, str], dict[str, Any] | None],
    *,
    subclasses: bool = False,
    input: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,  # noqa: A002
    output_grad: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Registers a module class with one of the core's kinds, for the preconditioners built afterwards.

    Args:
        module_type: the torch.nn.Module class; its exact instances are matched, and with
            subclasses=True the instances of its subclasses too. The last registration that
            matches a module (and whose describe returns a dict) wins, so a class registered
            again, or a subclass of a registered class, takes the new translation.
        kind: the core's layer kind its modules become: one of kfac._kfac.core_kinds()
            ('linear', 'conv2d', 'batch_norm', 'layer_norm', 'embedding', 'parameter'). A layer
            kind of its own (its shape, its rows of A and G) needs C++ (docs/torch.md).
        describe: describe(module, conventions) -> the kind's settings of this module
            ('linear': in_features, out_features; 'layer_norm': num_features, eps,
            normalized_dims; ... as the built-in registrations below give them), with 'weight' and
            'bias' when they are not the module's attributes of those names; None: not this kind
            under these conventions ('kfac-pytorch' or 'kfac').
        input: input(module, x) -> the tensor the kind observes of one call's input x (default:
            the kind's own, e.g. LayerNorm's normalized input).
        output_grad: output_grad(module, g) -> the tensor it observes of the call's output
            gradient (default: the kind's own).
    """
    if not isinstance(module_type, type) or not issubclass(module_type, torch.nn.Module):
        raise TypeError(f'register_module: {module_type!r} is not a torch.nn.Module class')
    kinds = _kfac.core_kinds()
    if kind not in kinds:
        raise ValueError(f"register_module: kind {kind!r} is not one of the core's kinds ({', '.join(kinds)})")
    _MODULE_KINDS.append(_ModuleKind(module_type, kind, describe, subclasses, input, output_grad))


def _registered_types() -> str:
    """The module classes registered now (register_module), each once, for the core's messages."""
    return ', '.join(dict.fromkeys(_class_name(k.module_type) for k in _MODULE_KINDS))


def _kind_of(module: torch.nn.Module, conventions: str) -> tuple[_ModuleKind, dict[str, Any]] | None:
    for k in reversed(_MODULE_KINDS):
        if type(module) is k.module_type or (k.subclasses and isinstance(module, k.module_type)):
            settings = k.describe(module, conventions)
            if settings is not None:
                return k, settings
    return None


def _describe(name: str, module: torch.nn.Module, conventions: str) -> dict[str, Any]:
    """What kfac's shared translation needs to know of one module owning parameters: the kind
    and settings of the last registration matching it (register_module), or type 'other'."""
    d: dict[str, Any] = {
        'name': name,
        'type_name': _type_name(module),
        'type': 'other',
        'all_frozen': not any(p.requires_grad for p in _own_parameters(module)),
        'weight': getattr(module, 'weight', None),
        'bias': getattr(module, 'bias', None),
    }
    found = _kind_of(module, conventions)
    if found is not None:
        k, settings = found
        d.update(settings, type=k.kind)
        if k.input is not None:
            d['input'] = functools.partial(k.input, module)
        if k.output_grad is not None:
            d['output_grad'] = functools.partial(k.output_grad, module)
    if not isinstance(d['weight'], torch.Tensor):
        d['weight'] = None
    if not isinstance(d['bias'], torch.Tensor):
        d['bias'] = None
    return d


# The built-in module classes, registered as a user's are. Under kfac-pytorch's conventions,
# subclasses of Linear and Conv2d count as theirs and BatchNorm2d, LayerNorm and Embedding are
# left to the optimizer (kfac-pytorch's registration); under kfac's, exact types only (a subclass
# may change what forward computes) and affine BatchNorm2d, LayerNorm and Embedding too.


def _linear(m: torch.nn.Linear, conventions: str) -> dict[str, Any] | None:
    if type(m) is not torch.nn.Linear and conventions != 'kfac-pytorch':
        return None
    return {'in_features': m.in_features, 'out_features': m.out_features}


def _conv2d(m: torch.nn.Conv2d, conventions: str) -> dict[str, Any] | None:
    if type(m) is not torch.nn.Conv2d and conventions != 'kfac-pytorch':
        return None
    return {
        'in_channels': m.in_channels,
        'out_channels': m.out_channels,
        'groups': m.groups,
        'kernel_size': tuple(m.kernel_size),
        'stride': tuple(m.stride),
        'dilation': tuple(m.dilation),
        'padding': m.padding if isinstance(m.padding, str) else tuple(m.padding),
        'padding_mode': m.padding_mode,
    }


def _batch_norm(m: torch.nn.BatchNorm2d, conventions: str) -> dict[str, Any] | None:
    if not m.affine or conventions == 'kfac-pytorch':
        return None
    return {'num_features': m.num_features, 'eps': m.eps}


def _layer_norm(m: torch.nn.LayerNorm, conventions: str) -> dict[str, Any] | None:
    if conventions == 'kfac-pytorch':
        return None
    shape = tuple(m.normalized_shape)
    return {'num_features': shape[-1], 'normalized_dims': len(shape), 'eps': m.eps}


def _embedding(m: torch.nn.Embedding, conventions: str) -> dict[str, Any] | None:
    if conventions == 'kfac-pytorch':
        return None
    return {
        'num_embeddings': m.num_embeddings,
        'embedding_dim': m.embedding_dim,
        'padding_idx': m.padding_idx,
        'sparse': m.sparse,
        'scale_grad_by_freq': m.scale_grad_by_freq,
    }


register_module(torch.nn.Linear, 'linear', _linear, subclasses=True)
register_module(torch.nn.Conv2d, 'conv2d', _conv2d, subclasses=True)
register_module(torch.nn.BatchNorm2d, 'batch_norm', _batch_norm)
register_module(torch.nn.LayerNorm, 'layer_norm', _layer_norm)
register_module(torch.nn.Embedding, 'embedding', _embedding)


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC preconditioning of a PyTorch model's gradients, by kfac's C++ core.

    Every argument kfac-pytorch's ``kfac.preconditioner.KFACPreconditioner`` takes is accepted
    with the same meaning and, by default (conventions='kfac-pytorch'), gives kfac-pytorch's
    steps; then kfac's own settings (docs/python.md, "Conventions").

    Example:
        >>> preconditioner = kfac.KFACPreconditioner(model, factor_update_steps=10)
        >>> loss.backward()
        >>> preconditioner.step()   # rewrites the registered modules' .grad in place
        >>> optimizer.step()

    Args (kfac-pytorch's):
        model: the model; its Linear and Conv2d modules are registered (and affine BatchNorm2d,
            LayerNorm and Embedding under conventions='kfac').
        factor_update_steps, inv_update_steps: intervals (int, or callable of the step).
        damping, factor_decay, kl_clip, lr: floats or callables of the step; kl_clip None
            disables the KL clipping.
        accumulation_steps: forward/backward passes per step(), each loss divided by it.
        allreduce_bucket_cap_mb: bound of one factor-averaging collective (0: 1 byte buckets).
        assignment_strategy: AssignmentStrategy or 'compute' / 'memory'.
        colocate_factors: decompose a layer's A and G on the same rank.
        compute_method: ComputeMethod or 'eigen' / 'inverse'.
        compute_eigenvalue_outer_product: store 1 / (outer(dG, dA) + damping) once per
            decomposition (kfac's precompute_reciprocal).
        grad_worker_fraction: DistributedStrategy or a fraction in [0, 1].
        symmetry_aware: accepted; kfac always communicates packed triangles.
        grad_scaler: torch.cuda.amp.GradScaler or a callable returning the loss scale; output
            gradients are divided by it.
        factor_dtype, inv_dtype: the storage of the factors (float16, i.e. kfac's binary16 Half;
            float32; float64) and the type of the decompositions (float32, float64) of every
            module whose method does not set its own (float16 factors: Linear and Conv2d only;
            the others keep float32); None (default): the
            parameters' dtype (float32 decompositions for float16 factors). What kfac has no
            precision for (bfloat16, float16 decompositions, float16 factors with float64
            decompositions) is a ValueError naming it (kfac.methods.precision).
        skip_layers: regular expressions searched in each module's name and class name; a
            pattern matching no module of the model is a ValueError.
        update_factors_in_hook: accepted; kfac folds the statistics in step().
        loglevel: level of the registration log lines.

    Args (kfac's own):
        methods: {regex or module: kfac.methods object} (Eigen(), RandomizedEigen(rank=32),
            Cholesky(), NewtonSchulz(), NGSGD(), UnitWiseFisher(), EmbeddingFisher()); a regex is
            searched in the module names, a module object is that module; the first entry that
            matches a module wins; modules no entry matches get compute_method's (BatchNorm2d and
            LayerNorm UnitWiseFisher(), Embedding EmbeddingFisher()).
            'eigen', 'inverse', 'ngsgd' stand for Eigen(), Cholesky(pi_damping=pi_damping),
            NGSGD(). A method for a module that is not preconditioned, or of the wrong kind for
            it, and a regex that decides no module's method, are ValueErrors naming them.
        pi_damping: with compute_method INVERSE (or 'inverse'), pi-damping (Martens & Grosse
            2015, section 6.3) instead of the same damping on both factors.
        conventions: 'kfac-pytorch' (default: its factor scalings, factors starting at the
            identity, its accumulation and INVERSE damping; subclasses of Linear and Conv2d
            registered, BatchNorm2d, LayerNorm and Embedding left to the optimizer) or 'kfac'
            (factors of per-sample gradients, KFC for convolutions, unit-wise Fisher of BatchNorm2d
            and LayerNorm, EmbeddingFisher of Embedding).
        loss_reduction: with conventions='kfac': 'mean' (default; the loss is a mean over the
            batch) or 'sum'.
        nonfinite: 'raise' (default) or 'skip' (a step with NaN/Inf changes nothing).
        decomposition_delay: decompositions of step s used from step s + d.
        token_reduction: 'none', 'expand' or 'reduce' for Linear layers on (B, T, ..., in) (an
            Embedding's Fisher is always K-FAC-expand, over ids of any shape);
            default 'expand' (kfac-pytorch's conventions: tokens flattened into the batch, as
            kfac-pytorch does) or 'none' (kfac's; 'expand' and 'reduce' are then Eschenhagen et
            al. 2023's K-FAC-expand and K-FAC-reduce, docs/python.md).
        mpi_comm: an mpi4py communicator: kfac's factors are averaged over it (instead of
            torch.distributed's default group); the gradients are averaged by the caller.
        fallback: with conventions='kfac': None (default) or 'diagonal': every module with
            parameters that kfac has no layer type for (MultiheadAttention and its out_proj included,
            and every module sharing a parameter with another: tied weights) has each of its
            parameters registered on its own under kfac.methods.DiagonalFisher(), so that the
            model's every parameter is preconditioned; a shared parameter once, under the name of
            the first module that owns it (docs/transformers.md).
        strict: False (default, as kfac-pytorch): a module with parameters whose type kfac has
            no layer for (EmbeddingBag, ConvTranspose2d, a custom module, ...) is left to the
            optimizer and listed by skipped(); True: such a module is a KFACError naming it.
        fisher: with conventions='kfac': 'empirical' (default: G from the output gradients of
            the loss at the data's targets) or 'sampled' (the true Fisher: G from the output
            gradients at targets drawn from the model's predictive distribution; call
            sample_fisher(outputs, loss) before loss.backward() on every step; the parameters'
            gradients stay the data's). Cost: fisher_samples extra backward passes on the steps
            that update the statistics, none on the others.
        fisher_samples: targets drawn per sample under fisher='sampled' (default 1).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        factor_update_steps: Callable[[int], int] | int = 1,
        inv_update_steps: Callable[[int], int] | int = 1,
        damping: Callable[[int], float] | float = 0.001,
        factor_decay: Callable[[int], float] | float = 0.95,
        kl_clip: Callable[[int], float] | float | None = 0.001,
        lr: Callable[[int], float] | float = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        skip_layers: list[str] | str | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        methods: dict[str | torch.nn.Module, kfac_methods.Method | str] | None = None,
        pi_damping: bool = False,
        loss_reduction: str | None = None,
        nonfinite: str = 'raise',
        decomposition_delay: int = 0,
        token_reduction: str | None = None,
        mpi_comm: Any = None,
        strict: bool = False,
        conventions: str = 'kfac-pytorch',
        fallback: str | None = None,
        fisher: str = 'empirical',
        fisher_samples: int = 1,
    ) -> None:
        self._check(factor_update_steps, 'factor_update_steps', lambda v: v > 0, 'must be > 0')
        self._check(inv_update_steps, 'inv_update_steps', lambda v: v > 0, 'must be > 0')
        self._check(damping, 'damping', lambda v: v > 0, 'must be > 0')
        if conventions == 'kfac-pytorch':  # factors start at I: decay 1 keeps them there, as in kfac-pytorch
            self._check(factor_decay, 'factor_decay', lambda v: 0 < v <= 1, 'must be in (0, 1]')
        else:
            self._check(factor_decay, 'factor_decay', lambda v: 0 <= v < 1, 'must be in [0, 1) (kfac: 1 would never update)')
        self._check(kl_clip, 'kl_clip', lambda v: v is None or v > 0, 'must be > 0 (None: no clipping)')
        self._check(lr, 'lr', lambda v: v > 0, 'must be > 0')
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError('accumulation_steps must be > 0')
        if conventions not in _CONVENTIONS:
            raise ValueError(f'conventions must be one of {", ".join(map(repr, _CONVENTIONS))} (got {conventions!r})')
        if conventions == 'kfac-pytorch' and loss_reduction is not None:
            raise ValueError(
                "loss_reduction is one of kfac's conventions: kfac-pytorch's factors take the output gradients as "
                "autograd gives them; pass conventions='kfac' with it",
            )
        if fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be None or 'diagonal' (got {fallback!r})")
        if conventions == 'kfac-pytorch' and fallback is not None:
            raise ValueError(
                "fallback='diagonal' is one of kfac's conventions: kfac-pytorch's registration leaves every module it "
                "has no layer for to the optimizer; pass conventions='kfac' with it",
            )
        if fisher not in _FISHERS:
            raise ValueError(f"fisher must be 'empirical' or 'sampled' (got {fisher!r})")
        if conventions == 'kfac-pytorch' and fisher != 'empirical':
            raise ValueError(
                "fisher='sampled' is one of kfac's conventions: kfac-pytorch's factors take the output gradients as "
                "autograd gives them, for a loss whose reduction kfac does not know; pass conventions='kfac' with it",
            )
        if not isinstance(fisher_samples, int) or isinstance(fisher_samples, bool) or fisher_samples < 1:
            raise ValueError(f'fisher_samples must be an int >= 1 (got {fisher_samples!r})')
        if allreduce_bucket_cap_mb < 0:
            raise ValueError('allreduce_bucket_cap_mb must be >= 0')
        if (
            not callable(inv_update_steps)
            and not callable(factor_update_steps)
            and inv_update_steps % factor_update_steps != 0
        ):
            warnings.warn(
                'It is suggested that inv_update_steps be an integer multiple of factor_update_steps',
                stacklevel=2,
            )
        if isinstance(assignment_strategy, str):
            assignment_strategy = AssignmentStrategy[assignment_strategy.upper()]
        if isinstance(compute_method, str):
            compute_method = ComputeMethod[compute_method.upper()]
        distributed = mpi_comm is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        world = mpi_comm.Get_size() if mpi_comm is not None else dist.get_world_size() if distributed else 1
        if mpi_comm is not None and not _kfac.has_mpi():
            raise ValueError('mpi_comm: this kfac was built without MPI (KFAC_ENABLE_MPI)')
        fraction, self.distributed_strategy, colocate_factors = grad_worker_layout(
            grad_worker_fraction,
            world,
            colocate_factors=colocate_factors,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
        )
        self.colocate_factors = colocate_factors
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.allreduce_bucket_cap_mb = allreduce_bucket_cap_mb
        bucketed = allreduce_bucket_cap_mb > 0
        self.allreduce_method = AllreduceMethod.ALLREDUCE_BUCKETED if bucketed else AllreduceMethod.ALLREDUCE

        self.model = model
        self.compute_method = compute_method
        self.pi_damping = pi_damping
        self.assignment_strategy = assignment_strategy
        self.grad_worker_fraction = fraction
        self.grad_scaler = grad_scaler
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        kfac_methods.precision(factor_dtype, inv_dtype, next(iter(dtypes)) if len(dtypes) == 1 else torch.float32)
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.symmetry_aware = symmetry_aware
        self.update_factors_in_hook = update_factors_in_hook
        self._accumulation_steps = accumulation_steps
        self._hyper = {
            'factor_update_steps': factor_update_steps,
            'inv_update_steps': inv_update_steps,
            'damping': damping,
            'factor_decay': factor_decay,
            'kl_clip': kl_clip,
            'lr': lr,
        }
        if isinstance(skip_layers, str):
            skip_layers = [skip_layers]
        self.skip_layers = list(skip_layers or [])
        self.strict = strict
        self.conventions = conventions
        self.fallback = fallback
        self.fisher = fisher
        self.fisher_samples = fisher_samples
        self.loss_reduction = 'sum' if conventions == 'kfac-pytorch' else loss_reduction or 'mean'
        self._sampling = False  # inside sample_fisher's backward passes
        self._sampled = False  # sample_fisher ran since the last step()
        self._seen: list[list[torch.Tensor]] = []  # fisher='sampled': each module's inputs since sample_fisher
        self._world = world
        self._counted: set[str] = set()  # registered names whose hooks count samples (the diagonal fallback)
        pytorch = conventions == 'kfac-pytorch'

        specs, modules = self._find_modules(model, self._method_entries(model, methods or {}))
        settings: dict[str, Any] = {name: self._for_core(name, v) for name, v in self._hyper.items()}
        settings.update(
            accumulation_steps=accumulation_steps,
            bucket_bytes=max(1, int(allreduce_bucket_cap_mb * 2**20)),
            assignment_cost=assignment_strategy.name.lower(),
            colocate_factors=colocate_factors,
            precompute_reciprocal=bool(compute_eigenvalue_outer_product and compute_method == ComputeMethod.EIGEN),
            grad_worker_fraction=fraction,
            # kfac-pytorch's conventions: G from the output gradients as they come ('sum': no
            # rescaling), factors starting at the identity, micro-batches' factors averaged as
            # they are, Linear over any leading dimensions (tokens as samples).
            loss_reduction='sum' if pytorch else loss_reduction or 'mean',
            initial_factors='identity' if pytorch else 'batch',
            rescale_accumulated=not pytorch,
            flatten_tokens=pytorch,
            nonfinite=nonfinite,
            decomposition_delay=decomposition_delay,
            token_reduction=token_reduction or ('expand' if pytorch else 'none'),
            # torch.distributed's default group: kfac averages the factors over it (KAISA); the
            # gradients are averaged by the user (DistributedDataParallel) before step().
            process_group=dist.distributed_c10d._get_default_group() if distributed else None,
            mpi_comm=mpi_comm if mpi_comm is not None and world > 1 else None,
        )
        # The communicator's settings, for kfac.SelfTuning (the same ranks).
        self._communicator = {k: settings[k] for k in ('process_group', 'mpi_comm')}
        self._core = _kfac.Core(specs, settings)
        self._modules = [modules[name] for name in self._core.modules()]
        self._handles: list[tuple[Any, Any] | None] = [None] * len(self._modules)
        self._seen = [[] for _ in self._modules]
        for name, module in zip(self._core.modules(), self._modules):
            logger.log(loglevel, f'Registered name="{name}": {module!r}')
        for skipped in self._core.skipped():
            logger.log(loglevel, f'Skipped {skipped}')
        logger.log(loglevel, f'KFAC layer assignments: {self._describe_assignment()}')
        self._sync_hooks()

    # ---- construction ----------------------------------------------------------------------

    @staticmethod
    def _check(v: Any, name: str, ok: Callable[[Any], bool], what: str) -> None:
        if not callable(v) and not ok(v):
            raise ValueError(f'{name} {what} (got {v})')

    @staticmethod
    def _for_core(name: str, v: Any) -> Any:
        """A value as kfac's Options take it. kl_clip None (kfac-pytorch: no clipping) is kfac's 0.
        An interval given as a callable f: kfac-pytorch updates at the steps s with
        s % f(s) == 0, kfac at s + interval(s) after an update at s; the interval handed to kfac
        is the distance to the next such step."""
        if name == 'kl_clip':
            if callable(v):
                return lambda step: 0.0 if v(step) is None else float(v(step))
            return 0.0 if v is None else v
        if name in ('factor_update_steps', 'inv_update_steps') and callable(v):

            @functools.lru_cache(maxsize=64)
            def interval(step: int) -> int:
                t = step + 1
                while t % int(v(t)) != 0:
                    t += 1
                return t - step

            return interval
        return v

    def _method_object(self, value: Any, key: str) -> kfac_methods.Method:
        """A kfac.methods object, or the one a string ('eigen', 'inverse', 'ngsgd') stands for."""
        if isinstance(value, kfac_methods.Method):
            return value
        named = {'eigen': kfac_methods.Eigen, 'inverse': kfac_methods.Cholesky, 'ngsgd': kfac_methods.NGSGD}
        if isinstance(value, str) and value in named:
            return kfac_methods.Cholesky(pi_damping=self.pi_damping) if value == 'inverse' else named[value]()
        raise ValueError(
            f"{key} = {value!r}: expected a kfac.methods object (Eigen(), Cholesky(), ...) or 'eigen', 'inverse', "
            "'ngsgd'",
        )

    def _method_entries(
        self,
        model: torch.nn.Module,
        methods: dict[Any, Any],
    ) -> list[tuple[str, Any, kfac_methods.Method]]:
        """methods= as (its key as messages name it, a compiled regex or a module, the method)."""
        names = {id(m): name or 'root' for name, m in model.named_modules()}
        entries = []
        for key, value in methods.items():
            if isinstance(key, torch.nn.Module):
                if id(key) not in names:
                    raise ValueError(f'methods: a key is a {_type_name(key)} that is not a module of the model')
                where = f'methods[<module {names[id(key)]}>]'
                entries.append((where, key, self._method_object(value, where)))
            elif isinstance(key, str):
                where = f'methods[{key!r}]'
                try:
                    pattern = re.compile(key)
                except re.error as e:
                    raise ValueError(f'{where}: not a regular expression ({e})') from None
                entries.append((where, pattern, self._method_object(value, where)))
            else:
                raise ValueError(f'methods: a key is {key!r}; expected a regular expression or a module of the model')
        return entries

    def _method_of(
        self,
        name: str,
        module: torch.nn.Module,
        d: dict[str, Any],
        entries: list[tuple[str, Any, kfac_methods.Method]],
        deciding: set[str],
    ) -> dict[str, Any] | None:
        """The core's description of the method of one module: the first entry matching it, else
        compute_method's; None for a module kfac does not precondition."""
        registered = not d['skipped'] and not d['all_frozen'] and d['type'] != 'other'
        hit = next((e for e in entries if e[1] is module or (isinstance(e[1], re.Pattern) and e[1].search(name))), None)
        if hit is not None and hit[1] is module and not registered:
            why = d.get('skip_reason') or (
                'frozen' if d['all_frozen'] else 'skip_layers' if d['skipped'] else 'no kfac layer type'
            )
            raise ValueError(f"{hit[0]}: module '{name}' ({d['type_name']}) is not preconditioned ({why})")
        if not registered:
            return None
        if hit is None:
            method = self._method_object(self.compute_method.name.lower(), 'compute_method')
            for only in (kfac_methods.UnitWiseFisher(), kfac_methods.EmbeddingFisher()):  # their kinds' one method
                method = only if d['type'] in only.modules else method
        else:
            where, _, method = hit
            deciding.add(where)
            if d['type'] not in method.modules:
                raise ValueError(
                    f"{where}: {type(method).__name__} is for {method.applies_to} modules; module '{name}' is a "
                    f"{d['type_name']}",
                )
        if isinstance(method, kfac_methods.Cholesky) and method.damping_on_each_factor is None:
            method = dataclasses.replace(method, damping_on_each_factor=self.conventions == 'kfac-pytorch')
        if isinstance(method, kfac_methods.NGSGD):
            self._check_ngsgd_ranks(name, d, method)
        params = d['weight'].dtype
        if params not in (torch.float32, torch.float64):  # refused by the core, naming the module
            return {**method._core_spec(None, None, torch.float32), 'precision': 'scalar'}
        return method._core_spec(self.factor_dtype, self.inv_dtype, params)

    @staticmethod
    def _check_ngsgd_ranks(name: str, d: dict[str, Any], method: kfac_methods.NGSGD) -> None:
        """NG-SGD's ranks below its sides' dimensions (kfac::NGSGD's contract)."""
        if d['type'] == 'linear':
            rows, cols = d['out_features'], d['in_features']
        else:
            rows, cols = d['out_channels'], d['in_channels'] * d['kernel_size'][0] * d['kernel_size'][1]
        cols += d['bias'] is not None
        sides = (('rank_in', method.rank_in, cols, 'input'), ('rank_out', method.rank_out, rows, 'output'))
        for arg, rank, dim, side in sides:
            rank = method.rank if rank is None else rank
            if rank is not None and rank >= dim:
                raise ValueError(
                    f"NGSGD: {arg if method.rank is None else 'rank'}={rank} for module '{name}', whose {side} side "
                    f'has dimension {dim}: expected < {dim}',
                )

    def _find_modules(
        self,
        model: torch.nn.Module,
        entries: list[tuple[str, Any, kfac_methods.Method]],
    ) -> tuple[list[dict[str, Any]], dict[str, torch.nn.Module]]:
        patterns = [re.compile(p) for p in self.skip_layers]
        matched = [False] * len(patterns)
        deciding: set[str] = set()
        specs, modules = [], {}
        # MultiheadAttention computes with its out_proj's weight, never calling the module: its
        # hooks would never fire (kfac-pytorch#267), so it is the optimizer's, or with the diagonal
        # fallback its parameters are registered under the attention module, whose call is counted.
        never_called = {
            id(m.out_proj) for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)
        }
        # Tied weights: a parameter owned by two modules (an LM head sharing the embedding's matrix).
        owners: dict[int, list[str]] = {}
        for raw, module in model.named_modules():
            if id(module) not in never_called:
                for _, p in _parameters_of(module):
                    owners.setdefault(id(p), []).append(raw or 'root')
        registered: dict[int, str] = {}  # parameter -> the name it is registered under (the fallback)
        for raw_name, module in model.named_modules():
            name = raw_name or 'root'
            cls = type(module).__name__
            hits = [bool(p.search(name) or p.search(cls)) for p in patterns]
            matched = [a or b for a, b in zip(matched, hits)]
            params = _parameters_of(module)
            if not params or (id(module) in never_called and self.fallback is not None):
                continue  # no parameters, or registered with its MultiheadAttention
            d = _describe(name, module, self.conventions)
            d['skipped'] = any(hits)
            d['conventions'] = self.conventions
            hit = next(
                (e for e in entries if e[1] is module or (isinstance(e[1], re.Pattern) and e[1].search(name))),
                None,
            )
            diagonal = hit is not None and isinstance(hit[2], kfac_methods.DiagonalFisher)
            if diagonal and self.conventions == 'kfac-pytorch':
                raise ValueError(
                    f"{hit[0]}: DiagonalFisher is one of kfac's conventions (kfac-pytorch's registration has no "
                    "diagonal fallback); pass conventions='kfac'",
                )
            sharing = sorted({o for _, p in params for o in owners[id(p)] if o != name})
            other = d['type'] == 'other' or isinstance(module, torch.nn.MultiheadAttention)
            if diagonal or (self.fallback is not None and (other or sharing) and not d['all_frozen']):
                if diagonal:
                    deciding.add(hit[0])
                method = hit[2] if diagonal else kfac_methods.DiagonalFisher()
                for pname, p in params:
                    self._add_parameter(specs, modules, registered, d, module, f'{name}.{pname}', p, method)
                continue
            # Left to the optimizer, and why: kfac-pytorch's rule is that what kfac has no layer for
            # is the optimizer's alone (with strict=True an error instead, except BatchNorm2d, LayerNorm and
            # Embedding, left by the conventions themselves); a frozen one is listed by frozen() instead.
            by_convention = (type(module) in (torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.Embedding)
                             and self.conventions == 'kfac-pytorch')
            hint = '' if self.conventions == 'kfac-pytorch' else " (fallback='diagonal' preconditions it)"
            if id(module) in never_called:
                d['type'] = 'other'
                why = "MultiheadAttention's out_proj, whose forward it never calls: left to the optimizer"
            elif by_convention:
                why = "kfac-pytorch's conventions: left to the optimizer (conventions='kfac' preconditions it)"
            else:
                why = f'no kfac layer type: left to the optimizer{hint}'
            if not d['skipped'] and not d['all_frozen'] and d['type'] == 'other' and (by_convention or not self.strict):
                d.update(skipped=True, skip_reason=why)
            method = self._method_of(name, module, d, entries, deciding)
            if method is not None:
                d['method'] = method
            specs.append(d)
            modules[name] = module
        unmatched = [p.pattern for p, m in zip(patterns, matched) if not m]
        if unmatched:
            raise ValueError(
                f'skip_layers: {", ".join(repr(p) for p in unmatched)} matches no module name or class of the model',
            )
        idle = [where for where, key, _ in entries if where not in deciding and isinstance(key, re.Pattern)]
        if idle:
            raise ValueError(f'{", ".join(idle)}: decides the method of no preconditioned module (first match wins)')
        return specs, modules

    def _add_parameter(
        self,
        specs: list[dict[str, Any]],
        modules: dict[str, torch.nn.Module],
        registered: dict[int, str],
        d: dict[str, Any],
        module: torch.nn.Module,
        name: str,
        p: torch.nn.Parameter,
        method: kfac_methods.Method,
    ) -> None:
        """One parameter of `module` (described by `d`) under the diagonal Fisher: registered
        under `name`, or skipped when a module before it registered the same (tied) parameter."""
        spec = {
            'name': name,
            'type_name': f"{d['type_name']} parameter",
            'type': 'parameter',
            'weight': p,
            'bias': None,
            'skipped': d['skipped'],
            'all_frozen': not p.requires_grad,
            'conventions': self.conventions,
        }
        if id(p) in registered:
            spec.update(skipped=True, skip_reason=f"tied weights: preconditioned once, as '{registered[id(p)]}'")
        elif not spec['skipped'] and p.requires_grad:
            registered[id(p)] = name
        if p.dtype in (torch.float32, torch.float64):
            spec['method'] = method._core_spec(self.factor_dtype, self.inv_dtype, p.dtype)
        else:  # refused by the core, naming the parameter
            spec['method'] = {**method._core_spec(None, None, torch.float32), 'precision': 'scalar'}
        specs.append(spec)
        modules[name] = module
        self._counted.add(name)

    # ---- hooks: registered only while the next step updates a module's statistics -------------

    def _sync_hooks(self) -> None:
        for i, wanted in enumerate(self._core.wanted()):
            handles = self._handles[i]
            if wanted and handles is None:
                self._handles[i] = self._register_hooks(i)
            elif not wanted and handles is not None:
                for h in handles:
                    h.remove()
                self._handles[i] = None

    def _register_hooks(self, i: int) -> tuple[Any, Any]:
        """The hooks hold the preconditioner weakly: one that is no longer referenced is freed
        and its hooks removed (__del__), rather than kept alive by the model."""
        ref = weakref.ref(self)

        def save_input(module: torch.nn.Module, inputs: Any) -> None:
            p = ref()
            if p is not None:
                p._save_input(i, module, inputs)

        def save_grad_output(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
            p = ref()
            if p is not None:
                p._save_grad_output(i, module, grad_input, grad_output)

        module = self._modules[i]
        if self._core.modules()[i] in self._counted:  # the diagonal fallback: only the sample count

            def count_samples(module: torch.nn.Module, inputs: Any) -> None:
                p = ref()
                if p is not None:
                    p._count_samples(i, module, inputs)

            return (module.register_forward_pre_hook(count_samples),)
        return module.register_forward_pre_hook(save_input), module.register_full_backward_hook(save_grad_output)

    def remove_hooks(self) -> None:
        """Removes every hook from the model (also done when the preconditioner is freed)."""
        for i, handles in enumerate(getattr(self, '_handles', [])):
            if handles is not None:
                for h in handles:
                    h.remove()
                self._handles[i] = None

    def __del__(self) -> None:
        self.remove_hooks()

    def _save_input(self, i: int, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if module.training and torch.is_grad_enabled():
            self._core.observe_input(i, inputs[0])
            if self.fisher == 'sampled':
                self._seen[i].append(inputs[0])

    def _count_samples(self, i: int, module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        """A parameter under the diagonal fallback observes the samples its gradient is over: the
        call's batch, times the world size (the gradients are averaged over the ranks)."""
        if not (module.training and torch.is_grad_enabled()):
            return
        n = _sample_count(module, inputs)
        if n is not None:
            count = torch.zeros(n * self._world, dtype=self._core_dtype())
            self._core.observe_input(i, count)
            self._core.observe_output_grad(i, count)

    def _core_dtype(self) -> torch.dtype:
        return torch.float64 if self._core.dtype() == 'double' else torch.float32

    def _save_grad_output(self, i: int, module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        if not module.training or (self.fisher == 'sampled' and not self._sampling):
            return  # the sampled Fisher's statistics come from sample_fisher's passes alone
        g = grad_output[0] if isinstance(grad_output, (tuple, list)) else grad_output
        if self.grad_scaler is not None:
            scale = self.grad_scaler() if callable(self.grad_scaler) else self.grad_scaler.get_scale()
            g = g / scale
        self._core.observe_output_grad(i, g)

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> None:
        """Preconditions the registered modules' .grad in place; call after backward() and
        before optimizer.step(). Raises KFACError naming the modules that were not ready (then
        nothing changed). (No torch.no_grad() needed: the core records no autograd graph; it
        costs ~20 us a step.)"""
        unsampled = self.fisher == 'sampled' and not self._sampled and any(h is not None for h in self._handles)
        try:
            self._core.precondition()
        except _kfac.KFACError as e:
            if unsampled:
                raise ValueError(
                    "fisher='sampled': this step updates the statistics, and sample_fisher(outputs, loss) was not "
                    'called before loss.backward(); nothing was preconditioned',
                ) from e
            raise
        finally:
            self._sampled = False
            self._seen = [[] for _ in self._modules]
            self._sync_hooks()

    def sample_fisher(self, outputs: torch.Tensor, loss: str = 'cross_entropy') -> None:
        """fisher='sampled': on a step that updates the statistics, draws fisher_samples targets
        per sample from the model's predictive distribution at `outputs` (categorical for
        'cross_entropy', N(outputs, I/2) for 'mse', Bernoulli for 'bce': kfac.losses) and runs one
        backward pass from `outputs` per draw, whose output gradients the hooks record instead of
        the data loss's; the parameters' .grad is not touched. Call it after the forward pass and
        before loss.backward() (the graph is kept for it). On other steps it does nothing."""
        if self.fisher != 'sampled':
            raise ValueError("sample_fisher: this preconditioner was built with fisher='empirical'")
        losses.check_loss(loss)
        if not isinstance(outputs, torch.Tensor) or not outputs.requires_grad:
            raise ValueError('sample_fisher: outputs must be the model output of this forward pass, with its graph')
        if not any(h is not None for h in self._handles):
            return  # not a statistics step: no extra pass
        bad = int((~torch.isfinite(outputs.detach())).sum())
        if bad:
            raise ValueError(f'sample_fisher: the outputs have {bad} non-finite values (NaN/Inf)')
        seen, self._seen = self._seen, [[] for _ in self._modules]
        params = list({id(p): p for m in self._modules for p in m.parameters() if p.requires_grad}.values())
        scale = 1.0 / self._accumulation_steps  # as each micro-batch's loss is divided
        self._sampling = True
        try:
            for s in range(self.fisher_samples):
                if s > 0:  # one more observation of each input, for this draw's output gradients
                    for i, xs in enumerate(seen):
                        for x in xs:
                            self._core.observe_input(i, x)
                objective = losses.sampled_objective(loss, outputs, self.loss_reduction) * scale
                torch.autograd.grad(objective, params, retain_graph=True, allow_unused=True)
        finally:
            self._sampling = False
        self._sampled = True

    # ---- kfac-pytorch's properties -------------------------------------------------------------

    @property
    def steps(self) -> int:
        """The number of step() calls so far (or the count assigned to _steps)."""
        return self._core.step_count()

    def _set_steps(self, value: int) -> None:
        self._core.set_step_count(value)

    # damping, factor_decay, kl_clip, lr, factor_update_steps, inv_update_steps (the value at the
    # current step) and their private spellings come from BaseKFACPreconditioner.

    # ---- kfac's own views ----------------------------------------------------------------------

    def modules(self) -> list[str]:
        """The registered module names, in model order."""
        return self._core.modules()

    def skipped(self) -> list[str]:
        """Modules with parameters left out, with the reason (skip list, frozen)."""
        return self._core.skipped()

    def frozen(self) -> list[str]:
        """The modules left out because every parameter had requires_grad = False."""
        return self._core.frozen()

    @property
    def last_kl_scale(self) -> float:
        """The KL-clip scale the last step() applied."""
        return self._core.last_kl_scale()

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """The step count, the constant hyperparameters and (include_factors) kfac's checkpoint
        (statistics, decompositions, schedules) as bytes under 'kfac'."""
        state: dict[str, Any] = {'steps': self.steps}
        for name, v in self._hyper.items():
            if not callable(v):
                state[name] = v
        if include_factors:
            state['kfac'] = self._core.save()
        return state

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restores a state_dict(); with kfac's checkpoint the next step() continues bit for bit
        as the saved preconditioner would have (decompositions restored, not recomputed)."""
        if 'kfac' not in state_dict:
            if state_dict.get('steps', self.steps) != self.steps:
                raise ValueError(
                    'state_dict has no kfac checkpoint (state_dict(include_factors=False)); '
                    "kfac's step counter lives in it",
                )
        for name in HYPERPARAMETERS:
            if name in state_dict:
                self._set_hyperparameter(name, state_dict[name])
        if 'kfac' in state_dict:
            self._core.load(state_dict['kfac'])
        self._sync_hooks()

    def __repr__(self) -> str:
        params = {name: self._hyper[name] for name in HYPERPARAMETERS}
        params.update(
            accumulation_steps=self._accumulation_steps,
            compute_method=self.compute_method,
            grad_worker_fraction=self.grad_worker_fraction,
            layers=len(self._modules),
            skip_layers=self.skip_layers,
            steps=self.steps,
        )
        body = '\n'.join(f'  {k}={v},' for k, v in sorted(params.items()))
        return f'{type(self).__name__}(\n{body}\n)'

    # ---- kfac-pytorch's public API (kfac/base_preconditioner.py): added by the api branch --------

    def _hyperparameter(self, name: str) -> Any:
        return self._hyper[name]

    def _set_hyperparameter(self, name: str, value: Any) -> None:
        """kfac-pytorch's `preconditioner._damping = v` (LambdaParamScheduler): the core takes the
        new value at its next step() and checks it there."""
        self._core.set_hyperparameter(name, self._for_core(name, value))
        self._hyper[name] = value
        self._sync_hooks()

    def _describe_assignment(self) -> str:
        """The KAISA settings the core places the work with (kfac-pytorch logs its KAISAAssignment;
        kfac's placement itself is decided in the core)."""
        return (
            f'KAISAAssignment(grad_worker_fraction={self.grad_worker_fraction}, '
            f'distributed_strategy={self.distributed_strategy.name}, colocate_factors={self.colocate_factors}, '
            f'assignment_strategy={self.assignment_strategy.name}, layers={len(self._modules)})'
        )

    # ---- end of kfac-pytorch's public API block ------------------------------------------------
