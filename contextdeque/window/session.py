"""Sessions: a window saved to one file and reopened later (another process, another day).

``window.save(path)`` writes one self-contained, checksummed safetensors file (the store's entry
format, ``contextdeque.stores.format``): every tensor the window needs to materialize without a
forward — the root's cached KV, each in-window chunk's canonical (or provisional KV) and its patch
stack, and the canonicals of evicted chunks still in the store (so they can be recalled) — plus a
versioned pydantic manifest (:class:`SessionManifest`) in the header: order, refs with labels,
positions, the conditioning stacks and what each was formed on, the evicted set, the pending
(latency-first) queue, the conditioning graph, the configuration (policies, budget, rank,
storage) and a summary of the receipts so far.

The write is atomic: the bytes go to a temporary file in the target directory, are fsynced, and
``os.replace`` puts them in place, so a crash mid-save leaves the previous session readable.

``ContextWindow.open(path, backend)`` checks the schema version, the checksums and that the
backend is the model, layout and root the session was saved with, puts the canonicals and
patches into the window's store (content-addressed: shared with other windows), and rebuilds the
window without running a forward: ``materialize()`` is bit-identical to the saved window's.

Refs are per process (``ChunkRef`` keys come from a process-wide counter), so the reopened window
hands out fresh refs, in the same order, with the same labels. Slot *versions* (the identity of a
slot's conditioned KV, which stored patches are validated against) include ref keys, so they are
recomputed under the new refs, dependencies first: every patch that was valid on its prefix stays
valid, every stale one stays stale, and the session continues exactly as the saved one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import networkx as nx
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ..core.chunk import Chunk
from ..core.counters import Counters
from ..core.errors import CorruptEntryError, SessionError
from ..patch import Patch
from ..stores import StoreEntry
from ..stores.format import decode_entry, encode_entry
from ..patch.alloc import DEFAULT_ON_MISS
from .budget import DEFAULT_BLIND_KL
from .config import DEFAULT_KL_BUDGET_MS, DEFAULT_MAX_EVICTED, DEFAULT_RECALL_PLACEMENT, WindowConfig
from .graph import ConditioningGraph
from .receipt import Meter, Receipt
from .ref import ChunkRef, new_ref
from .slot import Conditioning, Slot
from .pending import Pending, PendingWork
from .state import EvictedEntry, WindowState

if TYPE_CHECKING:  # pragma: no cover
    from .window import ContextWindow

SESSION_FORMAT = "contextdeque-session"
SESSION_VERSION = 1
_KEY = "contextdeque/session"
_META = "session"


# ====================================================================== schema (version 1)
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TagModel(_Model):
    """An antecedent as a conditioning recorded it: the ref and that ref's KV version then."""

    ref: int
    version: str


class ConditioningModel(_Model):
    patch: int  # index into SessionManifest.patches
    formed_on: list[TagModel]
    absolute: bool
    reused: bool = False
    key: str = ""


class SlotModel(_Model):
    ref: int
    chunk: int  # index into SessionManifest.chunks
    start: int
    stale: bool = False
    inline_on: list[TagModel] = []
    stack: list[ConditioningModel] = []
    version: str  # the slot's version when saved (under the saved refs)


class SourceModel(_Model):
    """An evicted chunk's inputs (re-encoded from them if its canonical is gone): tensors
    ``<prefix>/<name>``."""

    prefix: str
    chunk_id: str
    tensors: list[str]
    span: int
    modality: str


class EvictedModel(_Model):
    ref: int
    chunk_key: str
    chunk_id: str
    n_tokens: int
    span: int
    stale_patch_keys: list[str] = []
    formed_on: list[TagModel] = []
    provisional: int | None = None  # chunk index: left before its canonical was computed
    canonical: int | None = None  # chunk index of its canonical (None: not in the store when saved)
    source: SourceModel | None = None
    unhealed: bool = False  # left before its canonical was computed (encoded from source on recall)


