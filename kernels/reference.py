"""Pure-torch reference of the fused relocate+patch apply: the oracle every backend is tested against.

Written for obviousness, not speed: fp32 throughout, one rounding to the destination dtype at the
end. ``out_k = R(pos)·(k_content + delta_k)`` on the rotary slice (other channels: content + delta
only), ``out_v = v_content + delta_v``; with ``RopeSpec.tensor == "v"`` (MLA) the rotation applies
to v instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from .spec import TensorJob


def content_plus_delta(content: torch.Tensor, u: Optional[torch.Tensor], w: Optional[torch.Tensor]) -> torch.Tensor:
    """``content [H, T, d] + (u [T, m] @ w [m, H*d]).view(T, H, d).transpose(0, 1)`` in fp32 (new tensor)."""
    x = content.to(torch.float32, copy=True)
    if u is not None and w is not None and u.shape[1] > 0:
        H, T, d = content.shape
        x += (u.to(torch.float32) @ w.to(torch.float32)).view(T, H, d).transpose(0, 1)
    return x


def rope_pair_index(start: int, dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``(first, second)`` of each rotation pair, ``[dim/2]`` each."""
    p = torch.arange(dim // 2)
    if interleaved:
        return start + 2 * p, start + 2 * p + 1
    return start + p, start + dim // 2 + p


def rotate(x: torch.Tensor, start: int, half: int, interleaved: bool, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of fp32 ``x [H, T, d]`` by ``cos``/``sin [T, half]``; returns a new tensor."""
    i1, i2 = rope_pair_index(start, 2 * half, interleaved)
    x1, x2 = x[..., i1], x[..., i2]
    out = x.clone()
    out[..., i1] = x1 * cos - x2 * sin
    out[..., i2] = x2 * cos + x1 * sin
    return out


def job_result(job: TensorJob) -> torch.Tensor:
    """The fp32 ``[H, T, d]`` values one tensor job must write (before rounding to the destination)."""
    x = content_plus_delta(job.content, job.u, job.w)
    if job.half:
        x = rotate(x, job.rope_start, job.half, job.interleaved, job.cos, job.sin)  # type: ignore[arg-type]
    return x


def write_job(job: TensorJob, values: torch.Tensor) -> None:
    """Write ``values [H, T, d]`` into the job's destination (one rounding to its dtype).

    Paged: token ``t`` goes to slot ``slots[t]``; negative slots are skipped.
    """
    if job.slots is None:
        job.out_view().copy_(values)
        return
    cache, slots = job.buf, job.slots
    keep = slots >= 0
    sl = slots[keep]
    block_size = cache.shape[1]
    cache[sl // block_size, sl % block_size] = values.transpose(0, 1)[keep].to(cache.dtype)


__all__ = ["content_plus_delta", "rotate", "rope_pair_index", "job_result", "write_job"]
