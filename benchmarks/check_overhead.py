"""What ``python -m fastgrad.check`` adds to a training step on the host: the same small training script run
plainly (``runpy``) and under the checker (``fastgrad.diagnose.run.run_script``), in one process, alternating.

    python benchmarks/check_overhead.py [--script classifier|agent|clipped] [--steps 200] [--rounds 5] [--json out.json]

The script is a classifier (8 Linear layers of 256, GELU, AdamW, ``F.cross_entropy``; a scalar loss, one
backward and one step per iteration): per step, the checker's hooks on every module's forward, the backward
interceptor (the loss's graph read on the host), the optimizer-step reads and the device rows it flushes every
64 steps. Per-step time is the loop's time over its steps, as wall time and as the thread's CPU time (torch on
one thread computes in the calling thread, and the checker's work is host work there: on a shared machine the
thread time is the one that other jobs do not inflate); the table gives the minimum and median over the rounds
of each side and their difference. The final reads and the report, once per run, are counted apart.

``--script agent``: the same network as a Q-learner's online network beside a target network that no optimizer
holds, forwarded under ``torch.no_grad`` for a TD target and copied through ``.data`` every 50 steps (the way
tianshou and cleanrl copy): the checker's per-step watch of a target's values is in its time. ``--script
clipped``: the classifier with ``clip_grad_norm_(model.parameters(), 1.0)`` before each step.
"""

from __future__ import annotations

import argparse
import json
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the network and optimizer both scripts train (the agent's online network is the classifier's)
_NET = '''
import copy
import time
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [nn.Linear(256, 256), nn.GELU()]
model = nn.Sequential(*layers, nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

SCRIPT = _NET + '''x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
t0, c0 = time.perf_counter(), time.thread_time()
for step in range({steps}):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
TIMES.append((time.perf_counter() - t0, time.thread_time() - c0))
'''

AGENT = _NET + '''target = copy.deepcopy(model)
obs, nxt = torch.randn(64, 256), torch.randn(64, 256)
act, rew = torch.randint(0, 10, (64,)), torch.randn(64)
t0, c0 = time.perf_counter(), time.thread_time()
for step in range({steps}):
    if step % 50 == 0:
        for pt, p in zip(target.parameters(), model.parameters()):
            pt.data.copy_(p.data)
    with torch.no_grad():
        y = rew + 0.99 * target(nxt).max(1).values
    loss = (model(obs).gather(1, act[:, None]).squeeze(1) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
TIMES.append((time.perf_counter() - t0, time.thread_time() - c0))
'''
# the classifier with a norm clip before each step: the clip interceptor's reads (the tensors it is handed, where
# it sits) are in its time
CLIPPED = SCRIPT.replace("    opt.step()", "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    opt.step()")
SCRIPTS = {"classifier": SCRIPT, "agent": AGENT, "clipped": CLIPPED}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", choices=sorted(SCRIPTS), default="classifier")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from fastgrad.diagnose.run import run_script

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "train.py"
        path.write_text(SCRIPTS[a.script].format(steps=a.steps))
        plain, checked, plain_cpu, checked_cpu, report = [], [], [], [], []
        import builtins
        for _ in range(a.rounds + 1):   # the first round of each side warms up, not counted
            builtins.TIMES = []
            runpy.run_path(str(path), init_globals={"TIMES": builtins.TIMES}, run_name="__main__")
            plain.append(builtins.TIMES[0][0] / a.steps)
            plain_cpu.append(builtins.TIMES[0][1] / a.steps)
            builtins.TIMES = []
            t0 = time.perf_counter()
            run_script(str(path), [])
            total = time.perf_counter() - t0
            loop, cpu = builtins.TIMES[0] if builtins.TIMES else (float("nan"), float("nan"))
            checked.append(loop / a.steps)
            checked_cpu.append(cpu / a.steps)
            report.append(total - loop)
        plain, checked, report = plain[1:], checked[1:], report[1:]
        plain_cpu, checked_cpu = plain_cpu[1:], checked_cpu[1:]
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    row = {"commit": commit, "script": a.script, "steps": a.steps, "rounds": a.rounds, "threads": a.threads,
           "plain_ms": [1e3 * v for v in plain], "checked_ms": [1e3 * v for v in checked],
           "plain_cpu_ms": [1e3 * v for v in plain_cpu], "checked_cpu_ms": [1e3 * v for v in checked_cpu],
           "report_ms": [1e3 * v for v in report], "torch": torch.__version__, "machine": platform.node()}
    mn = lambda v: 1e3 * min(v)  # noqa: E731
    md = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    print(f"commit {commit}, script {a.script}, {a.steps} steps x {a.rounds} rounds, {a.threads} thread(s), torch {torch.__version__}")
    print("| per step | min ms | median ms |\n|---|---|---|")
    print(f"| plain | {mn(plain):.3f} | {md(plain):.3f} |")
    print(f"| under check | {mn(checked):.3f} | {md(checked):.3f} |")
    print(f"| added by check | {mn(checked) - mn(plain):.3f} | {md(checked) - md(plain):.3f} |")
    print(f"| plain, thread CPU time | {mn(plain_cpu):.3f} | {md(plain_cpu):.3f} |")
    print(f"| under check, thread CPU time | {mn(checked_cpu):.3f} | {md(checked_cpu):.3f} |")
    print(f"| added by check, thread CPU time | {mn(checked_cpu) - mn(plain_cpu):.3f} | "
          f"{md(checked_cpu) - md(plain_cpu):.3f} |")
    print(f"| the end of the run (reads, report), once | {mn(report):.1f} | {md(report):.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
