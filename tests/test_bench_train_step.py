"""benchmarks/train_step.py's counts per training step and per gradient-management region, on the CPU (torch
operators; kernels and host syncs are CUDA-only and stay empty here)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train_step():
    spec = importlib.util.spec_from_file_location("train_step", ROOT / "benchmarks" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_step_counts_per_step_and_region(tmp_path):
    import torch

    from fastgrad.benchmark import counting

    ts = _train_step()
    out = tmp_path / "ts.csv"
    assert ts.main(["--device", "cpu", "--model", "gpt2", "--size", "small", "--steps", "1", "--warmup", "0",
                    "--variants", "none,torch,fastgrad", "--threads", "1", "--out", str(out)]) == 0
    with open(out, newline="") as f:
        rows = {r["variant"]: r for r in csv.DictReader(line for line in f if not line.startswith("#"))}
    for r in rows.values():
        assert int(r["step_ops"]) > int(r["gm_ops"]) >= 0
        assert r["step_kernels"] == r["gm_kernels"] == r["step_syncs"] == r["gm_syncs"] == ""
    assert int(rows["none"]["gm_ops"]) == 0
    # the region's count is the clip's own: torch's clip_grad_norm_ over the same model's parameters
    model, _ = ts.build("gpt2", "small", torch.device("cpu"), ts.argparse.Namespace(batch=0, seq=0, image=0))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    want = sum(counting.count_ops(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)).values())
    assert int(rows["torch"]["gm_ops"]) == want
    assert 1 <= int(rows["fastgrad"]["gm_ops"]) < want
    # the step count is the region's plus the rest of the step: equal rests across variants
    rest = {v: int(r["step_ops"]) - int(r["gm_ops"]) for v, r in rows.items()}
    assert len(set(rest.values())) == 1, rest
