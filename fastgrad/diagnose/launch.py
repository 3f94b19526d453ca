"""``python -m fastgrad.check --nproc N``: start N local processes, each ``python -m fastgrad.check`` on the same
script, with the environment ``torchrun --nproc_per_node=N`` gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set), so that the script's
``dist.init_process_group()`` finds its peers. Rank 0 prints the report; the exit code is rank 0's, or 3 when
another rank failed (its peers are stopped a grace period later, as a rank left waiting in a collective would
never end)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

__all__ = ["launch_ranks", "GRACE_S"]

#: how long the other ranks may run on once one rank has failed
GRACE_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(nproc: int, opts: list[str], script: str, args: list[str]) -> int:
    """Run ``python -m fastgrad.check OPTS SCRIPT ARGS`` on ``nproc`` local ranks; returns the exit code."""
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "fastgrad.check", *opts, script, *args], env=env))
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0, 1) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c not in (0, 1)]
    if bad:
        print("python -m fastgrad.check: " + ", ".join(f"rank {r} exited with status {c}" for r, c in bad),
              file=sys.stderr)
    rc0 = codes[0]
    if rc0 < 0 or any(r != 0 for r, _ in bad) and rc0 in (0, 1):
        return 3
    return rc0
