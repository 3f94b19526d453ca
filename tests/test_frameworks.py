"""fastgrad.patch_torch() under the real frameworks (docs/contract.md section 11), tiny models on the CPU.

For each framework the same training runs twice from the same initial weights and data: once on torch's
clipping, once under ``fastgrad.patch_torch()``. The patched run must reach fastgrad through the framework's
own clipping call (counted by wrapping ``fastgrad.clip.<fn>``, which the patch's routers look up at call
time), clipping must actually trigger, and the parameters after the last step must equal the unpatched
run's within the contract's fp32 tolerance (docs/contract.md section 3: rtol 1e-6; fastgrad accumulates the norm in its own order, so bitwise
equality is not expected). Each call is also checked against torch's function on copies of the same
gradients. The unpatched run must not touch fastgrad. The framework is imported (by the unpatched run)
before ``patch_torch()``: routing must not depend on import order for these frameworks.

Each framework's cases run in their own subprocess (``python -m tests.test_frameworks FRAMEWORK``): the frameworks keep global
state (accelerate's AcceleratorState singleton, Lightning's seeding and warnings, transformers' logging)
that must not leak into the rest of the suite. Installed by ``pip install -e ".[frameworks]"``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
RTOL = 1e-6  # docs/contract.md section 3, fp32 against torch
ATOL = 1e-7  # for parameters that pass near zero: far below one SGD step's clipped update here

# case -> (framework module, fastgrad function the framework's call must reach, clip threshold)
CASES = {
    "lightning-norm": ("lightning", "clip_grad_norm_", 1.0),
    "lightning-value": ("lightning", "clip_grad_value_", 1.0),
    "accelerate-fp32": ("accelerate", "clip_grad_norm_", 1.0),
    "accelerate-bf16": ("accelerate", "clip_grad_norm_", 1.0),  # CPU autocast to bfloat16
    "hf-trainer": ("transformers", "clip_grad_norm_", 0.1),  # the tiny GPT-2's gradient norm stays below 1
}
FRAMEWORKS = sorted({m for m, _, _ in CASES.values()})


@pytest.fixture(scope="module")
def workers():
    """One subprocess per installed framework, all started at once (they are independent)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    procs = {m: subprocess.Popen([sys.executable, "-m", "tests.test_frameworks", m], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in FRAMEWORKS if importlib.util.find_spec(m) is not None}
    results = {}
    try:
        for m, proc in procs.items():
            out, err = proc.communicate(timeout=600)
            results[m] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_framework_clipping_reaches_fastgrad_and_matches_torch(case, workers):
    module = CASES[case][0]
    if module not in workers:
        pytest.skip(f"{module} is not installed (pip install -e '.[frameworks]')")
    rc, out, err = workers[module]
    assert rc == 0, f"{module} worker failed:\n{out[-3000:]}\n{err[-6000:]}"
    res = json.loads(out.strip().splitlines()[-1])[case]
    assert res["reference_fastgrad_calls"] == 0, res  # the unpatched run used torch's own function
    assert res["patched_fastgrad_calls"] == STEPS, res  # the framework's own call, once per step
    assert res["patch_counter"] == STEPS, res
    assert res["clipping_triggered"], res
    assert res["call_mismatch"] is None, res["call_mismatch"]  # each call vs torch on the same gradients
    assert res["mismatch"] is None, res["mismatch"]  # parameters after the last step


# ---------------------------------------------------------------------------------------------- worker
# Everything below runs only in the subprocess.

def _recorder(fn: str, threshold: float):
    """Wrap fastgrad.clip.<fn> to count calls, note whether clipping really changed something, and check
    each call against torch's own function (as captured by fastgrad) on copies of the same gradients:
    the total norm and the clipped gradients within rtol 1e-6 (docs/contract.md section 3, fp32), same dtype."""
    import torch

    import fastgrad.clip
    from fastgrad import patch

    from .helpers import clone_params, grads

    real = getattr(fastgrad.clip, fn)
    log = {"calls": 0, "triggered": False, "max_seen": 0.0, "call_mismatch": None,
           "restore": lambda: setattr(fastgrad.clip, fn, real)}

    def wrapped(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        twins = clone_params(params)
        if fn == "clip_grad_value_":
            seen = max(g.abs().max().item() for g in grads(params))
        out = real(params, *args, **kwargs)
        ref = getattr(patch.TORCH, fn)(twins, *args, **kwargs)
        if fn == "clip_grad_norm_":
            seen = out.item()
        try:
            if out is not None or ref is not None:
                assert out.dtype == ref.dtype and out.shape == ref.shape
                torch.testing.assert_close(out, ref, rtol=RTOL, atol=0)
            for g, gt in zip(grads(params), grads(twins), strict=True):
                torch.testing.assert_close(g, gt, rtol=RTOL, atol=0)
        except AssertionError as exc:
            log["call_mismatch"] = log["call_mismatch"] or f"call {log['calls']}: {exc}"
        log["max_seen"] = max(log["max_seen"], seen)
        log["triggered"] |= seen > threshold
        log["calls"] += 1
        return out

    setattr(fastgrad.clip, fn, wrapped)
    return log


def _data(n=64, d=8):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    y = torch.randn(n, 1, generator=g) * 50  # large targets: the gradients exceed the clip thresholds
    return torch.utils.data.TensorDataset(x, y)


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _lightning(algorithm: str, tmp: str):
    import lightning as L
    import torch
    import torch.nn.functional as F

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = Module()
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=CASES[f"lightning-{algorithm}"][2], gradient_clip_algorithm=algorithm, default_root_dir=tmp)
    trainer.fit(module, torch.utils.data.DataLoader(_data(), batch_size=16))
    return [p.detach().clone() for p in module.parameters()]


def _accelerate(mixed_precision: str, tmp: str):
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_data(), batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        loss = F.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CASES["accelerate-fp32"][2])
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def _hf_trainer(tmp: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(2))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=8, learning_rate=0.5,
                             max_grad_norm=CASES["hf-trainer"][2], optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.0, report_to="none", save_strategy="no", logging_strategy="no",
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=dataset).train()
    return [p.detach().clone() for p in model.parameters()]


