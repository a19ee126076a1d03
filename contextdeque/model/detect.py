"""The relocation oracle and the proof at load; :func:`detect_layout`, a model's proven layout.

The layout itself is read off the model's structure in :mod:`contextdeque.model.structure`
(:func:`read_layout`, re-exported here with its refusal reasons and shared measures).

:func:`prove_layout` is the proof at load: the relocation oracle (the model's own forward with every
position shifted, against ``relocate`` of the canonical chunk) on a short seeded chunk at two
offsets inside the model's regime (the detection's own forwards reused as two of its oracles), in the model's dtype and in bf16 storage, with the
``verify-model`` criterion. Results are cached per model fingerprint (plus the rotary code and
tables, so a monkey-patched rotary is proven afresh), in memory and on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..core import compat
from ..core.counters import Counters
from ..core.errors import UnsupportedLayoutError
from ..core.kv import LayerKV
from ..core.layout import KVLayout
from ..core.metrics import ulp_error_at_scale
from ..core.operator import relocate
from .structure import (  # noqa: F401  (REFUSAL_REASONS, noise_cap: the structure's names, public here as before)
    FP32_FLOOR,
    PROBE_SHIFT,
    PROBE_TOKENS,
    REFUSAL_REASONS,
    noise_cap,
    read_layout,
    rel_err,
    seeded_ids,
    tolerance,
)

#: The proof's offsets: the detection probe's shift (its forward is reused) and one far beyond it.
PROOF_OFFSETS = (PROBE_SHIFT, 257)
#: The proof's sequence is the detection probe's: its first token is the root, the rest the chunk.
PROOF_TOKENS = PROBE_TOKENS - 1
_PROOF_VERSION = "2"


# ----------------------------------------------------------------------------- the oracle


@dataclass
class OffsetReport:
    chunk: str
    offset: int
    key_rel_err: float  # rotated channels, model-dtype relocation vs the shifted forward
    noise_floor: float  # non-rotated channels: forward at target vs at canonical
    bf16_ulp: float  # rotated channels, bf16 storage, in bf16 ULPs of the tensor's scale (max |x|)
    worst_layer: int
    ok: bool


def split_rotated(kv: LayerKV, layout: KVLayout) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(rotated channels, [non-rotated tensors]) of one layer's ``(k, v)``."""
    k, v = kv
    rot_t, other_t = (k, v) if layout.rope_tensor == "k" else (v, k)
    a, n = layout.rope_start, layout.rope_dim
    rot = rot_t[..., a : a + n]
    rest = [other_t]
    if a > 0:
        rest.append(rot_t[..., :a])
    if a + n < rot_t.shape[-1]:
        rest.append(rot_t[..., a + n :])
    return rot, rest


def shifted_forward(backend: Any, chunk: Any, offset: int) -> list[LayerKV]:
    """transformers' own forward of [root, chunk] with every position shifted by ``offset``;
    returns the chunk's cached KV per layer ``[H, T, d]``."""
    R = backend.root_len
    root_pos = backend.text_positions(offset, R)
    pos = torch.cat([root_pos, chunk.positions(chunk.canonical_start + offset)], dim=1)
    if chunk.token_ids is not None:
        res = backend.forward(
            input_ids=torch.cat([torch.tensor(backend.root_ids), chunk.token_ids]), positions=pos, logits="none"
        )
    else:
        root_emb = backend.embed_tokens(torch.tensor(backend.root_ids))
        emb = torch.cat([root_emb.to(chunk.embeds.dtype), chunk.embeds.to(root_emb.device)], dim=0)
        res = backend.forward(inputs_embeds=emb, positions=pos, logits="none")
    return [(k[:, R:], v[:, R:]) for k, v in res.kv]


