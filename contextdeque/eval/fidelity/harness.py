"""The fidelity harness: every reuse arm against a full re-prefill over the probe set.

Per item (all arms get the same request, hence the same exact blind relocation):

- ``main`` group, the item's chunks in order: ``reprefill`` (the reference), ``blind``,
  ``prefix_cache`` (seeded with each chunk's own encode request), ``patch-r{m}`` for every rank and
  ``patch-full`` (exact patches formed by :func:`form_patch`, chained as a window holds them, then
  truncated), ``cacheblend-15``, ``epic-32``, ``vlcache-15``, and the matched-budget token arms
  ``cacheblend-matched`` / ``epic-matched`` (as many tokens per chunk as the rank-32 patch's bytes
  hold as KV rows — the paper's Table 6 rule).
- ``orbit`` group (items with >= 4 chunks): the last chunk B after the 3 before it, in every one of
  the 3! orderings. Antecedents hold their exact (re-prefill) KV; only B varies: blind, its own
  ordering's rank-32 patch (``orbit-exact-r32``), the rank-32 orbit patch averaged over the other
  five orderings (``orbit-r32``, the test ordering held out as in the paper) and over all six
  (``orbit-all-r32``).
- ``recall`` group (items long enough for a window of 2 to turn over): chunk 1 enters after chunk
  0, slides out, the window fully turns over, then chunk 1 is recalled behind the current window.
  ``recall-fresh-r32``: a recall patch formed on the window that now precedes it;
  ``recall-stale-r32``: the patch frozen at eviction (formed on chunk 0) replayed.

Each arm's KV gets the item's query prefilled on top: next-token KL(re-prefill ‖ arm) on its
logits, and a short greedy answer for flip checks.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ...core import compat
from ..arms import (
    BlindArm,
    CacheBlendArm,
    EpicArm,
    KVCapsuleArm,
    PatchArm,
    PrefixCacheArm,
    ReprefillArm,
    ReuseRequest,
    VLCacheArm,
    matched_token_budget,
)
from ...core.kv import concat_kv
from ...core.kv import LayerKV
from ...core.operator import relocate
from ...patch import FidelityRule, Patch, form_patch
from ...patch.ops import combine_patches, patch_from_conditioned, truncate_patch
from ...window.decode import greedy_steps
from .metrics import DEFAULT_MIN_GAP, BytesReport, eta, flip_recover, n_flips, percentile, pooled_eta
from ...core.metrics import kl_divergence, ulp_error, ulp_error_at_scale
from .probes import MaterializedItem, ProbeItem, materialize
from ...patch.rank import DEFAULT_RANK

FAMILIES = ("prefix_cache", "patch", "cacheblend", "epic", "vlcache", "orbit", "recall", "kvcapsule", "select")


@dataclass
class HarnessConfig:
    """What to run. ``arms``: families from :data:`FAMILIES` (blind and re-prefill always run)."""

    ranks: tuple[int, ...] = (8, 16, 32, 64)
    arms: tuple[str, ...] = FAMILIES
    storage: torch.dtype = torch.float32
    min_gap: float = DEFAULT_MIN_GAP
    matched_rank: int = DEFAULT_RANK
    cacheblend_ratio: float = 0.15
    check_layer: int = 1
    epic_k: int = 32
    vlcache_ratio: float = 0.15
    vlcache_schedule: Sequence[float] | None = None
    orbit_antecedents: int = 3
    orbit_rank: int = DEFAULT_RANK
    recall_window: int = 2
    recall_rank: int = DEFAULT_RANK
    max_decode: int = 6
    max_chunk_tokens: int = 512
    select_budgets: tuple[int, ...] = (64, 128, 256, 512)
    select_methods: tuple[str, ...] = ("mm-shiftkv", "snapkv", "streamingllm")
    select_on_patch: bool = True
    capsule_retention: float = 0.4
    image_grid: tuple[int, int] | None = None
    # ``target-{t}`` arms (with the patch family): a window's fidelity rule per η target, through
    # ``envelope`` (the model's, or None: the target read as an energy), under the byte cap
    fidelity_targets: tuple[float, ...] = ()
    envelope: Any = None
    max_patch_fraction: float | None = 0.25
    on_miss: str = "report"
    patch_precisions: tuple[str, ...] = ("hi",)  # the targets' storage precisions (contextdeque.patch.factors)


@dataclass
class ArmScore:
    """One arm on one sample: next-token ``kl`` vs re-prefill, greedy ``decision`` tokens, cost."""

    kl: float
    decision: tuple[int, ...]
    report: dict[str, Any] = field(default_factory=dict)
    reused_page_bytes: int = 0  # page bytes of the chunks this arm corrects (non-leading ones)


@dataclass
class Sample:
    """One measured placement: ``group`` (main/orbit/recall), the reference decision, the blind KL
    and decision of that same placement, and every arm's score."""

    item: str
    group: str
    ref_decision: tuple[int, ...]
    blind_kl: float
    blind_decision: tuple[int, ...]
    arms: dict[str, ArmScore]
    answer_ids: tuple[int, ...] = ()
    family: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # arm -> "ErrorType: message" (it has no score)


