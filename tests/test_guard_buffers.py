"""A skipped step leaves the model's buffers as they were (docs/guard.md, "What a skip keeps").

Twin runs: a small CNN with BatchNorm trained on micro-batches with a NaN batch among them, guarded with
``model=``, against plain torch (no fastgrad) trained on the same batches without the NaN one. Parameters,
buffers (running statistics, ``num_batches_tracked``), optimizer state and the evaluation output must be
the same bits. Fused, foreach and for-loop optimizers, the sync and restore paths; two micro-batches per step,
the NaN one second, so the first one's update of the buffers must be undone too."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fastgrad import StepGuard
from fastgrad.guard import BufferKeeper, GuardWarning

from .guard_cases import no_host_reads
from .helpers import bits

O = torch.optim
OPTS = {
    "adamw-fused": lambda ps: O.AdamW(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: O.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-momentum-forloop": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
}
PATHS = [("adamw-fused", "sync"), ("adamw-foreach", "sync"), ("adamw-foreach", "restore"),
         ("sgd-momentum-forloop", "sync")]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 2)
        self.bn1 = nn.BatchNorm1d(2)

    def forward(self, x):
        return self.bn1(self.head(torch.relu(self.bn(self.conv(x))).flatten(1)))


def batches(n, bad_step=None):
    """Per step, two micro-batches; at ``bad_step`` the second holds a NaN."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(n):
        mbs = [torch.randn(4, 3, 6, 6, generator=gen) for _ in range(2)]
        if step == bad_step:
            mbs[1][0, 0, 0, 0] = float("nan")
        out.append(mbs)
    return out


def fresh(name):
    torch.manual_seed(0)
    model = Net()
    return model, OPTS[name](list(model.parameters()))


def train(model, opt, steps, guard=None):
    for mbs in steps:
        for x in mbs:
            model(x).square().mean().backward()
        if guard is not None:
            guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)


def everything(model, opt):
    out = [bits(t.detach()).clone() for t in model.parameters()]
    out += [bits(b).clone() for b in model.buffers()]
    for st in opt.state.values():
        out += [bits(v).clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name,non_fused", PATHS)
def test_twin_run_a_nan_batch_leaves_the_model_buffers_included_as_if_never_seen(name, non_fused):
    data = batches(5, bad_step=2)
    model, opt = fresh(name)
    guard = StepGuard(opt, 1e9, model=model, non_fused=non_fused)  # 1e9: no clip, so plain torch is the twin
    train(model, opt, data, guard)
    twin, topt = fresh(name)
    train(twin, topt, data[:2] + data[3:])  # plain torch, never sees the NaN step
    assert guard.state()["skipped_steps"] == 1
    assert same(everything(model, opt), everything(twin, topt))
    model.eval(), twin.eval()
    x = batches(1)[0][0]
    assert torch.equal(bits(model(x)), bits(twin(x))) and model(x).isfinite().all()


def test_without_model_the_buffers_are_not_restored():
    """What the guide says plainly: without ``model=`` the parameters and the optimizer state are kept, the
    buffers are what the NaN forward made them."""
    model, opt = fresh("adamw-fused")
    guard = StepGuard(opt, 1e9)
    train(model, opt, batches(3, bad_step=1), guard)
    assert guard.state()["skipped_steps"] == 1
    assert all(p.isfinite().all() for p in model.parameters())
    assert not model.bn.running_mean.isfinite().all()


def test_the_restore_reads_nothing_on_the_host():
    model, opt = fresh("adamw-fused")
    guard = StepGuard(opt, 1e9, model=model)
    train(model, opt, batches(2), guard)  # optimizer state exists: the fused skip reads nothing either
    before = [bits(b).clone() for b in model.buffers()]
    for x in batches(1, bad_step=0)[0]:
        model(x).square().mean().backward()
    assert not same([bits(b) for b in model.buffers()], before)
    with no_host_reads():
        guard.clip_()
        opt.step()
    assert same([bits(b) for b in model.buffers()], before)


def test_submodules_called_directly_are_kept_too():
    """A training step that calls the model's parts rather than the model (Lightning's training_step often
    does): the snapshot is taken before the first module that owns a buffer runs."""
    model, opt = fresh("adamw-foreach")
    guard = StepGuard(opt, 1e9, model=model)

    def step(x):
        h = torch.relu(model.bn(model.conv(x))).flatten(1)
        model.bn1(model.head(h)).square().mean().backward()
        guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)

    data = batches(3, bad_step=1)
    step(data[0][0])
    before = [bits(b).clone() for b in model.buffers()]
    step(data[1][1])  # the NaN micro-batch
    assert guard.last_step_skipped()
    assert same([bits(b) for b in model.buffers()], before)
    step(data[2][0])
    assert all(b.isfinite().all() for b in model.buffers())


def test_a_buffer_replaced_by_the_forward_is_restored():
    """A module that assigns a new tensor to its buffer in training (not an in-place update)."""

    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("avg", torch.zeros(3))

        def forward(self, x):
            y = self.lin(x)
            if self.training:
                self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
            return y

    torch.manual_seed(0)
    model = Ema()
    opt = O.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = StepGuard(opt, 1e9, model=model)
    for x in (torch.ones(2, 3), torch.full((2, 3), float("nan")), torch.ones(2, 3) * 2):
        before = model.avg.clone()
        model(x).sum().backward()
        guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if guard.last_step_skipped():
            assert torch.equal(model.avg, before)
    assert model.avg.isfinite().all() and guard.state()["skipped_steps"] == 1


def test_model_is_checked_and_a_forward_that_never_ran_is_named():
    opt = O.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        StepGuard(opt, 1.0, model=opt)
    model = nn.BatchNorm1d(2)
    opt = O.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(opt, 1.0, model=model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.warns(GuardWarning, match="none of the model's modules that own buffers ran a forward"):
        guard.clip_()
    guard.remove()  # the model's hooks go with the guard that made them
    assert not model._forward_pre_hooks


def test_a_keeper_handed_over_keeps_saving_after_the_guard_is_removed():
    """The Hugging Face callback builds the keeper before the first forward, and may rebuild its guard."""
    model, opt = fresh("adamw-foreach")
    keeper = BufferKeeper(model)
    StepGuard(opt, 1e9, model=keeper).remove()
    assert model.bn._forward_pre_hooks
    guard = StepGuard(opt, 1e9, model=keeper)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, batches(2, bad_step=1), guard)
    assert guard.state()["skipped_steps"] == 1 and all(b.isfinite().all() for b in model.buffers())
