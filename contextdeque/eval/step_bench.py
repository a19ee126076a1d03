"""Per-step cost of re-reads: each window step followed by a one-token answer, against a
re-prefill and a prefix cache of the same window, measured side by side in one run.

The window holds ``n_pages`` pages of real text (``pydoc_data.topics``) that the store has seen
(their canonicals exist: re-reads read them) under a budget of exactly that many pages; one more
page was seen earlier and slid out (it is in the store). For each patch policy and step type:

- ``slide``: ``slide(1)``;
- ``recall``: ``recall(old page, at="end")`` (the budget slides the oldest page out);
- ``recall-valid``: ``recall(old page)``: the window chooses where (``recall_placement``, default
  ``"valid"``: where a stored patch stays valid, or the front; the receipt's ``placed`` says);
- ``look-back``: a middle page is evicted (with ``idle``, ``heal()`` runs then: the agent's idle
  time between the two), then ``recall(page, at=its old index)``: it comes back where it stood;
- ``reorder``: the window reversed;
- ``fork+reorder``: ``fork()`` then the child's first two pages swapped (an order no earlier
  step stored a patch for, and no hint names: with anticipation, covered where reorder
  anticipation's pricing took it, ``window.anticipate_reorder``);
- ``append``: a page never seen before (the budget slides the oldest out): the same page for
  every policy, so the policies' rows compare the same window. Latency-first keeps its one
  conditioned forward's KV (exact; no canonical until something re-reads it elsewhere), so its
  healed window differs from the eager one there: by being closer to the re-prefill.

``ttft``: the step, ``materialize()`` and the question's forward over the window (its last
logits are the first answer token). ``reprefill``: one forward over root + window + question.
``prefix cache``: the forward a prefix cache runs: the tokens after the longest prefix shared
with the window before the step, attending to that cached prefix. ``kl_answer``: next-token
KL(re-prefill || window) at answer time; ``kl_healed``: the same after ``heal()`` (latency
policies; eager windows have nothing to heal); ``kl_vs_eager``: next-token KL(eager || this
policy) after healing, both windows having run the same step on the same content (the
latency-first promise: 0 up to float noise), the eager policy under the same anticipation
setting where ``"eager+anticipate"`` is among the policies, else plain ``"eager"`` (``None`` when
neither is). The step's own ``step_ms`` is reported beside
the floor of the bytes it must place (page bytes ÷ measured copy bandwidth): pages are placed
lazily, so a re-read step itself is O(chunks) and the rotation is paid once, in ``materialize``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core.counters import Counters, adds, shown
from ..core.metrics import kl_divergence
from ..kernels.bench_util import copy_bandwidth
from ..window.config import WindowConfig
from ..window.placement import END
from ..window.window import ContextWindow
from ..patch.rank import DEFAULT_RANK

STEP_KL_BUDGET = 3e-3  # the "+budget" policies' answer_kl_budget: issue 21's acceptance KL per step
STEPS = ("slide", "recall", "recall-valid", "look-back", "reorder", "fork+reorder", "append")


def _rounded(v: "float | None") -> "float | None":
    return round(v, 6) if isinstance(v, float) else v


@dataclass(kw_only=True)
class StepRow(Counters):
    """One step of one policy: the step's receipt's :class:`~contextdeque.core.counters.Counters`
    (``forwards`` on the critical path, tokens prefilled, encodes, patches formed / reused) beside
    its measured times and KLs (see the module doc). Rows add like every cost record; a row writes
    the names it always wrote (of the counts, ``forwards``)."""

    json_omit = frozenset({"tokens_prefilled", "encodes", "patches_formed", "patches_reused"})

    policy: str = shown()
    step: str = shown()
    step_ms: float = shown(_rounded, default=0.0)
    ttft_ms: float = shown(_rounded, default=0.0)
    reprefill_ms: float = shown(_rounded, default=0.0)
    prefix_cache_ms: float = shown(_rounded, default=0.0)
    kl_answer: float = shown(_rounded, default=0.0)
    kl_healed: float = shown(_rounded, default=0.0)
    heal_ms: float = shown(_rounded, default=0.0)
    heal_forwards: int = adds()
    kl_vs_eager: float | None = shown(_rounded)
    deferred: int = adds()
    page_mb: float = shown(_rounded, default=0.0)
    floor_ms: float = shown(_rounded, default=0.0)
    served: str = shown(default="")  # what the step's receipt says each re-conditioned chunk was served (Receipt.served)
    placed: str = shown(default="")  # for a recall: the index it went to and why (Receipt.placed)
    idle: bool = shown(default=True)  # heal() ran before the step (run_steps' ``idle``)
    tokens: int = shown(default=0)  # root + window + question after the step (what the re-prefill runs)

    @property
    def vs_reprefill(self) -> float:
        return self.reprefill_ms / max(self.ttft_ms, 1e-9)

    @property
    def vs_prefix_cache(self) -> float:
        return self.prefix_cache_ms / max(self.ttft_ms, 1e-9)

    def _derived(self) -> dict[str, Any]:
        return {"ttft_vs_reprefill": round(self.vs_reprefill, 3), "ttft_vs_prefix_cache": round(self.vs_prefix_cache, 3)}


def _window_ids(win: ContextWindow) -> list[int]:
    ids = list(win.root_ids)
    for r in win.refs:
        ids += win.chunk(r).token_ids.tolist()
    return ids


def sync(device: "torch.device | str") -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously: a host clock read
    before the queue drains measures the launches, not the work)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], Any], device: "torch.device | str" = "cpu") -> tuple[Any, float]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - t) * 1000.0


def _answer_logits(win: ContextWindow, question: list[int]) -> torch.Tensor:
    """The first answer token's logits from the window's own KV (materialize + one forward)."""
    from ..core import compat

    backend = win.backend
    cache = win.materialize()
    past = [tuple(t[0] for t in compat.cache_layer(cache, l)) for l in range(compat.cache_num_layers(cache))]
    start = win.next_position()
    return backend.forward(input_ids=question, positions=backend.text_positions(start, len(question)), past=past).logits[-1]


def _reprefill(backend: Any, ids: list[int]) -> tuple[torch.Tensor, float]:
    def run() -> torch.Tensor:
        return backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids))).logits[-1]

    return _timed(run, backend.device)


def _prefix_cache_ms(backend: Any, before: list[int], after: list[int]) -> float:
    """A prefix cache's forward for ``after`` when it holds the KV of ``before``."""
    lcp = 0
    for a, b in zip(before, after):
        if a != b:
            break
        lcp += 1
    lcp = min(lcp, len(after) - 1)  # at least the question's last token runs
    past = backend.forward(input_ids=after[:lcp], positions=backend.text_positions(0, lcp), logits="none").kv if lcp else None
    _, ms = _timed(
        lambda: backend.forward(input_ids=after[lcp:], positions=backend.text_positions(lcp, len(after) - lcp), past=past),
        backend.device,
    )
    return ms


