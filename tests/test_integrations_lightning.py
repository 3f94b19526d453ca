"""fastgrad.integrations.lightning.StepGuardCallback in a real Lightning Trainer (CPU, automatic
optimization, a tiny model): a NaN batch at a known step leaves the parameters and the optimizer state
exactly as they were right before it, the run ends finite and the counters reach the logger; the same run
without the callback goes NaN."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from fastgrad.integrations.lightning import StepGuardCallback  # noqa: E402

from .integration_cases import BatchNormNet, batches, finite, model_bits, same, snapshot  # noqa: E402

STEPS = 6


class Tiny(pl.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 2)
        self.make_opt = make_opt

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


class Recorder(pl.Callback):
    """Parameters and optimizer state right before and right after every training batch."""

    def __init__(self):
        self.before, self.after = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[batch_idx] = snapshot(list(pl_module.parameters()), trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[batch_idx] = snapshot(list(pl_module.parameters()), trainer.optimizers[0])


class MemoryLogger(pl.loggers.logger.Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    name = "memory"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _fit(model, data, callbacks, **kw):
    trainer = pl.Trainer(accelerator="cpu", max_steps=kw.pop("max_steps", STEPS), callbacks=callbacks, logger=kw.pop("logger", False),
                         enable_checkpointing=kw.pop("enable_checkpointing", False), enable_progress_bar=False,
                         enable_model_summary=False,
                         log_every_n_steps=2, **kw)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return trainer


OPTS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("bad", [{0}, {2}])
@pytest.mark.parametrize("opt", list(OPTS))
def test_nan_batch_is_skipped_in_a_lightning_run(opt, bad):
    data = batches(STEPS, bad)
    guarded, rec, log = Tiny(OPTS[opt]), Recorder(), MemoryLogger()
    cb = StepGuardCallback(max_norm=1.0)
    trainer = _fit(guarded, data, [cb, rec], logger=log)
    for i in bad:
        assert same(rec.after[i], rec.before[i]), i
    for i in set(range(STEPS)) - bad:
        assert not same(rec.after[i], rec.before[i]), i
    assert finite(guarded.parameters())
    st = cb.guard.state()
    assert st["steps"] == STEPS and st["skipped_steps"] == len(bad) and st["nonfinite_steps"] == len(bad)
    assert cb.guard.optimizer is trainer.optimizers[0]
    logged = [m for _, m in log.rows if "guard/skipped_steps" in m]
    assert logged and logged[-1]["guard/skipped_steps"] == len(bad) and logged[-1]["guard/steps"] == STEPS
    # the control: the same run without the guard goes NaN
    control = Tiny(OPTS[opt])
    _fit(control, data, [], gradient_clip_val=1.0)
    assert not finite(control.parameters())


class WithBatchNorm(pl.LightningModule):
    """Its training step calls the net inside, not the module itself (as Lightning modules usually do)."""

    def __init__(self, make_opt):
        super().__init__()
        self.net = BatchNormNet()
        self.make_opt = make_opt

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


TWIN_OPTS = {**OPTS, "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)}


@pytest.mark.parametrize("opt", list(TWIN_OPTS))
def test_twin_run_a_nan_batch_leaves_the_model_buffers_included_as_if_never_seen(opt):
    """The run with a NaN batch, guarded, against plain Lightning on the same batches without it: the
    model (parameters, BatchNorm running statistics and num_batches_tracked) and the optimizer state are the
    same bits."""
    data = batches(STEPS, {2})
    guarded, cb = WithBatchNorm(TWIN_OPTS[opt]), StepGuardCallback(max_norm=1e9)  # 1e9: no clip engages
    _fit(guarded, data, [cb])
    twin = WithBatchNorm(TWIN_OPTS[opt])
    trainer = _fit(twin, data[:2] + data[3:], [], max_steps=STEPS - 1)
    assert cb.guard.state()["skipped_steps"] == 1
    assert same(model_bits(guarded, cb.guard.optimizer), model_bits(twin, trainer.optimizers[0]))
    assert finite(guarded.buffers())


@pytest.mark.parametrize("opt", list(OPTS))
def test_accumulated_batches_step_under_the_guard(opt):
    """accumulate_grad_batches=2: Lightning runs the micro-batches that do not step outside optimizer.step,
    and the callback clips inside the stepping closure after the last backward, so no step lacks a decision
    (the guard refuses one that does); the optimizer step holding the NaN micro-batch is skipped."""
    data = batches(2 * STEPS, {5})  # micro-batch 5: in optimizer step 2 (micro-batches 4 and 5)
    guarded, rec = Tiny(OPTS[opt]), Recorder()
    cb = StepGuardCallback(max_norm=1.0)
    _fit(guarded, data, [cb, rec], accumulate_grad_batches=2)
    assert same(rec.after[5], rec.before[4])  # the step of micro-batches 4 and 5 changed nothing
    assert not same(rec.after[3], rec.before[2]) and not same(rec.after[7], rec.before[6])
    st = cb.guard.state()
    assert st["steps"] == STEPS and st["skipped_steps"] == 1
    assert finite(guarded.parameters())


def test_bf16_mixed_precision_run():
    data = batches(STEPS, {3})
    model, rec = Tiny(OPTS["adamw-fused"]), Recorder()
    cb = StepGuardCallback(max_norm=1.0, skip_factor=10.0, warmup_steps=2)
    _fit(model, data, [cb, rec], precision="bf16-mixed")
    assert same(rec.after[3], rec.before[3]) and finite(model.parameters())
    assert cb.guard.state()["skipped_steps"] == 1


def test_trainer_that_also_clips_is_refused_at_fit_start():
    with pytest.raises(ValueError, match="gradient_clip_val=0.5"):
        _fit(Tiny(OPTS["sgd-momentum"]), batches(2, set()), [StepGuardCallback(max_norm=1.0)],
             gradient_clip_val=0.5)


def test_options_are_checked_when_the_callback_is_built():
    with pytest.raises(ValueError, match="skip_factor"):
        StepGuardCallback(max_norm=1.0, skip_factor=1.0)
    with pytest.raises(ValueError, match="needs max_norm"):
        StepGuardCallback()
    with pytest.raises(TypeError, match="guards the model the trainer trains"):
        StepGuardCallback(max_norm=1.0, model=torch.nn.Linear(1, 1))


def test_missing_framework_names_the_package(monkeypatch):
    import importlib
    import sys

    for mod in ("fastgrad.integrations.lightning", "fastgrad.integrations.transformers"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # import of it raises ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs the 'lightning' package.*pip install lightning"):
        importlib.import_module("fastgrad.integrations.lightning")
    with pytest.raises(ImportError, match="needs the 'transformers' package.*pip install transformers"):
        importlib.import_module("fastgrad.integrations.transformers")
    import fastgrad  # noqa: F401  (fastgrad itself imports no framework)


@pytest.mark.parametrize("mode,kw", [("zclip", dict(warmup_steps=2)), ("norm", dict(max_norm=1.0))])
def test_resume_from_a_lightning_checkpoint_keeps_the_guard(tmp_path, mode, kw):
    """Lightning saves each callback's state_dict in its checkpoints: a run resumed with
    ``trainer.fit(ckpt_path=...)`` continues the guard's statistics and counters (a zclip guard would
    otherwise start a new warm-up, with no spike detection, and count from 0). The resumed run equals the
    uninterrupted one: parameters, optimizer state, guard state."""
    n = 8
    data = batches(4, {2})  # two epochs; the checkpoint at the end of the first (Lightning starts a plain
    #                         DataLoader's epoch from its first batch on resume)

    def fit(max_steps, ckpt=None, save=False):
        model, cb = Tiny(OPTS["adamw-fused"]), StepGuardCallback(mode=mode, skip_factor=4.0, **kw)
        cbs = [cb]
        if save:
            cbs.append(pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4))
        trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=cbs, logger=False,
                             enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None), ckpt_path=ckpt)
        return model, trainer, cb

    full, tr_full, cb_full = fit(n)
    fit(4, save=True)
    resumed, tr_res, cb_res = fit(n, ckpt=str(tmp_path / "last.ckpt"))
    assert tr_res.global_step == n
    assert same(snapshot(list(resumed.parameters()), tr_res.optimizers[0]),
                snapshot(list(full.parameters()), tr_full.optimizers[0]))
    assert cb_res.guard.state() == cb_full.guard.state()
    assert cb_res.guard.state()["skipped_steps"] == 2 and cb_res.guard.state()["steps"] == n
    sd_full, sd_res = cb_full.guard.state_dict(), cb_res.guard.state_dict()
    for k, v in sd_full["stats"].items():
        assert torch.equal(v, sd_res["stats"][k]), k


def _with_step_scheduler(ps):
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("hold", [False, True])
def test_hold_schedule_holds_a_per_step_scheduler_on_a_skip(hold):
    """By default a skipped step advances a per-step scheduler; hold_schedule=True keeps it in step with
    the updates taken, and gives the module back its own lr_scheduler_step after the fit."""
    module = Tiny(_with_step_scheduler)
    cb = StepGuardCallback(max_norm=1.0, hold_schedule=hold)
    trainer = _fit(module, batches(STEPS, {1, 3}), [cb])
    sched = trainer.lr_scheduler_configs[0].scheduler
    taken = STEPS - 2 if hold else STEPS
    assert cb.guard.state()["skipped_steps"] == 2 and finite(module.parameters())
    assert int(trainer.optimizers[0].state[module.net.weight]["step"]) == STEPS - 2
    assert sched.last_epoch == taken and sched.get_last_lr()[0] == pytest.approx(1e-2 / (1 + taken))
    assert "lr_scheduler_step" not in module.__dict__


class PoisonAt(pl.Callback):
    """A write outside the optimizer step (the guard cannot see it coming): NaN into a weight or a buffer."""

    def __init__(self, step, tensor):
        self.step, self.tensor = step, tensor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.step:
            with torch.no_grad():
                self.tensor(pl_module).view(-1)[0] = float("nan")


@pytest.mark.parametrize("what", ["weight", "buffer"])
def test_a_checkpoint_that_is_not_finite_is_refused(tmp_path, what):
    from fastgrad.guard import GuardError

    module = WithBatchNorm(OPTS["adamw-fused"])
    tensor = (lambda m: m.net.lin.weight) if what == "weight" else (lambda m: m.net.bn.running_mean)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(GuardError, match="refusing to write this Lightning checkpoint: not finite: "
                                         + ("net.lin.weight" if what == "weight" else "buffer net.bn.running_mean")):
        _fit(module, batches(STEPS, set()), [StepGuardCallback(max_norm=1.0), PoisonAt(2, tensor), ckpt],
             enable_checkpointing=True)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 2, written  # steps 1 and 2: healthy; the third was refused
    for p in tmp_path.iterdir():
        state = torch.load(p, weights_only=False)["state_dict"]
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())