class RefModel(_Model):
    key: int
    chunk_id: str
    n_tokens: int
    label: str | None = None


class PendingModel(_Model):
    ref: int
    reason: str | None
    since: int
    carried: list[TagModel] = []  # what its conditioning carried before the deferral
    requeued: bool = False  # deferred again by a later operation (a provisional slot re-forwards at heal)


class GraphNodeModel(_Model):
    ref: int
    chunk_id: str | None = None
    version: str | None = None
    in_window: bool = False


class GraphEdgeModel(_Model):
    src: int
    dst: int
    version: str | None = None


class BlobModel(_Model):
    """A chunk or patch: its store metadata; its tensors are ``<prefix>/<name>`` in the file."""

    prefix: str
    meta: dict[str, str]
    tensors: list[str]
    basis_id: str | None = None  # patches on a shared basis are saved with their w factors


def _placement_name(spec: Any) -> str | None:
    """A placement setting as a manifest records it: its registered name (None stays None)."""
    return spec if spec is None or isinstance(spec, str) else (getattr(spec, "name", "") or "arrival")


class ConfigModel(_Model):
    """The saved :class:`~.config.WindowConfig` (its fields of plain values; the policies by name)."""

    budget_tokens: int | None
    rank: int
    patch_policy: str
    cascade_policy: str
    overflow: str
    storage: str
    placement: str
    fidelity_target: float | None
    max_patch_fraction: float
    max_evicted: int | None = DEFAULT_MAX_EVICTED  # absent in sessions saved before it was recorded
    on_miss: str = DEFAULT_ON_MISS  # absent in sessions saved before it was recorded
    patch_precisions: list[str] = ["hi"]  # (the same: those sessions formed their patches at the page dtype)
    anticipate: bool = False  # (the same)
    # (the same; sessions saved before issue 21 part C recalled at the end: None there would be the
    # old rule, but a reopened window takes today's default like a new one)
    recall_placement: str | None = DEFAULT_RECALL_PLACEMENT
    answer_kl_budget: float | None = None
    kl_budget_ms: float | None = DEFAULT_KL_BUDGET_MS
    blind_kl: float = DEFAULT_BLIND_KL
    recall_predictor: str = "session"  # (the same; its learned statistics are not saved)
    factorization_cost: float = 0.0  # (the same)
    factorization_fixed: float = 0.0  # (the same)


ReceiptSummary = create_model(
    "ReceiptSummary", __base__=_Model, __doc__="What the saved window's recorded receipts add up to (the last 1000 "
    "operations): how many, by operation, their :class:`~contextdeque.core.counters.Counters` and wall time.",
    operations=(int, 0), by_op=(dict[str, int], {}), **{name: (int, 0) for name in Counters().counts()},
    wall_ms=(float, 0.0),
)


class SessionManifest(_Model):
    """The manifest of a saved window (schema version 1)."""

    format: Literal["contextdeque-session"] = SESSION_FORMAT
    version: Literal[1] = SESSION_VERSION
    saved_at: str
    model: str
    fingerprint: str
    layout: str
    root_ids: list[int]
    root_digest: str
    root_kv: int  # number of layers of the root KV saved as root/<l>.k, root/<l>.v
    config: ConfigModel
    generation: int
    refs: list[RefModel]
    slots: list[SlotModel]
    evicted: list[EvictedModel]
    pending: list[PendingModel]
    graph_nodes: list[GraphNodeModel]
    graph_edges: list[GraphEdgeModel]
    chunks: list[BlobModel]
    patches: list[BlobModel]
    receipts: ReceiptSummary  # type: ignore[valid-type]
    counters: dict[str, int] = {}


# ====================================================================== helpers
def policy_spec(policy: Any) -> str:
    """The registered name a patch policy is rebuilt from (``"latency:exact"`` for a latency-first
    wrapper around a registered eager policy)."""
    inner = getattr(policy, "inner", None)
    if inner is not None and getattr(policy, "name", ""):
        return f"{policy.name}:{inner.name}" if inner.name != "eager" else policy.name
    return getattr(policy, "name", "") or "default"