class Oracles:
    """The re-prefill and prefix-cache references of a step table, computed once per window
    arrangement and shared by every policy's row and both idle modes (the same ids give the same
    logits and cost the same forward; under load they were most of the bench's time).

    ``reprefill(ids)`` is ``(logits, ms)``: the logits of the one forward run for that arrangement,
    and as its time the median of the re-prefills timed so far over the same number of tokens
    (arrangements of one length cost the same forward, so the median of their samples is a
    steadier denominator on a loaded machine than any one of them); :meth:`settle` gives every
    row the median of all of them once the table is done. ``prefix_cache_ms(before, after)`` is
    timed once per pair."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._ms: dict[int, list[float]] = {}  # tokens -> one sample per arrangement of that length
        self._prefix: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}

    def reprefill(self, ids: list[int]) -> tuple[torch.Tensor, float]:
        key = tuple(ids)
        if key not in self._logits:
            self._logits[key], ms = _reprefill(self.backend, ids)
            self._ms.setdefault(len(ids), []).append(ms)
        return self._logits[key], statistics.median(self._ms[len(ids)])

    def prefix_cache_ms(self, before: list[int], after: list[int]) -> float:
        key = (tuple(before), tuple(after))
        if key not in self._prefix:
            self._prefix[key] = _prefix_cache_ms(self.backend, before, after)
        return self._prefix[key]

    def settle(self, rows: "list[StepRow]") -> None:
        """Give each row the median re-prefill time of its window's length over the whole run
        (a row measured early saw fewer samples)."""
        for r in rows:
            if r.tokens in self._ms:
                r.reprefill_ms = statistics.median(self._ms[r.tokens])

    @property
    def forwards(self) -> int:
        """Reference forwards run (re-prefills and prefix-cache forwards)."""
        return len(self._logits) + len(self._prefix)


def _anticipates(policy: str) -> bool:
    """Whether the step table's ``policy`` runs with anticipation (see :func:`run_steps`)."""
    name, *extras = policy.split("+")
    return "anticipate" in extras or (name == "default" and WindowConfig().anticipate)


