"""``contextdeque calibrate``: measure the replay cost model's constants on this machine's backend.

Prefill tokens/s by length (a chunk encode after the root, at several lengths) and the fixed part
of every forward (the intercept of those times, ``CostModel.forward_fixed_s``), decode tokens/s,
apply bandwidth (relocation + a rank-m patch into a page), the cost of forming a patch beyond its
conditioned forward (its factorization) split into a fixed part per patch and a per-token part
(``cost_model.fit_fixed_and_slope``), and host / disk tier bandwidth (a tensor copied between
buffers, a safetensors entry written and read back through the disk tier). Saved with the
model's fingerprint under ``<cache>/calibration/`` (atomic write); ``replay`` uses it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..core.kv import kv_nbytes
from ..window.config import DEFAULT_RANK
from ..scheduler.cost_model import CostModel, fit_fixed_and_slope, split_forward_fixed


def _timed(fn: Callable[[], Any], repeats: int, device: torch.device | None = None) -> float:
    """Median wall seconds of ``fn``; on a CUDA ``device`` the queued kernels are waited for before
    and after each call (a launch returns before its work is done)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


DEFAULT_FORM_LENGTHS = (128, 512)
"""The chunk lengths whose forming overhead :func:`calibrate` measures (two: a fixed and a per-token part)."""
FORM_CONTEXT = 256
"""Tokens of the antecedent every calibration patch is formed on."""


def calibrate(backend: Any, *, lengths: tuple[int, ...] = (64, 256, 1024), rank: int = DEFAULT_RANK, repeats: int = 2,
              disk_dir: str | None = None, form_lengths: tuple[int, ...] = DEFAULT_FORM_LENGTHS) -> CostModel:
    """Measure a :class:`CostModel` on ``backend`` (an ``HFBackend``, on the CPU or a CUDA device:
    the prefill, forming, apply and decode speeds are the device's, the host and disk bandwidths
    the host's). ``lengths``: the chunk lengths whose prefill speed is measured; a forward's fixed
    part (``forward_fixed_s``) is the intercept of their times (``cost_model.split_forward_fixed``:
    a launch and per-layer floor the rate would scale away; at least two lengths for it, else 0),
    and the table is saved as the rates of full prefills that, with it, price each measured
    prefill at its measured time.

    The forming overhead: at each of ``form_lengths`` (at least two) a ``T``-token chunk's patch on
    a :data:`FORM_CONTEXT`-token antecedent is formed (``form_patch``: its conditioned forward and
    its factorization), less that conditioned forward as the model prices it (``prefill_s`` of
    ``T`` tokens after the antecedent: the fixed part and the per-token part), each the median of
    ``repeats`` timed runs after a warm one (on CUDA synchronized before and after: :func:`_timed`);
    ``cost_model.fit_fixed_and_slope`` splits the
    differences into ``form_fixed_s`` (per patch: the factorization's F x F eigenproblems do not
    grow with T) and ``svd_s_per_token``. The measured points are kept in ``extra["form_overhead_s"]``."""
    from ..core.errors import ArgumentError
    from ..core.operator import relocate
    from ..patch import form_patch
    from ..stores import DiskTier, StoreEntry

    if len(set(form_lengths)) < 2 or min(form_lengths) < 1:
        raise ArgumentError(f"form_lengths: two or more distinct positive chunk lengths, got {tuple(form_lengths)}")

    lay = backend.layout
    dev = torch.device(getattr(backend, "device", "cpu"))

    def timed(fn: Callable[[], Any], repeats: int) -> float:
        return _timed(fn, repeats, dev)

    vocab = int(backend.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(4, max(5, vocab - 1), (n,), generator=g).tolist()

    prefill = []
    for n in lengths:
        x = ids(n)
        backend.encode(token_ids=x)  # warm
        s = timed(lambda: backend.encode(token_ids=x), repeats)
        prefill.append((int(backend.root_len + n), n / s))
    ctx_ids, q = ids(FORM_CONTEXT), ids(1)
    a = backend.encode(token_ids=ctx_ids)
    forward_fixed, table = split_forward_fixed(prefill, lengths)
    # the conditioned forward as the model prices it inside a Form (fixed part + tokens after the
    # antecedent): the overhead is what a Form costs beyond that price. A difference of two encodes
    # (antecedent + chunk, less the antecedent) cancels the fixed part, which form_patch's own
    # forward pays: on a launch-bound device it left the whole forward in the overhead (H200:
    # 72 ms "beyond its forward", of which ~30 ms was the forward) and the model charged it twice
    priced = CostModel(prefill=table, forward_fixed_s=forward_fixed)
    overhead = []
    for n in form_lengths:
        b = backend.encode(token_ids=ids(n))
        form_patch(backend, b, [a], rank=min(rank, b.n_tokens))  # (warm: a length's first solve)
        t_form = timed(lambda: form_patch(backend, b, [a], rank=min(rank, b.n_tokens)), repeats)
        t_forward = priced.prefill_s(int(n), int(backend.root_len) + FORM_CONTEXT)
        overhead.append((int(n), max(0.0, t_form - t_forward)))
    form_fixed, svd_per_token = fit_fixed_and_slope(overhead)
    b = backend.encode(token_ids=ids(256))  # the apply and decode probes: a 256-token page
    patch = form_patch(backend, b, [a], rank=min(rank, b.n_tokens))
    page = relocate(b, 1000, layout=lay, patch=[patch], beyond_trained=True)
    page_bytes = kv_nbytes(page)
    t_apply = timed(lambda: relocate(b, 1000, layout=lay, patch=[patch], beyond_trained=True), max(3, repeats))
    # decode: one token after a 256-token cache
    from ..core.compat import cache_from_layers

    def decode_step() -> None:
        cache = cache_from_layers([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in page])
        with torch.no_grad():
            backend.model(input_ids=torch.tensor([q], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1)

    t_dec = timed(decode_step, max(3, repeats))
    buf = torch.empty(32 << 20, dtype=torch.uint8)
    t_host = _timed(lambda: buf.clone(), 3)
    with tempfile.TemporaryDirectory(dir=disk_dir) as d:
        tier = DiskTier(Path(d), None, name="disk")
        entry = StoreEntry({"x": torch.zeros(8 << 20, dtype=torch.float32)}, {"kind": "calibration"})
        n_bytes = 8 << 20 << 2
        t0 = time.perf_counter()
        tier.put("calibration:disk", entry)
        tier.get("calibration:disk")
        t_disk = time.perf_counter() - t0
    return CostModel.geometry_of(
        backend,
        storage_bytes=b.keys.element_size(),
        prefill=table,
        decode_tokens_per_s=1.0 / t_dec,
        apply_bytes_per_s=page_bytes / t_apply,
        svd_s_per_token=svd_per_token,
        form_fixed_s=form_fixed,
        forward_fixed_s=forward_fixed,
        host_bytes_per_s=buf.numel() / t_host,
        disk_bytes_per_s=2 * n_bytes / t_disk,
        rank=rank,
        source="calibration",
        fingerprint=backend.fingerprint,
        model=str(getattr(backend, "name", "")),
        extra={"threads": torch.get_num_threads(), "torch": torch.__version__, "device": _device_name(dev),
               "lengths": list(lengths), "form_overhead_s": [list(p) for p in overhead],
               "prefill_measured": [list(p) for p in prefill]},
    )


def _device_name(device: torch.device) -> str:
    """``cpu`` or the CUDA device's name (e.g. ``NVIDIA H100 80GB HBM3``): a calibration says where
    its speeds were measured."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
