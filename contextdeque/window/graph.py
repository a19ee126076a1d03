"""The conditioning graphs: which chunk's patch was formed on which antecedents — the one home of
the concept, for a window's live chunks (:class:`ConditioningGraph`) and for the stored patches
by content (:class:`PatchGraph`, the index the placement scheduler and the replay search).

:class:`ConditioningGraph`: nodes are :class:`ChunkRef` s (in the window, or evicted while an in-window chunk still depends
on them, directly or transitively: :meth:`ConditioningGraph.prune`); an edge ``A -> B``
says B's current conditioning was formed with A among its antecedents, and records the
*version* of A's KV at that time. Recalling A gives it a new version (fresh canonical + fresh
patch); every dependent whose edge records another version, or that now sits before A, was
conditioned on a state of A that no longer exists: its patch is stale. Re-forming it changes
its own version, so the staleness cascades down the graph (``Cascade.implied``).
"""

from __future__ import annotations

from collections import OrderedDict
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


ROOT = "<root>"  # the PatchGraph node standing for "nothing in front" (the canonical itself)


class PatchGraph:
    """The stored patches by content, with the networkx view ``g`` the scheduler searches.

    Nodes are chunk contents; a stored patch of content ``b`` formed on the ordered antecedents
    ``(a_1 .. a_k)`` adds the edge ``a_k -> b`` (b may sit right behind a_k without a forward)
    with ``weight`` = how many stored patches of b end in a_k, and records the whole antecedent
    sequence on ``b`` (:meth:`stored_prefixes`). Orbit patches are kept by antecedent set. A
    chunk's candidate places are then the window prefixes equal to one of its recorded sequences.

    ``max_contents`` / ``max_prefixes`` bound it (None: unbounded, the replay's full index): the
    most recently added contents, and prefixes per content, are kept — a window's hint of what
    its family stored (``WindowContext.patch_index``) stays small however long the window lives.
    """

    def __init__(self, *, max_contents: int | None = None, max_prefixes: int | None = None) -> None:
        self.max_contents, self.max_prefixes = max_contents, max_prefixes
        self._edges: dict[tuple[str, str], int] = {}  # (a_k, b) -> weight; ``g`` is built from it on demand
        self._g: nx.DiGraph | None = None
        self._prefixes: OrderedDict[str, dict[tuple[str, ...], None]] = OrderedDict()  # oldest first
        self._orbits: set[tuple[str, frozenset]] = set()
        self._orbit_contents: set[str] = set()

    def add(self, content: str, prefix: tuple[str, ...], kind: str = "exact") -> None:
        """Record a stored patch of ``content`` on ``prefix`` (``kind`` exact/recall or orbit); the
        most recent one of a bounded graph."""
        if kind == "orbit":
            self._orbits.add((content, frozenset(prefix)))
            self._orbit_contents.add(content)
            return
        seqs = self._prefixes.pop(content, None)
        if seqs is None:
            seqs = {}
        if prefix in seqs:
            del seqs[prefix]  # (re-added last: the most recent)
        else:
            self._edge(prefix, content, +1)
        seqs[prefix] = None
        self._prefixes[content] = seqs
        while self.max_prefixes is not None and len(seqs) > self.max_prefixes:
            self._forget(content, next(iter(seqs)))
        while self.max_contents is not None and len(self._prefixes) > self.max_contents:
            oldest = next(iter(self._prefixes))
            for old in list(self._prefixes[oldest]):
                self._forget(oldest, old)

    def _edge(self, prefix: tuple[str, ...], content: str, delta: int) -> None:
        edge = (prefix[-1] if prefix else ROOT, content)
        weight = self._edges.get(edge, 0) + delta
        if weight > 0:
            self._edges[edge] = weight
        else:
            self._edges.pop(edge, None)
        self._g = None

    def _forget(self, content: str, prefix: tuple[str, ...]) -> None:
        seqs = self._prefixes[content]
        del seqs[prefix]
        self._edge(prefix, content, -1)
        if not seqs:
            del self._prefixes[content]

    @property
    def g(self) -> nx.DiGraph:
        """The networkx view (built when asked for: a replay adds patches far more often than it
        reads the graph whole)."""
        if self._g is None:
            g = nx.DiGraph()
            g.add_weighted_edges_from((a, b, w) for (a, b), w in self._edges.items())
            self._g = g
        return self._g

    def has_patch(self, content: str, prefix: tuple[str, ...]) -> bool:
        seqs = self._prefixes.get(content)
        return seqs is not None and prefix in seqs

    def has_orbit(self, content: str, members: frozenset) -> bool:
        return (content, members) in self._orbits

    def may_hit(self, content: str) -> bool:
        """Whether any patch of ``content`` is stored."""
        return content in self._prefixes or content in self._orbit_contents

    def stored_prefixes(self, content: str) -> tuple[tuple[str, ...], ...]:
        """The antecedent sequences ``content`` has stored patches on (oldest first)."""
        return tuple(self._prefixes.get(content, ()))

    def successors(self, content: str) -> list[tuple[str, int]]:
        """Contents with a stored patch that may follow ``content`` directly, heaviest first."""
        if content not in self.g:
            return []
        return sorted(((b, d["weight"]) for b, d in self.g[content].items()), key=lambda x: (-x[1], x[0]))

    def contents(self) -> int:
        """How many contents have a stored (non-orbit) patch recorded."""
        return len(self._prefixes)

    def __len__(self) -> int:
        return sum(len(v) for v in self._prefixes.values()) + len(self._orbits)