def failure_text(exc: BaseException) -> str:
    """One line naming an arm's failure (its type and message)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


# ---------------------------------------------------------------------------- scoring


@torch.no_grad()
def score_query(
    backend: Any, kv: Sequence[LayerKV], start: int, query_ids: Sequence[int], n_decode: int
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Prefill ``query_ids`` after ``kv`` (per layer ``[H, S, d]``) at positions ``start..``, then
    greedy-decode up to ``n_decode`` tokens (stopping at EOS). Returns the next-token logits
    ``[vocab]`` (fp32) after the query and the decoded token ids."""
    dev = backend.device
    cache = compat.cache_from_layers([(k.unsqueeze(0).to(dev), v.unsqueeze(0).to(dev)) for k, v in kv])
    eos = getattr(backend.tokenizer, "eos_token_id", None) if backend.tokenizer is not None else None

    def count(n: int) -> None:
        backend.count_forward(n)

    # the window's one decoding loop; it always decodes one token: n_decode=0 keeps none of them
    first, answer = greedy_steps(backend, cache, kv[0][0].shape[1], start, [int(t) for t in query_ids],
                                 max(1, n_decode), [] if eos is None else [eos], count)
    return first, tuple(answer[: max(0, n_decode)])


class _Scorer:
    """Scores arms of one placement against its reference logits."""

    def __init__(self, backend: Any, start: int, query_ids: Sequence[int], n_decode: int) -> None:
        self.backend, self.start, self.query_ids, self.n_decode = backend, start, list(query_ids), n_decode
        self.ref_logits: torch.Tensor | None = None

    def __call__(self, kv: Sequence[LayerKV]) -> tuple[float, tuple[int, ...], torch.Tensor]:
        logits, dec = score_query(self.backend, kv, self.start, self.query_ids, self.n_decode)
        kl = 0.0 if self.ref_logits is None else kl_divergence(self.ref_logits, logits)
        return kl, dec, logits


def _rows(kv: Sequence[LayerKV], a: int, b: int) -> list[LayerKV]:
    return [(k[:, a:b], v[:, a:b]) for k, v in kv]


# ---------------------------------------------------------------------------- groups