LOOK_BACK_INDEX = 1
"""``look-back`` evicts the window's page at this index (a middle page) and recalls it there."""


def run_steps(
    backend: Any,
    pages: list[list[int]],
    question: list[int],
    *,
    policies: tuple[str, ...] = ("eager", "latency"),
    steps: tuple[str, ...] = STEPS,
    rank: int = DEFAULT_RANK,
    n_pages: int = 4,
    progress: Callable[[str], None] | None = None,
    idle: bool = True,
    heal_after: bool = True,
    oracles: Oracles | None = None,
) -> list[StepRow]:
    """Measure every ``steps`` x ``policies`` (see the module doc). ``pages`` needs
    ``n_pages + 2`` pages (an old one, the window, the page ``append`` adds).

    A policy named ``"<name>+anticipate"`` runs ``<name>`` with ``anticipate=True``
    (``window.anticipation``: ``heal()`` also prepares the next likely re-reads), any other
    ``<name>`` with ``anticipate=False`` but ``"default"``: the window's defaults (latency-first,
    anticipation as ``WindowConfig`` says: on); ``"+keep"`` with ``cascade_policy="keep"`` (a
    recall's dependents kept as they are, the paper's survivors rule); ``"+budget"``
    with ``answer_kl_budget=STEP_KL_BUDGET`` (``window.budget``: a step whose estimate is above it
    forms the one patch that matters most); both may be given (``latency+anticipate+budget``).

    ``idle=True``: the window is built page by page with its queued work healed after each append
    and one full ``heal()`` (anticipation included) before the steps, and the look-back's eviction
    is followed by a full ``heal()`` too: the idle time an agent has between steps. (Anticipation
    runs once, on the window the steps start from: what it would prepare for the windows on the way
    is never served there, its keys name other KV states.) ``idle=False``: no ``heal()`` before the
    step at all (what a miss costs). ``heal_after``: also heal the step's queued work afterwards
    (``kl_healed``, ``kl_vs_eager``; without it those are the answer-time values and None).
    ``oracles``: the re-prefill references to share with other calls (one is made otherwise)."""
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}")
    size = len(pages[0])
    need = n_pages + 2
    if len(pages) < need:
        raise ValueError(f"need {need} pages, got {len(pages)}")
    if "look-back" in steps and n_pages <= LOOK_BACK_INDEX + 1:
        raise ValueError(f"look-back evicts page {LOOK_BACK_INDEX} from the middle: it needs more than "
                         f"{LOOK_BACK_INDEX + 1} pages")
    oracles = oracles if oracles is not None else Oracles(backend)
    # every policy appends the same new page: its rows must describe the same window
    old, window_pages, new_page = pages[0], pages[1 : n_pages + 1], pages[n_pages + 1]
    canonicals = [backend.encode(token_ids=p) for p in [old, *window_pages]]  # the store has seen them: encoded once
    bandwidth = None
    rows: list[StepRow] = []
    eager_healed: dict[tuple[bool, str], torch.Tensor] = {}  # (anticipate, step) -> the eager window's answer logits
    for policy in sorted(policies, key=lambda p: p.split("+")[0] != "eager"):  # eager first: the others compare to it
        # one store per policy: the eager window must not serve the latency one (or back)
        name, *extras = policy.split("+")
        unknown = set(extras) - {"anticipate", "budget", "keep"}
        if unknown:
            raise ValueError(f"unknown policy option(s) {sorted(unknown)} in {policy!r}: anticipate, budget, keep")
        anticipate = _anticipates(policy)
        # compared with the eager policy under the same anticipation setting where that ran, else plain eager
        eager_ran = {_anticipates(p) for p in policies if p.split("+")[0] == "eager"}
        same = anticipate if anticipate in eager_ran else False
        base = ContextWindow(backend, budget_tokens=n_pages * size, rank=rank, patch_policy=name,
                             anticipate=anticipate, cascade_policy="keep" if "keep" in extras else "reform",
                             answer_kl_budget=STEP_KL_BUDGET if "budget" in extras else None)
        # pages the store has seen (their canonicals exist): what a re-read reads
        old_ref = base.append(chunk=canonicals[0])
        for chunk in canonicals[1:]:
            if idle:
                base.heal(anticipate=False)
            base.append(chunk=chunk)  # built step by step: the eager policy's window
        if idle:
            base.heal()
        for step in steps:
            if progress:
                progress(f"{policy}{'' if idle else ' (no idle)'}: {step}")
            win = base.fork()
            target = win
            if step == "fork+reorder":
                target = win.fork()
            looked_back = None
            if step == "look-back":  # a middle page leaves (idle time follows), then comes back where it stood
                looked_back = win.refs[LOOK_BACK_INDEX]
                win.evict(looked_back)
                if idle:
                    win.heal()
            before = _window_ids(win) + question

            def do_step() -> Any:
                if step == "slide":
                    return target.slide(1)
                if step == "recall":
                    return target.recall(old_ref, at=END)
                if step == "recall-valid":  # the window chooses (recall_placement)
                    return target.recall(old_ref)
                if step == "look-back":
                    return target.recall(looked_back, at=LOOK_BACK_INDEX)
                if step == "reorder":
                    return target.reorder(list(reversed(target.refs)))
                if step == "fork+reorder":  # another order than ``reorder``'s, unhinted: no step stored its patches
                    refs = list(target.refs)
                    return target.reorder([refs[1], refs[0], *refs[2:]])
                return target.append(token_ids=new_page).receipt

            sync(backend.device)
            t0 = time.perf_counter()
            receipt = do_step()
            sync(backend.device)
            step_ms = (time.perf_counter() - t0) * 1000.0
            logits = _answer_logits(target, question)
            sync(backend.device)
            ttft_ms = (time.perf_counter() - t0) * 1000.0
            after = _window_ids(target) + question
            ref_logits, reprefill_ms = oracles.reprefill(after)
            prefix_ms = oracles.prefix_cache_ms(before, after)
            kl_answer = kl_divergence(ref_logits, logits)
            healed_logits, kl_healed, heal_ms, heal_forwards = logits, kl_answer, 0.0, 0
            if heal_after:
                healed, heal_ms = _timed(lambda: target.heal(anticipate=False), backend.device)
                if healed.refs:
                    healed_logits = _answer_logits(target, question)
                    kl_healed, heal_forwards = kl_divergence(ref_logits, healed_logits), healed.forwards
                else:
                    heal_ms = 0.0
                if name == "eager" and "budget" not in extras:
                    eager_healed[same, step] = healed_logits
            reference = eager_healed.get((same, step)) if heal_after else None
            kl_vs_eager = None if reference is None else kl_divergence(reference, healed_logits)
            page_bytes = int(receipt.bytes_moved.get("pages", 0))
            if bandwidth is None:
                bandwidth = copy_bandwidth(max(page_bytes, 1 << 24), backend.device)
            rows.append(StepRow(
                **receipt.counts(), policy=policy, step=step, step_ms=step_ms, ttft_ms=ttft_ms,
                reprefill_ms=reprefill_ms, prefix_cache_ms=prefix_ms, kl_answer=kl_answer, kl_healed=kl_healed,
                heal_ms=heal_ms, heal_forwards=heal_forwards,
                kl_vs_eager=kl_vs_eager,
                deferred=len(receipt.deferred), page_mb=page_bytes / 1e6,
                floor_ms=page_bytes / bandwidth * 1000.0,
                served=",".join(sorted({what for _, what in receipt.served})),
                placed=";".join(f"@{i}: {why}" for _, i, why in receipt.placed),
                idle=idle, tokens=len(after),
            ))
            if target is not win:
                target.discard()
            win.discard()
        base.close()
    oracles.settle(rows)
    return rows


