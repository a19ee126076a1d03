"""Triton backend: the fused relocate + patch kernel for CUDA (and CPU under ``TRITON_INTERPRET=1``).

One program handles ``BLOCK_T`` tokens of one head of one cache tensor:

- pass-through channels (outside the rotary slice) in chunks of ``BLOCK_N``:
  ``x = content + u @ w`` (``tl.dot``, fp32 accumulation, the content as the accumulator's start);
- rotation pairs in chunks of ``BLOCK_P``: the two channels of each pair are gathered as two tiles
  (half-split: ``i`` and ``i + dim/2``; interleaved: ``2i`` and ``2i+1``), each gets its
  ``content + u @ w``, then ``(x1*cos - x2*sin, x2*cos + x1*sin)`` with per-token cos/sin;
- one rounding to the destination dtype (bf16 by explicit round-to-nearest-even bit arithmetic,
  so the interpreter, whose bf16 cast truncates, rounds exactly like the GPU), then a store into a
  contiguous ``[B, H, T_total, d]`` cache or a paged ``[NB, BS, H, d]`` cache by slot (negative or
  out-of-range slots are skipped).

Under the interpreter ``tl.dot`` on bf16 operands is wrong (it multiplies the raw bit patterns),
so operands are widened to fp32 there (``WIDEN_DOT``); on GPUs bf16/fp16 operands go to the tensor
cores as they are (their products are exact in fp32 and accumulation is fp32 either way), fp32
operands use ``input_precision="ieee"`` (never plain TF32), or from rank 16 on "tf32x3" (see
:data:`TF32X3_MIN_RANK`).

Importable without triton: :data:`HAVE_TRITON` is then ``False`` and :func:`run_jobs` raises.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .spec import LayerMismatch, TensorJob, dest_addresses, factor_addresses, layer0_jobs, layer_addresses, stacked_factors

try:  # triton is optional: an extra, never required to install or to test
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing or broken
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

#: Launch overrides for tuning sweeps (``contextdeque.eval.gpu_check``): ``block_t``,
#: ``num_warps``, ``num_stages``, ``dot_then_add``, ``fp32_precision``, ``hoist_u``,
#: ``block_p_max``, ``block_n_max``; empty: the defaults of :func:`_launch`.
LAUNCH_OVERRIDES: dict[str, Any] = {}


def _launch_from_env() -> dict[str, Any]:
    """A tuning run's launch for a whole process: ``CONTEXTDEQUE_TRITON_LAUNCH='{"hoist_u": true}'``."""
    raw = os.environ.get("CONTEXTDEQUE_TRITON_LAUNCH", "")
    if not raw:
        return {}
    import json

    try:
        over = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"CONTEXTDEQUE_TRITON_LAUNCH is not a JSON object: {raw!r}") from e
    if not isinstance(over, dict):
        raise ValueError(f"CONTEXTDEQUE_TRITON_LAUNCH is not a JSON object: {raw!r}")
    return over


LAUNCH_OVERRIDES.update(_launch_from_env())

#: fp32 factors of at least this rank go to the matrix units as three TF32 passes ("tf32x3",
#: the product accumulated from zero, the content added after it) instead of IEEE fp32 FMA
#: ("ieee"). Measured on an H200 (docs/gpu.md): rank-32 apply at 8,192 tokens 22x the true floor
#: with "ieee", 1.5x with "tf32x3" (SmolLM2 shape). tf32x3 drops the low x low partial products
#: (~2^-21 of |u w| per product): within the kernels' tolerance, (m + 4) * 2^-24 of the summed
#: magnitudes, from rank 16 on; at rank 1 it was measured 5% past it, so lower ranks stay "ieee".
TF32X3_MIN_RANK = 16

#: Load the program's ``u`` tile once and issue every load of a rotation pair before its products
#: (``HOIST_U``), where the rank fits one product block. Measured on an H100 (docs/gpu.md), rank-32
#: bf16 apply at 8,192 tokens, kernels alone vs the true floor: 1.34x -> 1.15x (Llama-3-8B shape),
#: 1.37x -> 1.15x (SmolLM2 shape); fp32 1.52x -> 1.48x and 1.24x -> 1.20x.
HOIST_U_DEFAULT = True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_for(device: torch.device) -> bool:
    """Whether this backend can run on tensors of ``device``."""
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