def _main_group(mat: MaterializedItem, cfg: HarnessConfig, n_decode: int, ulps: dict[str, list]) -> Sample:
    req = ReuseRequest(mat.meta["backend"], mat.chunks)
    be = req.backend
    scorer = _Scorer(be, req.next_position, mat.query_ids, n_decode)
    ref = ReprefillArm().run(req)
    _, ref_dec, ref_logits = scorer(ref.kv)
    scorer.ref_logits = ref_logits
    arms: dict[str, ArmScore] = {}
    failures: dict[str, str] = {}
    non_leading = sum(c.nbytes for c in req.chunks[1:])
    R = req.root_len

    def add(name: str, result, reused: int = non_leading) -> None:
        """Score an arm; ``result`` is its result or a thunk running it: a thunk that raises is
        recorded in ``failures`` (that arm has no score for this item) and the others go on."""
        try:
            if callable(result):
                result = result()
            kl, dec, _ = scorer(result.kv)
        except Exception as exc:  # noqa: BLE001  (one arm's failure must not take down the run)
            failures[name] = failure_text(exc)
            return
        arms[name] = ArmScore(kl=kl, decision=dec, report=result.report.as_dict(), reused_page_bytes=reused)

    arms["reprefill"] = ArmScore(kl=0.0, decision=ref_dec, report=ref.report.as_dict(), reused_page_bytes=non_leading)
    blind = BlindArm().run(req)
    add("blind", blind)
    sdt = cfg.storage
    # relocation error alone: the leading chunk has no antecedent, so blind == re-prefill there
    off0, T0 = req.offsets[0], req.chunks[0].n_tokens
    ulps.setdefault("relocation", []).append(_ulp_sample(_rows(blind.kv, off0, off0 + T0), _rows(ref.kv, off0, off0 + T0), sdt))
    fam = set(cfg.arms)
    if "prefix_cache" in fam:
        pc = PrefixCacheArm(label="prefix_cache", remember=False)
        pc.seed_canonicals(be, req.chunks)
        add("prefix_cache", lambda: pc.run(req))
    full: dict[int, list[Patch]] = {}
    need_patches = bool(fam & {"patch", "cacheblend", "epic", "kvcapsule", "select"})
    if need_patches and len(req.chunks) > 1:
        before = be.forwards_run
        for i in range(1, len(req.chunks)):
            ants = [(req.chunks[j], full.get(j)) for j in range(i)]
            full[i] = [form_patch(be, req.chunks[i], ants, rank="full", kind="exact")]
        compile_fw = be.forwards_run - before
    else:
        compile_fw = 0
    preq = req.with_patches(full)  # the very same relocated KV
    mat.meta["full_patches"] = full  # the select and kvcapsule groups reuse them
    if "patch" in fam:
        ranks = sorted(set(int(r) for r in cfg.ranks) | {cfg.matched_rank})
        for r in ranks:
            res = PatchArm(r, label=f"patch-r{r}").run(preq)
            res.report.compile_forwards = compile_fw
            add(f"patch-r{r}", res)
        res = PatchArm("full", label="patch-full").run(preq)
        res.report.compile_forwards = compile_fw
        add("patch-full", res)
        for t in cfg.fidelity_targets:
            rule = FidelityRule.for_target(t, cfg.envelope, cfg.max_patch_fraction, cfg.on_miss,
                                           precisions=cfg.patch_precisions)
            res = PatchArm("full", label=f"target-{t:g}", fidelity=rule).run(preq)
            res.report.compile_forwards = compile_fw
            add(f"target-{t:g}", res)
        if len(req.chunks) > 1:
            ulps.setdefault("patch-full", []).append(
                _ulp_sample(_rows(res.kv, req.offsets[1], R + req.n_chunk_tokens), _rows(ref.kv, req.offsets[1], R + req.n_chunk_tokens), sdt)
            )
    # matched budget: per chunk, the KV rows the rank-32 patch's bytes would hold
    matched = [0] + [
        matched_token_budget(truncate_patch(full[i][0], cfg.matched_rank), c) if i in full else 0
        for i, c in enumerate(req.chunks) if i > 0
    ]
    if "cacheblend" in fam:
        add(f"cacheblend-{round(100 * cfg.cacheblend_ratio)}",
            lambda: CacheBlendArm(cfg.cacheblend_ratio, check_layer=cfg.check_layer).run(req))
        add("cacheblend-matched",
            lambda: CacheBlendArm(budget=sum(matched), check_layer=cfg.check_layer, label="cacheblend-matched").run(req))
    if "epic" in fam:
        add(f"epic-{cfg.epic_k}", lambda: EpicArm(cfg.epic_k).run(req))
        add("epic-matched", lambda: EpicArm(matched, label="epic-matched").run(req))
    if "kvcapsule" in fam:
        bank = mat.meta["capsule_bank"]
        add("kvcapsule-linear", lambda: KVCapsuleArm(bank, rank=cfg.matched_rank).run(preq))
        add("kvcapsule-linear-blind", lambda: KVCapsuleArm(bank, rank=None).run(req))
    if "vlcache" in fam:
        add(f"vlcache-{round(100 * cfg.vlcache_ratio)}",
            lambda: VLCacheArm(cfg.vlcache_ratio, schedule=cfg.vlcache_schedule).run(req))
    return Sample(
        item=mat.item.id,
        family=mat.item.family,
        group="main",
        ref_decision=ref_dec,
        blind_kl=arms["blind"].kl,
        blind_decision=arms["blind"].decision,
        arms=arms,
        answer_ids=tuple(mat.answer_ids),
        detail={"n_chunks": len(req.chunks), "tokens": req.n_chunk_tokens, "matched_tokens": matched},
        failures=failures,
    )


