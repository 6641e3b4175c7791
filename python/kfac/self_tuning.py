"""kfac.SelfTuning: automatic step size, momentum and damping (Martens & Grosse 2015, sections 6.5
and 7) over kfac::SelfTuning (docs/self_tuning.md, "Python")."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.autograd.forward_ad as fwad
from torch.nn.utils.stateless import functional_call

from kfac import _kfac
from kfac import losses


class SelfTuning:
    """Self-tuning K-FAC for a KFACPreconditioner built with conventions='kfac'.

    Every step the update is U = alpha P + mu U0 (P: the preconditioned gradient, U0: the previous
    update), alpha and mu minimising the quadratic model with the exact Gauss-Newton curvature of
    the model's outputs under `loss`; the parameters move by theta <- theta - U (no optimizer
    step: the update is the whole step), and every `update_interval` steps the damping lambda
    follows the Levenberg-Marquardt rule; the preconditioner's damping is lambda + weight_decay.

    Example:
        >>> pre = kfac.KFACPreconditioner(model, conventions='kfac', kl_clip=None, factor_decay=0.95)
        >>> tune = kfac.SelfTuning(pre, loss='cross_entropy')
        >>> for x, y in batches:
        ...     model.zero_grad()
        ...     torch.nn.functional.cross_entropy(model(x), y).backward()
        ...     tune.step(x, y)   # preconditions, solves, moves the parameters

    Args:
        preconditioner: a KFACPreconditioner with conventions='kfac'; its model's trainable
            parameters (all of them, preconditioned or not) are what the update moves.
        loss: 'cross_entropy', 'mse' or 'bce' (PyTorch's, reduced as the preconditioner's
            loss_reduction says); the model's output is what the loss takes.
        initial_damping, min_damping, max_damping, update_interval, damping_decay,
        lower_threshold, upper_threshold, weight_decay, use_momentum, adapt_damping,
        rho_includes_damping, solve_interval, solve_warmup: kfac::Adaptive's settings
            (docs/self_tuning.md, Attributes); solve_interval k: after the first solve_warmup
            steps, step() computes the products and solves every k steps and in between
            (apply_last()) uses the weighted means of the solves' alpha and mu.
            weight_decay eta: step() adds eta * theta to the gradient and eta/2 ||theta||^2 to
            the loss the damping rule compares.
    """

    def __init__(
        self,
        preconditioner: Any,
        loss: str = 'cross_entropy',
        *,
        initial_damping: float = 1e-3,
        min_damping: float = 1e-4,
        max_damping: float = math.inf,
        update_interval: int = 5,
        damping_decay: float = 0.95,
        lower_threshold: float = 0.25,
        upper_threshold: float = 0.75,
        weight_decay: float = 0.0,
        use_momentum: bool = True,
        adapt_damping: bool = True,
        rho_includes_damping: bool = True,
        solve_interval: int = 1,
        solve_warmup: int = 10,
    ) -> None:
        if getattr(preconditioner, 'conventions', None) != 'kfac':
            raise ValueError(
                "SelfTuning needs a KFACPreconditioner with conventions='kfac': under kfac-pytorch's the factors "
                'are not scaled as the loss is, so the damping lambda would not be the quadratic model\'s',
            )
        self.preconditioner = preconditioner
        self.model: torch.nn.Module = preconditioner.model
        self.loss = losses.check_loss(loss)
        self.reduction: str = preconditioner.loss_reduction
        self.weight_decay = float(weight_decay)
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not self._params:
            raise ValueError('SelfTuning: the model has no trainable parameter')
        dtypes = {p.dtype for _, p in self._params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float64):
            raise ValueError(
                f'SelfTuning: the trainable parameters have dtypes {sorted(map(str, dtypes))}; expected all float32 '
                'or all float64',
            )
        self.dtype = next(iter(dtypes))
        settings: dict[str, Any] = dict(
            initial_damping=float(initial_damping),
            min_damping=float(min_damping),
            max_damping=float(max_damping),
            update_interval=int(update_interval),
            damping_decay=float(damping_decay),
            lower_threshold=float(lower_threshold),
            upper_threshold=float(upper_threshold),
            weight_decay=self.weight_decay,
            use_momentum=bool(use_momentum),
            adapt_damping=bool(adapt_damping),
            rho_includes_damping=bool(rho_includes_damping),
            solve_interval=int(solve_interval),
            solve_warmup=int(solve_warmup),
        )
        settings.update(preconditioner._communicator)  # the same ranks: alpha, mu, lambda agree
        self._core = _kfac.SelfTuning(
            [n for n, _ in self._params],
            [p.numel() for _, p in self._params],
            'double' if self.dtype == torch.float64 else 'float',
            settings,
        )
        self._buffers = self._core.buffers()
        self._sync_damping()

    # ---- the protocol, for a host that computes its own products (docs/self_tuning.md) --------

    def capture_gradient(self) -> None:
        """Copies every trainable parameter's .grad (None counts as 0) as this step's gradient;
        call it after backward() (and any averaging over ranks), before preconditioner.step()."""
        self._copy_in()
        self._core.capture()

    def needs_previous_product(self) -> bool:
        """True when solve() needs along_previous: momentum is on and a previous update exists."""
        return self._core.needs_previous_product()

    def previous_update(self) -> dict[str, torch.Tensor]:
        """The previous update U0 by parameter name, shaped as the parameters (a copy)."""
        return {n: self._core.previous_update(i).view_as(p) for i, (n, p) in enumerate(self._params)}

    def solve(
        self,
        outputs: torch.Tensor,
        along_proposal: torch.Tensor | None,
        along_previous: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Collective. After preconditioner.step(): from the model's outputs on this rank's batch
        and their Jacobian-vector products along the .grad buffers (P) and along
        previous_update() (U0, when needs_previous_product()), solves for alpha and mu and
        rewrites every trainable parameter's .grad to the update U = alpha P + mu U0, which the
        host subtracts from the parameters (learning rate 1). Returns alpha, mu and the model's
        terms. A refusal (a missing or non-finite product) is a KFACError naming it, and changes
        nothing."""
        kind, scale = losses.curvature(self.loss, outputs, self.reduction)
        z = self._as_rows(outputs, 'outputs')
        jp = self._as_rows(along_proposal, 'along_proposal')
        ju = self._as_rows(along_previous, 'along_previous')
        grads = self._copy_in(keep=True)
        step = self._core.solve(z, jp, ju, kind, self.reduction, scale)
        self._copy_out(grads)
        return step

    def _copy_out(self, grads: list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for (_, p), buf, g in zip(self._params, self._buffers, grads):
                if g is None:
                    p.grad = buf.view_as(p).clone()
                else:
                    g.copy_(buf.view_as(g))

    def wants_products(self) -> bool:
        """True when this step's update needs the products and solve() (each of the first
        solve_warmup steps, then every solve_interval steps); when False, apply_last() does
        without them."""
        return self._core.wants_products()

    def apply_last(self) -> dict[str, Any]:
        """Collective. After preconditioner.step(), on a step where wants_products() is False:
        rewrites every trainable parameter's .grad to U = alpha P + mu U0 with alpha and mu the
        means of the solves' values after the first, each solve's weight falling by 0.9 per later
        solve (kfac::SelfTuning::reused_step). Returns the last solve's result with the alpha and
        mu applied."""
        grads = self._copy_in(keep=True)
        step = self._core.apply_last()
        self._copy_out(grads)
        return step

    def wants_loss_change(self) -> bool:
        """True when the last solve is due for a damping update (update_damping())."""
        return self._core.wants_loss_change()

    def update_damping(self, loss_before: float, loss_after: float) -> dict[str, float]:
        """Collective. The Levenberg-Marquardt rule from this rank's loss before the last update and
        after it, on the same batch (including weight_decay's term); the preconditioner's damping
        follows. Returns rho, the loss change and lambda before and after."""
        update = self._core.update_damping(float(loss_before), float(loss_after))
        self._sync_damping()
        return update

    # ---- the whole step --------------------------------------------------------------------

    def step(self, inputs: Any, targets: torch.Tensor) -> dict[str, Any]:
        """After loss.backward() on the batch (inputs, targets), with the loss this object was
        built for: preconditions (preconditioner.step()), computes the products by forward-mode
        differentiation, solves, moves the parameters by -U (their .grad then holds U) and, when
        due, evaluates the loss after the update on the same batch for the damping rule. Collective.
        `inputs` is the model's argument (a tuple: its arguments). Returns the solve's result,
        with 'loss' (the batch's loss before the update) and, on damping steps, 'rho' and
        'loss_after'. Extra cost: two forward passes with forward-mode products (one without
        momentum), and one plain forward pass every update_interval steps.

        Non-finite inputs or outputs are refused before anything changes; a refusal of the solve
        itself (products that overflow) comes after preconditioner.step() and leaves the
        parameters and this object as they were, .grad holding the proposal.

        The model's buffers (BatchNorm's running statistics) are restored after each extra pass,
        and its forward must be deterministic (no dropout) for the products to be those of the
        loss that was differentiated."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        for k, a in enumerate(args):  # finite outputs of an infinite input may still have NaN products
            if isinstance(a, torch.Tensor) and a.is_floating_point() and not bool(torch.isfinite(a).all()):
                raise ValueError(f'SelfTuning.step: input {k} has non-finite values (NaN/Inf); nothing was changed')
        with torch.no_grad():
            z = self._forward(args)  # outputs at the current parameters; checked before anything moves
            self._check_outputs(z)
            before = float(losses.value(self.loss, z, targets, self.reduction)) + self._decay_term()
        if self.weight_decay:
            with torch.no_grad():
                for _, p in self._params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.add_(p.detach(), alpha=self.weight_decay)
        if not self.wants_products():  # solve_interval: the solves' mean alpha and mu, no products
            self.preconditioner.step()
            result = self.apply_last()
            with torch.no_grad():
                for _, p in self._params:
                    p.sub_(p.grad)
            result['loss'] = before
            return result
        self.capture_gradient()
        self.preconditioner.step()
        proposal = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self._params]
        z, jp = self._jvp(args, proposal)
        ju = None
        if self.needs_previous_product():
            _, ju = self._jvp(args, list(self.previous_update().values()))
        result = self.solve(z, jp, ju)
        with torch.no_grad():
            for _, p in self._params:
                p.sub_(p.grad)
        result['loss'] = before
        if self.wants_loss_change():
            with torch.no_grad():
                after = self._forward(args)
                after = float(losses.value(self.loss, after, targets, self.reduction)) + self._decay_term()
            result.update(self.update_damping(before, after), loss_after=after)
        return result

    # ---- state -------------------------------------------------------------------------------

    @property
    def damping(self) -> float:
        """lambda now (the preconditioner's damping is lambda + weight_decay)."""
        return self._core.lambda_()

    @property
    def solves(self) -> int:
        return self._core.solves()

    @property
    def steps(self) -> int:
        """Updates formed so far: solves and apply_last() calls."""
        return self._core.steps()

    @property
    def damping_updates(self) -> int:
        return self._core.damping_updates()

    @property
    def last_step(self) -> dict[str, Any]:
        return self._core.last_step()

    @property
    def last_damping_update(self) -> dict[str, float]:
        return self._core.last_damping_update()

    def state_dict(self) -> dict[str, Any]:
        """lambda, the counters and the previous update, as kfac::SelfTuning's checkpoint bytes
        (save it with the preconditioner's state_dict(): the pair resumes bit for bit)."""
        return {'self_tuning': self._core.save()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective. Restores a state_dict() of the same settings and parameters (a KFACError
        otherwise, changing nothing); the preconditioner's damping follows lambda."""
        if 'self_tuning' not in state_dict:
            raise ValueError("state_dict has no 'self_tuning' entry (not a SelfTuning.state_dict())")
        self._core.load(state_dict['self_tuning'])
        self._sync_damping()

    # ---- helpers -----------------------------------------------------------------------------

    def _sync_damping(self) -> None:
        self.preconditioner._set_hyperparameter('damping', self._core.damping())

    def _decay_term(self) -> float:
        if not self.weight_decay:
            return 0.0
        return 0.5 * self.weight_decay * sum(float(p.detach().double().pow(2).sum()) for _, p in self._params)

    def _copy_in(self, keep: bool = False) -> list[torch.Tensor | None]:
        grads = []
        with torch.no_grad():
            for (n, p), buf in zip(self._params, self._buffers):
                g = p.grad
                if g is None:
                    buf.zero_()
                else:
                    if g.is_sparse or g.shape != p.shape:
                        raise ValueError(f"SelfTuning: parameter '{n}' has a sparse or reshaped gradient")
                    buf.copy_(g.reshape(-1))
                grads.append(g)
        return grads

    def _as_rows(self, t: torch.Tensor | None, name: str) -> torch.Tensor | None:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'SelfTuning.solve: {name} is a {type(t).__name__}; expected a tensor')
        return losses.rows(t.detach()).to(self.dtype).contiguous()

    def _check_outputs(self, z: torch.Tensor) -> None:
        if not isinstance(z, torch.Tensor):
            raise TypeError(f'SelfTuning.step: the model returned a {type(z).__name__}; expected a tensor of outputs')
        bad = int((~torch.isfinite(z)).sum())
        if bad:
            raise ValueError(
                f'SelfTuning.step: the model outputs have {bad} non-finite values (NaN/Inf) at the current parameters; '
                'nothing was changed',
            )

    def _forward(self, args: tuple[Any, ...]) -> torch.Tensor:
        """model(*args) with its buffers (running statistics) restored afterwards. Under no_grad
        the preconditioner's hooks record nothing."""
        saved = [(b, b.clone()) for b in self.model.buffers()]
        try:
            return self.model(*args)
        finally:
            for b, copy in saved:
                b.copy_(copy)

    def _jvp(self, args: tuple[Any, ...], tangents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs and their Jacobian-vector product along `tangents` (one per trainable
        parameter), by forward-mode differentiation at the current parameters."""
        saved = [(b, b.clone()) for b in self.model.buffers()]
        try:
            with torch.no_grad(), fwad.dual_level():
                duals = {n: fwad.make_dual(p.detach(), t.detach().view_as(p))
                         for (n, p), t in zip(self._params, tangents)}
                out = functional_call(self.model, duals, args)
                z, jz = fwad.unpack_dual(out)
                if jz is None:
                    raise ValueError('SelfTuning: the model outputs do not depend on its trainable parameters')
                return z.clone(), jz.clone()
        finally:
            with torch.no_grad():
                for b, copy in saved:
                    b.copy_(copy)
