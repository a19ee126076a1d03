"""The live executor of a trace: a real :class:`~contextdeque.window.ContextWindow` driven through a
trace's window operations, the same trace the cost model prices.

One driver for everything that runs a trace on a window (``replay --fidelity``, the test that the
cost model's predicted forwards and tokens equal the window's receipts): ``arrive`` appends (or
recalls a chunk the window evicted; a new chunk always goes to the end, ``append`` takes no
index), ``recall`` / ``evict`` / ``reorder`` act on the chunk's ref,
``slide`` evicts the agent's ``n`` oldest (its own order, wherever placement put them), ``fork`` /
``commit`` / ``discard`` stack windows, ``expect`` passes the agent's hint on (a recall,
``window.expect``, or an order, ``window.expect_order``), and a ``step`` heals what a latency-first window queued
(the agent's tool time, as the cost model assumes); what is still queued when the trace ends is
healed after it. Queries are handed to ``on_query`` (the window itself does not read them).

With ``idle_tokens`` the trace's idle gaps are honoured instead: at each ``step`` the window heals
(and, with ``anticipate=True``, anticipates) within a deterministic budget of
``idle_tokens(idle_ms)`` prefilled tokens (``traces.idle_gaps``; 0: nothing), so what a re-read
finds depends on the idle time the agent had, not on the machine's speed.
"""

from __future__ import annotations

from typing import Any, Callable

from ..traces.io import Trace, idle_gaps
from ..window.placement import END
from ..window.receipt import Receipt


def _asked(at: int | None, pinned: bool = True) -> int | str | None:
    """A trace's recall position as the window takes it: a trace's ``at=None`` is the end, as the
    replay prices it (pinned: the window's own choice for unpinned recalls is not the trace's), or
    with ``pinned=False`` None, where ``recall(ref)`` puts it."""
    return (END if pinned else None) if at is None else at

TokenIds = Callable[[Any], "list[int]"]


def idle_budget(idle_rate: float, scale: float = 1.0) -> Callable[[float], int]:
    """An idle gap of ``ms`` milliseconds as a heal budget in the trace's tokens, ``scale`` x them
    (``drive_window``'s and ``Replayer``'s ``idle_tokens``): ``ms / 1000 x idle_rate x scale``.
    The fidelity mode's window runs a scaled trace (``scale`` < 1); the cost model prices the
    trace itself (``scale`` 1), so both spend the same idle seconds."""
    return lambda ms: int(ms / 1000.0 * float(idle_rate) * scale)


def recall_step(at: int | None, n_in_window: int) -> str:
    """``recall`` appends at the end; ``look-back`` brings a chunk back inside the window."""
    return "recall" if at is None or at >= n_in_window else "look-back"