def _predictor_name(predictor: Any) -> str:
    """The registered name a recall predictor is rebuilt from (an instance: its class's name)."""
    return predictor if isinstance(predictor, str) else (getattr(predictor, "name", "") or "session")



def _atomic_write(path: Path, data: bytes) -> None:
    """``data`` at ``path`` or nothing: temp file in the same directory, fsync, rename, fsync dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _Tables:
    """Chunks and patches of a session, each saved once, with their tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.chunks: list[BlobModel] = []
        self.patches: list[BlobModel] = []
        self._chunk_ix: dict[Any, int] = {}
        self._patch_ix: dict[Any, int] = {}

    def _blob(self, table: list[BlobModel], prefix: str, tensors: dict[str, torch.Tensor], meta: dict[str, str], **kw: Any) -> int:
        for name, t in tensors.items():
            self.tensors[f"{prefix}/{name}"] = t
        table.append(BlobModel(prefix=prefix, meta=dict(meta), tensors=sorted(tensors), **kw))
        return len(table) - 1

    def chunk(self, chunk: Chunk, *, provisional: bool) -> int:
        key = ("p", id(chunk)) if provisional else ("c", chunk.id)
        if key not in self._chunk_ix:
            tensors, meta = chunk.to_entry()
            self._chunk_ix[key] = self._blob(self.chunks, f"c{len(self.chunks)}", tensors, meta)
        return self._chunk_ix[key]

    def patch(self, patch: Patch) -> int:
        key = id(patch)
        if key not in self._patch_ix:
            flat = dataclasses.replace(patch, basis_id=None)  # keep the w factors in the file
            tensors, meta = flat.to_entry()
            self._patch_ix[key] = self._blob(self.patches, f"p{len(self.patches)}", tensors, meta, basis_id=patch.basis_id)
        return self._patch_ix[key]


def _tags(tags: Any) -> list[TagModel]:
    return [TagModel(ref=r.key, version=v) for r, v in tags]


def _summary(receipts: Any) -> Any:
    """The :data:`ReceiptSummary` of ``receipts``."""
    receipts = list(receipts)
    by_op = Counter(r.op for r in receipts)
    return ReceiptSummary(operations=len(receipts), by_op=dict(by_op), **Counters.summed(receipts).counts(),
                          wall_ms=round(sum(float(r.wall_ms) for r in receipts), 3))


