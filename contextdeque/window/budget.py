"""A fidelity floor users can set: ``ContextWindow(..., answer_kl_budget=...)``.

A latency-first window answers a re-read with no forward on the critical path; what it could not
serve valid (no stored patch, anticipation missed) it serves stale or blind and queues for
``heal``. This module estimates what that costs the next answer and, when the estimate is above the
budget, lets the step form the one patch that matters most, within a time cap.

**The estimate.** Per chunk in the window, its *deficit* in [0, 1]: for a chunk holding what the
eager policy would give it (a valid patch, its canonical at the front, its own conditioned forward
where it was read) 0, or ``1 - η`` where its patch was formed under a ``fidelity_target`` and the
model's calibrated envelope estimated its η (:func:`envelope_residual`); its staleness score (``window.staleness``) for a chunk served stale, 1 for a
blind canonical behind other chunks. Its estimated next-token KL is ``blind_kl x deficit``, where
``blind_kl`` is the KL a blind chunk costs the answer: ``WindowConfig.blind_kl`` (default
:data:`DEFAULT_BLIND_KL`, measured on the default model). The arrangement's estimate is the sum over
chunks (conservative: every deficit adds to the answer's). Valid chunks count 0: the budget bounds
what deferral costs over the eager policy, whose own residual (a rank-m patch, ~1e-3 on the default
model) is the floor no budget below it can reach, unless the envelope estimated it.

**The step.** After an operation, when its estimate exceeds ``answer_kl_budget``, the pending chunk
with the largest estimate (among equals, the one the operation brought in: a recall miss forms the
recalled chunk's own patch) gets one forward at once (:func:`heal_one`: the heal step when nothing
pending stands in front of it, else its patch on the window as it stands, not stored), if that
forward is predicted to fit ``kl_budget_ms`` (from the window family's measured ms per prefilled
token; the first time, with nothing measured, it runs). The operation's receipt then
holds both (``Receipt.budget`` says what was estimated and done).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..patch.alloc import fidelity_report
from .ref import ChunkRef
from .slot import Slot
from .staleness import staleness

if TYPE_CHECKING:  # pragma: no cover
    from .receipt import Meter, Receipt
    from .state import WindowState
    from .window import ContextWindow

DEFAULT_BLIND_KL = 0.06
"""Next-token KL one blind chunk costs the answer on the default model (SmolLM2-135M, 4 x 512-token
pages of pydoc text), measured: 0.033 (``window-bench --miss``, the ``blind`` arm: the page recalled
at the end as its relocated canonical), 0.061 (issue 21's latency-first recall step), 0.100 (its
slide step, the front page blind); 0.06 is their middle. A prior: set ``blind_kl`` for another model."""


@dataclass(frozen=True)
class ChunkEstimate:
    """One chunk's state after an operation: what it holds (``served``: ``"valid"``, or the deferred
    ``"stale"`` / ``"blind"`` / ``"conditioned"``), its deficit and its estimated KL."""

    ref: ChunkRef
    served: str
    deficit: float
    kl: float

    def as_dict(self) -> dict[str, Any]:
        return {"ref": self.ref.key, "served": self.served, "deficit": round(self.deficit, 4), "kl": self.kl}


@dataclass(frozen=True)
class BudgetReport:
    """What the fidelity floor saw and did on one operation.

    ``estimate``: the arrangement's estimated KL after the operation (before any fix);
    ``after``: after the fix (== ``estimate`` when nothing was formed); ``budget``: the setting;
    ``formed``: the chunk healed to meet it (None: none); ``skipped``: why nothing was formed
    although the estimate was above the budget (``"over the time cap"``), else ""; ``chunks``:
    per chunk estimates after the fix."""

    budget: float
    estimate: float
    after: float
    formed: ChunkRef | None
    skipped: str
    predicted_ms: float | None
    chunks: tuple[ChunkEstimate, ...]

    @property
    def bound(self) -> bool:
        """Whether the budget made the operation form something."""
        return self.formed is not None

    def as_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "estimate": self.estimate, "after": self.after,
                "formed": None if self.formed is None else self.formed.key, "skipped": self.skipped,
                "predicted_ms": self.predicted_ms, "chunks": [c.as_dict() for c in self.chunks]}


def chunk_estimates(slots: Sequence[Slot], pending: Any, served: dict[ChunkRef, str], blind_kl: float) -> list[ChunkEstimate]:
    """Per slot (window order): its deficit and estimated KL (see the module doc). ``pending``: the
    refs queued for healing; ``served``: what the operation served each deferred chunk."""
    out = []
    for i, s in enumerate(slots):
        if s.ref not in pending:
            deficit = envelope_residual(s)
            out.append(ChunkEstimate(s.ref, "valid", deficit, blind_kl * deficit))
            continue
        deficit = staleness(s, slots[:i])
        what = served.get(s.ref) or ("blind" if not s.stack and not s.provisional else "stale")
        out.append(ChunkEstimate(s.ref, what, deficit, blind_kl * deficit))
    return out


def _ms_per_token(win: "ContextWindow") -> float | None:
    rate = win._ctx.__dict__.get("_budget_ms_per_token")
    return None if rate is None else float(rate)


def envelope_residual(slot: Slot) -> float:
    """The share of the blind gap a valid slot's patch leaves, by the model's calibrated envelope:
    ``1 - η`` of its last patch where it was formed under a ``fidelity_target`` (the envelope's η
    estimate for the energy it captured, ``patch.alloc.fidelity_report``); 0 otherwise (no estimate:
    the eager policy's own residual is the floor)."""
    if not slot.stack:
        return 0.0
    rep = fidelity_report(slot.stack[-1].patch)
    eta = None if rep is None else rep.get("eta_est")
    return 0.0 if eta is None else max(0.0, min(1.0, 1.0 - float(eta)))


def learn_rate(win: "ContextWindow", receipt: "Receipt") -> None:
    if receipt.tokens_prefilled > 0 and receipt.wall_ms > 0:
        rate = receipt.wall_ms / receipt.tokens_prefilled
        old = _ms_per_token(win)
        win._ctx.__dict__["_budget_ms_per_token"] = rate if old is None else 0.5 * (old + rate)


def _predicted_tokens(state: "WindowState", target: ChunkRef) -> int:
    """Tokens the budget's step for ``target`` prefills: its own (see :func:`heal_one`)."""
    return state.slots[state.index(target)].n_tokens


def heal_one(win: "ContextWindow", target: ChunkRef) -> "Receipt":
    """One forward for ``target``, as a transaction. With nothing pending in front of it, the heal
    step (the eager policy's decision, stored under its usual key: exactly what ``heal()`` would
    form). Otherwise its patch is formed on the window as it stands (the stale or blind chunks in
    front included), placed but **not stored** (a stored patch is keyed by the antecedents' ids, and
    these antecedents are not in the state the key promises), and it stays queued: ``heal()`` later
    forms the eager policy's patch once the chunks in front are healed."""
    state = win._state
    idx = state.index(target)
    if not any(s.ref in state.pending for s in state.slots[:idx]) or state.slots[idx].provisional:
        return win._heal_step(target)

    def body(state: "WindowState", meter: "Meter") -> tuple[dict[str, Any], None]:
        from ..core.kv import concat_kv
        from ..patch import form_patch
        from .plan import Form
        from .reconcile import place
        from .slot import Conditioning

        ctx = win._ctx
        slots = list(state.slots)
        i = state.index(target)
        slot, prefix = slots[i], slots[:i]
        rk, rv = ctx.formation_ranks(ctx.rank, slot.chunk.n_tokens)
        patch = form_patch(ctx.backend, slot.chunk, antecedents=[(s.chunk, list(s.patches)) for s in prefix],
                           rank=rk, rank_v=rv, kind="recall", fidelity=ctx.fidelity_rule,
                           past=concat_kv([ctx.backend.root_kv(), *(s.page for s in prefix)]))
        meter.patches_formed += 1
        meter.plan.add(Form(slot.chunk.id, slot.n_tokens, kind="recall", antecedents=tuple(p.chunk.id for p in prefix),
                            forwards=1, context=sum(p.n_tokens for p in prefix), tier="none", nbytes=patch.nbytes))
        cond = Conditioning(patch=patch, formed_on=tuple((s.ref, s.version) for s in prefix), absolute=True)
        slots[i] = place(ctx, slot, slot.start, (cond,), meter)
        meter.served[target] = "fresh"
        meter.notes.append(f"#{target.key}: recall patch on the window as it stands (not stored; still queued)")
        state.slots = tuple(slots)
        return {"refs": (target,)}, None

    return win._run("budget", body)[0]


def enforce(win: "ContextWindow", receipt: "Receipt") -> "Receipt":
    """After an operation (``receipt``, already installed): estimate, and heal the one chunk that
    matters most when the estimate exceeds the window's ``answer_kl_budget`` within
    ``kl_budget_ms`` (see the module doc). Returns the operation's receipt, with the heal step's
    costs added and ``budget`` set."""
    cfg = win._ctx.config
    budget = cfg.answer_kl_budget
    if budget is None:
        return receipt
    state = win._state
    served = {r: what for r, what, _ in receipt.deferred}
    chunks = chunk_estimates(state.slots, state.pending, served, cfg.blind_kl)
    estimate = sum(c.kl for c in chunks)
    formed, skipped, predicted, after_chunks = None, "", None, chunks
    out = receipt
    deferred = [c for c in chunks if c.served != "valid" and c.kl > 0]
    if estimate > budget and not deferred:
        skipped = "nothing deferred: the estimate is the valid patches' own residual"
    elif estimate > budget:
        # the largest estimate; among equals the chunk the operation brought in (a miss forms the
        # recalled chunk's own patch first: the chunks behind it keep theirs, as survivors do)
        own = set(receipt.refs)
        target = max(deferred, key=lambda c: (c.kl, c.ref in own)).ref
        rate = _ms_per_token(win)
        predicted = None if rate is None else rate * _predicted_tokens(state, target)
        if cfg.kl_budget_ms is not None and predicted is not None and predicted > cfg.kl_budget_ms:
            skipped = f"over the time cap ({predicted:.0f} ms predicted > {cfg.kl_budget_ms:g} ms)"
        else:
            step = heal_one(win, target)
            learn_rate(win, step)
            formed = target
            out = receipt + step
            out.notes = out.notes + (f"answer_kl_budget: healed #{target.key} (estimate {estimate:.2e} > {budget:g})",)
            served[target] = "fresh"  # (still queued when its patch was formed on stale antecedents)
            after_chunks = chunk_estimates(win._state.slots, win._state.pending, served, cfg.blind_kl)
    report = BudgetReport(budget=budget, estimate=estimate, after=sum(c.kl for c in after_chunks), formed=formed,
                          skipped=skipped, predicted_ms=predicted, chunks=tuple(after_chunks))
    out = dataclasses.replace(out, budget=report)
    win.last_receipt = out  # (the operation and the heal step are each in ``receipts`` already)
    return out