def _cap(rank: int, chunk: Any, backend: Any) -> int:
    """``rank`` capped at what the chunk's Δ holds (min(T, F)): above it the full patch is exact."""
    lay = backend.layout
    return min(int(rank), chunk.n_tokens, lay.k_heads * lay.k_dim, lay.v_heads * lay.v_dim)


def _place_last(backend: Any, seq: Sequence[Any]) -> tuple[ReuseRequest, Any, int, int]:
    """Re-prefill ``seq``; return the request, the reference result, and the last chunk's
    sequence offset and start position."""
    req = ReuseRequest(backend, seq)
    ref = ReprefillArm().run(req)
    return req, ref, req.offsets[-1], req.starts[-1]


def _orbit_group(mat: MaterializedItem, cfg: HarnessConfig, n_decode: int) -> list[Sample]:
    be = mat.meta["backend"]
    K = cfg.orbit_antecedents
    if len(mat.chunks) < K + 1:
        return []
    ants, B = mat.chunks[-(K + 1):-1], mat.chunks[-1]
    perms = list(itertools.permutations(range(K)))
    placed = []
    for perm in perms:
        seq = [ants[i] for i in perm] + [B]
        req, ref, off, start = _place_last(be, seq)
        full = patch_from_conditioned(be, B, _rows(ref.kv, off, off + B.n_tokens), start, [c.id for c in seq[:-1]])
        placed.append((perm, req, ref, off, start, full))
    all_fulls = [p[-1] for p in placed]
    m = _cap(cfg.orbit_rank, B, be)
    orbit_all = combine_patches(all_fulls, m)
    out = []
    for perm, req, ref, off, start, full in placed:
        scorer = _Scorer(be, req.next_position, mat.query_ids, n_decode)
        _, ref_dec, ref_logits = scorer(ref.kv)
        scorer.ref_logits = ref_logits
        prefix = _rows(ref.kv, 0, off)  # antecedents exactly as re-prefill holds them
        held_out = combine_patches([f for f in all_fulls if f is not full], m)
        variants = {
            "orbit-blind": None,
            f"orbit-exact-r{cfg.orbit_rank}": truncate_patch(full, cfg.orbit_rank),
            f"orbit-r{cfg.orbit_rank}": held_out,
            f"orbit-all-r{cfg.orbit_rank}": orbit_all,
        }
        arms = {}
        for name, p in variants.items():
            kv = concat_kv([prefix, relocate(B, start, layout=be.layout, patch=p)])
            kl, dec, _ = scorer(kv)
            arms[name] = ArmScore(kl=kl, decision=dec, report={"bytes_extra": p.nbytes if p else 0}, reused_page_bytes=B.nbytes)
        out.append(Sample(item=mat.item.id, family=mat.item.family, group="orbit", ref_decision=ref_dec, blind_kl=arms["orbit-blind"].kl,
                          blind_decision=arms["orbit-blind"].decision, arms=arms, answer_ids=tuple(mat.answer_ids),
                          detail={"ordering": list(perm)}))
    return out