# ====================================================================== save
def save_window(window: "ContextWindow", path: str | os.PathLike[str]) -> Receipt:
    """Write ``window`` to ``path`` (see the module docstring). Returns the ``save`` receipt."""
    window._check_open()
    ctx = window._ctx
    meter = Meter(ctx, "save")
    state: WindowState = window._state
    tables = _Tables()
    refs: dict[int, RefModel] = {}

    def note_ref(ref: ChunkRef) -> None:
        refs.setdefault(ref.key, RefModel(key=ref.key, chunk_id=ref.chunk_id, n_tokens=ref.n_tokens, label=ref.label))

    slots = []
    for s in state.slots:
        note_ref(s.ref)
        stack = [
            ConditioningModel(patch=tables.patch(c.patch), formed_on=_tags(c.formed_on), absolute=c.absolute, reused=c.reused, key=c.key)
            for c in s.stack
        ]
        slots.append(SlotModel(
            ref=s.ref.key, chunk=tables.chunk(s.chunk, provisional=s.provisional), start=s.start, stale=s.stale,
            inline_on=_tags(s.inline_on), stack=stack, version=s.version,
        ))
    evicted = []
    for ref, e in state.evicted.items():
        note_ref(ref)
        canonical = None
        if not e.owes_encode:
            try:
                found = ctx.store.store.get(e.chunk_key, expect_fingerprint=ctx.fingerprint, promote=False, traffic=meter.traffic)
            except CorruptEntryError:
                found = None
            if found is not None:
                canonical = tables.chunk(Chunk.from_entry(dict(found.tensors), dict(found.meta)), provisional=False)
            else:
                meter.notes.append(f"{ref!r}: canonical not in the store; saved without it")
        source = None
        if e.source is not None:
            prefix = f"s{len(evicted)}"
            named = {n: e.source.get(n) for n in ("token_ids", "embeds", "rel_positions") if e.source.get(n) is not None}
            for n, tensor in named.items():
                tables.tensors[f"{prefix}/{n}"] = tensor
            source = SourceModel(prefix=prefix, chunk_id=e.chunk_id, tensors=sorted(named), span=int(e.source["span"]),
                                 modality=str(e.source.get("modality") or "text"))
        evicted.append(EvictedModel(
            ref=ref.key, chunk_key=e.chunk_key, chunk_id=e.chunk_id, n_tokens=e.n_tokens, span=e.span,
            stale_patch_keys=list(e.stale_patch_keys), formed_on=_tags(e.formed_on),
            provisional=None if e.provisional is None else tables.chunk(e.provisional, provisional=True),
            canonical=canonical, source=source, unhealed=e.unhealed,
        ))
    g = state.graph.g
    nodes, edges = [], []
    for ref, data in g.nodes(data=True):
        note_ref(ref)
        nodes.append(GraphNodeModel(ref=ref.key, chunk_id=data.get("chunk_id"), version=data.get("version"), in_window=bool(data.get("in_window"))))
    for a, b, data in g.edges(data=True):
        edges.append(GraphEdgeModel(src=a.key, dst=b.key, version=data.get("version")))
    for p in state.pending.values():
        for r, _ in p.carried:  # an antecedent it carried may have been purged since
            note_ref(r)
    root = ctx.backend.root_kv()
    for i, (k, v) in enumerate(root):
        tables.tensors[f"root/{i}.k"] = k
        tables.tensors[f"root/{i}.v"] = v
    placement = ctx.placement
    manifest = SessionManifest(
        saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=str(getattr(ctx.backend, "name", "")),
        fingerprint=ctx.fingerprint,
        layout=ctx.layout.signature,
        root_ids=[int(i) for i in ctx.backend.root_ids],
        root_digest=ctx.backend.root_digest,
        root_kv=len(root),
        config=ConfigModel(**{
            **{name: getattr(ctx.config, name) for name in ConfigModel.model_fields},
            # the instances the window made, saved as the registered names they are rebuilt from
            "patch_policy": policy_spec(ctx.policy), "storage": str(ctx.storage).removeprefix("torch."),
            "placement": getattr(placement, "name", "arrival") or "arrival",
            "recall_placement": _placement_name(ctx.config.recall_placement),
            "recall_predictor": _predictor_name(ctx.config.recall_predictor),
        }),
        generation=state.generation,
        refs=list(refs.values()),
        slots=slots,
        evicted=evicted,
        pending=[PendingModel(ref=r.key, reason=p.reason, since=p.since, carried=_tags(p.carried), requeued=p.requeued)
                 for r, p in state.pending.items()],
        graph_nodes=nodes,
        graph_edges=edges,
        chunks=tables.chunks,
        patches=tables.patches,
        receipts=_summary(window.receipts),
        counters=ctx.counters.as_dict(),
    )
    data = encode_entry(_KEY, StoreEntry(tables.tensors, {_META: manifest.model_dump_json()}), 0)
    _atomic_write(Path(path), data)
    meter.traffic.add_written("session", len(data))
    receipt = meter.finish(refs=state.refs)
    window._record(receipt)
    return receipt


# ====================================================================== open
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(WindowConfig))


