"""Reuse arms: one interface for every way of producing the KV of ``[root, chunk_1 .. chunk_N]``.

An arm is one small class in its own file that registers itself in :data:`ARMS` by setting
``name`` (kvpress style). Every arm is handed the same :class:`ReuseRequest` — the backend, the
canonical chunks in window order, and (lazily, computed once and shared) their exact blind
relocation — and returns an :class:`ArmResult`: the assembled per-layer KV plus an
:class:`ArmReport` of what it cost (forwards, tokens recomputed, bytes stored).

Positions: chunk ``i`` starts at ``root_len + sum(span_j, j < i)``; its tokens sit at sequence
indices ``root_len + sum(T_j, j < i) ...`` of the assembled cache (for text both coincide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import torch

from ...core.chunk import Chunk
from ...core.counters import OMIT, Counters, adds, shown
from ...core.errors import FingerprintMismatchError, ReuseArmError
from ...core.kv import LayerKV, concat_kv
from ...core.operator import relocate
from ...core.registry import Registered, Registry

if TYPE_CHECKING:  # pragma: no cover
    from ...model.hf import HFBackend
    from ...patch.base import Patch

ARMS: Registry["ReuseArm"] = Registry("reuse arm")


@dataclass
class ReuseRequest:
    """What every arm is asked to serve: ``chunks`` (canonical, window order) after the backend's root.

    ``patches``: optional precomputed conditioning patches by chunk index (what a store would hand
    the patch arm; the arm forms them itself when absent). ``query_ids``: the query that follows
    the chunks, for arms that act after it is prefilled (KV selection). The blind relocation of
    every chunk is computed once (:meth:`relocated`) and shared by all arms given this request.
    """

    backend: "HFBackend"
    chunks: Sequence[Chunk]
    patches: Mapping[int, "Patch | Sequence[Patch]"] | None = None
    query_ids: Sequence[int] | None = None
    _relocated: list[list[LayerKV]] | None = field(default=None, repr=False)
    _blind: list[LayerKV] | None = field(default=None, repr=False)
    _embeds: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ReuseArmError("a reuse request needs at least one chunk")
        for c in self.chunks:
            if c.fingerprint != self.backend.fingerprint or c.layout_signature != self.backend.layout.signature:
                raise FingerprintMismatchError(f"chunk {c.id[:12]} was encoded by another model than the backend's")
        self.chunks = list(self.chunks)

    # ------------------------------------------------------------------ geometry
    @property
    def root_len(self) -> int:
        return self.backend.root_len

    @property
    def starts(self) -> list[int]:
        """Start position of every chunk."""
        return _running(self.root_len, [c.span for c in self.chunks])

    @property
    def next_position(self) -> int:
        """The first position after the last chunk (where a query goes)."""
        return self.root_len + sum(c.span for c in self.chunks)

    @property
    def offsets(self) -> list[int]:
        """Sequence index (in the assembled cache, root included) where every chunk's tokens begin."""
        return _running(self.root_len, [c.n_tokens for c in self.chunks])

    @property
    def n_chunk_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks)

    @property
    def num_layers(self) -> int:
        return self.chunks[0].num_layers

    def positions(self) -> torch.Tensor:
        """``[n_axes, N]`` positions of all chunk tokens (N = sum of T_i), window order."""
        return torch.cat([c.positions(s) for c, s in zip(self.chunks, self.starts)], dim=1)

    def chunk_of_token(self) -> torch.Tensor:
        """``[N]`` index of the chunk each chunk token belongs to."""
        return torch.cat([torch.full((c.n_tokens,), i, dtype=torch.long) for i, c in enumerate(self.chunks)])

    # ------------------------------------------------------------------ inputs
    @property
    def all_text(self) -> bool:
        return all(c.token_ids is not None for c in self.chunks)

    def token_ids(self) -> torch.Tensor:
        """``[N]`` token ids of all chunk tokens (text chunks only)."""
        if not self.all_text:
            raise ReuseArmError("this request holds embedding chunks: use inputs() instead of token_ids()")
        return torch.cat([c.token_ids for c in self.chunks])

    def inputs(self, index: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Forward inputs for the chunk tokens ``index`` (into ``0..N-1``; all when None).

        ``{"input_ids": [n]}`` when every chunk is text, else ``{"inputs_embeds": [n, hidden]}``
        (text tokens embedded by the model's own embedding table, image spans as stored).
        """
        if self.all_text:
            ids = self.token_ids()
            return {"input_ids": ids if index is None else ids[index]}
        if self._embeds is None:
            parts = []
            for c in self.chunks:
                inp = self.backend.chunk_inputs(c)
                if "input_ids" in inp:
                    parts.append(self.backend.embed_tokens(inp["input_ids"]).to("cpu", torch.float32))
                else:
                    parts.append(inp["inputs_embeds"].to("cpu", torch.float32))
            self._embeds = torch.cat(parts)
        emb = self._embeds
        return {"inputs_embeds": emb if index is None else emb[index]}

    # ------------------------------------------------------------------ shared KV
    def relocated(self) -> list[list[LayerKV]]:
        """Per chunk, its exact blind relocation (canonical KV rotated to its start). Computed once."""
        if self._relocated is None:
            lay = self.backend.layout
            self._relocated = [relocate(c, s, layout=lay) for c, s in zip(self.chunks, self.starts)]
        return self._relocated

    def blind_kv(self) -> list[LayerKV]:
        """Root KV followed by every chunk's blind relocation: per layer ``[H, R + N, d]``.
        Computed once; arms copy before they write."""
        if self._blind is None:
            self._blind = concat_kv([self.backend.root_kv(), *self.relocated()])
        return self._blind

    def with_patches(self, patches: Mapping[int, "Patch | Sequence[Patch]"] | None) -> "ReuseRequest":
        """The same request (sharing its relocated KV) with precomputed ``patches`` by chunk index."""
        return ReuseRequest(self.backend, self.chunks, patches=patches, query_ids=self.query_ids,
                            _relocated=self.relocated(), _blind=self._blind, _embeds=self._embeds)

    def patches_for(self, index: int) -> list["Patch"]:
        if not self.patches or index not in self.patches:
            return []
        p = self.patches[index]
        return [p] if not isinstance(p, (list, tuple)) else list(p)

    @property
    def page_bytes(self) -> int:
        """Stored bytes of every chunk's canonical page."""
        return sum(c.nbytes for c in self.chunks)


@dataclass
class ArmReport(Counters):
    """What an arm cost to serve one request.

    ``forwards``: model forwards run at serve time (a partial pass counts as one; with
    ``tokens_prefilled`` the :class:`~contextdeque.core.counters.Counters` an arm counts);
    ``compile_forwards``: one-time forwards (patch forming) when the arm had to do them itself;
    ``tokens_prefilled``: tokens passed through the model at serve time;
    ``token_layers``: sum over serve-time forwards of tokens x layers actually computed;
    ``tokens_recomputed``: chunk tokens whose KV was replaced at one layer or more;
    ``bytes_canonical``: stored KV pages read (canonicals, or a prefix cache's entries);
    ``bytes_extra``: bytes stored beside them (patches).
    """

    json_omit = frozenset({"encodes", "patches_formed", "patches_reused"})  # (not an arm's counts)

    arm: str
    chunk_tokens: int
    num_layers: int = shown(OMIT)
    page_bytes: int = shown(OMIT)
    compile_forwards: int = adds()
    token_layers: int = adds()
    tokens_recomputed: int = adds()
    bytes_canonical: int = adds()
    bytes_extra: int = adds()
    extras: dict[str, Any] = shown(OMIT, factory=dict)

    @property
    def bytes_stored(self) -> int:
        """Everything the arm keeps in storage to serve the request."""
        return self.bytes_canonical + self.bytes_extra

    @property
    def recompute_fraction(self) -> float:
        """Share of the chunks' token-layers recomputed at serve time (1.0 = a full re-prefill)."""
        denom = self.num_layers * max(1, self.chunk_tokens)
        return self.token_layers / denom

    @property
    def bytes_fraction(self) -> float:
        """Extra stored bytes over the chunks' page bytes."""
        return self.bytes_extra / max(1, self.page_bytes)

    def _derived(self) -> dict[str, Any]:
        return {"recompute_fraction": self.recompute_fraction, "bytes_stored": self.bytes_stored,
                "bytes_fraction": self.bytes_fraction, **self.extras}


@dataclass
class ArmResult:
    """An arm's answer: ``kv`` per layer ``(k [H_k, R+N, d_k], v [H_v, R+N, d_v])`` for
    ``[root, chunk_1 .. chunk_N]`` as the model caches them (rotated), ``next_position`` where the
    query goes, and the cost ``report``. The tensors may be shared with the request (blind reuse):
    treat them as read-only."""

    kv: list[LayerKV]
    next_position: int
    report: ArmReport


class ReuseArm(Registered):
    """Base class of a reuse arm. Subclasses set ``name`` and implement :meth:`run`.

    Constructor keyword arguments are the arm's options (budget, rank, schedule, ...); ``label``
    is how the arm is reported (defaults to ``name``).
    """

    registry = ARMS
    name: ClassVar[str] = ""

    def __init__(self, *, label: str | None = None) -> None:
        self.label = label or self.name

    def run(self, request: ReuseRequest) -> ArmResult:  # pragma: no cover - abstract
        """Assemble the KV of ``request`` (see :class:`ArmResult`)."""
        raise NotImplementedError

    def new_report(self, request: ReuseRequest) -> ArmReport:
        return ArmReport(
            arm=self.label,
            chunk_tokens=request.n_chunk_tokens,
            num_layers=request.num_layers,
            page_bytes=request.page_bytes,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


def make_arm(name: str, **options: Any) -> ReuseArm:
    """Build a registered arm by name (``ARMS``) with its options."""
    return ARMS.make(name, error=ReuseArmError, **options)


def _running(first: int, sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` begins, the first at ``first``."""
    out, at = [], first
    for n in sizes:
        out.append(at)
        at += n
    return out


def kv_row_bytes(chunk: Chunk) -> float:
    """Bytes one token's KV takes in the chunk's page (all layers, K and V)."""
    return chunk.nbytes / chunk.n_tokens


def matched_token_budget(patch: "Patch", chunk: Chunk) -> int:
    """How many of ``chunk``'s KV rows the bytes of ``patch`` would hold (the paper's Table-6 rule:
    a token-recompute arm at matched budget recomputes this many tokens)."""
    return min(chunk.n_tokens, int(math.floor(patch.nbytes / kv_row_bytes(chunk))))
