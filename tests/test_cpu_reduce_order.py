"""The CPU norm kernels' summation order (csrc/cpu/reduce.cpp), pinned bit for bit by an independent model.

Each tensor is summed in blocks of 256 elements; element k of a block goes to lane k % 16 (lanes in the
accumulation dtype, each lane's terms added in element order), the 16 lanes are folded pairwise (8, 4, 2, 1)
and the block totals are added in double with Neumaier's compensation (bf16's full blocks, on a little-endian
CPU, put the even positions of each 16-element row in lanes 0-7 and the odd ones in lanes 8-15: the same fold).
The model below does exactly that with torch elementwise ops and Python floats; the kernel's per-tensor L1 norm
(the total itself) and L2 norm (its square root) must match it to the bit for every size around the lanes and
the block, so a change to how the kernel walks a partial block (its tail) cannot change a result unnoticed.
(A model with bf16's full-block lanes in the plain order differed from the kernel at 257 elements: the test
sees a lane assignment change.)
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from fastgrad import _ext

needs_ext = pytest.mark.skipif(not _ext.has_cpu_kernels(), reason=f"fastgrad._C not usable: {_ext.load_error()}")
ops = torch.ops.fastgrad

LANES, BLOCK = 16, 256
BF16_FULL = list(range(0, LANES, 2)) + list(range(1, LANES, 2))
SIZES = [1, 2, 5, 15, 16, 17, 31, 33, 100, 239, 240, 241, 255, 256, 257, 272, 273, 511, 512, 513, 700, 1000]


def _model_total(x: torch.Tensor, p: int) -> float:
    """The kernel's sum of |x|^p (p = 1, 2) for one tensor, by the order described above."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.reshape(-1).to(acc_dtype)  # 16-bit values widen exactly
    terms = v.abs() if p == 1 else v * v  # rounded to the accumulation dtype, as the kernel's (no FMA)
    s = c = 0.0
    for i in range(0, terms.numel(), BLOCK):
        blk = torch.zeros(BLOCK, dtype=acc_dtype)
        part = terms[i:i + BLOCK]
        blk[: part.numel()] = part  # +0 into the lanes a partial block does not reach: exact for terms >= 0
        rows = blk.view(BLOCK // LANES, LANES)
        if x.dtype == torch.bfloat16 and part.numel() == BLOCK and sys.byteorder == "little":
            rows = rows[:, BF16_FULL]
        acc = torch.zeros(LANES, dtype=acc_dtype)
        for r in range(rows.shape[0]):
            acc = acc + rows[r]
        w = LANES // 2
        while w:
            acc[:w] = acc[:w] + acc[w:2 * w]
            w //= 2
        b = float(acc[0])
        t = s + b
        c += (s - t) + b if abs(s) >= abs(b) else (b - t) + s
        s = t
    return s + c if math.isfinite(s) else s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@needs_ext
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_norm_matches_lane_model(dtype, p):
    g = torch.Generator().manual_seed(11 + p)
    ts = [(torch.randn(n, generator=g) * 3).to(dtype) for n in SIZES]
    ts.append((torch.randn(40, 9, generator=g)).to(dtype).t())  # non-contiguous, dense: its memory order
    _, per = ops.norm(ts, float(p))
    out = per.dtype
    for t, got in zip(ts, per):
        total = _model_total(t if t.is_contiguous() else t.t(), p)  # a dense tensor is read in memory order
        want = torch.tensor(total if p == 1 else math.sqrt(total), dtype=torch.float64).to(out)
        assert torch.equal(_bits(got.reshape(1)), _bits(want.reshape(1))), (dtype, p, t.shape, got, want)