def drive_window(window: Any, trace: Trace, token_ids: TokenIds, *,
                 on_query: Callable[[int, Any, Any, str], None] | None = None, heal_at_end: bool = True,
                 on_step: Callable[[str, Receipt], None] | None = None,
                 idle_tokens: Callable[[float], int] | None = None, hints: bool = True,
                 pin_recalls: bool = True) -> Receipt:
    """Run ``trace`` on ``window``; returns the sum of its window operations' receipts (``op="trace"``).

    ``token_ids(arrive_event)``: the ids a chunk's content becomes (called once per chunk id).
    ``on_query(index, event, window, step)``: called at every query with the window as it stands
    and the step type of the last window operation (``append``, ``recall``, ``look-back``,
    ``slide``, ``evict``, ``reorder``, ``fork``, ``commit``, ``discard``).
    ``on_step(step, receipt)``: called after every event that ran window operations, with its step
    type and their receipts summed (a ``slide`` of n is n evictions). ``idle_tokens(idle_ms)``: the
    heal budget of a step's idle gap, in prefilled tokens (see the module doc); None: heal what is
    queued at every step, to completion. ``hints``: pass the trace's ``expect`` events on to the
    window (``ContextWindow.expect``; False: the predictor goes without what the agent said).
    ``pin_recalls=False``: a recall the trace does not place (``at`` None) is ``recall(ref)``, where
    the window's recall placement puts it (``WindowConfig.recall_placement``: where a stored patch
    stays valid), instead of the end (issue 21's placement that seeks validity)."""
    win = window
    receipts: list[Receipt] = []
    gaps = idle_gaps(trace) if idle_tokens is not None else {}
    stack: list[tuple[Any, list[str]]] = []
    refs: dict[str, Any] = {}
    ids_of: dict[str, list[int]] = {}
    logical: list[str] = []  # the agent's own order (what `slide` counts)
    step = "append"
    for i, ev in enumerate(trace.events):
        op = ev.op
        ran = len(receipts)
        if op not in ("query", "step"):
            step = op if op not in ("arrive", "recall") else "append"
        if op == "arrive":
            if ev.id in refs and refs[ev.id] in win.evicted_refs:
                step = recall_step(ev.at, len(logical))
                receipts.append(win.recall(refs[ev.id], at=_asked(ev.at, pin_recalls)))
            elif ev.id not in refs or refs[ev.id] not in win.refs:
                if ev.id not in ids_of:
                    ids_of[ev.id] = token_ids(ev)
                refs[ev.id] = win.append(token_ids=ids_of[ev.id])  # (the window appends at the end only)
                receipts.append(win.last_receipt)
            logical.insert(len(logical) if ev.at is None else min(ev.at, len(logical)), ev.id)
        elif op == "recall":
            step = recall_step(ev.at, len(logical))
            if refs[ev.id] in win.evicted_refs:  # (not if it never left: a budget keeps no order)
                receipts.append(win.recall(refs[ev.id], at=_asked(ev.at, pin_recalls)))
            logical.insert(len(logical) if ev.at is None else min(ev.at, len(logical)), ev.id)
        elif op == "evict":
            if refs[ev.id] in win.refs:  # (a token budget may have let it go already)
                receipts.append(win.evict(refs[ev.id]))
            logical.remove(ev.id)
        elif op == "slide":
            for cid in logical[: ev.n]:
                if refs[cid] in win.refs:
                    receipts.append(win.evict(refs[cid]))
            del logical[: ev.n]
        elif op == "reorder":
            # the named chunks still in the window in the asked order, then any others (as the replay)
            here = set(win.refs)
            named = [refs[c] for c in ev.order if refs[c] in here]
            receipts.append(win.reorder(named + [r for r in win.refs if r not in set(named)]))
            logical = list(ev.order)
        elif op == "fork":
            stack.append((win, list(logical)))
            win = win.fork()
        elif op == "commit":
            receipts.append(win.commit())
            win, _ = stack.pop()
        elif op == "discard":
            receipts.append(win.discard())
            win, logical = stack.pop()
        elif op == "expect" and ev.order is not None:
            if hints:  # the order as the reorder executor will ask it: the named chunks, then any others
                known = set(win.refs) | set(win.evicted_refs)
                named = [refs[c] for c in ev.order if c in refs and refs[c] in known]
                win.expect_order(named + [r for r in win.refs if r not in set(named)])
            continue
        elif op == "expect":
            if hints and ev.id in refs and refs[ev.id] in win.evicted_refs:  # where the recall will insist on
                win.expect(refs[ev.id], at=_asked(ev.at, pin_recalls))
            continue
        elif op == "step":
            if idle_tokens is not None:  # the idle gap the trace records: heal and anticipate within it
                budget = int(idle_tokens(gaps[i]))
                if budget > 0:
                    receipts.append(win.heal(max_tokens=budget))
            elif win.pending_refs or win.anticipation_due:  # the agent's tool time: heal (and with
                receipts.append(win.heal())  # anticipate=True prepare what comes next), as the replay does
            continue
        elif op == "query" and on_query is not None:
            on_query(i, ev, win, step)
        if on_step is not None and len(receipts) > ran:
            on_step(step, Receipt.merged(step, receipts[ran:]))
    if heal_at_end and win.pending_refs:
        receipts.append(win.heal())
    return Receipt.merged("trace", receipts)
