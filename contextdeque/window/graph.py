"""The conditioning graph: which chunk's patch was formed on which antecedents.

Nodes are :class:`ChunkRef` s (in the window, or evicted while an in-window chunk still depends
on them, directly or transitively: :meth:`ConditioningGraph.prune`); an edge ``A -> B``
says B's current conditioning was formed with A among its antecedents, and records the
*version* of A's KV at that time. Recalling A gives it a new version (fresh canonical + fresh
patch); every dependent whose edge records another version, or that now sits before A, was
conditioned on a state of A that no longer exists: its patch is stale. Re-forming it changes
its own version, so the staleness cascades down the graph (``Cascade.implied``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import networkx as nx

from .ref import ChunkRef

if TYPE_CHECKING:  # pragma: no cover
    from .slot import Slot

CASCADE_POLICIES = ("reform", "keep", "flag")


@dataclass(frozen=True)
class Cascade:
    """What re-instating ``recalled`` implied for the chunks conditioned on it.

    ``direct``: in-window dependents of the recalled chunk whose patch became stale;
    ``implied``: those plus, transitively, in-window dependents of any of them (window order);
    ``action``: the cascade policy applied (``reform`` / ``keep`` / ``flag``);
    ``reformed``: slots whose conditioning was re-formed because of the cascade;
    ``flagged``: slots marked stale (``flag``) — see ``ContextWindow.stale_refs``.
    """

    recalled: ChunkRef
    direct: tuple[ChunkRef, ...] = ()
    implied: tuple[ChunkRef, ...] = ()
    action: str = "reform"
    reformed: tuple[ChunkRef, ...] = ()
    flagged: tuple[ChunkRef, ...] = ()

    def as_dict(self) -> dict:
        return {
            "recalled": self.recalled.key,
            "direct": [r.key for r in self.direct],
            "implied": [r.key for r in self.implied],
            "action": self.action,
            "reformed": [r.key for r in self.reformed],
            "flagged": [r.key for r in self.flagged],
        }


class ConditioningGraph:
    """A networkx ``DiGraph`` of conditioning dependencies (antecedent -> dependent).

    Node attributes: ``chunk_id``, ``version`` (of the node's current or last KV) and
    ``in_window``. Edge attributes: ``version`` (the antecedent's version the dependent's
    patch was formed on). The window keeps it in sync; read it through ``.g`` or the helpers.
    """

    def __init__(self, g: nx.DiGraph | None = None) -> None:
        self.g: nx.DiGraph = g if g is not None else nx.DiGraph()

    def copy(self) -> "ConditioningGraph":
        """An independent copy (metadata only: O(nodes + edges), no tensors)."""
        return ConditioningGraph(self.g.copy())

    # ------------------------------------------------------------------ updates
    def sync(self, slots: Sequence["Slot"], evicted: Iterable[ChunkRef]) -> None:
        """Make the graph describe ``slots`` (in-window, current conditioning) and mark the
        ``evicted`` refs out of the window (their outgoing edges stay: dependents still carry
        what they absorbed from them)."""
        for s in slots:
            self.g.add_node(s.ref, chunk_id=s.chunk.id, version=s.version, in_window=True)
        for ref in evicted:
            if ref in self.g:
                self.g.nodes[ref]["in_window"] = False
        for s in slots:
            self.g.remove_edges_from(list(self.g.in_edges(s.ref)))
            for a, v in s.conditioned_on:
                if a in self.g:
                    self.g.add_edge(a, s.ref, version=v)
        self.prune({s.ref for s in slots})

    def prune(self, window: set[ChunkRef]) -> None:
        """Drop the evicted nodes no in-window chunk depends on, even transitively (and their
        edges): no cascade can reach the window through them, and one that comes back gets fresh
        in-edges from its new conditioning. Keeps the graph (and the copy every operation makes of
        it) the size of the window's dependency closure instead of the whole history."""
        keep = set(window)
        frontier = [r for r in window if r in self.g]
        while frontier:
            for a in self.g.predecessors(frontier.pop()):
                if a not in keep:
                    keep.add(a)
                    frontier.append(a)
        if len(keep) < self.g.number_of_nodes():
            self.g.remove_nodes_from([r for r in self.g.nodes if r not in keep])

    def remove(self, ref: ChunkRef) -> None:
        """Forget ``ref`` entirely (purge)."""
        if ref in self.g:
            self.g.remove_node(ref)

    # ------------------------------------------------------------------ queries
    def antecedents(self, ref: ChunkRef) -> list[ChunkRef]:
        """Chunks ``ref``'s current conditioning was formed on."""
        return list(self.g.predecessors(ref)) if ref in self.g else []

    def dependents(self, ref: ChunkRef) -> list[ChunkRef]:
        """Chunks whose current conditioning was formed on ``ref``."""
        return list(self.g.successors(ref)) if ref in self.g else []

    def in_window(self, ref: ChunkRef) -> bool:
        return bool(ref in self.g and self.g.nodes[ref].get("in_window"))

    def stale_edges(self) -> list[tuple[ChunkRef, ChunkRef]]:
        """Edges ``(A, B)`` between in-window chunks where B was formed on another version of A
        than the one A holds now."""
        out = []
        for a, b, data in self.g.edges(data=True):
            if self.in_window(a) and self.in_window(b) and data.get("version") != self.g.nodes[a].get("version"):
                out.append((a, b))
        return out

    def preview_cascade(self, ref: ChunkRef, order: Sequence[ChunkRef]) -> tuple[ChunkRef, ...]:
        """In-window chunks (in ``order``) that transitively depend on ``ref``: what a recall of
        ``ref`` would at most make stale."""
        if ref not in self.g:
            return ()
        reach = nx.descendants(self.g, ref)
        return tuple(r for r in order if r in reach)

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    def __repr__(self) -> str:
        return f"ConditioningGraph({self.g.number_of_nodes()} nodes, {self.g.number_of_edges()} edges)"