def window_step_ttft(
    backend: Any,
    pages: list[list[int]],
    question: list[int],
    *,
    policies: tuple[str, ...] = ("latency", "eager"),
    rank: int = DEFAULT_RANK,
    repeats: int = 5,
) -> list[dict[str, Any]]:
    """Time to first token of one window step -- ``slide(1)``, ``recall`` of a page read before,
    the question's forward over the materialized window -- against re-prefilling root + window +
    question, per patch policy (the paper's TTFT comparison).

    ``pages``: ``n + 1`` equal pages; the first is read and slid out before timing, the window
    holds the other ``n``. Each repeat runs on a fresh fork of the same window (warm-up first);
    medians and minima in ms, with the next-token KL of the window's answer vs the re-prefill's.
    """
    old, window_pages = pages[0], pages[1:]
    size = len(old)
    rows = []
    for policy in policies:
        base = ContextWindow(backend, budget_tokens=len(window_pages) * size, rank=rank, patch_policy=policy)
        old_ref = base.append(chunk=backend.encode(token_ids=old))
        base.heal()
        for p in window_pages:
            base.append(chunk=backend.encode(token_ids=p))
            base.heal()
        ttft, reprefill, step = [], [], []
        kl = 0.0
        for i in range(repeats + 1):  # the first round warms up (kernel compilation, allocator)
            win = base.fork()
            sync(backend.device)
            t0 = time.perf_counter()
            win.slide(1)
            win.recall(old_ref, at=END)
            sync(backend.device)
            t_step = time.perf_counter()
            logits = _answer_logits(win, question)
            sync(backend.device)
            t_end = time.perf_counter()
            ref_logits, ms = _reprefill(backend, _window_ids(win) + question)
            if i:
                ttft.append((t_end - t0) * 1000.0)
                step.append((t_step - t0) * 1000.0)
                reprefill.append(ms)
                kl = max(kl, kl_divergence(ref_logits, logits))
            win.discard()
        base.close()
        med = statistics.median
        rows.append({
            "policy": policy, "window_tokens": len(window_pages) * size, "page_tokens": size, "repeats": repeats,
            "ttft_ms": round(med(ttft), 4), "ttft_min_ms": round(min(ttft), 4), "step_ms": round(med(step), 4),
            "reprefill_ms": round(med(reprefill), 4), "reprefill_min_ms": round(min(reprefill), 4),
            "ttft_vs_reprefill": round(med(reprefill) / med(ttft), 3), "kl_answer_max": kl,
        })
    return rows