def check_chunk(
    backend: Any,
    chunk: Any,
    offsets: list[int],
    label: str,
    *,
    reloc: Callable[..., list[LayerKV]] | None = None,
    oracles: dict[int, list[LayerKV]] | None = None,
) -> list[OffsetReport]:
    """Relocation of ``chunk`` (model dtype and bf16 storage) vs the shifted forward at each offset.

    ``oracles``: :func:`shifted_forward` results already computed for this backend and chunk,
    keyed by offset (0 is the canonical one); the others are run here."""
    reloc = reloc or relocate
    layout = backend.layout
    dtype = backend.dtype
    oracles = dict(oracles or {})

    def oracle_at(off: int) -> list[LayerKV]:
        if off not in oracles:
            oracles[off] = shifted_forward(backend, chunk, off)
        return oracles[off]

    canonical = oracle_at(0)
    chunk_bf16 = chunk.to(torch.bfloat16)
    out = []
    for off in offsets:
        oracle = oracle_at(off)
        # an exactness proof against the model's own shifted forward: the offsets may pass the
        # trained context on purpose (the oracle runs there too)
        kw = {"beyond_trained": True} if reloc is relocate else {}
        same = reloc(chunk, chunk.canonical_start + off, layout=layout, out_dtype=torch.float32, **kw)
        bf16 = reloc(chunk_bf16, chunk.canonical_start + off, layout=layout, out_dtype=torch.float32, **kw)
        key_err = floor = ulps = 0.0
        worst = 0
        for l in range(layout.num_layers):
            rot_o, rest_o = split_rotated(oracle[l], layout)
            rot_c, rest_c = split_rotated(canonical[l], layout)
            rot_r, _ = split_rotated(same[l], layout)
            rot_b, _ = split_rotated(bf16[l], layout)
            e = rel_err(rot_r, rot_o)
            if e > key_err:
                key_err, worst = e, l
            floor = max([floor] + [rel_err(a, b) for a, b in zip(rest_c, rest_o)])
            ulps = max(ulps, ulp_error_at_scale(rot_b, rot_o, torch.bfloat16))
        ulp_bound = 1.0 if dtype == torch.float32 else 4.0
        ok = key_err <= tolerance(dtype, floor) and ulps <= ulp_bound
        out.append(OffsetReport(label, off, key_err, floor, ulps, worst, ok))
    return out


# ----------------------------------------------------------------------------- the proof at load


@dataclass
class Proof:
    """The relocation oracle's verdict on one model's layout (what ``load_model`` ran or recalled)."""

    key: str
    layout_signature: str
    offsets: list[int]
    max_rel_err: float
    noise_floor: float
    max_ulp_bf16: float
    ok: bool
    seconds: float
    cached: bool = False
    forwards: int = 0  # forwards the proof ran (0 when recalled from the cache)
    details: list[dict] = field(default_factory=list)


_PROOFS: dict[str, Proof] = {}
_DISK = [True]


@contextmanager
def memory_only():
    """Within this block proofs and layouts are cached in memory only (sweeps over many throwaway
    models leave nothing in the cache directory)."""
    _DISK.append(False)
    try:
        yield
    finally:
        _DISK.pop()


def _code_digest(fn: Any, h: "hashlib._Hash", depth: int = 2, seen: set | None = None) -> None:
    seen = set() if seen is None else seen
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None or id(code) in seen:
        return
    seen.add(id(code))
    h.update(code.co_code)
    h.update(repr(code.co_consts).encode())
    if depth <= 0:
        return
    glb = getattr(getattr(fn, "__func__", fn), "__globals__", {})
    for name in code.co_names:
        g = glb.get(name)
        if callable(g) and hasattr(g, "__code__"):
            _code_digest(g, h, depth - 1, seen)


