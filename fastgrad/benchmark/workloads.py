"""Benchmark workloads: the parameter lists of real models, derived from their architectures.

A workload is a list of ``(name, shape, dtype)`` entries, one per trainable tensor (buffers such as
BatchNorm running statistics have no gradient and are left out; tied weights appear once). ``materialize``
turns it into ``nn.Parameter`` objects with random non-zero ``.grad`` on a device.

Workloads too large for the machine are scaled, not silently dropped: ``scale_entries`` shrinks dim 0 of
every tensor with ``ndim >= 2`` by one common factor so the gradient bytes fit a cap. That keeps the number
of tensors (which drives launch and Python overhead), their ndim and their inner dimensions (which define
AGC/GC units) and shrinks only the bytes. 1-D tensors (biases, norms) are kept whole.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

Entry = tuple[str, tuple[int, ...], torch.dtype]

F32, BF16 = torch.float32, torch.bfloat16


# --------------------------------------------------------------------------------------------- models
def gpt2_small(dtype: torch.dtype = F32) -> list[Entry]:
    """GPT-2 124M (HF layout: Conv1D weights are (in, out)); lm_head is tied to wte."""
    d, vocab, n_ctx, layers = 768, 50257, 1024, 12
    out: list[Entry] = [("wte", (vocab, d), dtype), ("wpe", (n_ctx, d), dtype)]
    for i in range(layers):
        p = f"h.{i}."
        out += [
            (p + "ln_1.weight", (d,), dtype), (p + "ln_1.bias", (d,), dtype),
            (p + "attn.c_attn.weight", (d, 3 * d), dtype), (p + "attn.c_attn.bias", (3 * d,), dtype),
            (p + "attn.c_proj.weight", (d, d), dtype), (p + "attn.c_proj.bias", (d,), dtype),
            (p + "ln_2.weight", (d,), dtype), (p + "ln_2.bias", (d,), dtype),
            (p + "mlp.c_fc.weight", (d, 4 * d), dtype), (p + "mlp.c_fc.bias", (4 * d,), dtype),
            (p + "mlp.c_proj.weight", (4 * d, d), dtype), (p + "mlp.c_proj.bias", (d,), dtype),
        ]
    out += [("ln_f.weight", (d,), dtype), ("ln_f.bias", (d,), dtype)]
    return out


def llama(d: int, layers: int, ffn: int, vocab: int, kv_dim: int, tied: bool,
          dtype: torch.dtype = BF16) -> list[Entry]:
    """A Llama-style decoder: RMSNorm (weight only), grouped-query attention (k/v project to ``kv_dim``),
    SwiGLU MLP (gate, up, down), no biases; nn.Linear layout (out, in)."""
    out: list[Entry] = [("embed_tokens", (vocab, d), dtype)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "input_layernorm", (d,), dtype),
            (p + "q_proj", (d, d), dtype), (p + "k_proj", (kv_dim, d), dtype),
            (p + "v_proj", (kv_dim, d), dtype), (p + "o_proj", (d, d), dtype),
            (p + "post_attention_layernorm", (d,), dtype),
            (p + "gate_proj", (ffn, d), dtype), (p + "up_proj", (ffn, d), dtype),
            (p + "down_proj", (d, ffn), dtype),
        ]
    out.append(("norm", (d,), dtype))
    if not tied:
        out.append(("lm_head", (vocab, d), dtype))
    return out


def llama_1b() -> list[Entry]:
    # Llama-3.2-1B geometry: 32 query heads of 64, 8 KV heads -> kv_dim 512, tied embeddings (1.24B).
    return llama(d=2048, layers=16, ffn=8192, vocab=128256, kv_dim=512, tied=True)


def llama_7b() -> list[Entry]:
    # Llama-2-7B geometry: full multi-head attention, untied head (6.74B, ~13.5 GB of bf16 grads).
    return llama(d=4096, layers=32, ffn=11008, vocab=32000, kv_dim=4096, tied=False)


def resnet50(dtype: torch.dtype = F32) -> list[Entry]:
    """torchvision ResNet-50 v1.5: bottleneck blocks [3, 4, 6, 3], stride on the 3x3 conv, conv without
    bias, BatchNorm weight and bias trainable (25.56M)."""
    out: list[Entry] = [("conv1.weight", (64, 3, 7, 7), dtype), ("bn1.weight", (64,), dtype),
                        ("bn1.bias", (64,), dtype)]
    inplanes = 64
    for li, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}."
            out += [
                (p + "conv1.weight", (width, inplanes, 1, 1), dtype),
                (p + "bn1.weight", (width,), dtype), (p + "bn1.bias", (width,), dtype),
                (p + "conv2.weight", (width, width, 3, 3), dtype),
                (p + "bn2.weight", (width,), dtype), (p + "bn2.bias", (width,), dtype),
                (p + "conv3.weight", (4 * width, width, 1, 1), dtype),
                (p + "bn3.weight", (4 * width,), dtype), (p + "bn3.bias", (4 * width,), dtype),
            ]
            if b == 0:
                out += [(p + "downsample.0.weight", (4 * width, inplanes, 1, 1), dtype),
                        (p + "downsample.1.weight", (4 * width,), dtype),
                        (p + "downsample.1.bias", (4 * width,), dtype)]
            inplanes = 4 * width
    out += [("fc.weight", (1000, 2048), dtype), ("fc.bias", (1000,), dtype)]
    return out


def vit_b16(dtype: torch.dtype = F32) -> list[Entry]:
    """ViT-B/16 at 224x224 (timm naming): 196 patches + cls token, 12 blocks of d 768, MLP 3072,
    1000-class head (86.57M)."""
    d, mlp, layers, tokens = 768, 3072, 12, 197
    out: list[Entry] = [("cls_token", (1, 1, d), dtype), ("pos_embed", (1, tokens, d), dtype),
                        ("patch_embed.proj.weight", (d, 3, 16, 16), dtype), ("patch_embed.proj.bias", (d,), dtype)]
    for i in range(layers):
        p = f"blocks.{i}."
        out += [
            (p + "norm1.weight", (d,), dtype), (p + "norm1.bias", (d,), dtype),
            (p + "attn.qkv.weight", (3 * d, d), dtype), (p + "attn.qkv.bias", (3 * d,), dtype),
            (p + "attn.proj.weight", (d, d), dtype), (p + "attn.proj.bias", (d,), dtype),
            (p + "norm2.weight", (d,), dtype), (p + "norm2.bias", (d,), dtype),
            (p + "mlp.fc1.weight", (mlp, d), dtype), (p + "mlp.fc1.bias", (mlp,), dtype),
            (p + "mlp.fc2.weight", (d, mlp), dtype), (p + "mlp.fc2.bias", (d,), dtype),
        ]
    out += [("norm.weight", (d,), dtype), ("norm.bias", (d,), dtype),
            ("head.weight", (1000, d), dtype), ("head.bias", (1000,), dtype)]
    return out


def small_tensors(count: int = 4000, lo: int = 1024, hi: int = 16384, seed: int = 0) -> list[Entry]:
    """``count`` fp32 tensors of ``lo``..``hi`` elements (launch and per-tensor costs at moderate sizes). Even entries are
    matrices with 64 columns, odd ones vectors, so AGC and GC see both kinds."""
    rng = random.Random(seed)
    out: list[Entry] = []
    for i in range(count):
        n = rng.randrange(lo, hi + 1, 64)
        out.append((f"t{i}", (n // 64, 64) if i % 2 == 0 else (n,), F32))
    return out


def one_element(count: int = 4000) -> list[Entry]:
    """``count`` one-element fp32 tensors: all cost is per-tensor host work (the host-overhead workload)."""
    return [(f"g{i}", (1,), F32) for i in range(count)]


def gpt2_count_small() -> list[Entry]:
    """GPT-2 124M's 148 tensors with each matrix shrunk to 32x32 and each vector to 64 elements: a real
    model's tensor count with next to no bytes, so the call's fixed host cost is what is timed."""
    return [(n, (32, 32) if len(s) >= 2 else (64,), F32) for n, s, _ in gpt2_small()]


def mixed_precision() -> list[Entry]:
    """GPT-2 124M as commonly trained in mixed precision: matrices in bf16, 1-D tensors kept in fp32."""
    return [(n, s, BF16 if len(s) >= 2 else F32) for n, s, _ in gpt2_small()]


def tiny() -> list[Entry]:
    """A handful of small tensors of both dtypes: for smoke tests of the harness, not for numbers."""
    return [("w1", (32, 16), F32), ("b1", (32,), F32), ("conv", (8, 4, 3, 3), F32), ("w2", (16, 32), BF16),
            ("b2", (16,), BF16)]


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    title: str
    build: callable
    #: False: the workload is defined by its tensor count and sizes (small-4000), so it is never shrunk
    scalable: bool = True
    #: the ops it runs (None: every requested op)
    ops: tuple[str, ...] | None = None
    #: True: the headline figure is the host time per call (perf_counter around the call, the device
    #: synchronised outside the timed region), not the device time
    host: bool = False


WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in (
    WorkloadSpec("gpt2-124m", "GPT-2 124M fp32", gpt2_small),
    WorkloadSpec("llama-1b", "Llama-style 1B bf16", llama_1b),
    WorkloadSpec("llama-7b", "Llama-style 7B bf16", llama_7b),
    WorkloadSpec("resnet50", "ResNet-50 fp32", resnet50),
    WorkloadSpec("vit-b16", "ViT-B/16 fp32", vit_b16),
    WorkloadSpec("small-4000", "4000 small fp32 tensors (1K-16K)", small_tensors, scalable=False),
    WorkloadSpec("mixed", "GPT-2 124M mixed bf16 matrices + fp32 vectors", mixed_precision),
    WorkloadSpec("host-4000", "host time: 4000 one-element fp32 grads", one_element, scalable=False,
                 ops=("clip",), host=True),
    WorkloadSpec("host-148", "host time: GPT-2's 148 tensors, 32x32 / 64 elements", gpt2_count_small,
                 scalable=False, ops=("clip",), host=True),
    WorkloadSpec("tiny", "5 tiny tensors (harness smoke test)", tiny),
)}

#: What ``--workloads all`` means: every real workload (``tiny`` only when asked for by name).
DEFAULT_WORKLOADS = ("gpt2-124m", "llama-1b", "llama-7b", "resnet50", "vit-b16", "small-4000", "mixed", "host-4000",
                     "host-148")


# --------------------------------------------------------------------------------------------- sizing
def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def nbytes(entries: list[Entry]) -> int:
    return sum(numel(s) * torch.empty((), dtype=d).element_size() for _, s, d in entries)


def scale_entries(entries: list[Entry], max_bytes: int) -> tuple[list[Entry], float]:
    """Shrink dim 0 of every tensor with ``ndim >= 2`` by one factor so the list holds at most about
    ``max_bytes`` of gradients. Returns ``(entries, factor)``; factor 1.0 means unchanged."""
    total = nbytes(entries)
    if total <= max_bytes:
        return entries, 1.0
    fixed = nbytes([e for e in entries if len(e[1]) < 2])
    scalable = total - fixed
    factor = max(max_bytes - fixed, 0) / scalable if scalable else 0.0
    out = []
    for name, shape, dtype in entries:
        if len(shape) >= 2:
            shape = (max(1, int(shape[0] * factor)),) + tuple(shape[1:])
        out.append((name, shape, dtype))
    return out, factor


@dataclass
class Workload:
    """A workload ready to run: its (maybe scaled) entries and the note saying how it was scaled."""

    name: str
    title: str
    entries: list[Entry]
    full_bytes: int
    scale: float = 1.0
    note: str = ""
    ops: tuple[str, ...] | None = None
    host: bool = False
    params: list[torch.nn.Parameter] = field(default_factory=list)

    @property
    def grad_bytes(self) -> int:
        return nbytes(self.entries)

    @property
    def n_tensors(self) -> int:
        return len(self.entries)


def prepare(name: str, max_bytes: int | None) -> Workload:
    """The named workload, scaled to ``max_bytes`` of gradients when it is larger (None: never scale)."""
    spec = WORKLOADS[name]
    entries = spec.build()
    full = nbytes(entries)
    w = Workload(name, spec.title, entries, full, ops=spec.ops, host=spec.host)
    if max_bytes is not None and full > max_bytes and not spec.scalable:
        w.note = f"full size ({full / 2**20:.0f} MiB) although over the {max_bytes / 2**20:.0f} MiB cap: " \
                 "its point is the count and size of its tensors"
    elif max_bytes is not None and full > max_bytes:
        w.entries, w.scale = scale_entries(entries, max_bytes)
        w.note = (f"scaled to {w.grad_bytes / 2**20:.0f} MiB of grads ({100 * w.grad_bytes / full:.1f}% of "
                  f"{full / 2**20:.0f} MiB: dim 0 of each matrix x{w.scale:.4f}, same tensor count)")
    return w


def materialize(w: Workload, device: torch.device | str, seed: int = 0, grad_std: float = 1e-2,
                param_std: float = 2e-2) -> list[torch.nn.Parameter]:
    """Parameters with random non-zero gradients on ``device`` (normal values; an exact zero is replaced,
    so zero-counting and "untouched zero" paths see realistic data)."""
    device = torch.device(device)
    # Generated on the device itself: the 7B workload's 13.5 GB would take minutes through the CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape, dtype in w.entries:
        p = torch.randn(shape, generator=gen, device=device).mul_(param_std).to(dtype)
        g = torch.randn(shape, generator=gen, device=device).mul_(grad_std).to(dtype)
        g.masked_fill_(g == 0, grad_std)
        param = torch.nn.Parameter(p)
        param.grad = g
        params.append(param)
    w.params = params
    return params
