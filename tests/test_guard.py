"""StepGuard (fastgrad/guard.py): a bad step never reaches the weights or the optimizer state.

References: twin runs of the same optimizer that (a) never take the bad step and clip the healthy ones with
the unguarded clip (fastgrad.clip_optimizer_grad_norm_ for torch's fused optimizers, fastgrad.clip_grad_norm_
otherwise), compared bit for bit; (b) plain float64 Python implementations of the ZClip, AutoClip and AdaGC
formulas, written here from the papers, on recorded norm sequences."""

from __future__ import annotations

import copy
import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fastgrad
from fastgrad import StepGuard
from fastgrad.guard import COUNTERS, GuardError, GuardWarning, guard_for

from .guard_cases import FUSED, INF, NAN, OPTIMIZERS, _params, _same, _scaled, _set_grads, _snapshot, no_host_reads
from .helpers import bits, spawn_ranks
from .helpers import optimizer_state as _opt_state

# ---------------------------------------------------------------- twins: skip == never took the step
BAD = {"nan": dict(poison=NAN), "inf": dict(poison=INF), "spike": dict(scale=100.0)}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("non_fused,name", [(m, n) for m in ("sync", "restore") for n in OPTIMIZERS
                                             if not (n in FUSED and m == "restore")])  # non_fused: unfused only
def test_bad_step_is_never_taken(name, bad, non_fused):
    make = OPTIMIZERS[name]
    ps_g, ps_r = _params(), _params()
    opt_g, opt_r = make(ps_g), make(ps_r)
    guard = StepGuard(opt_g, 1.0, skip_factor=10.0, warmup_steps=2, non_fused=non_fused)
    bad_steps = {2, 4, 5}
    for step in range(7):
        kw = BAD[bad] if step in bad_steps else {}
        _set_grads(ps_g, step, **kw)
        total = guard.clip_()
        opt_g.step()
        opt_g.zero_grad()
        if step not in bad_steps:  # the reference never sees the bad steps
            _set_grads(ps_r, step)
            if name in FUSED:
                ref_total = fastgrad.clip_optimizer_grad_norm_(opt_r, 1.0)
            else:
                ref_total = fastgrad.clip_grad_norm_(ps_r, 1.0)
            opt_r.step()
            opt_r.zero_grad()
            assert torch.equal(bits(total), bits(ref_total))
        assert _same(_snapshot(ps_g, opt_g), _snapshot(ps_r, opt_r)), (name, bad, step)
        st = guard.state()
        assert st["skipped"] == (step in bad_steps)
        assert st["consecutive_skipped"] == {4: 1, 5: 2, 2: 1}.get(step, 0)
    st = guard.state()
    assert st["steps"] == 7 and st["skipped_steps"] == 3
    assert st["clipped_steps"] == 4  # every healthy step has norm ~5 > 1
    assert st["nonfinite_steps"] == (3 if bad != "spike" else 0)
    assert st["spike_steps"] == (3 if bad == "spike" else 0)


def test_first_step_skipped_leaves_no_state_on_the_sync_paths():
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    guard = StepGuard(opt, 1.0, non_fused="restore")  # no state yet: falls back to one flag read
    before = [p.detach().clone() for p in ps]
    _set_grads(ps, 0, poison=NAN)
    guard.clip_()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps)) and len(opt.state) == 0
    assert all(p.grad is not None for p in ps)  # the hidden gradients are given back, unclipped
    assert torch.isnan(ps[1].grad).any()