def behavior_digest(model: torch.nn.Module) -> str:
    """Hash of what decides the cached keys' rotation beyond the weights: the code of every
    attention and rotary module's forward (and the helpers it calls, two levels down) and the
    rotary modules' tables. A monkey-patched rotary changes it, so its proof is run afresh."""
    h = hashlib.sha256()
    classes = {}
    for _, m in model.named_modules():
        name = type(m).__name__
        if "Attention" in name or "Rotary" in name or "Rope" in name or "RoPE" in name:
            classes.setdefault(type(m), m)
    for cls, m in sorted(classes.items(), key=lambda kv: kv[0].__qualname__):
        h.update(cls.__qualname__.encode())
        _code_digest(m.forward, h)
    for _, module in compat.find_rotary_modules(model):
        for bname, buf in sorted(module.named_buffers(recurse=False)):
            h.update(bname.encode())
            h.update(buf.detach().to(torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _proof_dir() -> Path:
    from .default_model import default_cache_dir

    return default_cache_dir() / "proofs"


def _load_cached(key: str) -> Proof | None:
    if key in _PROOFS:
        return _PROOFS[key]
    if not _DISK[-1]:
        return None
    path = _proof_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        proof = Proof(**data)
    except (OSError, ValueError, TypeError):
        return None
    _PROOFS[key] = proof
    return proof


def _store(proof: Proof) -> None:
    _PROOFS[proof.key] = proof
    if not _DISK[-1]:
        return
    d = _proof_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{proof.key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(proof)))
        os.replace(tmp, d / f"{proof.key}.json")
    except OSError:
        pass  # a read-only cache only costs the next load a proof


def _layout_key(fingerprint: str, behavior: str) -> str:
    import transformers  # (not at import: the window's envelope cache reads this module's paths)

    raw = f"{fingerprint}:{behavior}:{transformers.__version__}:{_PROOF_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


_LAYOUTS: dict[str, KVLayout] = {}


def cached_layout(
    model: torch.nn.Module, fingerprint: str, *, keep: dict | None = None, behavior: str | None = None
) -> KVLayout:
    """:func:`read_layout`, remembered per model fingerprint and behavior digest (in memory and on
    disk beside the proofs), so a second load of the same model runs no probe forwards. ``keep``:
    see :func:`read_layout` (left empty on a cache hit); ``behavior``: :func:`behavior_digest` of
    ``model`` when the caller has it already."""
    key = _layout_key(fingerprint, behavior or behavior_digest(model))
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    path = _proof_dir() / f"layout-{key}.json"
    try:
        if not _DISK[-1]:
            raise OSError("memory only")
        data = json.loads(path.read_text())
        tup = lambda x: tuple(tup(i) for i in x) if isinstance(x, list) else x  # noqa: E731
        layout = KVLayout(**{k: tup(v) for k, v in data.items()})
    except (OSError, ValueError, TypeError):
        layout = read_layout(model) if keep is None else read_layout(model, keep=keep)
        try:
            if not _DISK[-1]:
                raise OSError("memory only")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(layout)))
            os.replace(tmp, path)
        except OSError:
            pass
    _LAYOUTS[key] = layout
    return layout


def proof_offsets(layout: KVLayout, root_len: int, n_tokens: int) -> list[int]:
    """The offsets of :data:`PROOF_OFFSETS` that keep the chunk inside the exact regime (plus the
    last one inside it when some are cut)."""
    if layout.max_exact_position is None:
        return list(PROOF_OFFSETS)
    room = layout.max_exact_position - root_len - n_tokens
    offs = [o for o in PROOF_OFFSETS if o < room]
    if len(offs) < len(PROOF_OFFSETS) and room > 1 and room - 1 not in offs:
        offs.append(room - 1)
    return offs


