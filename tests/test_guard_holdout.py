"""The step guard as a user trains with it, on a real ``nn.Module``: param groups with their own learning rate
and weight decay, a head that gets a gradient only on some steps (``None`` gradients), a frozen layer inside
the optimizer, learning-rate schedulers, gradient accumulation, a GradScaler under bf16 autocast, checkpoints
mid-run, two guarded optimizers, closure loops, and wrong calls.

Reference: a twin run that never sees the bad batches, with the unguarded clip the docs name as bit-identical
(``fastgrad.clip_optimizer_grad_norm_`` for torch's fused optimizers, ``fastgrad.clip_grad_norm_`` otherwise,
``fastgrad.scaler_unscale_and_clip`` under a GradScaler); compared bit for bit, parameters AND optimizer state
(keys, tensors, scalars) AND param groups. Norms are compared with a float64 recomputation."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import fastgrad
from fastgrad import StepGuard
from fastgrad.guard import GuardError

from .guard_cases import no_host_reads

O = torch.optim
NAN = float("nan")


# ----------------------------------------------------------------------------- the model and its data
class Net(nn.Module):
    """Two trained groups, a head used on odd batches only (None gradient on even ones) and a frozen layer
    that sits in the optimizer anyway."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Linear(7, 13)
        self.body = nn.Linear(13, 11)
        self.frozen = nn.Linear(11, 11)
        self.frozen.requires_grad_(False)
        self.head_a = nn.Linear(11, 3)
        self.head_b = nn.Linear(11, 3)

    def forward(self, x, use_b):
        h = self.frozen(torch.tanh(self.body(torch.tanh(self.emb(x)))))
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out

    def groups(self, lr1, lr2):
        # head_b has a group of its own: torch's fused SGD with momentum refuses a group whose parameters get
        # their first gradient on different steps (with or without a guard)
        return [{"params": [*self.emb.parameters(), *self.body.parameters()], "lr": lr1, "weight_decay": 0.1},
                {"params": list(self.head_a.parameters()), "lr": lr2, "weight_decay": 0.0},
                {"params": list(self.head_b.parameters()), "lr": lr2, "weight_decay": 0.0},
                {"params": list(self.frozen.parameters()), "lr": 1.0}]


def batch(i, bad=None, n=5):
    """Batch ``i`` (the same for every twin); ``bad``: "nan" puts a NaN in the input, "spike" scales it up."""
    gen = torch.Generator().manual_seed(500 + i)
    x = torch.randn(n, 7, generator=gen)
    y = torch.randn(n, 3, generator=gen)
    if bad == "nan":
        x[1, 2] = NAN
    elif bad == "inf":
        x[1, 2] = float("inf")
    elif bad == "spike":  # (targets, not inputs: tanh would saturate and shrink the gradient)
        y = y * 1e4
    return x, y, i % 2 == 1


def loss_of(model, b):
    x, y, use_b = b
    return nn.functional.mse_loss(model(x, use_b), y)


OPTS = {
    "adamw-fused": (lambda g: O.AdamW(g, fused=True), True),
    "adamw-foreach": (lambda g: O.AdamW(g, foreach=True), False),
    "adam-amsgrad-forloop": (lambda g: O.Adam(g, amsgrad=True, foreach=False), False),
    "sgd-momentum-fused": (lambda g: O.SGD(g, lr=0.1, momentum=0.9, fused=True), True),
    "sgd-nesterov-foreach": (lambda g: O.SGD(g, lr=0.1, momentum=0.9, nesterov=True, foreach=True), False),
    "adagrad-fused": (lambda g: O.Adagrad(g, fused=True), True),
    "rmsprop-centered": (lambda g: O.RMSprop(g, momentum=0.5, centered=True), False),
    "nadam": (lambda g: O.NAdam(g), False),
}


def make(opt_name, seed=0, lr1=1e-2, lr2=3e-3):
    model = Net(seed)
    return model, OPTS[opt_name][0](model.groups(lr1, lr2))


def snapshot(model, opt):
    """Bits of every parameter, every optimizer state entry (keys sorted, non-tensors by value) and the
    param groups' hyper-parameters."""
    out = [("p", n, p.detach().clone()) for n, p in model.named_parameters()]
    for gi, group in enumerate(opt.param_groups):
        out.append(("group", gi, {k: v for k, v in group.items() if k != "params"}))
        for p in group["params"]:
            st = opt.state.get(p)
            out.append(("keys", id(p) and gi, None if st is None else sorted(st)))
            for k in sorted(st or {}):
                v = st[k]
                out.append(("s", k, v.detach().clone() if torch.is_tensor(v) else v))
    return out