NO_READ = dict(OPTIMIZERS, **{
    # (torch's non-fused Adam/RMSprop on the CPU read their own step counter with .item(): not ours to test)
    "sgd-forloop-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False)})


@pytest.mark.parametrize("name", ["adamw-fused", "adam-fused-amsgrad", "sgd-fused-momentum", "adagrad-fused",
                                  "sgd-foreach-nesterov", "sgd-forloop-momentum"])
def test_no_host_read_on_the_skip_path(name):
    """Fused optimizers, and the restore path once the state exists: clip_ + step read nothing on the host."""
    ps = _params()
    opt = NO_READ[name](ps)
    guard = StepGuard(opt, 1.0, skip_factor=10.0, warmup_steps=1, non_fused="restore")
    _set_grads(ps, 0)
    guard.clip_()
    opt.step()  # creates the state (outside the check)
    snap = _snapshot(ps, opt)
    for step, kw in [(1, dict(poison=NAN)), (2, dict(scale=100.0))]:
        _set_grads(ps, step, **kw)
        with no_host_reads():
            guard.clip_()
            opt.step()
        assert _same(_snapshot(ps, opt), snap)
    _set_grads(ps, 3)
    with no_host_reads():
        guard.clip_()
        opt.step()
    assert not _same(_snapshot(ps, opt), snap)


def test_no_host_read_check_can_fail():
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    guard = StepGuard(opt, 1.0, non_fused="sync")
    _set_grads(ps, 0)
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            guard.clip_()
            opt.step()


def test_healthy_norm_mode_is_the_unguarded_clip_bitwise():
    """Gradients written by the guard (non-fused) equal fastgrad.clip_grad_norm_'s bit for bit, odd sizes,
    mixed dtypes, a None grad."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(33, 17), (5,), (0,), (1023,), (2, 3)]
    dts = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float64]
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(shapes, dts)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    extra_a, extra_b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for x, y in zip(a, b):
        x.grad = torch.randn(x.shape, generator=gen).to(x.dtype) * 3
        y.grad = x.grad.clone()
    guard = StepGuard(torch.optim.SGD(a + [extra_a], lr=0.1), 0.5)
    t1 = guard.clip_()
    t2 = fastgrad.clip_grad_norm_(b + [extra_b], 0.5)
    assert torch.equal(bits(t1), bits(t2))
    for x, y in zip(a, b):
        assert torch.equal(bits(x.grad), bits(y.grad))


# ---------------------------------------------------------------- GradScaler
@pytest.mark.parametrize("fused", [True, False])
def test_scaler_overflow_backs_off_spike_does_not(fused):
    ps_g, ps_r = _params(), _params()
    opt_g = torch.optim.AdamW(ps_g, lr=1e-2, fused=fused)
    opt_r = torch.optim.AdamW(ps_r, lr=1e-2, fused=fused)
    sc_g = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    sc_r = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    guard = StepGuard(opt_g, 1.0, skip_factor=10.0, warmup_steps=1)
    plan = {1: dict(poison=INF), 3: dict(scale=100.0)}
    for step in range(5):
        _scaled(ps_g, sc_g, step, **plan.get(step, {}))
        guard.clip_(sc_g)
        sc_g.step(opt_g)
        sc_g.update()
        # reference: the overflow step is one torch skips too (scale halves); the spike step is never taken
        if step != 3:
            _scaled(ps_r, sc_r, step, **plan.get(step, {}))
            fastgrad.scaler_unscale_and_clip(sc_r, opt_r, 1.0, zero_write=fused)
            sc_r.step(opt_r)
            sc_r.update()
        else:
            assert sc_g.get_scale() == 2 * sc_r.get_scale()  # growth_interval=1: a non-overflow step grows
            sc_r.update(sc_g.get_scale())
        assert _same(_snapshot(ps_g, opt_g), _snapshot(ps_r, opt_r)), step
        assert sc_g.get_scale() == sc_r.get_scale()
    st = guard.state()
    assert st["skipped_steps"] == 2 and st["spike_steps"] == 1 and st["nonfinite_steps"] == 1


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_sharded_scaler_norm_is_the_unscaled_gradients(one_rank_group, backend, norm_type):
    """process_group= under a GradScaler (the sharded read, one all-reduce of the unscaled norm and the
    overflow flag): the recorded and returned norm is the float64 norm of the UNSCALED gradients, and the
    gradients are left unscaled and clipped by it. (The rank scenario above only asks skip or step.)"""
    from . import oracle

    if backend not in fastgrad.backends.available_backends():
        pytest.skip("fastgrad._C is not built")
    scale = 2.0 ** 11
    gen = torch.Generator().manual_seed(41)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (13, 7, 64)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    unscaled = [oracle.f64(p.grad) / scale for p in ps]
    max_norm = 0.25 * oracle.total_norm(unscaled, norm_type)  # clips: the coefficient is read from the norm
    want_total, want = oracle.clipped(unscaled, max_norm, norm_type)
    opt = torch.optim.SGD(ps, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    guard = StepGuard(opt, max_norm, norm_type, process_group=one_rank_group, backend=backend)
    total = guard.clip_(scaler)
    torch.testing.assert_close(total.double(), torch.tensor(want_total, dtype=torch.float64), rtol=1e-6, atol=0)
    assert guard.state()["total_norm"] == pytest.approx(want_total, rel=1e-6)
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.grad.double(), torch.from_numpy(w.astype("float64")), rtol=2e-6, atol=1e-12)
    assert not guard.last_step_skipped()


# ---------------------------------------------------------------- errors, counters, stale decisions
def test_bad_arguments_raise_before_anything():
    ps = _params()
    opt = torch.optim.SGD(ps, lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        StepGuard(ps, 1.0)
    with pytest.raises(TypeError, match="GradScaler"):
        StepGuard(torch.amp.GradScaler("cpu"), 1.0)
    with pytest.raises(ValueError, match="LBFGS"):
        StepGuard(torch.optim.LBFGS(ps), 1.0)
    with pytest.raises(ValueError, match="mode"):
        StepGuard(opt, 1.0, mode="zscore")
    with pytest.raises(ValueError, match="needs max_norm"):
        StepGuard(opt)
    with pytest.raises(TypeError, match="does not take percentile"):
        StepGuard(opt, mode="zclip", percentile=5)
    with pytest.raises(ValueError, match="norm_type must be 2"):
        StepGuard(opt, mode="zclip", norm_type=1.0)
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        StepGuard(opt, 1.0, max_consecutive_skips=0)
    with pytest.raises(ValueError, match="non_fused"):
        StepGuard(opt, 1.0, non_fused="maybe")
    g = StepGuard(opt, 1.0)
    with pytest.raises(ValueError, match="already has a StepGuard"):
        StepGuard(opt, 1.0)
    assert guard_for(opt) is g
    g.remove()
    assert guard_for(opt) is None
    # sparse gradients: refused, nothing written
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    g2 = StepGuard(torch.optim.SGD([p], lr=0.1), 1.0)
    with pytest.raises(TypeError, match="dense real floating"):
        g2.clip_()
    assert torch.equal(p.grad.to_dense(), torch.ones(4))


def test_gradients_changed_after_clip_refuse_the_step():
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    guard = StepGuard(opt, 1.0)
    _set_grads(ps, 0)
    guard.clip_()
    before = _snapshot(ps, opt)
    _set_grads(ps, 1)  # new gradient tensors (a backward after zero_grad)
    with pytest.raises(RuntimeError, match="gradients changed after the clip"):
        opt.step()
    assert _same(_snapshot(ps, opt), before) or len(opt.state) == 0
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_max_consecutive_skips_raises():
    ps = _params()
    opt = torch.optim.SGD(ps, lr=0.1)
    guard = StepGuard(opt, 1.0, max_consecutive_skips=3)
    for step in range(3):
        _set_grads(ps, step, poison=NAN)
        guard.clip_()
        opt.step()
    _set_grads(ps, 3)
    g_before = ps[0].grad.clone()
    with pytest.raises(GuardError, match="skipped 3 steps in a row"):
        guard.clip_()
    assert torch.equal(ps[0].grad, g_before)  # nothing written by the refused call
    # a healthy step in between resets the run
    guard2 = StepGuard(torch.optim.SGD(_params(), lr=0.1), 1.0, max_consecutive_skips=2)
    q = guard2.optimizer.param_groups[0]["params"]
    for step, kw in enumerate([dict(poison=NAN), {}, dict(poison=NAN), {}]):
        _set_grads(q, step, **kw)
        guard2.clip_()
        guard2.optimizer.step()
    assert guard2.state()["consecutive_skipped"] == 0


def test_state_is_one_transfer_and_last_step_skipped():
    ps = _params()
    opt = torch.optim.SGD(ps, lr=0.1)
    guard = StepGuard(opt, 100.0)
    _set_grads(ps, 0)
    total = guard.clip_()
    assert not guard.last_step_skipped()
    st = guard.state()
    assert st["total_norm"] == pytest.approx(float(total)) and st["coef"] == 1.0 and not st["clipped"]
    assert st["clipped_norm"] == pytest.approx(float(total))
    assert guard.counters().shape == (len(COUNTERS),)
    opt.step()
    _set_grads(ps, 1, poison=INF)
    guard.clip_()
    assert guard.last_step_skipped() and guard.skipped.dtype == torch.bool


# ---------------------------------------------------------------- ranks: one poisoned shard, every rank skips
WALL_LIMIT_S = 120


def _rank_worker(rank: int, world: int, out_dir: str) -> None:
    import traceback

    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        for fused in (True, False):
            gen = torch.Generator().manual_seed(7)
            # this rank's disjoint shards of three tensors (sizes differ per rank)
            shards = [torch.nn.Parameter(torch.randn(5 + rank + k, generator=gen)) for k in range(3)]
            opt = torch.optim.AdamW(shards, lr=1e-2, fused=fused) if fused else \
                torch.optim.AdamW(shards, lr=1e-2, foreach=True)
            guard = StepGuard(opt, 1.0, process_group=dist.group.WORLD, non_fused="restore")
            for step in range(4):
                g2 = torch.Generator().manual_seed(100 * step + rank)
                for s in shards:
                    s.grad = torch.randn(s.shape, generator=g2)
                if step == 2 and rank == world - 1:
                    shards[1].grad[0] = NAN
                before = [s.detach().clone() for s in shards] + [t.clone() for t in _opt_state(opt)]
                total = guard.clip_()
                opt.step()
                after = [s.detach().clone() for s in shards] + [t.clone() for t in _opt_state(opt)]
                same = len(before) == len(after) and all(torch.equal(bits(a), bits(b))
                                                         for a, b in zip(before, after))
                if step == 2:
                    assert same and math.isnan(float(total)), (rank, fused)
                elif step > 0:
                    assert not same, (rank, fused, step)
            st = guard.state()
            assert st["skipped_steps"] == 1 and st["nonfinite_steps"] == 1, st
            dist.barrier()
        _dtensor_scenario(rank, world)
        _scaler_scenario(rank, world)
        _replica_scenario(rank, world)
        open(os.path.join(out_dir, f"ok.{rank}"), "w").close()
    except BaseException:
        with open(os.path.join(out_dir, f"fail.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _scaler_scenario(rank: int, world: int) -> None:
    """process_group shards under a GradScaler: an inf in rank 1's scaled shard skips the step on every rank
    and backs the scale off on every rank; a spike (skip_factor) skips everywhere and keeps the scale."""
    for fused in (True, False):
        gen = torch.Generator().manual_seed(3)
        shards = [torch.nn.Parameter(torch.randn(4 + rank + k, generator=gen)) for k in range(3)]
        opt = torch.optim.AdamW(shards, lr=1e-2, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        guard = StepGuard(opt, 1.0, skip_factor=50.0, warmup_steps=2, process_group=dist.group.WORLD)
        for step in range(5):
            g2 = torch.Generator().manual_seed(200 * step + rank)
            s = scaler.scale(torch.ones(()))
            for p in shards:
                p.grad = torch.randn(p.shape, generator=g2) * 0.1 * s
            if step == 2 and rank == 1:
                shards[0].grad[0] = INF
            if step == 3:  # every rank's shards spike
                for p in shards:
                    p.grad = p.grad * 1000.0
            before = [bits(q.detach()).clone() for q in shards] + [bits(t).clone() for t in _opt_state(opt)]
            guard.clip_(scaler)
            scaler.step(opt)
            scaler.update()
            after = [bits(q.detach()).clone() for q in shards] + [bits(t).clone() for t in _opt_state(opt)]
            same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
            if step in (2, 3):
                assert same, (rank, fused, step)
            elif step > 0:
                assert not same, (rank, fused, step)
            assert scaler.get_scale() == (1024.0 if step < 2 else 512.0), (rank, fused, step)
        st = guard.state()
        assert st["skipped_steps"] == 2 and st["nonfinite_steps"] == 1 and st["spike_steps"] == 1, st
        dist.barrier()


def _dtensor_scenario(rank: int, world: int) -> None:
    """DTensor parameters and gradients (Shard(0) on a 1-D mesh, uneven sizes, empty shards on the last of 4
    ranks): the poisoned local shard on rank 1 makes every rank skip (sync and restore paths)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for non_fused in ("sync", "restore"):
        gen = torch.Generator().manual_seed(11)
        fulls = [torch.randn(n, 3, generator=gen) for n in (2 * world + 1, world, 5)]
        ps = [torch.nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
        opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
        guard = StepGuard(opt, 1.0, non_fused=non_fused)
        for step in range(4):
            g2 = torch.Generator().manual_seed(50 + step)
            for p, f in zip(ps, fulls):
                p.grad = distribute_tensor(torch.randn(f.shape, generator=g2), mesh, [Shard(0)])
            if step == 2 and rank == 1:  # (with 4 ranks the last one holds empty shards: a case of its own)
                ps[0].grad._local_tensor.view(-1)[0] = NAN  # this rank's shard only
            before = [bits(p._local_tensor).clone() for p in ps] + \
                [bits(t._local_tensor if hasattr(t, "_local_tensor") else t).clone() for t in _opt_state(opt)]
            total = guard.clip_()
            opt.step()
            after = [bits(p._local_tensor).clone() for p in ps] + \
                [bits(t._local_tensor if hasattr(t, "_local_tensor") else t).clone() for t in _opt_state(opt)]
            same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
            if step == 2:
                assert same and math.isnan(float(total.full_tensor())), (rank, non_fused)
            elif step > 0:
                assert not same, (rank, non_fused, step)
        assert guard.state()["skipped_steps"] == 1
        dist.barrier()


def _replica_scenario(rank: int, world: int) -> None:
    """Copies that count on one rank only: a Replicate() DTensor and a plain tensor beside Shard(0) DTensors
    are counted on the lowest rank. A NaN in the LAST rank's copy alone (which no norm reads) still makes
    every rank skip: that rank folds a NaN into its share of the same all-reduce. Without it, the last rank
    would step with its NaN gradient while the others step normally (the ranks diverge)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for non_fused, use_scaler in (("sync", False), ("restore", False), ("sync", True)):
        gen = torch.Generator().manual_seed(21)
        shard = torch.nn.Parameter(distribute_tensor(torch.randn(2 * world + 1, 3, generator=gen), mesh, [Shard(0)]))
        rep = torch.nn.Parameter(distribute_tensor(torch.randn(5, generator=gen), mesh, [Replicate()]))
        ps = [shard, rep]
        opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1000) if use_scaler else None
        guard = StepGuard(opt, 1.0, non_fused=non_fused)
        for step in range(4):
            g2 = torch.Generator().manual_seed(70 + step)
            s = float(scaler.scale(torch.ones(()))) if use_scaler else 1.0
            shard.grad = distribute_tensor(torch.randn(shard.shape, generator=g2) * s, mesh, [Shard(0)])
            rep.grad = distribute_tensor(torch.randn(rep.shape, generator=g2) * s, mesh, [Replicate()])
            if step == 2 and rank == world - 1:
                rep.grad._local_tensor[1] = NAN  # this rank's copy only
            before = [bits(p._local_tensor).clone() for p in ps]
            total = guard.clip_(scaler) if use_scaler else guard.clip_()
            if use_scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            after = [bits(p._local_tensor).clone() for p in ps]
            same = all(torch.equal(a, b) for a, b in zip(before, after))
            if step == 2:
                assert same, (rank, non_fused, use_scaler)
                assert not math.isfinite(float(total.full_tensor())), (rank, non_fused, use_scaler)
            elif step > 0:
                assert not same, (rank, non_fused, use_scaler, step)
            assert all(torch.isfinite(p._local_tensor).all() for p in ps)
        assert guard.state()["skipped_steps"] == 1
        if use_scaler:
            assert scaler.get_scale() == 4.0  # every rank backed off alike
        dist.barrier()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_skip_together(world):
    out = tempfile.mkdtemp(prefix="fastgrad-guard-")
    try:
        err = spawn_ranks(_rank_worker, world, out, WALL_LIMIT_S)
        fails = sorted(f for f in os.listdir(out) if f.startswith("fail."))
        if fails:
            with open(os.path.join(out, fails[0])) as f:
                pytest.fail(f.read())
        assert not err, err
        assert sorted(f for f in os.listdir(out) if f.startswith("ok.")) == [f"ok.{r}" for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ---------------------------------------------------------------- CUDA (runs where a GPU is present)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("mode", ["norm", "zclip", "autoclip", "adagc"])
def test_cuda_fused_skip_without_sync(mode):
    """Fused AdamW on CUDA: NaN and spike steps skipped bit-exactly, with torch's sync debug mode set to
    raise on any synchronizing call during clip_ + step."""
    ps = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    kw = dict(max_norm=1.0) if mode in ("norm", "adagc") else {}
    if mode in ("norm", "zclip", "adagc"):
        kw["warmup_steps"] = 2
    guard = StepGuard(opt, mode=mode, skip_factor=10.0, **kw)
    for step in range(4):  # past the warm-ups; creates the state
        _set_grads(ps, step)
        guard.clip_()
        opt.step()
    snap = _snapshot(ps, opt)
    for step, bad in [(4, dict(poison=NAN)), (5, dict(scale=1000.0))]:
        _set_grads(ps, step, **bad)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            guard.clip_()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert _same(_snapshot(ps, opt), snap), (mode, step)
    assert guard.state()["skipped_steps"] == 2


@needs_cuda
def test_cuda_healthy_steps_match_unguarded():
    a = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    b = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    oa = torch.optim.AdamW(a, lr=1e-2, fused=True)
    ob = torch.optim.AdamW(b, lr=1e-2, fused=True)
    guard = StepGuard(oa, 1.0)
    for step in range(3):
        _set_grads(a, step)
        _set_grads(b, step)
        t1 = guard.clip_()
        t2 = fastgrad.clip_optimizer_grad_norm_(ob, 1.0)
        oa.step()
        ob.step()
        assert torch.equal(bits(t1), bits(t2))
        assert _same(_snapshot(a, oa), _snapshot(b, ob))


def test_remove_detaches_the_hooks():
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    g = StepGuard(opt, 1.0)
    _set_grads(ps, 0, poison=NAN)
    g.clip_()
    g.remove()
    opt.step()  # no guard: the NaN goes through, as it would without one
    assert any(torch.isnan(p).any() for p in ps)
    assert not hasattr(opt, "found_inf")


# ---------------------------------------------------------------- every option checked before any work
BAD_OPTIONS = [
    (dict(max_norm=1.0, skip_factor=1.0), ValueError, r"skip_factor must be in \(1, inf\).*skip every step"),
    (dict(max_norm=1.0, skip_factor=0.5), ValueError, "skip_factor"),
    (dict(max_norm=1.0, skip_factor=float("nan")), ValueError, "skip_factor"),
    (dict(max_norm=1.0, skip_factor="10"), TypeError, "skip_factor must be a real number"),
    (dict(max_norm=-1.0), ValueError, "max_norm"),
    (dict(max_norm=float("nan")), ValueError, "max_norm"),
    (dict(max_norm=1.0, max_consecutive_skips=True), ValueError, "max_consecutive_skips"),
    (dict(max_norm=1.0, max_consecutive_skips=2.0), ValueError, "max_consecutive_skips"),
    (dict(max_norm=1.0, zero_write=1), TypeError, "zero_write"),
    (dict(max_norm=1.0, backend="nope"), ValueError, "unknown fastgrad backend"),
    (dict(max_norm=1.0, alpha=0.9), TypeError, "only with skip_factor"),
    (dict(max_norm=1.0, skip_factor=5.0, alpha=1.0), ValueError, r"alpha must be in \[0, 1\)"),
    (dict(max_norm=1.0, skip_factor=5.0, warmup_steps=True), ValueError, "warmup_steps must be a positive int"),
    (dict(mode="zclip", z_thresh=0.0), ValueError, "z_thresh"),
    (dict(mode="zclip", eps=-1e-6), ValueError, "eps"),
    (dict(mode="zclip", clip_factor=float("inf")), ValueError, "clip_factor"),
    (dict(mode="zclip", warmup_steps=0), ValueError, "warmup_steps"),
    (dict(mode="autoclip", percentile=101), ValueError, "percentile"),
    (dict(mode="autoclip", percentile=float("nan")), ValueError, "percentile"),
    (dict(mode="autoclip", history_size=2.5), ValueError, "history_size"),
    (dict(mode="adagc", beta=-0.1), ValueError, "beta"),
    (dict(mode="adagc", lambda_rel=0), ValueError, "lambda_rel"),
    (dict(mode="adagc", norm_type=1.0), ValueError, "norm_type must be 2"),
    (dict(mode="autoclip", z_thresh=2.0), TypeError, "does not take z_thresh"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_OPTIONS, ids=[str(k) for k, _, _ in BAD_OPTIONS])
def test_every_option_is_checked_before_any_work(kw, exc, match):
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    with pytest.raises(exc, match=match):
        StepGuard(opt, **kw)
    assert guard_for(opt) is None and not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    StepGuard(opt, 1.0, skip_factor=1.5)  # just above 1 is allowed


def test_skip_factor_just_above_one_does_not_skip_forever():
    """The rule the skip_factor check protects: with k > 1 a run whose norm level shifts is followed after
    some skips (the reference learns k times itself from a skipped spike), never skipped forever."""
    p = torch.nn.Parameter(torch.zeros(16))
    opt = torch.optim.SGD([p], lr=1e-3)
    guard = StepGuard(opt, 1.0, skip_factor=1.5, warmup_steps=5)
    gen = torch.Generator().manual_seed(1)
    with pytest.warns(GuardWarning, match="as spikes"):  # the shift is followed, but after 25+ skips in a row
        for step in range(120):
            p.grad = torch.randn(16, generator=gen) * (1.0 if step < 40 else 3.0)
            guard.clip_()
            opt.step()
    st = guard.state()
    assert st["consecutive_skipped"] == 0 and st["skipped_steps"] < 60, st


# ---------------------------------------------------------------- no host value written into a device tensor
@contextmanager
def no_host_values_into_device_tensors():
    """While active, ``t[i] = ...`` and ``torch.tensor(data, device=...)`` raise: on CUDA both copy a host
    value into device memory with a wait (a sync under set_sync_debug_mode("error")); the CPU cannot show the
    sync itself, so the pattern is refused where it would be one."""
    saved_set, saved_tensor = torch.Tensor.__setitem__, torch.tensor

    def ours() -> bool:  # not called from torch itself (torch's own optimizers are not under test here)
        return not sys._getframe(2).f_globals.get("__name__", "").startswith("torch")

    def refuse_set(self, *a, **k):
        if ours():
            raise AssertionError("indexed assignment into a tensor on the guard's path")
        return saved_set(self, *a, **k)

    def checked_tensor(*a, **k):
        if k.get("device") is not None and ours():
            raise AssertionError("torch.tensor(..., device=...) on the guard's path")
        return saved_tensor(*a, **k)

    torch.Tensor.__setitem__ = refuse_set
    torch.tensor = checked_tensor
    try:
        yield
    finally:
        torch.Tensor.__setitem__ = saved_set
        torch.tensor = saved_tensor


@pytest.mark.parametrize("mode", ["norm", "zclip", "autoclip", "adagc"])
@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach"])
def test_default_paths_write_no_host_values_into_device_tensors(mode, opt_name):
    ps = _params()
    extra = torch.nn.Parameter(torch.ones(3))  # no gradient: AdaGC's index of the parameters that have one
    opt = OPTIMIZERS[opt_name](ps + [extra])
    kw = dict(max_norm=1.0) if mode in ("norm", "adagc") else {}
    if mode != "autoclip":
        kw["warmup_steps"] = 2
    guard = StepGuard(opt, mode=mode, skip_factor=10.0, max_consecutive_skips=5, non_fused="restore", **kw)
    for step, bad in enumerate([{}, {}, {}, dict(poison=NAN), dict(scale=1000.0), {}]):
        _set_grads(ps, step, **bad)
        with no_host_values_into_device_tensors():
            guard.clip_()
        with no_host_values_into_device_tensors():
            opt.step()
            guard.counters()  # a fold
    assert guard.state()["skipped_steps"] == 2


def test_no_host_values_check_can_fail(monkeypatch):
    import fastgrad.guard.counters as C

    def bad_fold(self):  # the pattern the check exists for, planted in the guard's own code
        if self.counts is not None:
            self.counts[3] = 0

    monkeypatch.setattr(C.Counters, "fold", bad_fold)
    guard = StepGuard(torch.optim.SGD(_params(), lr=0.1), 1.0)
    _set_grads(guard.optimizer.param_groups[0]["params"], 0)
    guard.clip_()
    with pytest.raises(AssertionError, match="indexed assignment"):
        with no_host_values_into_device_tensors():
            guard.counters()


# ---------------------------------------------------------------- what .grad holds after a skip (docs/guard-paths.md)
def _grad_after_skip(mode, fused, use_scaler, bad, step_of_bad=4):
    gen0 = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, generator=gen0)), torch.nn.Parameter(torch.randn(4, generator=gen0))]
    opt = torch.optim.AdamW(ps, fused=True) if fused else torch.optim.AdamW(ps, foreach=True)
    kw = dict(max_norm=1.0) if mode in ("norm", "adagc") else {}
    if mode != "autoclip":
        kw["warmup_steps"] = 2
    guard = StepGuard(opt, mode=mode, skip_factor=10.0, **kw)
    sc = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1000) if use_scaler else None
    for step in range(step_of_bad + 1):
        gen = torch.Generator().manual_seed(step)
        s = float(sc.scale(torch.ones(()))) if sc else 1.0
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 3 * s
        if step == step_of_bad:
            if bad == "nan":
                ps[1].grad[0] = NAN
            else:
                for p in ps:
                    p.grad *= 1000
        orig = [p.grad.clone() for p in ps]
        guard.clip_(sc) if sc else guard.clip_()
        if sc:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
    assert guard.last_step_skipped()
    return orig, [p.grad for p in ps], 1.0 / s


def _kind(o, n, inv):
    if torch.equal(bits(o), bits(n)):
        return "as backward left it"
    if torch.isnan(n).all():
        return "NaN"
    if torch.equal(bits(n), bits(o * inv)):
        return "unscaled"
    r = (n.double() / (o.double() * inv))
    if torch.isfinite(r).all() and (r.max() - r.min()) < 1e-6 and r.max() < 1:
        return "clipped"
    return "other"


# (mode, fused zero-write, GradScaler, bad) -> per tensor (the second one holds the NaN)
GRAD_AFTER_SKIP = {
    ("norm", True, False, "nan"): ["as backward left it"] * 2,
    ("norm", True, True, "nan"): ["as backward left it"] * 2,
    ("norm", False, False, "nan"): ["as backward left it"] * 2,  # the CPU write path
    ("norm", False, True, "nan"): ["NaN"] * 2,
    ("zclip", True, True, "nan"): ["as backward left it"] * 2,
    ("zclip", False, False, "nan"): ["as backward left it"] * 2,  # coefficient 1 (times an unscale of 1)
    ("zclip", False, True, "nan"): ["unscaled"] * 2,
    ("autoclip", True, False, "nan"): ["as backward left it"] * 2,
    ("autoclip", False, False, "nan"): ["NaN"] * 2,
    ("autoclip", False, True, "nan"): ["NaN"] * 2,
    ("adagc", True, False, "nan"): ["clipped", "NaN"],  # AdaGC always writes, per tensor (after its warm-up)
    ("adagc", False, True, "nan"): ["clipped", "NaN"],
    ("norm", True, False, "spike"): ["as backward left it"] * 2,
    ("norm", False, False, "spike"): ["clipped"] * 2,
    ("norm", False, True, "spike"): ["clipped"] * 2,
    ("zclip", True, True, "spike"): ["as backward left it"] * 2,
    ("zclip", False, True, "spike"): ["clipped"] * 2,
    ("autoclip", False, False, "spike"): ["clipped"] * 2,
    ("adagc", True, False, "spike"): ["clipped"] * 2,
}


@pytest.mark.parametrize("case", list(GRAD_AFTER_SKIP), ids=[str(c) for c in GRAD_AFTER_SKIP])
def test_grad_after_a_skip_is_what_the_docs_say(case):
    mode, fused, use_scaler, bad = case
    orig, new, inv = _grad_after_skip(mode, fused, use_scaler, bad)
    assert [_kind(o, n, inv) for o, n in zip(orig, new)] == GRAD_AFTER_SKIP[case]


def test_adagc_nan_in_its_warm_up_makes_every_gradient_nan():
    orig, new, inv = _grad_after_skip("adagc", False, False, "nan", step_of_bad=1)
    assert [_kind(o, n, inv) for o, n in zip(orig, new)] == ["NaN", "NaN"]


def test_healthy_steps_zero_write_vs_written():
    """Fused optimizer, healthy steps: with zero_write (the default) the kernel divides each gradient by
    1/coef, which differs from fastgrad.clip_grad_norm_'s multiplication by coef by at most 1 ulp per element
    (and does differ); with
    zero_write=False the guard writes exactly clip_grad_norm_'s gradients, and the step is bit-identical."""
    a, b, c = _params(), _params(), _params()
    oa = torch.optim.AdamW(a, lr=1e-2, fused=True)
    ob = torch.optim.AdamW(b, lr=1e-2, fused=True)
    oc = torch.optim.AdamW(c, lr=1e-2, fused=True)
    ga, gb = StepGuard(oa, 1.0), StepGuard(ob, 1.0, zero_write=False)
    worst = 0
    for step in range(3):
        for ps in (a, b, c):
            _set_grads(ps, step)
        ga.clip_()
        gb.clip_()
        fastgrad.clip_grad_norm_(c, 1.0)
        for o in (oa, ob, oc):
            o.step()  # the fused kernel leaves the gradient it used in .grad (zero-write: grad / grad_scale)
        for x, y, z in zip(a, b, c):
            assert torch.equal(bits(y.grad), bits(z.grad))
            worst = max(worst, int((bits(x.grad).long() - bits(z.grad).long()).abs().max()))
        assert _same(_snapshot(b, ob), _snapshot(c, oc))
        with torch.no_grad():  # the next step from the same weights, to compare the gradients alone
            for x, z in zip(a, c):
                x.copy_(z)
        oa.load_state_dict(copy.deepcopy(oc.state_dict()))
    assert 0 < worst <= 1  # ulps: not bit-identical (so the docs must not say so), and never more than 1


@needs_cuda
def test_cuda_grad_after_a_nonfinite_skip():
    """docs/guard-paths.md's CUDA cell: mode "norm" writing the gradients on CUDA (the fused read pass, unscale
    factor 1) leaves every element NaN after a non-finite skip; with fused zero-write nothing is written."""
    for fused, want in ((False, True), (True, False)):
        ps = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
        opt = torch.optim.AdamW(ps, lr=1e-2, fused=fused, foreach=None if fused else True)
        guard = StepGuard(opt, 1.0)
        _set_grads(ps, 0)
        guard.clip_()
        opt.step()
        _set_grads(ps, 1, poison=NAN)
        orig = [p.grad.clone() for p in ps]
        guard.clip_()
        opt.step()
        assert guard.last_step_skipped()
        if want:
            assert all(torch.isnan(p.grad).all() for p in ps)
        else:
            assert all(torch.equal(bits(p.grad), bits(o)) for p, o in zip(ps, orig))
