"""``replay --fidelity N``: drive a real ``ContextWindow`` through a trace and measure, at N sampled
queries per policy, next-token KL and η against a full re-prefill of the same window contents and
the time-to-first-token of the window step against that re-prefill.

Traces carry sizes and content hashes, not content: every chunk becomes real English (a seeded
slice of CPython's reference manual, ``pydoc_data.topics``, chosen by its content hash, so equal
hashes give equal text), ``scale`` times its token count (default 1/16, at least 8 tokens) so a
trace runs in minutes on a CPU. Image and frame chunks become text of their (scaled) size too: the
window path is the same, the vision tower is not exercised here.

Per (trace, placement, arm): the window runs the trace with ``placement=`` (the scheduler or
arrival order); its patch policy is ``patch_policy`` (``eager`` unless told, e.g. ``latency``, as the
``patch-latency`` arm does) for the ``patch`` arm and ``none`` for the others.
At a sampled query the reference is a re-prefill of root + the window's chunks in window order; the
``patch`` / ``blind`` arms are the window's own materialized KV; the other arms
(``contextdeque.eval.arms``: prefix cache, CacheBlend, EPIC, VLCache) are run on the same chunks in the
same order. η = (KL_blind − KL_arm) / KL_blind at that query (None without a measurable gap).
Every figure is also reported per step type — the last window operation before the query
(append, slide, evict, recall, look-back = a recall placed inside the window, reorder, fork,
commit, discard) — and, for a latency-first window with queued work, once more after ``heal()``.
A latency-first window heals at every step boundary (the agent's tool time), as the cost model
assumes.
Idle gaps (``idle_rate``, trace tokens the model prefills per idle second): each ``step``'s idle
time (``traces.idle_gaps``) becomes a deterministic heal budget of ``idle_ms / 1000 x idle_rate x
scale`` prefilled tokens (the trace's idle time, in the scaled trace's tokens), spent by ``heal``
and, with ``anticipate=True``, by anticipation, instead of healing to completion at every step.
A forming costs that budget its forward and its factorization: every forward its tokens plus
:func:`forward_fixed` (its fixed part), per factorized token :func:`factorization_cost` and per
patch :func:`factorization_fixed` (from the cost model, :func:`idle_charges`, passed as the
window's ``forward_fixed`` / ``factorization_cost`` / ``factorization_fixed``; the per-forward and
per-patch charges scaled like the chunks and the budget, a per-token one needs no scaling).
The patch arm then reports the anticipation hit rate per step type (``replay.hits``: re-read
steps answered fresh with 0 forwards, from the receipts).
TTFT: wall time of (assembling the arm's KV + prefilling the query) over (re-prefilling the
window + the query), measured side by side. The eviction policy does not change what the model
sees, so its results are shared by every eviction combo.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from ..core.errors import PolicyError, TraceError
from ..traces.io import Trace, read_trace
from .hits import HitRate
from .live import drive_window, idle_budget
from .reuse import make_reuse

DEFAULT_SCALE = 1 / 16
IDLE_CONTEXT = 2048
"""The context length whose calibrated prefill rate ``--idle-rate calibrated`` takes."""
NO_FIDELITY = frozenset({"kvcapsule-linear"})  # cost rules whose arm fidelity mode does not drive
MIN_TOKENS = 8


@lru_cache(maxsize=1)
def _corpus_ids(backend_name: str, tokenizer: Any) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None else []


def chunk_ids(backend: Any, content_hash: str, n: int) -> list[int]:
    """``n`` token ids of real text for a content hash (deterministic)."""
    corpus = _corpus_ids(getattr(backend, "name", ""), backend.tokenizer)
    h = int(hashlib.sha256(content_hash.encode()).hexdigest()[:12], 16)
    if not corpus:
        vocab = int(backend.model.get_input_embeddings().weight.shape[0])
        g = torch.Generator().manual_seed(h % (2**31))
        return torch.randint(4, vocab, (n,), generator=g).tolist()
    start = h % max(1, len(corpus) - n)
    return list(corpus[start : start + n])


def scaled_chunk_ids(backend: Any, scale: float) -> Callable[[Any], list[int]]:
    """The token ids the driven window gives an ``arrive`` event's chunk (``drive_window``'s
    ``token_ids``): :func:`chunk_ids` of its content hash, ``scale`` x its trace tokens (at least
    :data:`MIN_TOKENS`)."""
    return lambda ev: chunk_ids(backend, ev.hash, max(MIN_TOKENS, int(round(ev.tokens * scale))))


_DISTINCT_TRIES = 1000


def trace_chunk_ids(backend: Any, trace: Trace) -> dict[str, list[int]]:
    """Token ids for every chunk of ``trace`` (:func:`chunk_ids` of its content hash), distinct for
    distinct contents: the window names a chunk by its tokens, so two contents whose ids happened
    to be equal (short chunks cut from real text repeat) would be one chunk to it, one canonical
    stored, where the trace and its replay hold two. Such a collision takes the next derived hash."""
    out: dict[str, list[int]] = {}
    owner: dict[tuple[int, ...], str] = {}  # token ids -> the content hash they stand for
    for cid, chunk in trace.chunks.items():
        for attempt in range(_DISTINCT_TRIES):
            ids = chunk_ids(backend, chunk.hash if not attempt else f"{chunk.hash}:{attempt}", chunk.tokens)
            if owner.setdefault(tuple(ids), chunk.hash) == chunk.hash:
                break
        else:
            raise TraceError(f"chunk {cid!r}: no {chunk.tokens} token ids found that no other content of the trace "
                             f"has after {_DISTINCT_TRIES} tries (the corpus repeats too much for chunks this short)")
        out[cid] = ids
    return out


def factorization_cost(cost: Any) -> float:
    """What one token a patch factorizes costs an idle budget counted in prefill tokens (the
    window's ``factorization_cost``): the cost model's ``svd_s_per_token`` over the seconds one
    budget token stands for (:func:`idle_token_s`), i.e. the calibrated machine's ratio of SVD time
    to prefill time, taken to hold at any ``--idle-rate`` (both run on the same device)."""
    return float(cost.svd_s_per_token) / idle_token_s(cost)


def factorization_fixed(cost: Any, scale: float = DEFAULT_SCALE) -> float:
    """What factorizing one patch costs an idle budget beyond its per-token part (the window's
    ``factorization_fixed``), in the scaled trace's prefill tokens: the cost model's
    ``form_fixed_s`` in budget tokens (as :func:`factorization_cost`) x ``scale``. The replay
    scales chunks and idle budgets by ``scale`` while a patch stays one patch, so a per-patch
    charge in real prefill tokens is scaled the same way (the per-token charge is a ratio of
    tokens to tokens and needs no scaling): a patch then takes the same share of an idle gap as
    at full scale."""
    return float(cost.form_fixed_s) / idle_token_s(cost) * float(scale)


def forward_fixed(cost: Any, scale: float = DEFAULT_SCALE) -> float:
    """What every forward costs an idle budget beside its tokens (the window's ``forward_fixed``),
    in the scaled trace's prefill tokens: the cost model's ``forward_fixed_s`` in budget tokens x
    ``scale`` (a forward stays one forward at any scale, as a patch does:
    :func:`factorization_fixed`)."""
    return float(cost.forward_fixed_s) / idle_token_s(cost) * float(scale)


def idle_token_s(cost: Any) -> float:
    """Seconds one token of an idle budget stands for: what one more token adds to a forward at
    :data:`IDLE_CONTEXT` (``CostModel.per_token_s``; the table's ``1 / tokens_per_s`` when forwards
    have no fixed part), so that with :func:`forward_fixed` per forward a forward there is priced
    at its modelled seconds. ``--idle-rate calibrated`` is its inverse."""
    return 1.0 / float(cost.marginal_tokens_per_s(IDLE_CONTEXT))


def idle_charges(cost: Any, scale: float = DEFAULT_SCALE) -> dict[str, float]:
    """The window options that price idle work by ``cost`` at ``scale`` (``WindowConfig``'s
    ``factorization_cost``, ``factorization_fixed``, ``forward_fixed``; the replay's cost-model side
    takes them at scale 1)."""
    return {"factorization_cost": factorization_cost(cost), "factorization_fixed": factorization_fixed(cost, scale),
            "forward_fixed": forward_fixed(cost, scale)}


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from ..core.compat import cache_layer, cache_num_layers

    return [tuple(t[0] for t in cache_layer(cache, i)) for i in range(cache_num_layers(cache))]  # type: ignore[misc]


def _by_step(samples: dict[str, list[float]]) -> dict[str, float]:
    return {step: statistics.median(v) for step, v in sorted(samples.items()) if v}


@torch.no_grad()
def fidelity_run(backend: Any, trace: Trace, placement: str, arm: str, n: int, *, seed: int = 0,
                 scale: float = DEFAULT_SCALE, patch_policy: str = "eager",
                 window_options: dict[str, Any] | None = None, idle_rate: float | None = None,
                 hints: bool = True) -> dict[str, Any]:
    """Drive one window through ``trace``; measure at ``n`` sampled queries. Returns medians, overall
    and per step type (``kl_by_step`` ...; ``kl_healed_by_step`` where a latency-first window had
    work queued at the query). ``window_options``: more ``ContextWindow`` settings of the patch
    arm's window (e.g. ``fidelity_target=``); the patches its byte cap could not fit the target
    into are listed (``fidelity_miss_list``: ref, estimated η, action; the root window's
    receipts, the last 1000). ``idle_rate``: honour the trace's idle gaps (see the module doc);
    the patch arm then reports ``anticipation`` (``HitRate.as_dict``) and ``hit_rate``. ``hints``:
    pass the trace's ``expect`` events on to the window."""
    from ..eval.arms import BlindArm, ReprefillArm, ReuseRequest, make_arm
    from ..eval.fidelity.harness import score_query
    from ..core.metrics import kl_divergence
    from ..eval.fidelity.metrics import DEFAULT_MIN_GAP, eta
    from ..window import ContextWindow

    rule = make_reuse(arm)
    if rule.defers:  # patch-latency(-shared): the patch arm on a latency-first window
        patch_policy = rule.window_policy
    arm = rule.arm or rule.name
    queries = [i for i, e in enumerate(trace.events) if e.op == "query"]
    rng = random.Random(f"{seed}:{trace.name}")
    sampled = set(rng.sample(queries, min(n, len(queries))))
    win = ContextWindow(backend, placement=placement, patch_policy=patch_policy if arm == "patch" else "none",
                        **(dict(window_options or {}) if arm == "patch" else {}))
    served = make_arm(arm) if arm not in ("patch", "blind", "reprefill") else None  # one instance: a prefix cache keeps what it saw
    kls, etas, ttfts = [], [], []
    step_kl: dict[str, list[float]] = {}
    step_ttft: dict[str, list[float]] = {}
    step_healed: dict[str, list[float]] = {}

    def on_query(i: int, ev: Any, win: Any, step: str) -> None:
        if i not in sampled or not win.refs:
            return
        q = chunk_ids(backend, f"query:{i}", max(4, min(32, ev.tokens)))
        chunks = [win.chunk(r) for r in win.refs]
        req = ReuseRequest(backend, chunks)
        start = req.next_position
        t0 = time.perf_counter()
        ref_logits, _ = score_query(backend, ReprefillArm().run(req).kv, start, q, 0)
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        if arm in ("patch", "blind"):
            kv = _layers(win.materialize())
        elif arm == "reprefill":
            kv = ReprefillArm().run(req).kv
        else:
            kv = served.run(req).kv
        logits, _ = score_query(backend, kv, start, q, 0)
        t_arm = time.perf_counter() - t0
        blind_logits, _ = score_query(backend, BlindArm().run(req).kv, start, q, 0)
        kl_blind = kl_divergence(ref_logits, blind_logits)
        kl = kl_divergence(ref_logits, logits)
        kls.append(kl)
        etas.append(eta(kl_blind, kl, DEFAULT_MIN_GAP))
        ttfts.append(t_arm / t_ref)
        step_kl.setdefault(step, []).append(kl)
        step_ttft.setdefault(step, []).append(t_arm / t_ref)
        if arm == "patch" and win.pending_refs and idle_rate is None:  # latency-first: the answer once healed
            win.heal()
            healed, _ = score_query(backend, _layers(win.materialize()), start, q, 0)
            step_healed.setdefault(step, []).append(kl_divergence(ref_logits, healed))

    hits = HitRate() if arm == "patch" else None
    idle_tokens = None if idle_rate is None else idle_budget(idle_rate, scale)
    drive_window(win, trace, scaled_chunk_ids(backend, scale),
                 on_query=on_query, heal_at_end=False, on_step=None if hits is None else hits.add, idle_tokens=idle_tokens,
                 hints=hints)
    # the patches the byte cap could not fit the target into, from the window's receipts
    misses = [{**m.as_dict(), "chunk": m.ref.label or m.ref.key} for rec in win.receipts for m in rec.fidelity_misses]
    defined = [e for e in etas if e is not None]
    return {
        "kl": statistics.median(kls) if kls else None,
        "eta": statistics.median(defined) if defined else None,
        "ttft_ratio": statistics.median(ttfts) if ttfts else None,
        "fidelity_queries": len(kls),
        "kl_by_step": _by_step(step_kl),
        "ttft_ratio_by_step": _by_step(step_ttft),
        "kl_healed_by_step": _by_step(step_healed),
        "fidelity_misses": sum(1 for m in misses if m["action"] == "reported"),
        "fidelity_over_cap": sum(1 for m in misses if m["action"] != "reported"),
        "fidelity_miss_list": misses,
        "anticipation": None if hits is None else hits.as_dict(),
        "hit_rate": None if hits is None else hits.rate(),
    }


def run_fidelity_mode(traces: Sequence[str], combos: Sequence[tuple[str, str, str]], n: int, *, seed: int = 0,
                      scale: float = DEFAULT_SCALE, backend: Any = None, console: Any = None,
                      patch_policy: str = "eager", window_options: dict[str, Any] | None = None,
                      idle_rate: float | None = None, hints: bool = True) -> dict[tuple, dict[str, Any]]:
    """Fidelity figures keyed by ``(trace, placement, eviction, arm)`` for every combo."""
    for _, _, arm in combos:  # refused before any model work
        rule = make_reuse(arm)
        if rule.budgeted or rule.name in NO_FIDELITY:
            raise PolicyError(f"--fidelity does not drive reuse arm {arm!r} (selection and compressed-at-rest arms are "
                              f"priced in cost-model mode only; their fidelity is `contextdeque fidelity`'s)")
    if backend is None:
        from ..model import load_model

        backend = load_model()
    out: dict[tuple, dict[str, Any]] = {}
    for path in traces:
        t = read_trace(path)
        done: dict[tuple[str, str], dict[str, Any]] = {}
        for placement, eviction, arm in combos:
            key = (placement, arm)
            if key not in done:
                if console is not None:
                    console.print(f"[dim]fidelity: {t.name} {placement}/{arm}[/dim]")
                done[key] = fidelity_run(backend, t, placement, arm, n, seed=seed, scale=scale,
                                         patch_policy=patch_policy, window_options=window_options, idle_rate=idle_rate,
                                         hints=hints)
            out[(t.name, placement, eviction, arm)] = done[key]
    return out