if HAVE_TRITON:

    @triton.jit
    def _round_out(x, OUT_KIND: tl.constexpr):
        if OUT_KIND == 1:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            nan = (bits & 0x7FFFFFFF) > 0x7F800000
            rounded = tl.where(nan, (bits >> 16) | 0x40, rounded)
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        elif OUT_KIND == 2:
            return x.to(tl.float16)
        else:
            return x

    @triton.jit
    def _content_plus_delta(
        c_ptr, c_rows, t_mask, cols, col_mask,
        u_ptr, u_rows, w_ptr, w_sr, w_col0, m,
        HAS_PATCH: tl.constexpr, WIDEN_DOT: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
        M_LOOP: tl.constexpr, DOT_THEN_ADD: tl.constexpr, FP32_PRECISION: tl.constexpr,
    ):
        """fp32 ``content[rows, cols] + u[rows, :] @ w[:, w_col0 + cols]`` for a [BLOCK_T, N] tile.

        ``DOT_THEN_ADD``: the product accumulates from zero and the content is added after it
        (the path measured and tested with "tf32x3"); otherwise the content is the accumulator's
        start. ``FP32_PRECISION``: ``tl.dot``'s precision for fp32 operands."""
        mask = t_mask[:, None] & col_mask[None, :]
        x = tl.load(c_ptr + c_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_PATCH:
            if DOT_THEN_ADD:
                acc = tl.zeros(x.shape, dtype=tl.float32)
            else:
                acc = x
            for j0 in range(0, M_LOOP, BLOCK_M):
                j = j0 + tl.arange(0, BLOCK_M)
                j_mask = j < m
                uu = tl.load(u_ptr + u_rows[:, None] + j[None, :], mask=t_mask[:, None] & j_mask[None, :], other=0.0)
                ww = tl.load(
                    w_ptr + j[:, None].to(tl.int64) * w_sr + (w_col0 + cols)[None, :],
                    mask=j_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )
                if WIDEN_DOT:
                    uu = uu.to(tl.float32)
                    ww = ww.to(tl.float32)
                if FP32_DOT:
                    acc = tl.dot(uu, ww, acc, input_precision=FP32_PRECISION)
                else:
                    acc = tl.dot(uu, ww, acc)
            if DOT_THEN_ADD:
                x = x + acc
            else:
                x = acc
        return x

    @triton.jit
    def _load_u(u_ptr, u_rows, t_mask, m, WIDEN_DOT: tl.constexpr, BLOCK_M: tl.constexpr):
        """The program's whole ``u[rows, :m]`` tile (``m <= BLOCK_M``), loaded once (``HOIST_U``)."""
        j = tl.arange(0, BLOCK_M)
        uu = tl.load(u_ptr + u_rows[:, None] + j[None, :], mask=t_mask[:, None] & (j < m)[None, :], other=0.0)
        if WIDEN_DOT:
            uu = uu.to(tl.float32)
        return uu

    @triton.jit
    def _load_w(w_ptr, w_sr, w_col0, cols, col_mask, m, WIDEN_DOT: tl.constexpr, BLOCK_M: tl.constexpr):
        j = tl.arange(0, BLOCK_M)
        ww = tl.load(
            w_ptr + j[:, None].to(tl.int64) * w_sr + (w_col0 + cols)[None, :],
            mask=(j < m)[:, None] & col_mask[None, :],
            other=0.0,
        )
        if WIDEN_DOT:
            ww = ww.to(tl.float32)
        return ww

    @triton.jit
    def _plus_product(x, uu, ww, FP32_DOT: tl.constexpr, DOT_THEN_ADD: tl.constexpr, FP32_PRECISION: tl.constexpr):
        """``x + uu @ ww`` in fp32 (the content as the accumulator's start unless ``DOT_THEN_ADD``)."""
        if DOT_THEN_ADD:
            acc = tl.zeros(x.shape, dtype=tl.float32)
        else:
            acc = x
        if FP32_DOT:
            acc = tl.dot(uu, ww, acc, input_precision=FP32_PRECISION)
        else:
            acc = tl.dot(uu, ww, acc)
        if DOT_THEN_ADD:
            return x + acc
        return acc

    @triton.jit
    def _fused_kernel(
        c_ptr, c_sh, c_st,
        u_ptr, u_st, w_ptr, w_sr, m,
        cos_ptr, sin_ptr, cs_st, rope_start, half,
        o_ptr, o_sh, o_st,
        slot_ptr, block_size, o_sblk, o_soff, num_slots,
        T, D, n_pass,
        c_sl, u_sl, w_sl, cs_sl, o_sl,
        PAGED: tl.constexpr, HAS_PATCH: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
        WIDEN_DOT: tl.constexpr, FP32_DOT: tl.constexpr, OUT_KIND: tl.constexpr, DOT_THEN_ADD: tl.constexpr,
        FP32_PRECISION: tl.constexpr, HOIST_U: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
        N_LOOP: tl.constexpr, P_LOOP: tl.constexpr, M_LOOP: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        # layer (grid axis 2): every layer is laid out like layer 0, ``*_sl`` elements apart
        layer = tl.program_id(2).to(tl.int64)
        c_ptr += layer * c_sl
        u_ptr += layer * u_sl
        w_ptr += layer * w_sl
        cos_ptr += layer * cs_sl
        sin_ptr += layer * cs_sl
        o_ptr += layer * o_sl
        tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = tok < T
        tok64 = tok.to(tl.int64)
        if PAGED:
            slot = tl.load(slot_ptr + tok64, mask=t_mask, other=-1)
            t_ok = t_mask & (slot >= 0) & (slot < num_slots)
            slot = tl.where(t_ok, slot, 0)
            o_rows = (slot // block_size) * o_sblk + (slot % block_size) * o_soff + h * o_sh
        else:
            t_ok = t_mask
            o_rows = tok64 * o_st + h * o_sh
        c_rows = h * c_sh + tok64 * c_st
        u_rows = tok64 * u_st
        w_col0 = h * D
        if HOIST_U:  # m fits one block: u loaded once for every channel tile of this program
            uu = _load_u(u_ptr, u_rows, t_mask, m, WIDEN_DOT, BLOCK_M)

        # channels outside the rotary slice: content + delta only
        for n0 in range(0, N_LOOP, BLOCK_N):
            q = n0 + tl.arange(0, BLOCK_N)
            q_mask = q < n_pass
            if ROPE:
                cols = tl.where(q < rope_start, q, q + 2 * half)
            else:
                cols = q
            if HOIST_U:
                x = tl.load(c_ptr + c_rows[:, None] + cols[None, :], mask=t_mask[:, None] & q_mask[None, :], other=0.0)
                ww = _load_w(w_ptr, w_sr, w_col0, cols, q_mask, m, WIDEN_DOT, BLOCK_M)
                x = _plus_product(x.to(tl.float32), uu, ww, FP32_DOT, DOT_THEN_ADD, FP32_PRECISION)
            else:
                x = _content_plus_delta(
                    c_ptr, c_rows, t_mask, cols, q_mask, u_ptr, u_rows, w_ptr, w_sr, w_col0, m,
                    HAS_PATCH, WIDEN_DOT, FP32_DOT, BLOCK_M, M_LOOP, DOT_THEN_ADD, FP32_PRECISION,
                )
            tl.store(o_ptr + o_rows[:, None] + cols[None, :], _round_out(x, OUT_KIND), mask=t_ok[:, None] & q_mask[None, :])

        if ROPE:
            for p0 in range(0, P_LOOP, BLOCK_P):
                pp = p0 + tl.arange(0, BLOCK_P)
                p_mask = pp < half
                if INTERLEAVED:
                    col1 = rope_start + 2 * pp
                    col2 = col1 + 1
                else:
                    col1 = rope_start + pp
                    col2 = col1 + half
                cs_off = tok64[:, None] * cs_st + pp[None, :]
                cs_mask = t_mask[:, None] & p_mask[None, :]
                if HOIST_U:  # every operand of the pair in flight before the first product
                    x1 = tl.load(c_ptr + c_rows[:, None] + col1[None, :], mask=cs_mask, other=0.0)
                    x2 = tl.load(c_ptr + c_rows[:, None] + col2[None, :], mask=cs_mask, other=0.0)
                    w1 = _load_w(w_ptr, w_sr, w_col0, col1, p_mask, m, WIDEN_DOT, BLOCK_M)
                    w2 = _load_w(w_ptr, w_sr, w_col0, col2, p_mask, m, WIDEN_DOT, BLOCK_M)
                    cs = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0)
                    sn = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
                    x1 = _plus_product(x1.to(tl.float32), uu, w1, FP32_DOT, DOT_THEN_ADD, FP32_PRECISION)
                    x2 = _plus_product(x2.to(tl.float32), uu, w2, FP32_DOT, DOT_THEN_ADD, FP32_PRECISION)
                else:
                    x1 = _content_plus_delta(
                        c_ptr, c_rows, t_mask, col1, p_mask, u_ptr, u_rows, w_ptr, w_sr, w_col0, m,
                        HAS_PATCH, WIDEN_DOT, FP32_DOT, BLOCK_M, M_LOOP, DOT_THEN_ADD, FP32_PRECISION,
                    )
                    x2 = _content_plus_delta(
                        c_ptr, c_rows, t_mask, col2, p_mask, u_ptr, u_rows, w_ptr, w_sr, w_col0, m,
                        HAS_PATCH, WIDEN_DOT, FP32_DOT, BLOCK_M, M_LOOP, DOT_THEN_ADD, FP32_PRECISION,
                    )
                    cs = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0)
                    sn = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
                o_mask = t_ok[:, None] & p_mask[None, :]
                tl.store(o_ptr + o_rows[:, None] + col1[None, :], _round_out(x1 * cs - x2 * sn, OUT_KIND), mask=o_mask)
                tl.store(o_ptr + o_rows[:, None] + col2[None, :], _round_out(x2 * cs + x1 * sn, OUT_KIND), mask=o_mask)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << (max(n, 1) - 1).bit_length()))  # plain ints: triton's helpers cost µs per call