def _train(case: str, tmp: str):
    if case.startswith("lightning"):
        return _lightning(case.split("-")[1], tmp)
    if case.startswith("accelerate"):
        return _accelerate({"fp32": "no", "bf16": "bf16"}[case.split("-")[1]], tmp)
    return _hf_trainer(tmp)


def _run_case(case: str) -> dict:
    import torch

    import fastgrad
    from fastgrad import patch

    _, fn, threshold = CASES[case]
    log = _recorder(fn, threshold)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            reference = _train(case, tmp)
            reference_calls = log["calls"]
            counter0 = patch.call_counts()[fn]
            with fastgrad.patch_torch():
                ours = _train(case, tmp)
            counter = patch.call_counts()[fn] - counter0
    finally:
        log["restore"]()
    mismatch = None
    try:
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    except AssertionError as exc:
        mismatch = str(exc)
    moved = max((a - b).abs().max().item() for a, b in zip(ours, reference))
    return {"reference_fastgrad_calls": reference_calls, "patched_fastgrad_calls": log["calls"] - reference_calls,
            "patch_counter": counter, "clipping_triggered": log["triggered"], "max_abs_param_diff": moved,
            "max_seen": log["max_seen"], "call_mismatch": log["call_mismatch"], "mismatch": mismatch}


def _worker(framework: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    results = {}
    for case, (module, _, _) in CASES.items():
        if module == framework:
            results[case] = _run_case(case)
            if module == "accelerate":  # a new Accelerator with other settings needs a fresh singleton
                from accelerate.state import AcceleratorState

                AcceleratorState._reset_state(reset_partial_state=True)
    return results


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
