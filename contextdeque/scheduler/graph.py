"""The patch graph: which stored patches exist, as a networkx graph the scheduler searches.

Nodes are chunk contents; a stored patch of content ``b`` formed on the ordered antecedents
``(a_1 .. a_k)`` adds the edge ``a_k -> b`` (b may sit right behind a_k without a forward) with
``weight`` = how many stored patches of b end in a_k, and records the whole antecedent sequence
on ``b`` (``prefixes``). Orbit patches are kept by antecedent set. A chunk's candidate places
are then the window prefixes equal to one of its recorded sequences.
"""

from __future__ import annotations

from typing import Iterable

import networkx as nx

ROOT = "<root>"  # the node standing for "nothing in front" (the canonical itself)


class PatchGraph:
    """Index of stored patches by content, with the networkx view ``g``."""

    def __init__(self) -> None:
        self._edges: dict[tuple[str, str], int] = {}  # (a_k, b) -> weight; ``g`` is built from it on demand
        self._g: nx.DiGraph | None = None
        self._prefixes: dict[str, set[tuple[str, ...]]] = {}
        self._orbits: set[tuple[str, frozenset]] = set()
        self._orbit_contents: set[str] = set()

    def add(self, content: str, prefix: tuple[str, ...], kind: str = "exact") -> None:
        """Record a stored patch of ``content`` on ``prefix`` (``kind`` exact/recall or orbit)."""
        if kind == "orbit":
            self._orbits.add((content, frozenset(prefix)))
            self._orbit_contents.add(content)
            return
        seqs = self._prefixes.setdefault(content, set())
        if prefix in seqs:
            return
        seqs.add(prefix)
        a = prefix[-1] if prefix else ROOT
        self._edges[(a, content)] = self._edges.get((a, content), 0) + 1
        self._g = None

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

    def stored_prefixes(self, content: str) -> Iterable[tuple[str, ...]]:
        return self._prefixes.get(content, ())

    def successors(self, content: str) -> list[tuple[str, int]]:
        """Contents with a stored patch that may follow ``content`` directly, heaviest first."""
        if content not in self.g:
            return []
        return sorted(((b, d["weight"]) for b, d in self.g[content].items()), key=lambda x: (-x[1], x[0]))

    def __len__(self) -> int:
        return sum(len(v) for v in self._prefixes.values()) + len(self._orbits)