def same(a, b) -> bool:
    if len(a) != len(b):
        return False
    for (ka, na, va), (kb, nb, vb) in zip(a, b):
        if (ka, na) != (kb, nb):
            return False
        if torch.is_tensor(va):
            if not (torch.is_tensor(vb) and va.dtype == vb.dtype and va.shape == vb.shape and
                    torch.equal(va.view(-1).view(torch.uint8) if va.numel() else va,
                                vb.view(-1).view(torch.uint8) if vb.numel() else vb)):
                return False
        elif isinstance(va, dict):
            if va.keys() != vb.keys() or any(not _eq(va[k], vb[k]) for k in va):
                return False
        elif not _eq(va, vb):
            return False
    return True


def _eq(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def ref_clip(opt, fused, max_norm=1.0):
    if fused:
        return fastgrad.clip_optimizer_grad_norm_(opt, max_norm)
    params = [p for g in opt.param_groups for p in g["params"]]
    return fastgrad.clip_grad_norm_(params, max_norm)


def norm64(opt):
    gs = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.double()) for x in gs]))


# ----------------------------------------------------------------------------- 1. groups, None grads, frozen
@pytest.mark.parametrize("bad", [(0,), (0, 1), (1,), (1, 3), (4,)], ids=lambda b: "bad" + "-".join(map(str, b)))
@pytest.mark.parametrize("opt_name,non_fused", [(o, nf) for o in OPTS for nf in ("sync", "restore")
                                                  if nf == "sync" or not OPTS[o][1]])
def test_groups_none_grads_frozen_twin(opt_name, bad, non_fused):
    """Batch 1 is the first to give head_b a gradient: a bad batch 1 must not create its state."""
    fused = OPTS[opt_name][1]
    model, opt = make(opt_name)
    twin, opt_t = make(opt_name)
    guard = StepGuard(opt, max_norm=1.0, non_fused=non_fused)
    for i in range(7):
        b = batch(i, "nan" if i in bad else None)
        if i not in bad:
            loss_of(twin, b).backward()
            ref_total = ref_clip(opt_t, fused)
            opt_t.step()
            opt_t.zero_grad(set_to_none=True)
        before = snapshot(model, opt)
        loss_of(model, b).backward()
        total = guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i in bad:
            assert math.isnan(total.item())
            assert same(snapshot(model, opt), before), (opt_name, i)
            continue
        assert torch.equal(total, ref_total)
        assert same(snapshot(model, opt), snapshot(twin, opt_t)), (opt_name, i)
        assert model.frozen.weight.grad is None
    st = guard.state()
    assert st["skipped_steps"] == st["nonfinite_steps"] == len(bad) and st["steps"] == 7
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_norm_is_the_float64_norm_and_groups_keep_their_lr():
    model, opt = make("adamw-fused")
    guard = StepGuard(opt, max_norm=0.05)
    for i in range(3):
        loss_of(model, batch(i)).backward()
        ref = norm64(opt)
        total = guard.clip_()
        assert abs(total.double() - ref) <= 1e-6 * ref
        opt.step()
        opt.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3, 3e-3, 1.0]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.0, 0.01]


# ----------------------------------------------------------------------------- 2. learning-rate schedulers
def _sched_run(opt_name, bad, gated, with_twin_batches=None):
    model, opt = make(opt_name)
    sched = O.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3, 5e-3, 1.0], total_steps=20)
    guard = StepGuard(opt, max_norm=1.0) if with_twin_batches is None else None
    lrs = []
    for i in range(8):
        if with_twin_batches is not None and i not in with_twin_batches:
            continue
        loss_of(model, batch(i, "nan" if i in bad else None)).backward()
        if guard is None:
            ref_clip(opt, OPTS[opt_name][1])
        else:
            guard.clip_()
        opt.step()
        opt.zero_grad()
        if not gated or guard is None or not guard.last_step_skipped():
            sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return model, opt, sched, lrs


@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-nesterov-foreach"])
def test_scheduler_gated_on_skips_is_the_twin_bitwise(opt_name):
    """docs/guard.md: gate scheduler.step() on guard.last_step_skipped() to keep the schedule in lock-step
    with the updates taken; then the run is the twin that never saw the bad batches, bit for bit."""
    bad = {0, 3, 4}
    model, opt, sched, _ = _sched_run(opt_name, bad, gated=True)
    twin, opt_t, sched_t, _ = _sched_run(opt_name, set(), gated=True, with_twin_batches=set(range(8)) - bad)
    assert sched.last_epoch == sched_t.last_epoch == 5
    assert same(snapshot(model, opt), snapshot(twin, opt_t))