def prove_layout(
    backend: Any, *, use_cache: bool = True, probes: dict | None = None, behavior: str | None = None
) -> Proof:
    """Run (or recall) the proof at load for ``backend`` (an :class:`~contextdeque.model.hf.HFBackend`).

    What it checks: the property relocation rests on, that every layer's cached rotated channels
    of a chunk at ``p + δ`` are ``relocate`` of its canonical chunk, with the model's own forward as
    the oracle (:func:`check_chunk`, all layers, model dtype and bf16 storage), at
    :data:`PROOF_OFFSETS` inside the exact regime. The sequence is the detection probe's seeded
    :data:`PROBE_TOKENS` tokens, the first one as root and the other :data:`PROOF_TOKENS` as the
    chunk, encoded after that root's cache. The property is per token and per position (a chunk's
    key content depends on what precedes it, its rotation only on its position), so a one-token
    root proves it as well as the window's real one, and ``probes`` (the detection's forwards of
    the same tokens at 0 and :data:`PROBE_SHIFT`, see :func:`read_layout`) are its canonical
    forward and its first shifted oracle: with them the proof runs 2 forwards (the chunk's encode
    after the root's cache, the far offset), without them 5 (the root and the canonical too). The
    result is cached under the model fingerprint (config and every weight byte, dtype included),
    the layout, the behavior digest (the rotary/attention code and tables: a patched rotary is
    proven afresh), the device type, the transformers version and the proof's own parameters; a
    hit runs no forward.

    Raises:
        UnsupportedLayoutError: ``reason="proof-failed"`` with the measured error when the oracle
            disagrees with relocation (never used while inexact).
    """
    import transformers

    layout = backend.layout
    key = hashlib.sha256(
        f"{backend.fingerprint}:{layout.signature}:{behavior or behavior_digest(backend.model)}:{backend.device.type}:"
        f"{transformers.__version__}:{_PROOF_VERSION}:{PROOF_OFFSETS}:{PROOF_TOKENS}:{FP32_FLOOR}".encode()
    ).hexdigest()[:32]
    proof = _load_cached(key) if use_cache else None
    if proof is not None:
        proof = Proof(**{**asdict(proof), "cached": True})
    else:
        t0 = time.perf_counter()
        ids = probes["ids"] if probes else seeded_ids(backend.model, PROBE_TOKENS)
        offsets = proof_offsets(layout, 1, PROOF_TOKENS)
        if not offsets:
            raise UnsupportedLayoutError(
                f"{layout.model_type}: no offset inside the exact regime (switch at {layout.max_exact_position})",
                reason="rope-regime",
            )
        view = backend.with_root([int(ids[0])])
        probe_kv: dict[int, list[LayerKV]] = (probes or {}).get("kv", {})
        # the probe forward of [root, chunk] at start.. is shifted_forward(view, chunk, start)
        oracles = {int(start): [(k[:, 1:], v[:, 1:]) for k, v in kv] for start, kv in probe_kv.items()}
        if 0 in probe_kv and view is not backend:
            # the root's cache at position 0 is the canonical probe's first token (causal attention)
            view.adopt_root_kv([(k[:, :1].clone(), v[:, :1].clone()) for k, v in probe_kv[0]])
        view.counters = Counters()  # the proof's own forwards
        try:
            chunk = view.encode(token_ids=ids[1:])
            reports = check_chunk(view, chunk, offsets, "proof", oracles=oracles)
        except UnsupportedLayoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - a foreign architecture's forward after a cached past
            raise UnsupportedLayoutError(
                f"{layout.model_type}: the forward after a cached past at explicit positions fails: "
                f"{type(exc).__name__}: {str(exc)[:200]}",
                reason="forward-failed",
            ) from exc
        proof = Proof(
            key=key,
            layout_signature=layout.signature,
            offsets=offsets,
            max_rel_err=max(r.key_rel_err for r in reports),
            noise_floor=max(r.noise_floor for r in reports),
            max_ulp_bf16=max(r.bf16_ulp for r in reports),
            ok=all(r.ok for r in reports),
            seconds=time.perf_counter() - t0,
            forwards=view.forwards_run,
            details=[asdict(r) for r in reports],
        )
        _store(proof)
    if not proof.ok:
        raise UnsupportedLayoutError(
            f"{layout.model_type}: the layout read off the model ({layout.describe()}) fails the relocation oracle "
            f"at load: key error {proof.max_rel_err:.2e} of scale (noise floor {proof.noise_floor:.2e}, bf16 "
            f"{proof.max_ulp_bf16:.2f} ULP) at offsets {proof.offsets}; refusing rather than relocating inexactly",
            reason="proof-failed",
            measured=proof.max_rel_err,
        )
    return proof


def detect_layout(model: torch.nn.Module, *, verify: bool = True) -> KVLayout:
    """The layout of ``model`` read off its structure, proven by the relocation oracle unless
    ``verify=False`` (see :func:`read_layout`, :func:`prove_layout`)."""
    from .hf import HFBackend

    return HFBackend(model, None, root_ids=[int(seeded_ids(model, 1)[0])], verify_at_load=verify).layout
