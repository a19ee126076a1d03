"""``contextdeque soak``: a long random run of window operations and its resident-memory curve.

The run the issue's reproducer describes, as long as asked: random operations (append of a
~``section_tokens``-token section of Python's documentation, slide, recall, reorder, evict) on a
window with ``budget_tokens`` and the *default* store (bounded memory spilling to disk), on the
default model, healed after every operation (an agent's idle time). Every ``sample_every`` operations it records the process's resident memory
(``/proc/self/status`` VmRSS), what the store keeps per tier, how many refs are evicted, the sizes
of the window's own bookkeeping (conditioning graph, stored-prefix hint, receipts) and, with
``count_tensors``, the bytes of every live tensor outside the model. The
store's disk tier goes to ``store_dir`` (a fresh temporary directory by default, removed at the
end) so a soak never fills the user's cache.

It reports, and asserts nothing: operations run, errors (by type), the memory curve, the
resident memory after warm-up and its growth after it, and the peak above the *baseline* (the
runtime with the model paged in and warmed by one forward of a full window, see
`warm_baseline`) against the configured memory budget: ``within_budget``.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..window.config import WindowConfig


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _sections(backend: Any, size: int) -> list[list[int]]:
    """Sections of Python's documentation, ~``size`` tokens each (ids folded into the vocabulary
    for a tokenizer-less model)."""
    from pydoc_data.topics import topics

    out: list[list[int]] = []
    for name in sorted(topics):
        text = topics[name]
        if backend.tokenizer is not None:
            ids = backend.tokenize(text[: 8 * size])
        else:
            vocab = int(backend.model.config.vocab_size)
            ids = [3 + b % (vocab - 3) for b in text.encode()[: 4 * size]]
        if len(ids) >= size // 2:
            out.append(ids[:size])
    return out


def live_tensor_bytes() -> int:
    """Bytes of the distinct tensor storages Python can reach, model parameters excluded (a walk
    over the garbage collector's objects: tens of milliseconds; deterministic, unlike RSS). Garbage
    is collected first: unreachable cycles still holding tensors are not live, and whether the
    collector had run yet depends on what ran before (the whole suite vs one test)."""
    import gc
    import warnings

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on a deprecated torch alias warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter):
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def warm_baseline(backend: Any, sections: list[list[int]], tokens: int) -> int:
    """Resident memory of the runtime with the model paged in and warmed by one forward of a full
    window (``tokens`` tokens, then freed): what the process needs before any window or store
    exists. The soak's memory is judged above this line: a model's weights load lazily (mmapped),
    so the start's RSS would count them as the store's."""
    from ..core.heap import release_freed_heap

    ids = [t for s in sections for t in s][:tokens]
    with torch.no_grad():
        backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids)), logits="last")
    release_freed_heap(force=True)
    return rss_bytes()


def model_bytes(backend: Any) -> int:
    return sum(p.numel() * p.element_size() for p in backend.model.parameters())


def run_soak(
    backend: Any,
    *,
    ops: int = 10_000,
    config: WindowConfig | None = None,
    section_tokens: int = 100,
    memory_budget: int | str | None = None,
    disk_budget: int | str | None = None,
    store_dir: str | None = None,
    seed: int = 0,
    sample_every: int = 100,
    max_seconds: float | None = None,
    warmup_ops: int | None = None,
    progress: Callable[[dict], None] | None = None,
    count_tensors: bool = False,
) -> dict[str, Any]:
    """Run the soak (see the module docstring) on a window of ``config`` (default: a budget of 1024
    tokens); returns the record."""
    from ..window import ContextWindow

    config = WindowConfig(budget_tokens=1024) if config is None else config
    budget_tokens = config.budget_tokens
    from ..window.store import default_store, parse_bytes, machine_memory, default_memory_budget

    tmp = None
    if store_dir is None:
        tmp = tempfile.mkdtemp(prefix="cdq-soak-store-")
        store_dir = tmp
    try:
        store = default_store(backend.device, memory_budget=memory_budget, disk_budget=disk_budget, disk_dir=store_dir)
        budget = default_memory_budget() if memory_budget is None else parse_bytes(memory_budget, machine_memory())
        win = ContextWindow.from_config(backend, config, store=store)
        sections = _sections(backend, section_tokens)
        rng = random.Random(seed)
        errors: dict[str, int] = {}
        op_counts: dict[str, int] = {}
        curve: list[dict[str, Any]] = []
        warm = warmup_ops if warmup_ops is not None else max(sample_every, ops // 10)
        rss0 = rss_bytes()
        baseline = warm_baseline(backend, sections, budget_tokens or 1024)
        t0 = time.perf_counter()
        forwards0 = backend.forwards_run
        done = 0

        def sample() -> None:
            tiers = store.nbytes()
            row = {
                "op": done, "s": round(time.perf_counter() - t0, 1), "rss": rss_bytes(),
                "store": tiers, "evicted_refs": len(win.evicted_refs), "in_window": len(win),
                "tokens": win.tokens_used, "forwards": backend.forwards_run - forwards0,
                "graph_nodes": len(win.graph), "patch_index": win.context.patch_index.contents(), "receipts": len(win.receipts),
                # anticipation's prepared re-forwards (bounded by their own caps, window/prepared.py)
                "prepared": len(win.context.prepared), "prepared_bytes": win.context.prepared.nbytes,
            }
            if count_tensors:
                row["tensor_bytes"] = live_tensor_bytes()
            curve.append(row)
            if progress is not None:
                progress(row)

        sample()
        while done < ops:
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
            choice = rng.choices(["append", "slide", "recall", "reorder", "evict"], weights=[5, 1, 2, 1, 1])[0]
            try:
                if choice == "append" or not len(win):
                    choice = "append"
                    win.append(token_ids=rng.choice(sections))
                elif choice == "slide":
                    win.slide(1)
                elif choice == "recall" and win.evicted_refs:
                    refs = win.evicted_refs
                    win.recall(refs[rng.randrange(len(refs))], at=rng.randint(0, len(win)))
                elif choice == "reorder" and len(win) > 1:
                    order = list(win.refs)
                    rng.shuffle(order)
                    win.reorder(order)
                elif choice == "evict":
                    win.evict(win.refs[rng.randrange(len(win))])
                else:
                    choice = "append"
                    win.append(token_ids=rng.choice(sections))
                # an agent's idle time between operations: what the latency-first default
                # deferred is formed (the eager policy's window; under "eager" a no-op)
                win.heal()
            except Exception as e:  # counted and reported: the soak's point is 0 of these
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            op_counts[choice] = op_counts.get(choice, 0) + 1
            done += 1
            if done % sample_every == 0:
                sample()
        if not curve or curve[-1]["op"] != done:
            sample()
        after = [r["rss"] for r in curve if r["op"] >= warm] or [curve[-1]["rss"]]
        at_warm = after[0]
        return {
            "model": getattr(backend, "name", "?"), "device": str(backend.device), "threads": torch.get_num_threads(),
            "ops": done, "ops_asked": ops, "op_counts": op_counts, "errors": errors, "seconds": round(time.perf_counter() - t0, 1),
            "budget_tokens": budget_tokens, "section_tokens": section_tokens, "memory_budget": budget,
            "max_evicted": config.max_evicted, "patch_policy": config.patch_policy,
            "store_budgets": store.budget_bytes(), "model_bytes": model_bytes(backend),
            "rss_start": rss0, "rss_baseline": baseline, "rss_at_warmup": at_warm, "rss_max_after_warmup": max(after),
            "rss_end": curve[-1]["rss"], "rss_max": max(r["rss"] for r in curve),
            "over_baseline_max": max(r["rss"] for r in curve) - baseline,
            "within_budget": max(r["rss"] for r in curve) - baseline <= budget,
            "growth_after_warmup": max(after) - at_warm, "warmup_ops": warm,
            "forwards": backend.forwards_run - forwards0, "evicted_refs": len(win.evicted_refs), "curve": curve,
        }
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
