"""ForwardWatcher: names the first module (execution order) whose output became non-finite, without syncs."""

import pytest
import torch
import torch.nn.modules.module as M

from fastgrad.diagnose.collect.watch import ForwardWatcher


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)


class Shift(torch.nn.Module):
    """Finite except when told to break: then it subtracts a lot, so the following Log sees negatives."""

    def __init__(self):
        super().__init__()
        self.amount = 0.0

    def forward(self, x):
        return x - self.amount


def _model():
    # third layer (index 2) is the Log: finite while its input is positive
    return torch.nn.Sequential(torch.nn.Linear(6, 6), Shift(), Log(), torch.nn.Linear(6, 3))


def _x():
    return torch.rand(5, 6) + 0.5


def _positive(model):
    with torch.no_grad():
        model[0].weight.copy_(torch.rand(6, 6) * 0.1)
        model[0].bias.fill_(1.0)


def test_third_layer_nan_is_named_with_its_step():
    torch.manual_seed(0)
    model = _model()
    _positive(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    w = ForwardWatcher(model, opt)
    for step in range(5):
        if step == 3:
            model[1].amount = 100.0  # log of a negative from now on
        opt.zero_grad()
        model(_x()).sum().backward()
        opt.step()
    origin = w.first_nonfinite()
    assert origin is not None
    assert (origin.module, origin.module_type, origin.step) == ("2", "Log", 3)
    assert origin.call == 2  # Linear, Shift, then Log finish in that order
    assert "2 (Log) at step 3" in str(origin)
    w.remove()


def test_finite_run_reports_none():
    torch.manual_seed(0)
    model = _model()
    _positive(model)
    w = ForwardWatcher(model)
    for _ in range(3):
        model(_x()).sum().backward()
        w.step()
    assert w.first_nonfinite() is None
    w.remove()


def test_first_in_execution_order_not_registration_order():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.late = Log()   # registered first, runs second
            self.early = Log()  # registered second, runs first

        def forward(self, x):
            return self.late(self.early(x) - 10.0)

    net = Net()
    w = ForwardWatcher(net)
    net(torch.tensor([-1.0, 2.0]))  # early: log(-1) = NaN; late: NaN too
    assert w.first_nonfinite().module == "early"
    w.remove()


def test_inf_and_structured_and_integer_outputs():
    class Multi(torch.nn.Module):
        def forward(self, x):
            return {"ids": x.long(), "pair": (x * 2, [x / 0.0])}  # x / 0 -> Inf (x > 0)

    class IntOnly(torch.nn.Module):
        def forward(self, x):
            return (x > 0).sum()

    net = torch.nn.Sequential(torch.nn.Identity(), IntOnly())
    w = ForwardWatcher(net)
    net(torch.ones(3))
    assert w.first_nonfinite() is None  # an integer output can never be non-finite
    w.remove()

    m = Multi()
    w = ForwardWatcher(m)
    m(torch.ones(3))
    o = w.first_nonfinite()
    assert o is not None and o.module_type == "Multi"
    w.remove()


def test_remove_removes_every_hook():
    model = _model()
    w = ForwardWatcher(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(len(m._forward_hooks) == 1 for m in model.modules())
    w.remove()
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    g = ForwardWatcher()
    assert len(M._global_forward_hooks) == 1 and len(M._global_forward_pre_hooks) == 1
    g.remove()
    assert len(M._global_forward_hooks) == 0 and len(M._global_forward_pre_hooks) == 0
    with ForwardWatcher(model) as w2:
        pass
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    assert w2.first_nonfinite() is None


def test_global_mode_names_modules_of_the_root():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), Log())

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    net = Net()
    w = ForwardWatcher()
    try:
        net(torch.randn(8, 4))  # some negative inputs to the log
        w.step()
        assert w.first_nonfinite().module == "body.1"
        assert w.first_nonfinite().step == 0
    finally:
        w.remove()


@pytest.mark.parametrize("global_mode", [False, True])
def test_ran_lists_the_modules_whose_forward_finished_and_no_other(global_mode):
    """A module built but never called is not in ``ran()``; one called under torch.no_grad() or whose output is
    detached is (it ran: its gradient is cut later); a model's input is not a module."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.frozen = torch.nn.Linear(4, 4)
            self.spare = torch.nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                x = self.frozen(x)
            return self.body(x).detach()

    net = Net()
    w = ForwardWatcher() if global_mode else ForwardWatcher(net)
    try:
        assert w.ran() == []
        net(torch.randn(2, 4))
        got = w.ran()
        assert any(m is net.body for m in got) and any(m is net.frozen for m in got) and any(m is net for m in got)
        assert not any(m is net.spare for m in got) and len(got) == 3
    finally:
        w.remove()


def test_no_host_sync_during_forward(monkeypatch):
    torch.manual_seed(0)
    model = _model()
    w = ForwardWatcher(model)
    model[1].amount = 100.0

    def boom(*a, **k):
        raise AssertionError("host sync in the watcher's hot path")

    with monkeypatch.context() as mp:
        for name in ("item", "__bool__", "tolist", "cpu", "__int__", "__float__", "numpy"):
            mp.setattr(torch.Tensor, name, boom)
        for _ in range(3):
            model(_x())
            w.step()
    assert w.first_nonfinite().module == "2"
    w.remove()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_outputs(dtype):
    m = Log()
    w = ForwardWatcher(m)
    m(torch.tensor([1.0, 2.0], dtype=dtype))
    assert w.first_nonfinite() is None
    # large but finite values whose sum overflows: still finite, so not flagged
    ident = torch.nn.Identity()
    with ForwardWatcher(ident) as wi:
        ident(torch.full((8,), torch.finfo(dtype).max / 2, dtype=dtype))
        assert wi.first_nonfinite() is None
    m(torch.tensor([0.0], dtype=dtype))  # log(0) = -inf
    assert w.first_nonfinite() is not None
    w.reset()
    assert w.first_nonfinite() is None
    w.remove()
