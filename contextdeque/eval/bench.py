"""``contextdeque bench``: what serving a reused chunk costs, measured side by side in one run.

On the default model (or ``--model``), for chunks of 256/512/1024/2048 tokens of real text:

- **apply vs re-prefill**: the fused relocate + rank-32 patch of every layer into a destination
  cache, against re-prefilling the same chunk after the root (one forward) — "times faster";
- **apply vs its roofline floor**: the floor is the larger of (a) a plain memory copy of the
  bytes the apply reads, onto as many bytes, and (b) the same rank-m factor products alone
  (``addmm`` into the destination) — "times the floor" (see ``contextdeque.kernels.bench_util``);
- **relocation (rank 0) vs the memory copy**;
- on CUDA, also **vs the true floor**: bytes moved over the device's measured copy bandwidth, or
  FLOPs over a large GEMM's measured rate (``bench_util.measure_ceilings``), and the **time to
  first token of a window step** (slide + recall + the question's forward) against re-prefilling
  the same window (``step_bench.window_step_ttft``; the paper reports 29x at 2,048 tokens);
- **break-even reuses**: the one forming forward (+ SVD) divided by what each reuse saves;
- **forming a patch, split**: per chunk size, the conditioned forward and the top-m factorization
  of every layer's K and V Δ (``contextdeque.patch.topm``) by the route in use (``auto``), by
  each of the Gram's eigen-solvers on Δ's device (``subspace``, ``eigh``) and against the float64
  SVD it replaces, on the same real Δ; on CUDA also ``eigh`` on the host (``eig_device="cpu"``,
  the batch spread over the host's threads);
- **patch bytes / page bytes** at ranks 16, 32, 64.

It prints measured ratios; nothing here is a pass/fail threshold.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..model.text import text_ids
from ..patch.rank import DEFAULT_RANK

DEFAULT_TOKENS = (256, 512, 1024, 2048)


def _best_of(fn, repeats: int, device: "torch.device | str" = "cpu") -> float:
    from .step_bench import sync

    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def forming_split(backend: Any, chunk: Any, antecedent: Any, rank: int, device: "torch.device | str",
                  repeats: int = 2) -> dict[str, float]:
    """One patch of ``chunk`` on ``antecedent``: ``form_patch_s`` (the whole call, the route in
    use), ``forward_s`` (its conditioned forward) and, on that forward's real Δ (every layer, K
    and V), ``factorize_s`` per route (``auto``: the route in use; ``subspace`` / ``eigh``: the
    Gram route with that eigen-solver on Δ's device; ``svd``: the float64 SVD; on CUDA also
    ``eigh_host``: ``eigh`` on the host's threads) and ``svd_vs_auto`` (how many times faster the
    route in use is than the SVD). Seconds, best of ``repeats``."""
    from ..patch import form_patch
    from ..patch.base import PATCH_KINDS, FormContext
    from ..patch.topm import truncated_svd

    ctx = FormContext(backend, chunk, [(antecedent, [])], {})
    exact = PATCH_KINDS["exact"]()
    forward_s = _best_of(lambda: exact.target(ctx), 1, device)
    dk, dv = exact.target(ctx)
    m = min(rank, *dk.shape[1:])
    routes: dict[str, dict[str, Any]] = {"auto": {}, "subspace": {"eig": "subspace"}, "eigh": {"eig": "eigh"},
                                         "svd": {"method": "svd"}}
    if torch.device(device).type == "cuda":
        routes["eigh_host"] = {"eig": "eigh", "eig_device": "cpu"}
    factorize_s = {}
    for name, kw in routes.items():
        run = lambda: (truncated_svd(dk, m, **kw), truncated_svd(dv, m, **kw))  # noqa: E731
        run()  # warm (CUDA: the solver's handles and workspaces)
        factorize_s[name] = _best_of(run, repeats, device)
    form_s = _best_of(lambda: form_patch(backend, chunk, [antecedent], rank=m), 1, device)
    return {"form_patch_s": form_s, "forward_s": forward_s, "factorize_s": factorize_s,
            "svd_vs_auto": factorize_s["svd"] / factorize_s["auto"]}


def run_bench(
    backend: Any,
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    rank: int = DEFAULT_RANK,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    rounds: int = 20,
    progress: bool = True,
    window_step_tokens: int = 0,
    page_tokens: int = 256,
) -> dict:
    """Measure everything the module docstring lists on the backend's device (with
    ``window_step_tokens`` > 0 also the window step's TTFT on a window of that many tokens).
    Returns one JSON-able dict."""
    from rich.progress import Progress

    from ..kernels.bench_util import bench_apply, measure_ceilings
    from ..kernels.dispatch import select_backend
    from ..core.operator import relocate
    from ..patch import form_patch
    from .step_bench import sync

    lay = backend.layout
    device = backend.device
    shape = dict(layers=lay.num_layers, heads=lay.k_heads, head_dim=lay.k_dim)
    ceilings = measure_ceilings(device, tuple(getattr(torch, d) for d in dtypes)) if device.type == "cuda" else None
    out: dict[str, Any] = {
        "model": backend.name,
        "device": ceilings.device if ceilings else "cpu",
        "model_dtype": str(backend.dtype).replace("torch.", ""),
        "ceilings": None if ceilings is None else {
            "copy_bytes_per_s": ceilings.copy_bytes_per_s, "gemm_flops_per_s": ceilings.gemm_flops_per_s,
        },
        "threads": torch.get_num_threads(),
        "kernel_backend": select_backend(device),
        "rank": rank,
        "apply_vs_reprefill": {},
        "apply_vs_floor": {},
        "relocate_vs_memcpy": {},
        "reprefill_s": {},
        "apply_s": {},
        "operator_apply_s": {},
        "floor": {},
        "by_dtype": {},
    }
    steps = len(tokens) * (3 + 2 * len(dtypes)) + 2
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("bench", total=steps)
        ids_all = text_ids(backend, max(tokens) + 256)
        root = backend.root_kv()
        chunks = {}
        for T in tokens:
            ids = ids_all[:T]
            pos = backend.text_positions(backend.root_len, T)
            bar.update(task, description=f"re-prefill {T} tokens")
            reps = 2 if T <= 512 else 1
            if device.type == "cuda":
                reps = 5
                backend.forward(input_ids=ids, positions=pos, past=root, logits="last")  # warm-up
            out["reprefill_s"][str(T)] = _best_of(
                lambda: backend.forward(input_ids=ids, positions=pos, past=root, logits="last"), reps, device
            )
            chunks[T] = backend.encode(token_ids=ids)
            bar.advance(task)
            for dt_name in dtypes:
                dt = getattr(torch, dt_name)
                bar.update(task, description=f"apply r{rank} vs floor, {T} tokens, {dt_name}")
                r = bench_apply(T, rank=rank, dtype=dt, rounds=rounds, device=device, ceilings=ceilings, **shape)
                bar.advance(task)
                bar.update(task, description=f"relocate vs memcpy, {T} tokens, {dt_name}")
                r0 = bench_apply(T, rank=0, dtype=dt, rounds=rounds, device=device, ceilings=ceilings, **shape)
                bar.advance(task)
                out["by_dtype"].setdefault(dt_name, {})[str(T)] = {
                    "apply_s": r.apply_s,
                    "memcpy_s": r.memcpy_s,
                    "gemm_s": r.gemm_s,
                    "floor_s": r.floor_s,
                    "apply_vs_floor": r.ratio,
                    "relocate_s": r0.apply_s,
                    "relocate_memcpy_s": r0.memcpy_s,
                    "relocate_vs_memcpy": r0.ratio,
                    "apply_vs_reprefill": out["reprefill_s"][str(T)] / r.apply_s,
                    "bytes_moved": r.bytes_moved,
                    "flops": r.flops,
                    "true_floor_s": r.true_floor_s,
                    "apply_vs_true_floor": r.true_ratio,
                    "relocate_true_floor_s": r0.true_floor_s,
                    "relocate_vs_true_floor": r0.true_ratio,
                    # the kernels alone (CUDA-graph replay: no argument checks, no launch costs)
                    "apply_device_s": r.apply_device_s,
                    "apply_device_vs_true_floor": r.device_ratio,
                    "relocate_device_s": r0.apply_device_s,
                    "relocate_device_vs_true_floor": r0.device_ratio,
                }
            fp = out["by_dtype"][dtypes[0]][str(T)]
            out["apply_s"][str(T)] = fp["apply_s"]
            out["floor"][str(T)] = {"memcpy_s": fp["memcpy_s"], "gemm_s": fp["gemm_s"], "binding": "gemm" if (fp["gemm_s"] or 0) > fp["memcpy_s"] else "memory"}
            out["apply_vs_floor"][str(T)] = fp["apply_vs_floor"]
            out["relocate_vs_memcpy"][str(T)] = fp["relocate_vs_memcpy"]
            out["apply_vs_reprefill"][str(T)] = fp["apply_vs_reprefill"]

        # the operator end to end on a real chunk and patch (tables, allocation, dispatch included)
        T_mid = 1024 if 1024 in chunks else tokens[len(tokens) // 2]
        bar.update(task, description=f"form a rank-{rank} patch on {T_mid} tokens")
        antecedent = backend.encode(token_ids=ids_all[-256:])
        t0 = time.perf_counter()
        patch = form_patch(backend, chunks[T_mid], [antecedent], rank=rank)
        sync(device)
        form_s = time.perf_counter() - t0
        bar.advance(task)
        start = backend.root_len + antecedent.span
        for T, chunk in chunks.items():
            p = patch if T == T_mid else None
            if p is None:
                continue
            out["operator_apply_s"][str(T)] = _best_of(
                lambda: relocate(chunk, start, patch=p, beyond_trained=True), 5, device
            )
        saved = out["reprefill_s"][str(T_mid)] - out["apply_s"][str(T_mid)]
        out["form_patch_s"] = form_s
        out["breakeven_reuses"] = form_s / saved if saved > 0 else float("inf")
        out["breakeven_tokens"] = T_mid
        # bytes: patch / page at several ranks, on the real chunk
        bar.update(task, description="patch bytes at ranks 16/32/64")
        fractions = {}
        for m in (16, 32, 64):
            pm = form_patch(backend, chunks[T_mid], [antecedent], rank=m) if m != rank else patch
            fractions[str(m)] = pm.bytes_fraction(chunks[T_mid])
        out["patch_bytes_fraction"] = fractions
        bar.advance(task)
        out["forming"] = {}
        for T, chunk in chunks.items():
            bar.update(task, description=f"form a rank-{rank} patch on {T} tokens: forward vs factorization")
            out["forming"][str(T)] = forming_split(backend, chunk, antecedent, rank, device)
            bar.advance(task)
        if window_step_tokens:
            from .step_bench import window_step_ttft
            from .window_bench import _chunks, _question

            bar.update(task, description=f"window step TTFT at {window_step_tokens} tokens")
            page = min(page_tokens, window_step_tokens)
            n = max(1, window_step_tokens // page)
            out["window_step"] = window_step_ttft(backend, _chunks(backend, n + 1, page), _question(backend), rank=rank)
    return out