def healer_interference(
    backend: Any, pages: list[list[int]], *, rank: int = DEFAULT_RANK, probes: int = 8, seed: int = 0
) -> dict[str, Any]:
    """How long foreground operations wait for the idle healer.

    A latency-first window of ``pages`` is reversed (every page but the new first one is queued
    for healing, one conditioned forward each); the healer starts at once; ``probes`` foreground
    ``materialize()`` calls arrive at seeded random moments while it works. Reports the longest
    and median wait for the model against one decoder layer's share of a conditioned forward of
    one page after the rest of the window (the bound the healer promises), and the steps it
    finished vs abandoned."""
    import random

    rng = random.Random(seed)
    size = len(pages[0])
    win = ContextWindow(backend, budget_tokens=len(pages) * size, rank=rank, patch_policy="latency")
    for p in pages:
        win.append(token_ids=p)
        win.heal()
    # one layer's share of the forward a heal step runs: a page after the rest of the window
    past = [tuple(t[0] for t in kv) for kv in _cache_layers(win)]
    past = [(k[:, : -size], v[:, : -size]) for k, v in past]
    start = backend.root_len + (len(pages) - 1) * size
    _, fwd_ms = _timed(lambda: backend.forward(input_ids=pages[-1], positions=backend.text_positions(start, size), past=past, logits="none"))
    layer_ms = fwd_ms / max(1, backend.layout.num_layers)
    win.reorder(list(reversed(win.refs)))
    waits: list[float] = []
    with win.start_healing(idle_ms=0) as healer:
        for _ in range(probes):
            time.sleep(rng.uniform(0.05, 0.6))
            if not win.pending_refs:
                break
            n = len(win.context.foreground_waits_ms)
            win.materialize()
            waits.append(list(win.context.foreground_waits_ms)[n])
        healer.wait_idle(timeout=600)
    waits.sort()
    return {
        "probes": len(waits),
        "max_wait_ms": round(waits[-1], 3) if waits else 0.0,
        "median_wait_ms": round(waits[len(waits) // 2], 3) if waits else 0.0,
        "layer_forward_ms": round(layer_ms, 3),
        "max_wait_in_layers": round((waits[-1] if waits else 0.0) / max(layer_ms, 1e-9), 3),
        "heal_steps": healer.steps,
        "heal_steps_abandoned": healer.yielded,
        "healer_errors": len(healer.errors),
        "pending_after": len(win.pending_refs),
    }


def _cache_layers(win: ContextWindow) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from ..core import compat

    cache = win.materialize()
    return [compat.cache_layer(cache, l) for l in range(compat.cache_num_layers(cache))]
