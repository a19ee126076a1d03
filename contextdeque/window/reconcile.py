"""The reconcile pass: after a structural change, bring every slot's conditioning and page up
to date, in window order, as the patch policy and the cascade policy say.

Each slot is looked at once, after the slots in front of it are final (a patch is formed on
the antecedents' *current* KV). Per slot: ask the policy (why the slot is looked at, what is
in front of it), carry out the decision (store lookup first, one conditioned forward only on
a miss), then re-place its page if its start or its conditioning changed. Slots whose start
and conditioning are unchanged keep their page object (no bytes written).
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from ..core.chunk import Chunk
from ..core.kv import concat_kv
from ..patch import PATCH_KINDS, form_patch, patch_signature
from ..patch.rank import FULL, is_full
from ..core.cooperative import checkpoint
from .context import WindowContext
from .graph import Cascade
from .ingest import reforward_run
from .kvstate import antecedent_states
from .plan import Clear, Form, Keep, Prepared, Reuse
from .prepared import prepared_key
from .policy import CLEAR, KEEP, Decision, PatchPolicy
from .receipt import Meter
from .ref import ChunkRef
from .slot import Conditioning, Slot, Tag
from .staleness import staleness
from .store import WindowStore


def place(ctx: WindowContext, slot: Slot, start: int, stack: tuple[Conditioning, ...], meter: Meter) -> Slot:
    """``slot`` at ``start`` with ``stack``; a new page (relocation from the content frame, plus the
    stack's patches; computed when first read) only if either changed."""
    if slot.placed and start == slot.start and stack is slot.stack:
        return slot
    if slot.provisional and stack is not slot.stack:
        raise AssertionError("a provisional slot cannot take a patch before it is healed")
    out = Slot(ref=slot.ref, chunk=slot.chunk, stack=stack, start=start, stale=slot.stale, layout=ctx.layout,
               inline_on=slot.inline_on)
    meter.page(out.page_nbytes)
    return out


def patch_store_key(ctx: WindowContext, slot: Slot, prefix: Sequence[Slot], kind: str, ranks: tuple[int, int]) -> str:
    """Store key of the ``kind`` patch for ``slot`` on ``prefix``: named by the prefix's KV states
    (``window.kvstate``), so it is valid exactly behind the KV it was formed on (see
    :func:`patch_key_for`)."""
    states = antecedent_states(prefix, ordered=PATCH_KINDS[kind].ordered)
    return patch_key_for(ctx, slot.chunk, states, kind, ranks, [p.id for p in slot.patches])


def patch_key_for(ctx: WindowContext, chunk, prefix_states: Sequence[str], kind: str, ranks: tuple[int, int],
                  base_ids: Sequence[str] = ()) -> str:
    """Store key of the ``kind`` patch of ``chunk`` on the antecedent states ``prefix_states``
    (``window.kvstate.antecedent_states``).

    The signature (``patch.keys.patch_signature``) covers the antecedent states as the kind
    orders them, what the kind adds for the patches it is stacked on (``base_ids``), and the
    window's formation context: the policy's regime and, under a fidelity target, the rule's
    parts (energy, byte cap, ``on_miss``). Exact and recall patches measure the same thing (one
    conditioned forward on the antecedents) and share one store kind, so a recall behind the antecedents a chunk was first
    placed after is a store hit."""
    context = [f"regime:{ctx.policy.regime}"]
    rule = ctx.fidelity_rule
    if rule is not None:
        context += rule.key_parts()
    sig = patch_signature(kind, prefix_states, base_ids=base_ids, context=context)
    return WindowStore.patch_key(chunk, sig, PATCH_KINDS[kind].store_kind(), ranks)


def served_label(kind: str, reused: bool, anticipated: bool) -> str:
    """What ``Receipt.served`` says a chunk given a patch was served: ``"fresh"`` (formed now),
    ``"anticipated"`` (a stored patch anticipation formed in idle time), ``"orbit"`` (a stored orbit
    patch: every ordering of its antecedent set), ``"recurring"`` (a stored patch formed earlier for
    this very arrangement: a recurring antecedent, amortized)."""
    if not reused:
        return "fresh"
    return "anticipated" if anticipated else "orbit" if kind == "orbit" else "recurring"


def obtain(
    ctx: WindowContext, slot: Slot, prefix: Sequence[Slot], decision: Decision, meter: Meter
) -> Conditioning | None:
    """The patch a ``form`` decision asks for: from the store, else formed (unless
    ``reuse_only``). None when a ``reuse_only`` lookup misses."""
    kind = decision.kind
    assert kind is not None and decision.rank is not None
    rk, rv = ctx.formation_ranks(decision.rank, slot.chunk.n_tokens)
    # under a fidelity target a patch is formed with every direction and cut per layer by the
    # rule, which records how it met the target; a full-rank ask (exact conditioning) stays exact
    rule = ctx.fidelity_rule if not is_full(decision.rank) else None
    key = patch_store_key(ctx, slot, prefix, kind, (rk, rv))
    q0 = len(meter.traffic.quarantined)
    patch = ctx.store.get_patch(key, fingerprint=ctx.fingerprint, traffic=meter.traffic)
    healed = patch is None and len(meter.traffic.quarantined) > q0
    reused = patch is not None
    antecedents = tuple(s.chunk.id for s in prefix)
    if patch is None:
        if decision.reuse_only:
            return None
        fw0 = ctx.backend.forwards_run
        options = dict(decision.options)
        if PATCH_KINDS[kind].stacked:
            options["current"] = list(slot.patches)
        if all(s.placed for s in prefix):
            # the antecedents are already placed: hand their pages over instead of re-placing
            options["past"] = concat_kv([ctx.backend.root_kv(), *(s.page for s in prefix)])
        patch = form_patch(
            ctx.backend,
            slot.chunk,
            antecedents=[(s.chunk, list(s.patches)) for s in prefix],
            rank=rk,
            rank_v=rv,
            kind=kind,
            fidelity=rule,
            **options,
        )
        failed = ctx.store.put_patch(key, patch, traffic=meter.traffic)
        if failed:
            meter.notes.append(failed)
        meter.plan.add(Form(slot.chunk.id, slot.n_tokens, kind=kind, antecedents=antecedents,
                            forwards=int(ctx.backend.forwards_run - fw0), context=sum(s.n_tokens for s in prefix),
                            tier=ctx.store.tier_of(key) or "none", nbytes=patch.nbytes))
        if PATCH_KINDS[kind].exact_on_prefix:  # what the placement scheduler may aim for
            ctx.note_stored_prefix(slot.chunk.id, tuple(s.chunk.id for s in prefix))
        meter.patches_formed += 1
        meter.formed_keys.append(key)
        if healed:
            meter.repairs.append(f"re-formed the {kind} patch of #{slot.ref.key} (its stored copy was corrupt)")
    else:
        meter.patches_reused += 1
        meter.plan.add(Reuse(slot.chunk.id, slot.n_tokens, kind=kind, antecedents=antecedents))
    meter.served[slot.ref] = served_label(kind, reused, key in ctx.anticipated_keys)
    cap_k, cap_v = ctx.clamp_rank(FULL, slot.chunk.n_tokens)
    # a stacked correction replaces the conditioning only when it holds every direction of every
    # layer (what it holds, not what it was asked for: the fidelity rule cuts it per layer)
    ranks_k, ranks_v = patch.layer_ranks
    absolute = not PATCH_KINDS[kind].stacked or (
        len(patch.layers) == slot.chunk.num_layers and min(ranks_k, default=0) >= cap_k and min(ranks_v, default=0) >= cap_v)
    meter.notes.append(f"#{slot.ref.key}:{kind}@{patch.rank_label if patch.per_layer else rk}{'(reused)' if reused else ''}")
    meter.note_fidelity(slot, patch)
    formed_on = tuple((s.ref, s.version) for s in prefix)
    return Conditioning(patch=patch, formed_on=formed_on, absolute=absolute, reused=reused, key=key)


def execute(
    ctx: WindowContext, slot: Slot, prefix: Sequence[Slot], decision: Decision, meter: Meter, reason: str | None = None
) -> tuple[Conditioning, ...]:
    """The slot's new conditioning stack under ``decision`` (``slot.stack`` itself if unchanged).

    A ``deferred`` keep/clear (latency-first) is recorded on the meter with what it served."""
    while True:
        if decision.deferred:
            stack = slot.stack if decision.action == "keep" or not slot.stack else ()
            meter.carried.setdefault(slot.ref, slot.conditioned_on)  # what heal's eager decision starts from
            if slot.provisional:  # its own conditioned forward's KV, waiting for its canonical
                meter.deferred[slot.ref] = (reason, "conditioned", staleness(slot, prefix))
            elif stack:
                meter.deferred[slot.ref] = (reason, "stale", staleness(slot, prefix))
            else:
                meter.deferred[slot.ref] = (reason, "blind", 1.0 if prefix else 0.0)
            meter.served[slot.ref] = meter.deferred[slot.ref][1]
            meter.plan.add((Keep if stack is slot.stack else Clear)(slot.chunk.id, slot.n_tokens, deferred=True))
            return stack
        if decision.action == "keep":
            if reason is not None:  # (a slot nothing happened to is not part of the plan)
                meter.plan.add(Keep(slot.chunk.id, slot.n_tokens))
            return slot.stack
        if decision.action == "clear":
            if reason is not None or slot.stack:
                meter.plan.add(Clear(slot.chunk.id, slot.n_tokens))
            return () if slot.stack else slot.stack
        rk, rv = ctx.clamp_rank(decision.rank, slot.chunk.n_tokens)
        if rk == 0 and rv == 0:  # rank 0: nothing to add
            decision = KEEP if decision.stack else CLEAR
            continue
        cond = obtain(ctx, slot, prefix, decision, meter)
        if cond is None:
            decision = decision.fallback or KEEP
            continue
        meter.reconditioned.add(slot.ref)
        return (*slot.stack, cond) if decision.stack else (cond,)


def _defers_reforward(ctx: WindowContext, slot: Slot, prefix: Sequence[Slot], reason: str | None, valid: bool,
                      in_cascade: bool) -> bool:
    """Whether the window's policy defers provisional ``slot`` to a re-forward by ``heal`` here
    (latency-first: the eager policy would re-condition it; ``latency-shared`` heals with the
    canonical instead, so nothing is re-forwarded)."""
    if not getattr(ctx.policy, "lazy_canonicals", False):
        return False
    cascade = in_cascade and ctx.cascade_policy == "reform"
    asked = ctx.policy.decide("cascade" if cascade else reason, slot, prefix, valid=valid and not cascade, rank=ctx.rank)
    return asked.deferred


def _prepared(ctx: WindowContext, slot: Slot, prefix: Sequence[Slot], mode: str, meter: Meter,
              ran: Mapping[Hashable, Chunk]) -> Slot | None:
    """Provisional ``slot`` conditioned anew behind ``prefix`` (``reconcile``'s ``prepared``):
    ``"run"``: the conditioned forward this pass ran ahead (``ran``, by prepared key: kept in
    ``ctx.prepared`` for the step that lands here where its bound allowed) or one kept for this
    prefix already; ``"take"``: the one kept for exactly this prefix (None: none)."""
    key = prepared_key(slot.chunk.id, prefix)
    found = ctx.prepared.get(key)
    if found is None and mode == "run":
        found = ran.get(key)
    if found is None:
        return None
    if mode == "run":  # prepared before (another prediction through this arrangement): nothing to run
        return Slot(ref=slot.ref, chunk=found, inline_on=tuple((s.ref, s.version) for s in prefix))
    meter.served[slot.ref] = "anticipated"
    meter.plan.add(Prepared(slot.chunk.id, slot.n_tokens, antecedents=tuple(s.chunk.id for s in prefix)))
    return Slot(ref=slot.ref, chunk=found, inline_on=tuple((s.ref, s.version) for s in prefix))


def reconcile(
    ctx: WindowContext,
    slots: Sequence[Slot],
    reasons: Mapping[ChunkRef, str],
    meter: Meter,
    *,
    recalled: ChunkRef | None = None,
    cascade_candidates: frozenset[ChunkRef] = frozenset(),
    policy: PatchPolicy | None = None,
    prepared: str | None = None,
) -> tuple[tuple[Slot, ...], Cascade | None]:
    """Re-condition and re-place ``slots`` (the window's new order) after an operation.

    ``reasons``: why each touched slot is looked at (see ``policy`` module). ``recalled``: the
    slot a recall just re-instated; ``cascade_candidates``: in-window chunks that transitively
    depend on it in the conditioning graph. Returns the new slots and, for a recall, the
    cascade it implied and how the cascade policy handled it. ``policy``: decide with this
    policy instead of the window's (``heal`` carries out the eager policy's decisions).
    ``prepared``: what becomes of a provisional slot the window's (latency-first) policy would
    defer to ``heal``'s re-forward (``window.prepared``): ``"run"`` runs that forward now and
    keeps it for the step that lands here (anticipation's simulation), ``"take"`` takes the one
    kept for exactly this prefix, if any (a live step); None: neither.
    """
    policy = policy or ctx.policy
    out: list[Slot] = []
    pos = ctx.root_len
    index = {s.ref: i for i, s in enumerate(slots)}
    new_version: dict[ChunkRef, str] = {}
    implied: list[ChunkRef] = []
    direct: list[ChunkRef] = []
    reformed: list[ChunkRef] = []
    flagged: list[ChunkRef] = []
    ran: dict[Hashable, Chunk] = {}  # prepared key -> the chunk this pass re-forwarded ahead

    def decide(i: int, slot: Slot, prefix: tuple[Slot, ...], implied: Sequence[ChunkRef],
               new_version: Mapping[ChunkRef, str]) -> tuple[str | None, Decision, bool, bool, bool]:
        """``(reason, decision, in_cascade, is_direct, reforward)`` of ``slot`` at ``i`` behind
        ``prefix``; ``reforward``: a provisional slot re-forwarded per ``prepared``."""
        prefix_tags: tuple[Tag, ...] = tuple((s.ref, s.version) for s in prefix)
        reason = reasons.get(slot.ref)
        valid = slot.conditioned_on == prefix_tags
        is_direct = in_cascade = False
        if recalled is not None and slot.ref in cascade_candidates:
            for a, v in slot.conditioned_on:
                ia = index.get(a)
                if ia is None:
                    continue
                behind = ia > i  # conditioned on a chunk that now sits after it
                if a == recalled and (behind or new_version.get(a) != v):
                    is_direct = in_cascade = True
                elif a in implied or (behind and a in cascade_candidates):
                    in_cascade = True
        decision = policy.decide(reason, slot, prefix, valid=valid, rank=ctx.rank)
        # a chunk in the cascade re-forms where its own decision could leave its conditioning as it
        # is (a keep, or an inserted chunk's store-only patch falling back to keep)
        if in_cascade and ctx.cascade_policy == "reform" and decision.may_keep:
            reason = "cascade"
            decision = policy.decide(reason, slot, prefix, valid=False, rank=ctx.rank)
        reforward = bool(prepared is not None and slot.provisional and prefix and reason != "append" and
                         (prepared == "run" or len(ctx.prepared)) and
                         _defers_reforward(ctx, slot, prefix, reason, valid, in_cascade))
        return reason, decision, in_cascade, is_direct, reforward

    def run_ahead(i: int, slot: Slot, prefix: tuple[Slot, ...], in_cascade: bool) -> None:
        """Slot ``i``'s prepared re-forward and those of the slots right behind it that the pass
        will re-forward next, each behind the ones before it: one forward of their concatenation
        (``ingest.reforward_run``), each in ``ran`` for the pass to take in turn (a forward run
        once, whether or not ``ctx.prepared``'s bound keeps it for a later step)."""
        run, ahead = [slot], list(prefix)
        implied_ahead, versions = [*implied, *([slot.ref] if in_cascade else [])], dict(new_version)
        for j in range(i, len(slots)):
            if j > i:
                _, _, cascade_j, _, again = decide(j, slots[j], tuple(ahead), implied_ahead, versions)
                if not again or ctx.prepared.get(prepared_key(slots[j].chunk.id, ahead)) is not None:
                    break
                run.append(slots[j])
                if cascade_j:
                    implied_ahead.append(slots[j].ref)
            # (the slot as the pass will hold it: its content behind the ones in front of it)
            ahead.append(Slot(ref=slots[j].ref, chunk=slots[j].chunk, inline_on=tuple((s.ref, s.version) for s in ahead)))
            versions[slots[j].ref] = ahead[-1].version
        for k, new in enumerate(reforward_run(ctx, run, prefix, meter)):
            key = prepared_key(new.chunk.id, ahead[:len(prefix) + k])
            ctx.prepared.put(key, new.chunk)
            ran[key] = new.chunk

    for i, slot in enumerate(slots):
        checkpoint()
        prefix = tuple(out)
        reason, decision, in_cascade, is_direct, reforward = decide(i, slot, prefix, implied, new_version)
        redone = None
        if reforward:
            key = prepared_key(slot.chunk.id, prefix)
            if prepared == "run" and key not in ran and ctx.prepared.get(key) is None:
                run_ahead(i, slot, prefix, in_cascade)
            redone = _prepared(ctx, slot, prefix, prepared, meter, ran)
            if redone is not None:
                slot, decision = redone, KEEP
                meter.reconditioned.add(slot.ref)
        stack = execute(ctx, slot, prefix, decision, meter, reason)
        new = place(ctx, slot, pos, stack, meter)
        if stack is not slot.stack and new.stale:
            new = new.flagged(False)  # re-conditioned: no longer stale
        if in_cascade:
            implied.append(slot.ref)
            if is_direct:
                direct.append(slot.ref)
            if stack is not slot.stack or redone is not None:
                reformed.append(slot.ref)
            elif ctx.cascade_policy == "flag":
                new = new.flagged(True)
                flagged.append(slot.ref)
        out.append(new)
        new_version[slot.ref] = new.version
        pos = new.end
    cascade = None
    if recalled is not None:
        cascade = Cascade(
            recalled=recalled,
            direct=tuple(direct),
            implied=tuple(implied),
            action=ctx.cascade_policy,
            reformed=tuple(reformed),
            flagged=tuple(flagged),
        )
    return tuple(out), cascade
