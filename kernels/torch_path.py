"""Portable torch backend: the fallback where neither the native CPU kernel nor Triton can run.

Few full-size ops per tensor, fp32 intermediates, one rounding on the write:
``ws = u @ w`` (skinny GEMM into fp32), ``x = content + ws`` (one pass, fp32), then the rotation
written straight into the destination with ``addcmul(..., out=dest_slice)`` so the
fp32 -> storage rounding happens once. Correct on any device torch supports; on CPU 2-3x slower
than the native kernel in fp32 and up to ~10x in bf16 (a memory pass and a dtype conversion per
op instead of one pass in all).
"""

from __future__ import annotations

import torch

from .reference import rope_pair_index, write_job
from .spec import TensorJob


def _content_plus_delta(job: TensorJob) -> torch.Tensor:
    c = job.content
    H, T, d = c.shape
    x = torch.empty((H, T, d), dtype=torch.float32, device=c.device)
    if job.u is None or job.w is None:
        x.copy_(c)
        return x
    ws = torch.mm(job.u.to(torch.float32), job.w.to(torch.float32))  # [T, H*d]
    torch.add(c, ws.view(T, H, d).transpose(0, 1), out=x)
    return x


def _pair_views(t: torch.Tensor, start: int, half: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    seg = t[..., start : start + 2 * half]
    if interleaved:
        return seg[..., 0::2], seg[..., 1::2]
    return seg[..., :half], seg[..., half:]


def run_job(job: TensorJob) -> None:
    """Compute one checked tensor job and write it to its destination."""
    x = _content_plus_delta(job)
    if job.slots is not None:
        # paged: rows scatter to slots; compute the rotation in place, then one indexed write
        if job.half:
            i1, i2 = rope_pair_index(job.rope_start, 2 * job.half, job.interleaved)
            x1, x2 = x[..., i1], x[..., i2]
            x[..., i1] = x1 * job.cos - x2 * job.sin
            x[..., i2] = x2 * job.cos + x1 * job.sin
        write_job(job, x)
        return
    out = job.out_view()
    if not job.half:
        out.copy_(x)
        return
    a, b = job.rope_start, job.rope_start + 2 * job.half
    if a:
        out[..., :a].copy_(x[..., :a])
    if b < x.shape[-1]:
        out[..., b:].copy_(x[..., b:])
    x1, x2 = _pair_views(x, job.rope_start, job.half, job.interleaved)
    o1, o2 = _pair_views(out, job.rope_start, job.half, job.interleaved)
    cos, sin = job.cos, job.sin
    torch.addcmul(x1 * cos, x2, sin, value=-1.0, out=o1)
    torch.addcmul(x2 * cos, x1, sin, out=o2)