def read_manifest(path: str | os.PathLike[str]) -> tuple[SessionManifest, dict[str, torch.Tensor]]:
    """The verified manifest and tensors of a session file.

    Raises:
        SessionError: missing, not a session, corrupt, or another schema version.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise SessionError(f"no session at {p}") from None
    except OSError as e:
        raise SessionError(f"cannot read session {p}: {e.strerror or e}") from None
    try:
        entry, _ = decode_entry(_KEY, data, str(p))
    except CorruptEntryError as e:
        raise SessionError(f"{p} is not a readable contextdeque session: {e}") from None
    raw = entry.meta.get(_META)
    if raw is None:
        raise SessionError(f"{p} holds no session manifest")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise SessionError(f"{p}: session manifest is not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != SESSION_FORMAT:
        raise SessionError(f"{p} is not a contextdeque session (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != SESSION_VERSION:
        raise SessionError(
            f"{p}: session schema version {doc.get('version')!r}; this contextdeque reads version {SESSION_VERSION}"
        )
    try:
        head = SessionManifest.model_validate(doc)
    except ValidationError as e:
        raise SessionError(f"{p}: session manifest does not match schema version {SESSION_VERSION}: {e}") from None
    return head, dict(entry.tensors)


def open_window(cls: type, path: str | os.PathLike[str], backend: Any, **overrides: Any) -> "ContextWindow":
    """Rebuild a saved window over ``backend`` (see :meth:`ContextWindow.open`)."""
    from .root import backend_with_root

    m, tensors = read_manifest(path)
    backend = backend_with_root(backend, m.root_ids)
    if backend.fingerprint != m.fingerprint or backend.layout.signature != m.layout:
        raise SessionError(
            f"session {path} was saved with model {m.fingerprint[:12]} (layout {m.layout}); "
            f"the backend runs {backend.fingerprint[:12]} ({backend.layout.signature})"
        )
    if backend.root_digest != m.root_digest:
        raise SessionError(f"session {path} was saved after root {m.root_digest}, the backend's is {backend.root_digest}")
    config = WindowConfig(**{**m.config.model_dump(), **{k: v for k, v in overrides.items() if k in CONFIG_FIELDS}})
    win = cls.from_config(backend, config, **{k: v for k, v in overrides.items() if k not in CONFIG_FIELDS})
    ctx = win._ctx
    device = ctx.backend.device
    meter = Meter(ctx, "open")

    def t(name: str) -> torch.Tensor:
        try:
            return tensors[name].to(device)
        except KeyError:
            raise SessionError(f"session {path} lacks tensor {name!r}") from None

    # The root's KV as saved: no forward for it either (the same model's output for the same ids).
    ctx.backend.adopt_root_kv([(t(f"root/{i}.k"), t(f"root/{i}.v")) for i in range(m.root_kv)])

    def blob_tensors(b: BlobModel) -> dict[str, torch.Tensor]:
        return {n: t(f"{b.prefix}/{n}") for n in b.tensors}

    try:
        chunks = [Chunk.from_entry(blob_tensors(b), dict(b.meta)) for b in m.chunks]
        patches = []
        for b in m.patches:
            p = Patch.from_entry(blob_tensors(b), dict(b.meta))
            patches.append(p if b.basis_id is None else dataclasses.replace(p, basis_id=b.basis_id))
    except CorruptEntryError as e:
        raise SessionError(f"session {path}: {e}") from None
    for ch in chunks:
        if ch.fingerprint != ctx.fingerprint or ch.root_digest != ctx.backend.root_digest:
            raise SessionError(f"session {path}: chunk {ch.id[:12]} belongs to another model or root")

    # Canonicals and keyed patches go into the store (content-addressed: shared, recallable).
    provisional_ix = {s.chunk for s in m.slots if s.inline_on} | {e.provisional for e in m.evicted if e.provisional is not None}
    for i, ch in enumerate(chunks):
        if i not in provisional_ix:
            ctx.store.put_chunk(ch, traffic=meter.traffic)
    for s in m.slots:
        for cm in s.stack:
            if cm.key:
                ctx.store.put_patch(cm.key, patches[cm.patch], traffic=meter.traffic)

    # Fresh refs (same order, same labels); versions recomputed under them, dependencies first.
    new_refs = {r.key: new_ref(r.chunk_id, r.n_tokens, r.label) for r in m.refs}

    def ref(key: int) -> ChunkRef:
        try:
            return new_refs[key]
        except KeyError:
            raise SessionError(f"session {path} mentions ref #{key} it does not describe") from None

    in_window = {s.ref: i for i, s in enumerate(m.slots)}
    saved_version = {s.ref: s.version for s in m.slots}
    built: dict[int, Slot] = {}
    visiting: set[int] = set()

    def tag(tm: TagModel) -> tuple[ChunkRef, str]:
        if tm.ref in in_window and tm.version == saved_version[tm.ref]:
            return ref(tm.ref), build(in_window[tm.ref]).version
        return ref(tm.ref), tm.version

    def build(i: int) -> Slot:
        if i in built:
            return built[i]
        if i in visiting:
            raise SessionError(f"session {path}: conditioning versions form a cycle")
        visiting.add(i)
        sm = m.slots[i]
        stack = tuple(
            Conditioning(patch=patches[cm.patch], formed_on=tuple(tag(x) for x in cm.formed_on), absolute=cm.absolute, reused=cm.reused, key=cm.key)
            for cm in sm.stack
        )
        slot = Slot(
            ref=ref(sm.ref), chunk=chunks[sm.chunk], stack=stack, start=sm.start, stale=sm.stale,
            layout=ctx.layout, inline_on=tuple(tag(x) for x in sm.inline_on),
        )
        visiting.discard(i)
        built[i] = slot
        return slot

    state = WindowState()
    state.slots = tuple(build(i) for i in range(len(m.slots)))
    new_version = {sm.ref: built[i].version for i, sm in enumerate(m.slots)}

    def version_of(key: int, v: str | None) -> str | None:
        return new_version[key] if key in in_window and v == saved_version[key] else v

    def _source(sm: SourceModel) -> dict[str, Any]:
        named = {n: tensors[f"{sm.prefix}/{n}"] for n in sm.tensors if f"{sm.prefix}/{n}" in tensors}
        if "rel_positions" not in named:
            raise SessionError(f"session {path}: source {sm.prefix} lacks rel_positions")
        return {"token_ids": named.get("token_ids"), "embeds": named.get("embeds"), "rel_positions": named["rel_positions"],
                "span": sm.span, "modality": sm.modality}

    for e in m.evicted:
        state.evicted[ref(e.ref)] = EvictedEntry(
            ref=ref(e.ref), chunk_key=e.chunk_key, chunk_id=e.chunk_id, n_tokens=e.n_tokens, span=e.span,
            stale_patch_keys=tuple(e.stale_patch_keys), formed_on=tuple(tag(x) for x in e.formed_on),
            provisional=None if e.provisional is None else chunks[e.provisional],
            source=None if e.source is None else _source(e.source),
            unhealed=e.unhealed,
        )
    state.pending = PendingWork({ref(p.ref): Pending(reason=p.reason, since=p.since, carried=tuple(tag(x) for x in p.carried),
                                                     requeued=p.requeued) for p in m.pending})
    g = nx.DiGraph()
    for n in m.graph_nodes:
        g.add_node(ref(n.ref), chunk_id=n.chunk_id, version=version_of(n.ref, n.version), in_window=n.in_window)
    for e in m.graph_edges:
        g.add_edge(ref(e.src), ref(e.dst), version=version_of(e.src, e.version))
    state.graph = ConditioningGraph(g)
    state.generation = m.generation
    meter.notes.extend(ctx.store.hold(list(state.held_keys().elements()), meter.traffic))
    win._state = state
    s = m.receipts
    meter.notes.append(
        f"session saved {m.saved_at}: {s.operations} operations ({s.forwards} forwards, {s.encodes} encodes, "
        f"{s.patches_formed} patches formed) before the save"
    )
    win.session = m
    win._record(meter.finish(refs=state.refs))
    return win


__all__ = ["SessionManifest", "SESSION_VERSION", "save_window", "open_window", "read_manifest", "policy_spec"]