def recall_plan(n_chunks: int, window: int) -> tuple[int, list[int], list[int]] | None:
    """Simulate a sliding window of ``window`` chunks over a history of ``n_chunks``.

    Chunk 1 enters behind chunk 0, slides out, and the window keeps sliding until none of the
    chunks it shared the window with at eviction remain (full turnover). Returns ``(x, stale, now)``:
    the recalled chunk, the antecedents it had at admission (its stale patch's context) and the
    window it is recalled behind; None when the history is too short to turn over.
    """
    if window < 1:
        return None
    x = 1
    win: list[int] = []
    stale: list[int] = []
    at_eviction: set[int] | None = None
    for h in range(n_chunks):
        if h == x:
            stale = list(win)
        win.append(h)
        if len(win) > window:
            gone = win.pop(0)
            if gone == x:
                at_eviction = set(win) - {h}  # those that shared the window with x
        if at_eviction is not None and not (at_eviction & set(win)) and x not in win:
            return x, stale, list(win)
    return None


def _recall_group(mat: MaterializedItem, cfg: HarnessConfig, n_decode: int) -> list[Sample]:
    be = mat.meta["backend"]
    plan = recall_plan(len(mat.chunks), cfg.recall_window)
    if plan is None:
        return []
    x, stale_ids, now_ids = plan
    X = mat.chunks[x]
    m = _cap(cfg.recall_rank, X, be)
    stale = form_patch(be, X, [mat.chunks[j] for j in stale_ids], rank=m, kind="exact")
    window = [mat.chunks[j] for j in now_ids]
    req, ref, off, start = _place_last(be, window + [X])
    # the window's chunks as the window holds them: exact (full-rank patches from the re-prefill)
    win_patches: list[list[Patch]] = []
    for j, c in enumerate(window):
        if j == 0:
            win_patches.append([])
        else:
            o = req.offsets[j]
            win_patches.append([patch_from_conditioned(be, c, _rows(ref.kv, o, o + c.n_tokens), req.starts[j],
                                                       [w.id for w in window[:j]])])
    fresh = form_patch(be, X, [(c, ps) for c, ps in zip(window, win_patches)], rank=m, kind="recall")
    scorer = _Scorer(be, req.next_position, mat.query_ids, n_decode)
    _, ref_dec, ref_logits = scorer(ref.kv)
    scorer.ref_logits = ref_logits
    prefix = _rows(ref.kv, 0, off)
    arms = {}
    for name, p in {"recall-blind": None, f"recall-fresh-r{cfg.recall_rank}": fresh,
                    f"recall-stale-r{cfg.recall_rank}": stale}.items():
        kv = concat_kv([prefix, relocate(X, start, layout=be.layout, patch=p)])
        kl, dec, _ = scorer(kv)
        arms[name] = ArmScore(kl=kl, decision=dec, report={"bytes_extra": p.nbytes if p else 0}, reused_page_bytes=X.nbytes)
    return [Sample(item=mat.item.id, family=mat.item.family, group="recall", ref_decision=ref_dec, blind_kl=arms["recall-blind"].kl,
                   blind_decision=arms["recall-blind"].decision, arms=arms, answer_ids=tuple(mat.answer_ids),
                   detail={"recalled": x, "stale_context": stale_ids, "recall_context": now_ids})]


