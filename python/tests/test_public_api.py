"""kfac-pytorch's public modules in kfac's package (docs/python.md, "kfac-pytorch's public API"):
enums, BaseKFACPreconditioner's surface, LambdaParamScheduler reaching the core, hyperparams,
tracing, warnings, the KAISA argument checks and the registration log."""

from __future__ import annotations

import logging
import time
import warnings

import pytest
import torch

import kfac
from kfac.assignment import grad_worker_layout
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _step(model: torch.nn.Module, p: kfac.KFACPreconditioner, seed: int = 0) -> list[torch.Tensor]:
    """One forward/backward/step on a fixed batch; the preconditioned gradients."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    p.step()
    return [q.grad.clone() for q in model.parameters()]


def test_modules_and_enums_as_in_kfac_pytorch() -> None:
    for module in ('assignment', 'base_preconditioner', 'enums', 'hyperparams', 'preconditioner', 'scheduler',
                   'tracing', 'warnings'):
        assert getattr(kfac, module).__name__ == f'kfac.{module}'
    values = {
        kfac.enums.AllreduceMethod: {'ALLREDUCE': 1, 'ALLREDUCE_BUCKETED': 2},
        kfac.enums.AssignmentStrategy: {'COMPUTE': 1, 'MEMORY': 2},
        kfac.enums.ComputeMethod: {'EIGEN': 1, 'INVERSE': 2},
        kfac.enums.DistributedStrategy: {'COMM_OPT': 1, 'MEM_OPT': 2, 'HYBRID_OPT': 3},
    }
    for enum, members in values.items():
        assert {m.name: m.value for m in enum} == members
    assert issubclass(kfac.warnings.ExperimentalFeatureWarning, Warning)
    with pytest.warns(kfac.warnings.ExperimentalFeatureWarning):
        warnings.warn('x', kfac.warnings.ExperimentalFeatureWarning)


def test_preconditioner_is_a_base_preconditioner_with_its_views() -> None:
    p = kfac.KFACPreconditioner(_model(), damping=lambda s: 0.1 * (s + 1), lr=0.2, allreduce_bucket_cap_mb=0)
    assert isinstance(p, kfac.base_preconditioner.BaseKFACPreconditioner)
    assert p.allreduce_method is kfac.enums.AllreduceMethod.ALLREDUCE
    assert p.distributed_strategy is DistributedStrategy.COMM_OPT and p.colocate_factors
    assert callable(p._damping) and p._lr == 0.2 and p._steps == 0
    model = p.model
    _step(model, p)
    assert p._steps == p.steps == 1 and p.damping == pytest.approx(0.2)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match='_steps'):
            p._steps = bad
    assert p.steps == 1
    p._steps = 5  # the core's counter: a callable damping reads step 5, every module is due next
    assert p.steps == p._steps == 5 and p.damping == pytest.approx(p._damping(5))
    _step(model, p)
    assert p.steps == 6
    with pytest.raises(NotImplementedError, match='kfac.KFACPreconditioner'):
        kfac.base_preconditioner.BaseKFACPreconditioner({}, assignment=None, tdc=None)
    with pytest.raises(NotImplementedError):
        p.memory_usage()


def test_scheduler_scales_the_hyperparameters_the_core_uses() -> None:
    """A damping scaled by the scheduler gives the steps of a preconditioner built with the scaled
    value, and not those of the unscaled one."""
    scaled, built, unscaled = _model(), _model(), _model()
    kw = dict(factor_update_steps=1, inv_update_steps=1, kl_clip=None, lr=0.1)
    p = kfac.KFACPreconditioner(scaled, damping=0.01, **kw)
    scheduler = kfac.scheduler.LambdaParamScheduler(p, damping_lambda=lambda step: 4.0 if step == 0 else 0.5)
    scheduler.step()
    assert p.damping == pytest.approx(0.04) and p.state_dict(include_factors=False)['damping'] == pytest.approx(0.04)
    expected = _step(built, kfac.KFACPreconditioner(built, damping=0.04, **kw))
    other = _step(unscaled, kfac.KFACPreconditioner(unscaled, damping=0.01, **kw))
    got = _step(scaled, p)
    for a, b, c in zip(got, expected, other):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert any(not torch.allclose(a, c, rtol=1e-3) for a, c in zip(got, other))
    scheduler.step()  # at step 1: halves
    assert p.damping == pytest.approx(0.02)


def test_scheduler_lambdas_multiply_each_hyperparameter() -> None:
    p = kfac.KFACPreconditioner(_model(), factor_update_steps=2, inv_update_steps=4, damping=0.5,
                                factor_decay=0.5, kl_clip=0.01, lr=0.3)
    s = kfac.scheduler.LambdaParamScheduler(
        p,
        factor_update_steps_lambda=lambda step: 1.6,
        inv_update_steps_lambda=lambda step: step + 2,
        damping_lambda=lambda step: 0.5,
        factor_decay_lambda=lambda step: 1.5,
        kl_clip_lambda=lambda step: 10,
        lr_lambda=lambda step: 0.1,
    )
    s.step()
    assert (p.factor_update_steps, p.inv_update_steps) == (3, 8)  # int(2 * 1.6), int(4 * 2)
    assert isinstance(p.factor_update_steps, int)
    assert (p.damping, p.factor_decay, p.kl_clip, p.lr) == pytest.approx((0.25, 0.75, 0.1, 0.03))
    s.step(step=1)
    assert p.inv_update_steps == 24
    kfac.scheduler.LambdaParamScheduler(p).step()  # no lambdas: nothing changes
    assert p.inv_update_steps == 24


@pytest.mark.parametrize('name', ['factor_update_steps', 'inv_update_steps', 'damping', 'factor_decay', 'kl_clip',
                                  'lr'])
def test_scheduler_refuses_a_hyperparameter_given_as_a_callable(name: str) -> None:
    value = {'factor_update_steps': 1, 'inv_update_steps': 1, 'factor_decay': 0.9}.get(name, 0.01)
    p = kfac.KFACPreconditioner(_model(), **{name: lambda step: value})
    with pytest.raises(ValueError, match=name):
        kfac.scheduler.LambdaParamScheduler(p, **{f'{name}_lambda': lambda step: 2})
    kfac.scheduler.LambdaParamScheduler(p, lr_lambda=None)


def test_exp_decay_factor_averaging() -> None:
    f = kfac.hyperparams.exp_decay_factor_averaging()
    assert [f(k) for k in (0, 1, 2, 4, 10, 20, 1000)] == pytest.approx([0, 0, 0.5, 0.75, 0.9, 0.95, 0.95])
    assert isinstance(f(1), float)
    assert kfac.hyperparams.exp_decay_factor_averaging(0.5)(100) == 0.5
    for bad in (0, -1):
        with pytest.raises(ValueError):
            kfac.hyperparams.exp_decay_factor_averaging(bad)
    with pytest.raises(ValueError):
        f(-1)
    # As a factor_decay schedule: evaluated at the preconditioner's step.
    p = kfac.KFACPreconditioner(_model(), factor_decay=kfac.hyperparams.exp_decay_factor_averaging(0.9))
    for _ in range(3):
        _step(p.model, p)
    assert p.factor_decay == pytest.approx(1 - 1 / 3)


def test_tracing_records_calls(caplog: pytest.LogCaptureFixture) -> None:
    kfac.tracing.clear_trace()

    @kfac.tracing.trace()
    def slow(t: float) -> str:
        time.sleep(t)
        return 'done'

    @kfac.tracing.trace()
    def quick() -> None:
        pass

    assert kfac.tracing.get_trace() == {}
    assert slow(0.02) == 'done' and slow.__name__ == 'slow'
    slow(0.0)
    quick()
    mean, total = kfac.tracing.get_trace(), kfac.tracing.get_trace(average=False)
    assert set(mean) == {'slow', 'quick'}
    assert total['slow'] >= 0.02 and mean['slow'] == pytest.approx(total['slow'] / 2)
    assert kfac.tracing.get_trace(average=False, max_history=1)['slow'] < 0.02
    caplog.set_level(logging.INFO, logger='kfac.tracing')
    kfac.tracing.log_trace(loglevel=logging.WARNING)
    assert sorted(r.getMessage().split(':')[0] for r in caplog.records) == ['quick', 'slow']
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    kfac.tracing.clear_trace()
    assert kfac.tracing.get_trace() == {}


def test_grad_worker_layout_as_kfac_pytorch_reads_it() -> None:
    def layout(fraction, world, colocate=True, method=ComputeMethod.EIGEN, outer=True):
        return grad_worker_layout(fraction, world, colocate_factors=colocate, compute_method=method,
                                  compute_eigenvalue_outer_product=outer)

    assert layout(DistributedStrategy.HYBRID_OPT, 4)[:2] == (0.5, DistributedStrategy.HYBRID_OPT)
    assert layout(DistributedStrategy.MEM_OPT, 4)[:2] == (0.25, DistributedStrategy.MEM_OPT)
    assert layout(0, 4)[:2] == (0.25, DistributedStrategy.MEM_OPT)
    assert layout(1, 4)[:2] == (1.0, DistributedStrategy.COMM_OPT)
    assert layout(0.5, 8)[:2] == (0.5, DistributedStrategy.HYBRID_OPT)
    for fraction, world in ((0.33, 8), (-1, 1), (2, 1)):
        with pytest.raises(ValueError, match='grad_worker_fraction'):
            layout(fraction, world)
    with pytest.raises(ValueError, match='colocate_factors'):
        layout(1, 1, colocate=False)
    assert layout(1, 1, colocate=False, method=ComputeMethod.INVERSE)[2] is False
    with pytest.warns(UserWarning, match='colocate_factors'):
        assert layout(DistributedStrategy.MEM_OPT, 2, colocate=False, method=ComputeMethod.INVERSE)[2] is True


def test_preconditioner_applies_the_kaisa_checks_and_logs_the_assignment(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match='colocate_factors'):
        kfac.KFACPreconditioner(_model(), colocate_factors=False)
    with pytest.warns(UserWarning, match='colocate_factors'):
        p = kfac.KFACPreconditioner(_model(), colocate_factors=False, compute_method='inverse',
                                    grad_worker_fraction=DistributedStrategy.MEM_OPT)
    assert p.colocate_factors and p.distributed_strategy is DistributedStrategy.MEM_OPT
    caplog.set_level(logging.INFO, logger='kfac.preconditioner')
    kfac.KFACPreconditioner(_model(), loglevel=logging.DEBUG)
    assert not caplog.records
    kfac.KFACPreconditioner(_model(), loglevel=logging.INFO)
    messages = [r.getMessage() for r in caplog.records]
    assert sum('Registered' in m for m in messages) == 2
    assert [m for m in messages if 'KAISAAssignment' in m] == [
        'KFAC layer assignments: KAISAAssignment(grad_worker_fraction=1.0, distributed_strategy=COMM_OPT, '
        'colocate_factors=True, assignment_strategy=COMPUTE, layers=2)',
    ]


def test_the_kaisa_arguments_are_the_settings_of_the_cores_kfac_kaisa_object() -> None:
    p = kfac.KFACPreconditioner(_model(), assignment_strategy='memory', colocate_factors=False,
                                compute_method='inverse', allreduce_bucket_cap_mb=2)
    assert p._core.distribution() == dict(grad_worker_fraction=1.0, assignment_cost='memory', colocate_factors=False,
                                          bucket_bytes=2 * 2**20)
    assert kfac.KFACPreconditioner(_model())._core.distribution() == dict(
        grad_worker_fraction=1.0, assignment_cost='compute', colocate_factors=True, bucket_bytes=25 * 2**20)


def test_a_hyperparameter_set_between_steps_reaches_a_copy_of_the_run() -> None:
    """lr set through kfac-pytorch's private name changes the KL clip's scale from the next step."""
    a, b = _model(), _model()
    pa = kfac.KFACPreconditioner(a, kl_clip=1e-4, lr=0.1)
    pb = kfac.KFACPreconditioner(b, kl_clip=1e-4, lr=0.1)
    _step(a, pa)
    _step(b, pb)
    pb._lr = 0.05
    ga, gb = _step(a, pa, seed=1), _step(b, pb, seed=1)
    assert pa.last_kl_scale < 1 and pb.last_kl_scale == pytest.approx(min(1.0, 2 * pa.last_kl_scale))
    assert not torch.allclose(ga[0], gb[0])
    assert pb.state_dict(include_factors=False)['lr'] == 0.05