def test_scheduler_ungated_advances_on_a_skip_without_warning():
    """docs/guard.md: a skipped step still counts for the scheduler; and torch's "lr_scheduler.step() before
    optimizer.step()" warning must not fire when the very first step is skipped."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt, sched, lrs = _sched_run("adamw-fused", {0, 3}, gated=False)
    assert sched.last_epoch == 8
    ref = O.lr_scheduler.OneCycleLR(O.SGD([{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(4)], lr=1),
                                    max_lr=[2e-2, 5e-3, 5e-3, 1.0], total_steps=20)
    for k in range(8):
        ref.optimizer.step()
        ref.step()
        assert lrs[k] == [g["lr"] for g in ref.optimizer.param_groups]


# ----------------------------------------------------------------------------- 3. gradient accumulation
@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum-fused"])
def test_plain_accumulation_loop(opt_name):
    """Three micro-batches per step, clip_ once after the last; a NaN in one micro-batch skips the whole
    accumulated step."""
    fused = OPTS[opt_name][1]
    model, opt = make(opt_name)
    twin, opt_t = make(opt_name)
    guard = StepGuard(opt, max_norm=0.5)
    bad_micro = {(0, 1), (3, 2)}  # (step, micro-batch)
    for step in range(6):
        before = snapshot(model, opt)
        for m in range(3):
            b = batch(10 * step + 2 * m + 1, "nan" if (step, m) in bad_micro else None)  # head_b every time
            (loss_of(model, b) / 3).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad()
        if any(s == step for s, _ in bad_micro):
            assert same(snapshot(model, opt), before)
            continue
        for m in range(3):
            (loss_of(twin, batch(10 * step + 2 * m + 1)) / 3).backward()
        ref_clip(opt_t, fused, 0.5)
        opt_t.step()
        opt_t.zero_grad()
        assert same(snapshot(model, opt), snapshot(twin, opt_t)), step
    assert guard.state()["skipped_steps"] == 2


# ----------------------------------------------------------------------------- 4. GradScaler + bf16 autocast
def _amp_step(model, opt, scaler, b, guard=None, clip="guard", loss_mult=1.0):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model, b) * loss_mult
    scaler.scale(loss).backward()
    if clip == "guard":
        guard.clip_(scaler)
    elif clip == "fastgrad":
        fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, zero_write=True)  # what the guard hands over
    else:  # plain torch
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum-fused", "adam-amsgrad-forloop"])
def test_gradscaler_bf16_overflow_then_nan(opt_name):
    """Step 2 overflows (the scaled loss is Inf), step 3 has a NaN input, step 0 too. The guard skips all
    three, the scaler backs off three times (as plain torch's); the parameters and state are the twin's that
    never saw those batches, bit for bit (power-of-two scales are exact)."""
    model, opt = make(opt_name)
    twin, opt_t = make(opt_name)
    plain, opt_p = make(opt_name)
    if opt_name == "sgd-momentum-fused":  # plain torch's skip of batch 0 creates the momentum buffers as
        plain = None  # uninitialised memory (the fused kernel runs with found_inf): not a reference
    sc, sc_t, sc_p = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3) for _ in range(3))
    guard = StepGuard(opt, max_norm=1.0)
    bad = {0: "nan", 2: "overflow", 3: "nan"}
    for i in range(9):
        kind = bad.get(i)
        b = batch(i, "nan" if kind == "nan" else None)
        mult = 1e38 if kind == "overflow" else 1.0
        before = snapshot(model, opt)
        _amp_step(model, opt, sc, b, guard, loss_mult=mult)
        if plain is not None:
            _amp_step(plain, opt_p, sc_p, b, clip="torch", loss_mult=mult)
        if kind:
            assert same(snapshot(model, opt), before), i
            continue
        _amp_step(twin, opt_t, sc_t, b, clip="fastgrad")
        assert same(snapshot(model, opt), snapshot(twin, opt_t)), i
    assert sc.get_scale() != sc_t.get_scale()
    if plain is not None:
        assert sc.get_scale() == sc_p.get_scale()
    st = guard.state()
    assert (st["skipped_steps"], st["nonfinite_steps"], st["spike_steps"]) == (3, 3, 0)
    for p, q in zip(model.parameters(), (plain or model).parameters()):  # plain torch's skips: the same run
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- 5. consecutive skips
@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach"])
def test_max_consecutive_skips(opt_name):
    model, opt = make(opt_name)
    guard = StepGuard(opt, max_norm=1.0, max_consecutive_skips=3)
    plan = [None, "nan", "nan", None, "nan", "inf", "nan", "nan"]
    for i, kind in enumerate(plan[:7]):
        loss_of(model, batch(i, kind)).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad()
    assert guard.state()["consecutive_skipped"] == 3 and guard.state()["skipped_steps"] == 5
    loss_of(model, batch(7)).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    before = snapshot(model, opt)
    with pytest.raises(GuardError, match="3 steps in a row"):
        guard.clip_()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, [p for p in model.parameters() if p.grad is not None]))
    assert same(snapshot(model, opt), before)


# ----------------------------------------------------------------------------- 6. adaptive modes
ADAPTIVE = {"zclip": dict(warmup_steps=3), "autoclip": dict(percentile=50, history_size=8),
            "adagc": dict(warmup_steps=3)}


@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum-fused", "rmsprop-centered"])
@pytest.mark.parametrize("mode", list(ADAPTIVE))
@pytest.mark.parametrize("bad", [(0,), (0, 1, 2), (2, 5)], ids=["first", "first3", "later"])
def test_adaptive_modes_nan_twin(mode, opt_name, bad):
    """A non-finite step changes neither the mode's statistics nor the optimizer: the run equals a guarded
    twin that never saw those batches, bit for bit (the guard's own healthy steps are the mode's rule,
    checked against a float64 transcription in test_guard_modes)."""
    model, opt = make(opt_name)
    twin, opt_t = make(opt_name)
    guard = StepGuard(opt, mode=mode, **ADAPTIVE[mode])
    guard_t = StepGuard(opt_t, mode=mode, **ADAPTIVE[mode])
    for i in range(8):
        b = batch(i, "nan" if i in bad else None)
        if i not in bad:
            loss_of(twin, b).backward()
            ref_total = guard_t.clip_()
            opt_t.step()
            opt_t.zero_grad()
        before = snapshot(model, opt)
        loss_of(model, b).backward()
        total = guard.clip_()
        opt.step()
        opt.zero_grad()
        if i in bad:
            assert same(snapshot(model, opt), before), i
            continue
        assert torch.equal(total, ref_total)
        assert same(snapshot(model, opt), snapshot(twin, opt_t)), i
        for k, v in guard._mode.state.items():
            assert torch.equal(v.view(-1).view(torch.uint8), guard_t._mode.state[k].view(-1).view(torch.uint8)), k
    assert guard.state()["skipped_steps"] == len(bad)


@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach"])
@pytest.mark.parametrize("mode", ["norm", "zclip", "autoclip", "adagc"])
@pytest.mark.parametrize("first_spike", [False, True])
def test_spike_is_skipped_and_leaves_weights_and_state(mode, opt_name, first_spike):
    """A spike after the warm-up is skipped; a spike on the very first step is a normal first step (no
    reference yet), taken. The first-step spike enters the warm-up reference of the EMA modes (norm, zclip),
    which then miss the later spike (docs/guard-reference.md says so); autoclip's percentile and adagc's per-tensor
    minimum of the warm-up do not."""
    kw = dict(ADAPTIVE.get(mode, dict(max_norm=1.0, warmup_steps=3)), skip_factor=5.0)
    model, opt = make(opt_name)
    guard = StepGuard(opt, mode=mode, **kw)
    spikes = {0, 6} if first_spike else {6}
    later_missed = first_spike and mode in ("norm", "zclip")
    for i in range(9):
        before = snapshot(model, opt)
        loss_of(model, batch(2 * i + 1, "spike" if i in spikes else None)).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad()
        assert same(snapshot(model, opt), before) == (i == 6 and not later_missed), i
    st = guard.state()
    n = 0 if later_missed else 1
    assert (st["skipped_steps"], st["spike_steps"], st["nonfinite_steps"]) == (n, n, 0), st


# ----------------------------------------------------------------------------- 7. checkpoints
def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-momentum-fused", "adamw-foreach", "adagrad-fused"])
@pytest.mark.parametrize("mode", ["norm", "zclip"])
@pytest.mark.parametrize("at", [0, 1, 4])
def test_resume_from_checkpoint_mid_run(opt_name, mode, at):
    """Save model + optimizer + guard after ``at`` steps, rebuild everything from scratch, load, go on with a
    NaN batch right after the resume (and, for at=0/1, state not created yet: lazily created after the load).
    The resumed run equals the uninterrupted one bit for bit, the counters carry over."""
    kw = dict(max_norm=1.0) if mode == "norm" else dict(warmup_steps=3)
    bad = {at, at + 2}
    run, opt = make(opt_name)
    guard = StepGuard(opt, mode=mode, **kw)
    states = []
    for i in range(at + 5):
        if i == at:
            ckpt = _save({"model": run.state_dict(), "opt": opt.state_dict(), "guard": guard.state_dict()})
        loss_of(run, batch(i, "nan" if i in bad else None)).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad()
        states.append(snapshot(run, opt))
    full = guard.state()

    ck = torch.load(ckpt, weights_only=True)
    res, opt_r = make(opt_name, seed=7)  # other weights: the load must bring everything
    res.load_state_dict(ck["model"])
    opt_r.load_state_dict(ck["opt"])
    guard_r = StepGuard(opt_r, mode=mode, **kw)
    guard_r.load_state_dict(ck["guard"])
    for i in range(at, at + 5):
        loss_of(res, batch(i, "nan" if i in bad else None)).backward()
        guard_r.clip_()
        opt_r.step()
        opt_r.zero_grad()
        assert same(snapshot(res, opt_r), states[i]), i
    assert guard_r.state() == full


def test_optimizer_load_state_dict_under_the_same_guard():
    """Loading a checkpoint into the guarded optimizer itself (the guard stays): a skip right after the
    load is exact, also for state the load brought no entry for."""
    model, opt = make("sgd-momentum-fused")
    twin, opt_t = make("sgd-momentum-fused")
    guard = StepGuard(opt, max_norm=1.0)
    fresh = opt.state_dict()  # no state at all
    for i in (0, 2):
        loss_of(model, batch(i)).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(twin.state_dict())
    opt.load_state_dict(fresh)
    assert len(opt.state) == 0
    for i in range(5):
        b = batch(i, "nan" if i in (0, 1) else None)
        before = snapshot(model, opt)
        loss_of(model, b).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad()
        if i in (0, 1):
            assert same(snapshot(model, opt), before), i
            continue
        loss_of(twin, b).backward()
        fastgrad.clip_optimizer_grad_norm_(opt_t, 1.0)
        opt_t.step()
        opt_t.zero_grad()
        assert same(snapshot(model, opt), snapshot(twin, opt_t)), i


# ----------------------------------------------------------------------------- 8. two guarded optimizers (GAN)
class _D(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 9), nn.Tanh(), nn.Linear(9, 1))

    def forward(self, x):
        return self.net(x)


def _gan(seed=0):
    torch.manual_seed(seed)
    G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    D = _D()
    return G, D, O.AdamW(G.parameters(), lr=1e-2, fused=True), O.Adam(D.parameters(), lr=1e-2, betas=(0.5, 0.9))


def _gan_step(G, D, oG, oD, i, bad_d, clipG, clipD, scaler=None, skip_d=False):
    """One GAN iteration with one GradScaler for both (torch's AMP recipe); D's real batch may hold a NaN."""
    gen = torch.Generator().manual_seed(900 + i)
    z = torch.randn(6, 4, generator=gen)
    real = torch.randn(6, 3, generator=gen)
    if bad_d:
        real[2, 1] = NAN
    bce = nn.functional.binary_cross_entropy_with_logits
    sc = scaler.scale if scaler is not None else (lambda t: t)
    oD.zero_grad()
    fake = G(z)
    lossD = bce(D(real), torch.ones(6, 1)) + bce(D(fake.detach()), torch.zeros(6, 1))
    sc(lossD).backward()
    clipD(scaler)
    if not skip_d:
        scaler.step(oD) if scaler is not None else oD.step()
    oG.zero_grad()
    lossG = bce(D(fake), torch.ones(6, 1))  # also leaves gradients in D's parameters: D zeroes them first
    sc(lossG).backward()
    clipG(scaler)
    scaler.step(oG) if scaler is not None else oG.step()
    if scaler is not None:
        scaler.update()


@pytest.mark.parametrize("amp", [False, True])
def test_two_guarded_optimizers_gan(amp):
    """D's batch 2 holds a NaN: D's step is skipped (its weights and Adam state are those right before), G's
    is taken as in a run whose D skipped by torch's own GradScaler. Each guard counts its own skips."""
    G, D, oG, oD = _gan()
    G2, D2, oG2, oD2 = _gan()
    gG, gD = StepGuard(oG, max_norm=1.0), StepGuard(oD, max_norm=1.0, non_fused="restore")
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp else None
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp else None

    def ref_clip_of(opt):
        def f(scaler):
            if scaler is not None:
                return fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, zero_write=opt is oG2)
            return ref_clip(opt, opt is oG2)
        return f

    for i in range(5):
        bad = i == 2
        beforeD = snapshot(D, oD)
        _gan_step(G, D, oG, oD, i, bad, lambda s: gG.clip_(s), lambda s: gD.clip_(s), s1)
        if bad:
            assert same(snapshot(D, oD), beforeD)
            # the reference: D's step not taken (torch's GradScaler skips it; without one, it is left out)
            _gan_step(G2, D2, oG2, oD2, i, bad, ref_clip_of(oG2), ref_clip_of(oD2), s2, skip_d=not amp)
        else:
            _gan_step(G2, D2, oG2, oD2, i, bad, ref_clip_of(oG2), ref_clip_of(oD2), s2)
        assert same(snapshot(G, oG), snapshot(G2, oG2)), i
        assert same(snapshot(D, oD), snapshot(D2, oD2)), i
    assert gD.state()["skipped_steps"] == 1 and gG.state()["skipped_steps"] == 0
    if amp:
        assert s1.get_scale() == s2.get_scale()


# ----------------------------------------------------------------------------- 9. closures
@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-momentum-fused", "adamw-foreach", "nadam"])
@pytest.mark.parametrize("mode", ["norm", "zclip"])
def test_closure_loop_twin(opt_name, mode):
    """A real closure loop: zero_grad, forward, backward, guard.clip_() inside the closure. NaN batches 0
    and 3; the twin never sees them. On a fused optimizer, once the state exists, no host read anywhere in
    clip_ + step."""
    fused = OPTS[opt_name][1]
    kw = dict(max_norm=1.0) if mode == "norm" else dict(warmup_steps=2)
    model, opt = make(opt_name)
    twin, opt_t = make(opt_name)
    guard = StepGuard(opt, mode=mode, **kw)
    guard_t = StepGuard(opt_t, mode=mode, **kw) if mode != "norm" else None
    bad = {0, 3}
    for i in range(7):
        b = batch(2 * i + 1, "nan" if i in bad else None)  # head_b in every batch: every state exists after 1
        losses = []

        def closure():
            opt.zero_grad()
            loss = loss_of(model, b)
            loss.backward()
            guard.clip_()
            losses.append(loss.detach())
            return loss

        before = snapshot(model, opt)
        if fused and i >= 2:
            with no_host_reads():
                out = opt.step(closure)
        else:
            out = opt.step(closure)
        assert len(losses) == 1 and out is not None
        if i in bad:
            assert same(snapshot(model, opt), before), i
            continue

        opt_t.zero_grad()  # the twin steps without a closure
        loss_of(twin, b).backward()
        guard_t.clip_() if guard_t is not None else ref_clip(opt_t, fused)
        opt_t.step()
        assert same(snapshot(model, opt), snapshot(twin, opt_t)), i
    assert guard.state()["skipped_steps"] == 2


# ----------------------------------------------------------------------------- 10. wrong calls, options
def _ready(opt_name="adamw-fused"):
    model, opt = make(opt_name)
    loss_of(model, batch(1)).backward()
    return model, opt


@pytest.mark.parametrize("arg,match", [
    ("optimizer", "optimizer"), (1.0, "max_norm"), ("params", "GradScaler"), ("model", "GradScaler")])
def test_clip_with_a_wrong_argument_is_a_clear_error_before_any_work(arg, match):
    model, opt = _ready()
    guard = StepGuard(opt, max_norm=1.0)
    value = {"optimizer": opt, "params": model.parameters(), "model": model}.get(arg, arg)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(TypeError, match=match):
        guard.clip_(value)
    assert all(torch.equal(a, b) for a, b in zip(grads, [p.grad for p in model.parameters() if p.grad is not None]))
    assert guard.state()["steps"] == 0 and not guard.counters().any()  # nothing recorded
    guard.clip_()  # and the guard still works
    opt.step()


@pytest.mark.parametrize("kw,exc,match", [
    (dict(max_norm=1.0, skip_factor=1.0), ValueError, r"skip_factor must be in \(1, inf\).*skip every step"),
    (dict(max_norm=1.0, skip_factor=0.3), ValueError, "skip_factor"),
    (dict(max_norm=1.0, skip_factor=NAN), ValueError, "skip_factor"),
    (dict(max_norm=1.0, skip_factor="10"), TypeError, "skip_factor must be a real number"),
    (dict(max_norm=1.0, max_consecutive_skips=0), ValueError, "max_consecutive_skips must be a positive int"),
    (dict(max_norm=1.0, max_consecutive_skips=True), ValueError, "max_consecutive_skips"),
    (dict(max_norm=-1.0), ValueError, "max_norm"),
    (dict(), ValueError, "needs max_norm"),
    (dict(max_norm=1.0, mode="ZClip"), ValueError, "mode must be one of"),
    (dict(mode="zclip", norm_type=1.0), ValueError, "2-norm"),
    (dict(mode="zclip", alpha=1.0), ValueError, r"alpha must be in \[0, 1\)"),
    (dict(mode="zclip", warmup_steps=0), ValueError, "warmup_steps must be a positive int"),
    (dict(mode="autoclip", percentile=150), ValueError, "percentile"),
    (dict(mode="zclip", percentile=10), TypeError, "does not take percentile"),
    (dict(max_norm=1.0, alpha=0.9), TypeError, "only with skip_factor"),
    (dict(mode="adagc", beta=1.0), ValueError, "beta"),
    (dict(max_norm=1.0, non_fused="fast"), ValueError, "non_fused"),
    (dict(mode="adagc", max_norm=0.0), ValueError, "max_norm.*adagc"),
    (dict(mode="zclip", max_norm=0.0), ValueError, "max_norm.*zclip"),
])
def test_option_messages(kw, exc, match):
    model, opt = _ready("adamw-foreach")
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(exc, match=match):
        StepGuard(opt, **kw)
    assert fastgrad.guard.guard_for(opt) is None and not opt._optimizer_step_pre_hooks
    assert all(torch.equal(a, b) for a, b in zip(grads, [p.grad for p in model.parameters() if p.grad is not None]))


def test_numpy_numbers_are_accepted_as_options():
    """Sweeps hand options over as numpy scalars (np.linspace, np.arange): they are real numbers / ints."""
    np = pytest.importorskip("numpy")
    model, opt = _ready("adamw-foreach")
    g = StepGuard(opt, max_norm=np.float32(1.0), mode="zclip", skip_factor=np.float64(5.0),
                  warmup_steps=np.int64(3), alpha=np.float32(0.9), max_consecutive_skips=np.int32(4))
    assert g.options["warmup_steps"] == 3 and type(g.options["warmup_steps"]) is int
    assert g.max_consecutive_skips == 4 and g.skip_factor == 5.0
    g.clip_()
    opt.step()


# ----------------------------------------------------------------------------- 11. .grad after a skip, step() twice
def _grad_case(mode, path, use_scaler, kind):
    """(gradients as backward left them, unscaled, in float64; after clip_ + step; the guard's state)."""
    opt_name = "adamw-fused" if path == "fused" else "adamw-foreach"
    model, opt = make(opt_name)
    kw = {"norm": dict(max_norm=0.05, warmup_steps=3), "zclip": dict(warmup_steps=3),
          "autoclip": dict(history_size=8), "adagc": dict(warmup_steps=3)}[mode]
    guard = StepGuard(opt, mode=mode, skip_factor=4.0, zero_write=path == "fused", **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if use_scaler else None
    for i in range(6):
        b = batch(2 * i + 1, "spike" if i == 5 and kind == "spike" else None)
        loss = loss_of(model, b)
        (scaler.scale(loss) if scaler else loss).backward()
        if i == 5 and kind == "nan":  # one element of one gradient (a NaN input would spread to all of them)
            model.head_a.weight.grad[1, 2] = NAN
        params = [p for p in model.parameters() if p.grad is not None]
        before = [p.grad.double() / (scaler.get_scale() if scaler else 1.0) for p in params]
        raw = [p.grad.clone() for p in params]
        guard.clip_(scaler) if scaler else guard.clip_()
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        after = [p.grad.clone() for p in params]
        if i < 5:
            opt.zero_grad()
    return raw, before, after, guard.state()


def _bits(t):
    return t.view(-1).view(torch.uint8)


def _kind_of(raw, before, after):
    if all(torch.equal(_bits(a), _bits(r)) for a, r in zip(after, raw)):
        return "untouched"
    if all(torch.isnan(a).all() for a in after):
        return "all-nan"
    fin = [(a.double(), b) for a, b in zip(after, before) if torch.isfinite(b).all()]
    ratios = torch.cat([(a / b).flatten() for a, b in fin])
    ratios = ratios[torch.isfinite(ratios)]
    if torch.allclose(ratios, torch.ones_like(ratios), rtol=1e-6, atol=0):
        return "unscaled"
    if (ratios < 1).all():
        return "clipped"
    return "other"


# docs/guard-paths.md's table "What .grad holds after a skipped step"
DOC_TABLE = [
    ("norm", "fused", False, "nan", "untouched"), ("norm", "fused", False, "spike", "untouched"),
    ("zclip", "fused", True, "nan", "untouched"), ("autoclip", "fused", False, "spike", "untouched"),
    ("norm", "written", False, "nan", "untouched"), ("norm", "written", False, "spike", "clipped"),
    ("norm", "written", True, "nan", "all-nan"), ("norm", "written", True, "spike", "clipped"),
    ("zclip", "written", False, "nan", "untouched"),  # "unscaled, not clipped": without a scaler, g * 1
    ("zclip", "written", True, "nan", "unscaled"),
    ("zclip", "written", True, "spike", "clipped"),
    ("autoclip", "written", False, "nan", "all-nan"), ("autoclip", "written", True, "spike", "clipped"),
    ("adagc", "written", True, "spike", "clipped"),
]


@pytest.mark.parametrize("mode,path,use_scaler,kind,expected", DOC_TABLE,
                         ids=["-".join(map(str, c[:4])) for c in DOC_TABLE])
def test_grad_after_a_skip_as_the_docs_table(mode, path, use_scaler, kind, expected):
    raw, before, after, st = _grad_case(mode, path, use_scaler, kind)
    assert st["skipped"] and st["skipped_steps"] == 1
    assert (st["nonfinite_steps"], st["spike_steps"]) == ((1, 0) if kind == "nan" else (0, 1))
    assert _kind_of(raw, before, after) == expected


def test_adagc_nan_after_warmup_clips_finite_tensors_and_nans_the_bad_one():
    raw, before, after, st = _grad_case("adagc", "written", False, "nan")
    bad = [not torch.isfinite(b).all() for b in before]
    assert any(bad) and not all(bad)
    for a, b, is_bad in zip(after, before, bad):
        if is_bad:
            assert torch.isnan(a).all()
        else:
            r = a.double() / b
            assert torch.isfinite(a).all() and (r <= 1 + 1e-6).all() and torch.allclose(r, r.flatten()[0].expand_as(r))


@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum-fused"])
def test_second_step_after_a_skip_is_skipped_and_after_a_take_is_taken(opt_name):
    """docs/guard-paths.md: a decision holds until the next clip_. The reference for two steps on the same
    gradients is the unguarded clip then two steps; for a skip, no step at all."""
    fused = OPTS[opt_name][1]
    model, opt = make(opt_name)
    twin, opt_t = make(opt_name)
    guard = StepGuard(opt, max_norm=0.05)
    for i in range(4):
        b = batch(2 * i + 1, "nan" if i == 2 else None)
        before = snapshot(model, opt)
        loss_of(model, b).backward()
        guard.clip_()
        opt.step()
        opt.step()
        opt.zero_grad()
        if i == 2:
            assert same(snapshot(model, opt), before)
            continue
        loss_of(twin, b).backward()
        ref_clip(opt_t, False, 0.05)  # written: two steps read the same clipped gradients
        opt_t.step()
        opt_t.step()
        opt_t.zero_grad()
        if fused:  # the zero-write hand-over divides by 1/coef: within an ulp of the written clip
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
        else:
            assert same(snapshot(model, opt), snapshot(twin, opt_t)), i


# ----------------------------------------------------------------------------- 12. a norm beyond float32's range
@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum-fused", "rmsprop-centered"])
@pytest.mark.parametrize("zero_write", [True, False])
@pytest.mark.parametrize("use_scaler", [False, True])
@pytest.mark.parametrize("mode", ["norm", "zclip", "autoclip", "adagc"])
def test_finite_gradients_with_an_overflowing_norm_are_skipped(opt_name, zero_write, use_scaler, mode):
    """A diverging run: every gradient element finite, their float32 norm inf (as torch's). The norm is
    non-finite, so the step is bad on every path (it was clipped to zero and taken on the one-call path of
    mode "norm": Adam's moments decayed and the weights moved), and the counters agree."""
    model, opt = make(opt_name)
    kw = dict(max_norm=1.0) if mode == "norm" else dict(warmup_steps=2) if mode != "autoclip" else {}
    guard = StepGuard(opt, mode=mode, zero_write=zero_write, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if use_scaler else None
    for i in range(5):
        loss = loss_of(model, batch(2 * i + 1, "spike" if i == 4 else None)) * (1e30 if i == 4 else 1.0)
        (scaler.scale(loss) if scaler else loss).backward()
        if i == 4:
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
            assert norm64(opt) > 1.9e19  # the float32 sum of squares overflows: torch's norm is inf too
        before = snapshot(model, opt)
        total = guard.clip_(scaler) if scaler else guard.clip_()
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        opt.zero_grad()
    assert not torch.isfinite(total)
    assert same(snapshot(model, opt), before)
    st = guard.state()
    assert st["skipped"] and st["skipped_steps"] == st["nonfinite_steps"] == 1
    if scaler:  # the scale was not the problem: no element overflowed, the scaler does not back off
        assert scaler.get_scale() == 1.0