def _ulp_sample(kv: Sequence[LayerKV], ref: Sequence[LayerKV], dtype: torch.dtype, keep: int = 50_000) -> dict[str, Any]:
    """ULP errors of ``kv`` vs ``ref`` in ``dtype``: elementwise (a strided subsample, for quantiles)
    and per tensor at its scale (max error over the ULP at max |ref|, one value per layer and K/V)."""
    errs = torch.cat([torch.cat([ulp_error(k, rk, dtype).reshape(-1), ulp_error(v, rv, dtype).reshape(-1)])
                      for (k, v), (rk, rv) in zip(kv, ref)])
    step = max(1, errs.numel() // keep)
    at_scale = [ulp_error_at_scale(a, b, dtype) for (k, v), (rk, rv) in zip(kv, ref) for a, b in ((k, rk), (v, rv))]
    return {"sample": errs[::step].to(torch.float32), "at_scale": at_scale}


# ---------------------------------------------------------------------------- the run


@dataclass
class FidelityResult:
    """``samples``: every measured placement; ``summary``: the aggregate (see :func:`summarize_samples`)."""

    samples: list[Sample]
    summary: dict[str, Any]

    def per_sample(self) -> list[dict[str, Any]]:
        """One JSON-able row per sample: item, family, group, blind KL, and every arm's KL and
        whether its greedy answer equals the re-prefill's."""
        return [
            {
                "item": s.item,
                "family": s.family,
                "group": s.group,
                "blind_kl": s.blind_kl,
                "flipped": s.blind_decision != s.ref_decision,
                "kl": {k: a.kl for k, a in s.arms.items()},
                "agrees": {k: a.decision == s.ref_decision for k, a in s.arms.items()},
                **({"detail": s.detail} if s.detail else {}),
            }
            for s in self.samples
        ]


def run_fidelity(
    backend: Any,
    items: Sequence[ProbeItem],
    cfg: HarnessConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> FidelityResult:
    """Run every configured arm over ``items``; returns per-sample scores and the summary
    (see :func:`summarize_samples`). ``progress(item_id)`` is called after each item."""
    cfg = cfg or HarnessConfig()
    t0 = time.perf_counter()
    samples: list[Sample] = []
    ulps: dict[str, list] = {}
    bank = None
    if "kvcapsule" in cfg.arms:
        from ...core.capsule import CapsuleBank
        from .calibration import ProbeCalibration

        bank = CapsuleBank(cfg.capsule_retention, calibrate=ProbeCalibration(backend, cfg.storage,
                                                                             max_tokens=cfg.max_chunk_tokens))
    with torch.no_grad():
        for item in items:
            mat = materialize(item, backend, storage=cfg.storage, max_chunk_tokens=cfg.max_chunk_tokens,
                              image_grid=cfg.image_grid)
            mat.meta["backend"] = backend
            mat.meta["capsule_bank"] = bank
            n_decode = max(1, min(cfg.max_decode, len(mat.answer_ids)))
            samples.append(_main_group(mat, cfg, n_decode, ulps))
            main = samples[-1]
            # a group that raises is recorded on the item's main sample; the other groups go on
            for group in ("orbit", "recall", "select"):
                if group in cfg.arms:
                    try:
                        samples.extend(_GROUPS[group](mat, cfg, n_decode))
                    except Exception as exc:  # noqa: BLE001
                        main.failures[group] = failure_text(exc)
            if progress is not None:
                progress(item.id)
    summary = summarize_samples(samples, cfg)
    summary["n_items"] = len(items)
    summary["runtime_s"] = time.perf_counter() - t0
    summary["kv_ulp"] = {
        name: _pool_ulps(v) for name, v in ulps.items()
    }
    summary["storage"] = str(cfg.storage).replace("torch.", "")
    return FidelityResult(samples=samples, summary=summary)


def _selection_group(mat: MaterializedItem, cfg: HarnessConfig, n_decode: int) -> list[Sample]:
    from .selection import selection_samples

    return selection_samples(mat, cfg, n_decode, mat.meta.get("full_patches"))


_GROUPS: dict[str, Callable[[MaterializedItem, HarnessConfig, int], list[Sample]]] = {
    "orbit": _orbit_group, "recall": _recall_group, "select": _selection_group,
}


def _pool_ulps(parts: list[dict[str, Any]]) -> dict[str, float]:
    """Elementwise median / p99 (no max: at an exact-zero reference one ULP is 2^-149, so the
    elementwise max says nothing) and the per-tensor at-scale median / max."""
    if not parts:
        return {}
    sample = torch.cat([p["sample"] for p in parts]).to(torch.float64)
    scale = torch.tensor([x for p in parts for x in p["at_scale"]], dtype=torch.float64)
    return {
        "median": float(torch.quantile(sample, 0.5)),
        "p99": float(torch.quantile(sample, 0.99)),
        "at_scale_median": float(torch.quantile(scale, 0.5)),
        "at_scale_max": float(scale.max()),
    }


# ---------------------------------------------------------------------------- aggregation


def _patch_figures(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A patch arm's ranks and bytes: mean directions per patch (K, V; summed over layers), patch
    bytes, and under a fidelity rule the miss count (patches short of the target within the cap)
    and patches past the cap."""
    dirs = [d for r in reports for ps in r.get("patch_directions", ()) for d in ps]
    if not dirs:
        return {}
    out: dict[str, Any] = {
        "mean_directions_k": sum(d[0] for d in dirs) / len(dirs), "mean_directions_v": sum(d[1] for d in dirs) / len(dirs),
        "patch_bytes": sum(int(r.get("bytes_extra", 0)) for r in reports), "patches": len(dirs),
    }
    fid = [f for r in reports for f in r.get("fidelity", ()) if f]
    if fid:
        out["misses"] = sum(1 for f in fid if f["miss"])
        out["over_cap"] = sum(1 for f in fid if f["action"] in ("exceeded-budget", "recomputed"))
        est = [f["eta_est"] for f in fid if f.get("eta_est") is not None]
        out["median_estimated_eta"] = _median(est) if est else None
    return out


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize_samples(samples: Sequence[Sample], cfg: HarnessConfig) -> dict[str, Any]:
    """Per arm: median/mean η over samples with a measurable gap (blind KL > ``min_gap``), pooled η,
    median/mean KL over all samples, flip-recover, bytes and recompute fractions."""
    by_arm: dict[str, list[tuple[Sample, ArmScore]]] = {}
    for s in samples:
        for name, sc in s.arms.items():
            by_arm.setdefault(name, []).append((s, sc))
    arms: dict[str, Any] = {}
    for name, rows in by_arm.items():
        kls = [sc.kl for _, sc in rows]
        etas = [e for e in (eta(s.blind_kl, sc.kl, cfg.min_gap) for s, sc in rows) if e is not None]
        ref = [s.ref_decision for s, _ in rows]
        bl = [s.blind_decision for s, _ in rows]
        ar = [sc.decision for _, sc in rows]
        extra = sum(int(sc.report.get("bytes_extra", 0)) for _, sc in rows)
        reused = sum(sc.reused_page_bytes for _, sc in rows)
        rec = [sc.report["recompute_fraction"] for _, sc in rows if "recompute_fraction" in sc.report]
        row_bytes = [
            (sc.report.get("tokens_recomputed", 0), sc.report.get("chunk_tokens", 0)) for _, sc in rows
        ]
        arms[name] = {
            "group": rows[0][0].group,
            "n": len(rows),
            "n_with_gap": len(etas),
            "median_eta": _median(etas),
            "p10_eta": percentile(etas, 0.1),
            "mean_eta": _mean(etas),
            "pooled_eta": pooled_eta([s.blind_kl for s, _ in rows], kls),
            "median_kl": _median(kls),
            "mean_kl": _mean(kls),
            "flip_recover": flip_recover(ref, bl, ar),
            "n_flips": n_flips(ref, bl),
            "agreement": sum(1 for r, a in zip(ref, ar) if r == a) / len(rows),
            "bytes_fraction": extra / reused if reused else 0.0,
            "bytes": BytesReport(canonical=reused, patch=extra).as_dict(),
            "recompute_fraction": _mean(rec) if rec else 0.0,
            "tokens_recomputed_fraction": (sum(a for a, _ in row_bytes) / max(1, sum(b for _, b in row_bytes))),
        }
        arms[name].update(_patch_figures([sc.report for _, sc in rows]))
        for key in ("coverage", "kept_fraction", "recon_error_k", "recon_error_v", "bytes_saved_fraction"):
            vals = [float(sc.report[key]) for _, sc in rows if sc.report.get(key) is not None]
            if vals:
                arms[name][f"median_{key}"] = _median(vals)
                arms[name][f"mean_{key}"] = _mean(vals)
    by_family: dict[str, Any] = {}
    for s in samples:
        if s.group != "main" or not s.family:
            continue
        fam = by_family.setdefault(s.family, {"n": 0, "median_blind_kl": [], "median_eta": {}})
        fam["n"] += 1
        fam["median_blind_kl"].append(s.blind_kl)
        for name, sc in s.arms.items():
            e = eta(s.blind_kl, sc.kl, cfg.min_gap)
            if e is not None and name not in ("reprefill", "blind"):
                fam["median_eta"].setdefault(name, []).append(e)
    for fam in by_family.values():
        fam["median_blind_kl"] = _median(fam["median_blind_kl"])
        fam["median_eta"] = {k: _median(v) for k, v in fam["median_eta"].items()}
    main = [s for s in samples if s.group == "main"]
    gap = [s for s in main if s.blind_kl > cfg.min_gap]
    p = f"patch-r{cfg.matched_rank}"
    # items where an arm of the comparison failed are left out of it (summary["failures"] names them)
    compared = [s for s in main if all(k in s.arms for k in (p, "cacheblend-matched", "epic-matched"))]
    compared_gap = [s for s in compared if s.blind_kl > cfg.min_gap]
    beats = None
    beats_all = None
    if compared:
        def win(s: Sample) -> bool:
            return s.arms[p].kl < s.arms["cacheblend-matched"].kl and s.arms[p].kl < s.arms["epic-matched"].kl

        beats = sum(win(s) for s in compared_gap) / len(compared_gap) if compared_gap else None
        beats_all = sum(win(s) for s in compared) / len(compared)
    ranks = sorted(set(int(r) for r in cfg.ranks) | {cfg.matched_rank})
    curve = {str(r): arms[f"patch-r{r}"]["median_eta"] for r in ranks if f"patch-r{r}" in arms}
    if "patch-full" in arms:
        curve["full"] = arms["patch-full"]["median_eta"]
    summary: dict[str, Any] = {
        "arms": arms,
        "n_samples": {g: sum(1 for s in samples if s.group == g) for g in ("main", "orbit", "recall", "select")},
        "n_items_with_gap": len(gap),
        "min_gap": cfg.min_gap,
        "eta_aggregation": (
            "median/mean of eta over samples whose blind-reuse KL exceeds min_gap (eta is a ratio to "
            "that gap, undefined without one); pooled_eta = 1 - sum KL_arm / sum KL_blind over all samples"
        ),
        "eta_vs_rank": curve,
        "by_family": by_family,
        "patch_beats_matched_share": beats,
        "patch_beats_matched_share_all_items": beats_all,
        "ranks": ranks,
    }
    summary["failures"] = arm_failures(samples)
    summary["targets"] = _targets(summary, cfg)
    return summary


def arm_failures(samples: Sequence[Sample]) -> dict[str, Any]:
    """Per arm (or group) that raised on some items: how many, which, and the first error."""
    out: dict[str, Any] = {}
    for s in samples:
        for name, error in s.failures.items():
            row = out.setdefault(name, {"n_failed": 0, "items": [], "error": error})
            row["n_failed"] += 1
            row["items"].append(s.item)
    return out


def _targets(summary: dict[str, Any], cfg: HarnessConfig) -> dict[str, Any]:
    """The acceptance targets beside the measured figures (reported, never enforced)."""
    a = summary["arms"]

    def get(name: str, key: str) -> float | None:
        return a.get(name, {}).get(key)

    out: dict[str, Any] = {}

    def t(key: str, measured: float | None, ok: Callable[[float], bool], target: str) -> None:
        out[key] = {"target": target, "measured": measured, "met": None if measured is None else bool(ok(measured))}

    t("patch-full median KL", get("patch-full", "median_kl"), lambda v: v <= 1e-6, "<= 1e-6")
    t("patch-r32 median eta", get("patch-r32", "median_eta"), lambda v: v >= 0.90, ">= 0.90")
    t("patch-r64 median eta", get("patch-r64", "median_eta"), lambda v: v >= 0.97, ">= 0.97")
    t("patch beats matched cacheblend and epic", summary.get("patch_beats_matched_share"), lambda v: v >= 0.90, ">= 90% of items")
    oe, ox = get(f"orbit-r{cfg.orbit_rank}", "median_eta"), get(f"orbit-exact-r{cfg.orbit_rank}", "median_eta")
    t("orbit median eta within 0.05 of exact", None if oe is None or ox is None else ox - oe, lambda v: v <= 0.05, "exact - orbit <= 0.05")
    t("recall fresh median eta", get(f"recall-fresh-r{cfg.recall_rank}", "median_eta"), lambda v: v >= 0.8, ">= 0.8")
    out["recall stale median eta (reported beside)"] = {"measured": get(f"recall-stale-r{cfg.recall_rank}", "median_eta")}
    return out