def _ceil_to(n: int, block: int) -> int:
    # loop bounds are constexpr (a multiple of the block; masks use the runtime size): the
    # interpreter cannot iterate over a runtime scalar with numpy >= 2, and on GPUs this only
    # specializes the kernel per size bucket
    return -(-n // block) * block


def _launch(job: TensorJob, layers: int = 1, layer_steps: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)) -> None:
    """One launch for ``job`` (layer 0) and, with ``layers > 1``, the ``layers - 1`` layers laid out
    like it ``layer_steps`` = (content, u, w, cos/sin, destination) elements apart."""
    c = job.content
    H, T, D = c.shape
    if c.stride(2) != 1:
        c = c.contiguous()
    m = job.rank
    u, w = job.u, job.w
    if u is not None and w is not None:
        u = u if u.stride(1) == 1 else u.contiguous()
        w = w if w.stride(1) == 1 else w.contiguous()
    half = job.half
    cos, sin = job.cos, job.sin
    if half and cos is not None and sin is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    n_pass = D - 2 * half
    interp = interpreting()
    buf = job.buf
    if job.slots is None:
        out = job.out_view()  # [H, T, d] view; the kernel indexes it from its own base pointer
        o_ptr, o_sh, o_st = out, out.stride(0), out.stride(1)
        slot_args: tuple[Any, ...] = (c, 1, 0, 0, 0)  # unused (PAGED=False); any pointer will do
    else:
        slots = job.slots.contiguous()
        o_ptr, o_sh, o_st = buf, buf.stride(2), 0
        slot_args = (slots, buf.shape[1], buf.stride(0), buf.stride(1), buf.shape[0] * buf.shape[1])
    widen = interp or (u is not None and w is not None and u.dtype != w.dtype)
    fp32_dot = widen or (u is not None and u.dtype == torch.float32)
    # fp32 factors (not widened ones: the tested and measured case) of rank >= TF32X3_MIN_RANK
    tf32x3 = fp32_dot and not widen and m >= TF32X3_MIN_RANK
    block_t = LAUNCH_OVERRIDES.get("block_t") or (16 if interp else (32 if D > 256 else 64))
    block_n = _pow2_at_least(n_pass, 16, LAUNCH_OVERRIDES.get("block_n_max", 128))
    block_p = _pow2_at_least(half, 16, LAUNCH_OVERRIDES.get("block_p_max", 64))
    block_m = _pow2_at_least(m, 16, 64)
    # u loaded once per program: only where the rank fits one product block
    hoist_u = bool(LAUNCH_OVERRIDES.get("hoist_u", HOIST_U_DEFAULT)) and 0 < m <= block_m
    grid = (-(-T // block_t), H, layers)
    _fused_kernel[grid](
        c, c.stride(0), c.stride(1),
        u if u is not None else c, u.stride(0) if u is not None else 0,
        w if w is not None else c, w.stride(0) if w is not None else 0, m,
        cos if half else c, sin if half else c, cos.stride(0) if half else 0, job.rope_start, half,
        o_ptr, o_sh, o_st,
        *slot_args,
        T, D, n_pass,
        *layer_steps,
        PAGED=job.slots is not None,
        HAS_PATCH=m > 0,
        ROPE=half > 0,
        INTERLEAVED=bool(job.interleaved),
        WIDEN_DOT=widen,
        DOT_THEN_ADD=bool(LAUNCH_OVERRIDES.get("dot_then_add", tf32x3)),
        FP32_PRECISION=str(LAUNCH_OVERRIDES.get("fp32_precision", "tf32x3" if tf32x3 else "ieee")),
        FP32_DOT=fp32_dot,
        HOIST_U=hoist_u,
        OUT_KIND=_OUT_KIND[buf.dtype],
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_P=block_p,
        BLOCK_M=block_m,
        N_LOOP=_ceil_to(n_pass, block_n),
        P_LOOP=_ceil_to(half, block_p),
        M_LOOP=_ceil_to(m, block_m),
        num_warps=LAUNCH_OVERRIDES.get("num_warps", 4),
        **({"num_stages": LAUNCH_OVERRIDES["num_stages"]} if "num_stages" in LAUNCH_OVERRIDES else {}),
    )


def run_jobs(jobs: list[TensorJob]) -> None:
    """Run checked tensor jobs with the Triton kernel (one launch per job)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed (pip install contextdeque[triton])")
    for job in jobs:
        _launch(job)


def _step(addresses: list[int], element_size: int) -> int:
    """The constant distance, in elements, between consecutive layers' addresses (``LayerMismatch`` if none)."""
    a0 = addresses[0]
    delta = addresses[1] - a0 if len(addresses) > 1 else 0
    if delta % element_size:
        raise LayerMismatch
    expected = [a0] * len(addresses) if delta == 0 else list(range(a0, a0 + delta * len(addresses), delta))
    if addresses != expected:  # one C-level comparison: this runs per call, for every argument
        raise LayerMismatch
    return delta // element_size


def _layer_step(arg, L: int, stacked_dim: int, ref: torch.Tensor) -> int:
    """Elements between consecutive layers' tensors of a per-layer argument laid out like ``ref``."""
    if isinstance(arg, torch.Tensor):
        return arg.stride(0) if arg.dim() == stacked_dim + 1 else 0  # stacked, or shared by every layer
    return _step(layer_addresses(arg, L, stacked_dim, ref), ref.element_size())


def run_all_layers(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v, L: int) -> bool:
    """Two launches (K, V) for all ``L`` layers of a chunk when they are laid out alike, each
    layer's tensors a constant distance apart (stacked tensors, per-layer views of them, or
    equally spaced allocations); layer 0 is checked in full, the others only for that.

    Returns ``False`` (nothing written) otherwise, for the per-layer path."""
    own = dests is None
    jobs0 = layer0_jobs(k, v, rope, cos, sin, kf, vf, dests, out_k, out_v)
    if not all(j.unit_channel_strides() for j in jobs0):  # no per-layer contiguous copies
        return False
    try:
        if own:
            o_k, o_v = out_k.stride(0), out_v.stride(0)
        else:
            addresses = dest_addresses(dests)
            if addresses is None:
                return False
            d_k, d_v = addresses
            o_k, o_v = _step(d_k, jobs0[0].buf.element_size()), _step(d_v, jobs0[1].buf.element_size())
        launches = []
        for job, content, f, o_step in ((jobs0[0], k, kf, o_k), (jobs0[1], v, vf, o_v)):
            u_step = w_step = cs_step = 0
            if job.u is not None and job.w is not None:
                if stacked_factors(f):
                    u_step, w_step = f[0].stride(0), f[1].stride(0)
                else:
                    u, w = factor_addresses(f, L, job)
                    u_step, w_step = _step(u, job.u.element_size()), _step(w, job.w.element_size())
            elif f is not None and not stacked_factors(f) and any(x is not None for x in f):
                raise LayerMismatch  # layer 0 unpatched: so must every layer be
            if job.half:
                cs_step = _layer_step(cos, L, 2, job.cos)  # type: ignore[arg-type]
                if _layer_step(sin, L, 2, job.sin) != cs_step:  # type: ignore[arg-type]
                    raise LayerMismatch
            steps = (_layer_step(content, L, 3, job.content), u_step, w_step, cs_step, o_step)
            launches.append((job, steps))
    except LayerMismatch:
        return False
    for job, steps in launches:
        _launch(job, L, steps)
    return True
