"""Layouts read off the loaded model's structure, and proven against its own forward at load.

No list of model types decides anything here. :func:`read_layout` looks at what the model *is*:

- its rotary tables: every ``inv_freq`` / ``<layer type>_inv_freq`` buffer of the language model's
  rotary modules (per-layer bases, scaled kinds; ``original_inv_freq`` for kinds that grow the table
  in place), and precomputed sin/cos tables (GPT-J, CodeGen);
- what its cache holds: one forward of a short seeded chunk at positions ``0..T-1`` and one at
  ``δ..δ+T-1`` (RoPE attention is shift-invariant, so every layer's pre-rotation keys are the same in
  both). Each candidate geometry — rotated tensor (K, or MLA's k_pe in V), channel range (all, the
  first ``2F`` for partial rotary, the last ``2F`` for decompressed MLA), pairing (half-split or
  interleaved), table per layer (or none: a NoPE/ALiBi layer) — predicts the second cache from the
  first; the one that does, within the forward's own noise, is the layout. Head counts and head
  dims are the cache's shapes.

What cannot be relocated is refused with the reason (:data:`REFUSAL_REASONS`, the error's
``reason``): learned absolute position embeddings (the keys move with position and no rotation
explains it), recurrent / state-space layers (the cache holds running states), no cache, layers
whose K/V shapes differ.

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
import transformers

from ..core import compat
from ..core.errors import UnsupportedLayoutError
from ..core.kv import LayerKV
from ..core.layout import REGIME_ROPE_TYPES, KVLayout, probe_freq_axis, trained_length
from ..core.metrics import ulp_error_at_scale
from ..core.operator import relocate
from ..core.rotation import rope_tables
from ..kernels import RopeSpec, fused_apply
from .forward import run_forward

#: Why a model can be refused (``UnsupportedLayoutError.reason``).
REFUSAL_REASONS: dict[str, str] = {
    "learned-positions": "absolute position embeddings are added to the inputs: cached keys depend on absolute position",
    "recurrent": "recurrent / state-space / linear-attention layers cache a running state, not per-token keys",
    "no-kv-cache": "the model returns no per-token KV cache",
    "no-positions": "the forward takes no explicit position ids",
    "positions-ignored": "the model holds positions (embeddings or rotary tables) but takes them from the cache length, not position_ids",
    "layer-shapes": "layers cache differently shaped K/V (a chunk stacks all layers in one tensor)",
    "not-a-rotation": "cached keys move with position in a way no rotation by the model's own tables explains",
    "rope-regime": "the rotary table switches with sequence length below any usable position",
    "proof-failed": "the structural layout failed the relocation oracle at load",
    "forward-failed": "the forward at explicit positions over a per-token KV cache fails (the error is given)",
}

FP32_FLOOR = 1e-5
PROBE_TOKENS = 8
PROBE_SHIFT = 37
#: The proof's offsets: the detection probe's shift (its forward is reused) and one far beyond it.
PROOF_OFFSETS = (PROBE_SHIFT, 257)
#: The proof's sequence is the detection probe's: its first token is the root, the rest the chunk.
PROOF_TOKENS = PROBE_TOKENS - 1
_PROOF_VERSION = "2"


# ----------------------------------------------------------------------------- shared measures


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64 (absolute when ``b`` is all zero)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if b.numel() else 0.0
    return diff if scale == 0.0 else diff / scale


def tolerance(dtype: torch.dtype, floor: float) -> float:
    """The acceptance bound on a relocated key's error relative to its scale: twice the forward's
    own noise floor, and never tighter than the dtype allows (1e-5 in fp32; 4 machine epsilons of
    a 16-bit compute dtype, i.e. a few ULPs of the keys' scale)."""
    unit = FP32_FLOOR if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps
    return max(2 * min(floor, noise_cap(dtype)), unit)


def noise_cap(dtype: torch.dtype) -> float:
    """The largest movement of never-rotated channels still taken for forward noise (1e-2 of scale in
    fp32, 8 epsilons in 16-bit): beyond it the model is not shift-invariant and the floor says
    nothing (a learned-position model moves its values by O(1))."""
    return 1e-2 if dtype in (torch.float32, torch.float64) else 8 * torch.finfo(dtype).eps


def _seeded_ids(model: torch.nn.Module, n: int, seed: int = 0) -> torch.Tensor:
    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    lo = min(4, vocab - 1)
    return torch.randint(lo, vocab, (n,), generator=g)


# ----------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class _Table:
    name: str
    inv_freq: torch.Tensor  # fp32 [F]
    scaling: float
    max_positions: int | None = None


def _rotary_tables(model: torch.nn.Module) -> tuple[list[_Table], list[tuple[str, torch.nn.Module]]]:
    """Every distinct rotary table of the language model (rotary modules' inv_freq buffers and
    precomputed sin/cos tables), and the rotary modules themselves."""
    tables: list[_Table] = []
    modules = compat.find_rotary_modules(model)
    for mname, module in modules:
        names = [b for b, _ in module.named_buffers(recurse=False)]
        prefixes = sorted({b[: -len("inv_freq")] for b in names if b.endswith("inv_freq") and "original_" not in b})
        for prefix in prefixes:
            lt = prefix[:-1] if prefix else None
            inv = compat.rotary_inv_freq(module, lt)
            scale = compat.rotary_attention_scaling(module, lt)
            if not any(torch.equal(inv, t.inv_freq) for t in tables):
                tables.append(_Table(f"{mname}.{prefix}inv_freq", inv, scale))
                # the same table turned the other way (rotate_half with flipped signs, NanoChat):
                # angles -θp, which fp32 computes as exactly -(θp)
                tables.append(_Table(f"-{mname}.{prefix}inv_freq", -inv, scale))
    for bname, inv, n_pos in compat.sinusoid_tables(model):
        if not any(torch.equal(inv, t.inv_freq) for t in tables):
            tables.append(_Table(bname, inv, 1.0, n_pos))
    return tables, modules


def _position_embeddings(model: torch.nn.Module) -> list[str]:
    """What adds an absolute position signal to the inputs: embedding modules or ``[positions, width]``
    buffers (other than the token embedding and rotary tables) whose name says position. Buffers are
    listed as ``buffer:<name>``."""
    tok = model.get_input_embeddings()
    out = []
    for name, module in model.named_modules():
        if module is tok or "vision" in name.lower() or "visual" in name.split("."):
            continue
        leaf = name.split(".")[-1].lower()
        is_table = isinstance(module, torch.nn.Embedding) or "Positional" in type(module).__name__
        if is_table and ("pos" in leaf or leaf in ("wpe",)):
            out.append(name)
    for name, buf in model.named_buffers():
        leaf = name.split(".")[-1].lower()
        if buf.dim() == 2 and "pos" in leaf and "inv_freq" not in leaf and buf.is_floating_point():
            if not any(name.startswith(m + ".") for m in out):
                out.append(f"buffer:{name}")
    return out


def _n_pos_axes(cfg: Any) -> int:
    return 3 if compat.rope_parameters(cfg).get("mrope_section") is not None else 1


def _regime(cfg: Any, modules: list[tuple[str, torch.nn.Module]], layer_types: list[str]) -> tuple[str, int | None, list[str]]:
    """(rope kind, first position outside the exact regime or None, notes)."""
    kinds: set[str] = set()
    for lt in set(layer_types) or {None}:
        kinds.add(str(compat.rope_parameters(cfg, lt).get("rope_type", "default")))
    for _, m in modules:
        rt = getattr(m, "rope_type", None)
        if isinstance(rt, str):
            kinds.add(rt)
        elif isinstance(rt, dict):
            kinds.update(str(v) for v in rt.values())
    kinds.discard("default") if len(kinds) > 1 else None
    kind = "+".join(sorted(kinds)) or "default"
    limit, notes = None, []
    if kinds & REGIME_ROPE_TYPES:
        params = compat.rope_parameters(cfg)
        if "longrope" in kinds:  # long factors once max(position)+1 > original length
            limit = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        else:  # dynamic NTK grows inv_freq once max(position)+1 > max_position_embeddings
            limit = int(cfg.max_position_embeddings)
        notes.append(f"{kind}: inv_freq switches at {limit} tokens; relocation refused beyond it")
    return kind, limit, notes


@dataclass
class _Candidate:
    spec: RopeSpec
    per_layer: list[int]  # table index per layer, -1 = identity
    errors: list[float]
    floor: float

    @property
    def err(self) -> float:
        return max(self.errors)


def _predict(k0, v0, spec: RopeSpec, inv: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor):
    # the tables are built on the CPU (inv_freq is read there); the cache may be on an accelerator
    cos0, sin0 = (t.to(k0.device) for t in rope_tables(inv, p0))
    cos1, sin1 = (t.to(k0.device) for t in rope_tables(inv, p1))
    k, v = fused_apply(k0.to(torch.float32), v0.to(torch.float32), spec, cos0, -sin0, out_dtype=torch.float32)
    return fused_apply(k, v, spec, cos1, sin1, out_dtype=torch.float32)


def _fit(kv0: list[LayerKV], kv1: list[LayerKV], tables: list[_Table], shift: int) -> _Candidate:
    """The geometry (one spec for all layers, a table or the identity per layer) that best predicts
    the shifted forward's cache from the unshifted one."""
    T = kv0[0][0].shape[-2]
    p0 = torch.arange(T)
    p1 = p0 + shift
    k_dim, v_dim = kv0[0][0].shape[-1], kv0[0][1].shape[-1]
    ident = [max(rel_err(k0, k1), rel_err(v0, v1)) for (k0, v0), (k1, v1) in zip(kv0, kv1)]
    # the identity everywhere (NoPE / ALiBi): one candidate over the whole head
    even = k_dim - (k_dim % 2)
    best = _Candidate(RopeSpec("k", 0, max(even, 2)), [-1] * len(kv0), ident, 0.0)
    specs: list[tuple[RopeSpec, list[int]]] = []
    for tensor, dim in (("k", k_dim), ("v", v_dim)):
        for ti, t in enumerate(tables):
            r = 2 * t.inv_freq.numel()
            if r > dim or r == 0:
                continue
            for start in sorted({0, dim - r}):
                for inter in (False, True):
                    specs.append((RopeSpec(tensor, start, r, inter), [ti]))
    # group tables by width: a spec may use any table of its width on each layer
    by_spec: dict[RopeSpec, list[int]] = {}
    for spec, tis in specs:
        by_spec.setdefault(spec, []).extend(tis)
    for spec, tis in by_spec.items():
        choice, errs = [], []
        for l, ((k0, v0), (k1, v1)) in enumerate(zip(kv0, kv1)):
            cand = [(ident[l], -1)]
            for ti in tis:
                pk, pv = _predict(k0, v0, spec, tables[ti].inv_freq, p0, p1)
                cand.append((max(rel_err(pk, k1), rel_err(pv, v1)), ti))
            e, ti = min(cand)
            choice.append(ti)
            errs.append(e)
        if max(errs) < best.err:
            best = _Candidate(spec, choice, errs, 0.0)
    # noise floor: how much the channels that never rotate moved between the two forwards
    floors = []
    for l, ((k0, v0), (k1, v1)) in enumerate(zip(kv0, kv1)):
        if best.per_layer[l] == -1:
            continue
        s = best.spec
        rot0, rot1 = (k0, k1) if s.tensor == "k" else (v0, v1)
        other0, other1 = (v0, v1) if s.tensor == "k" else (k0, k1)
        floors.append(rel_err(other0, other1))
        if s.start > 0:
            floors.append(rel_err(rot0[..., : s.start], rot1[..., : s.start]))
        if s.start + s.dim < rot0.shape[-1]:
            floors.append(rel_err(rot0[..., s.start + s.dim :], rot1[..., s.start + s.dim :]))
    # identity everywhere (NoPE / ALiBi): nothing never rotates, so nothing may move beyond the dtype's unit
    best.floor = max(floors) if floors else 0.0
    return best


def _probe_forward(model: torch.nn.Module, n_axes: int, ids: torch.Tensor, start: int) -> list[LayerKV]:
    """The cache of ``ids`` at positions ``start..``; when that forward fails, what the model caches
    on a plain forward decides the refusal (a recurrent state, or the failure itself)."""
    pos = torch.arange(ids.numel(), dtype=torch.long) + start
    try:
        kv, _ = run_forward(model, n_axes, input_ids=ids, positions=pos.unsqueeze(0), logits="none")
        return kv
    except UnsupportedLayoutError as exc:
        if exc.reason != "no-positions":
            raise
        failure: Exception = exc
    except Exception as exc:  # noqa: BLE001 - a foreign architecture's forward
        failure = exc
    from .forward import cached_kv

    try:
        with torch.no_grad():
            out = model(input_ids=ids.reshape(1, -1), use_cache=True)
    except Exception:  # noqa: BLE001
        out = None
    if out is not None:
        cached_kv(out, 0, ids.numel())  # raises "recurrent" / "no-kv-cache" when that is what it caches
    if isinstance(failure, UnsupportedLayoutError):
        raise failure
    raise UnsupportedLayoutError(
        f"the forward at explicit positions with a per-token KV cache fails: {type(failure).__name__}: "
        f"{str(failure)[:200]}",
        reason="forward-failed",
    ) from failure


def read_layout(model: torch.nn.Module, *, keep: dict | None = None) -> KVLayout:
    """The model's KV/RoPE layout, read off its structure and its own cache (see the module doc).

    ``keep``: when given, filled with the probe forwards (``"ids"`` ``[PROBE_TOKENS]`` and ``"kv"``
    ``{start position: per-layer (k [H,T,d], v [H,T,d])}``) so :func:`prove_layout` reuses them as
    its canonical and shifted oracle instead of running them again.

    Raises:
        UnsupportedLayoutError: with ``reason`` (one of :data:`REFUSAL_REASONS`) and the evidence.
    """
    cfg = compat.text_config(model.config)
    model_type = str(getattr(cfg, "model_type", None) or getattr(model.config, "model_type", "?"))
    outer_type = str(getattr(model.config, "model_type", model_type))
    display = outer_type if outer_type != model_type and model_type.endswith("_text") else model_type
    tables, modules = _rotary_tables(model)
    layer_types = [str(t) for t in (getattr(cfg, "layer_types", None) or [])]
    rope_type, limit, notes = _regime(cfg, modules, layer_types)
    for t in tables:
        if t.max_positions is not None:
            limit = t.max_positions if limit is None else min(limit, t.max_positions)
            notes.append(f"sin/cos table ends at position {t.max_positions}")
    n_axes = _n_pos_axes(cfg)
    shift = PROBE_SHIFT
    if limit is not None:
        shift = min(shift, limit - PROBE_TOKENS)
        if shift < 1:
            raise UnsupportedLayoutError(f"{display}: {notes[-1]}", reason="rope-regime")
    was_training = model.training
    model.eval()
    ids = _seeded_ids(model, PROBE_TOKENS)
    kv0 = _probe_forward(model, n_axes, ids, 0)
    kv1 = _probe_forward(model, n_axes, ids, shift)
    model.train(was_training)
    if keep is not None:
        keep.update(ids=ids, kv={0: kv0, shift: kv1})
    shapes = {(k.shape[0], k.shape[-1], v.shape[0], v.shape[-1]) for k, v in kv0}
    if len(shapes) != 1:
        raise UnsupportedLayoutError(
            f"{display}: layers cache differently shaped K/V ({sorted(shapes)} as [k heads, k dim, v heads, v dim]); "
            "a chunk stacks every layer in one tensor",
            reason="layer-shapes",
        )
    k_heads, k_dim, v_heads, v_dim = shapes.pop()
    fit = _fit(kv0, kv1, tables, shift)
    dtype = next(model.parameters()).dtype
    bound = tolerance(dtype, fit.floor)
    if fit.err > bound:
        worst = max(range(len(fit.errors)), key=lambda l: fit.errors[l])
        pos_mods = _position_embeddings(model)
        measured = f"best geometry misses the shifted forward by {fit.err:.2e} of the keys' scale at layer {worst} (noise floor {fit.floor:.2e})"
        if pos_mods:
            raise UnsupportedLayoutError(
                f"{display}: absolute position embeddings added to the inputs ({', '.join(pos_mods)}) make cached "
                f"keys depend on absolute position; {measured}",
                reason="learned-positions",
                measured=fit.err,
                evidence=tuple(pos_mods),
            )
        where = f"rotary tables {[t.name for t in tables]}" if tables else "no rotary table"
        raise UnsupportedLayoutError(
            f"{display}: cached keys move with position in a way no rotation explains ({where}); {measured}",
            reason="not-a-rotation",
            measured=fit.err,
        )
    if all(ti < 0 for ti in fit.per_layer):
        # nothing moved with position_ids: position-free (NoPE / ALiBi), unless the model does hold a
        # position signal, which then is not driven by position_ids (taken from the cache length)
        pos_mods = _position_embeddings(model) + [t.name for t in tables if not t.name.startswith("-")]
        if pos_mods:
            raise UnsupportedLayoutError(
                f"{display}: cached keys ignore position_ids although the model holds positions "
                f"({', '.join(pos_mods)}): it takes them from the cache length, so a chunk's keys depend on where it "
                "was encoded and cannot be placed elsewhere",
                reason="positions-ignored",
                evidence=tuple(pos_mods),
            )
    spec = fit.spec
    n_freq = spec.dim // 2
    zero = tuple([0.0] * n_freq)
    inv_tables: list[tuple[float, ...]] = []
    layer_table: list[int] = []
    scalings = {1.0}
    for ti in fit.per_layer:
        tup = zero if ti < 0 else tuple(float(x) for x in tables[ti].inv_freq.tolist())
        if ti >= 0:
            scalings.add(tables[ti].scaling)
        if tup not in inv_tables:
            inv_tables.append(tup)
        layer_table.append(inv_tables.index(tup))
    freq_axis = None
    if n_axes > 1:
        rot = next((m for _, m in modules), None)
        if rot is None:
            raise UnsupportedLayoutError(f"{display}: M-RoPE positions but no rotary module", reason="not-a-rotation")
        freq_axis = probe_freq_axis(rot, n_freq)
    sw = getattr(cfg, "sliding_window", None)
    n_layers = len(kv0)
    lts = layer_types if len(layer_types) == n_layers else ["full_attention"] * n_layers
    sliding = tuple(int(sw) if (t == "sliding_attention" and sw) else None for t in lts)
    if all(ti < 0 for ti in fit.per_layer):
        rope_type = "none"
    return KVLayout(
        model_type=display,
        family="mla" if spec.tensor == "v" else "gqa",
        num_layers=n_layers,
        k_heads=int(k_heads),
        k_dim=int(k_dim),
        v_heads=int(v_heads),
        v_dim=int(v_dim),
        rope_tensor=spec.tensor,
        rope_start=spec.start,
        rope_dim=spec.dim,
        interleaved=spec.interleaved,
        inv_freqs=tuple(inv_tables),
        layer_table=tuple(layer_table),
        rope_type=rope_type,
        attention_scaling=max(scalings),
        n_pos_axes=n_axes,
        freq_axis=freq_axis,
        max_exact_position=limit,
        sliding_windows=sliding,
        compute_dtype=str(dtype).replace("torch.", ""),
        notes=tuple(notes),
        max_trained_position=trained_length(cfg),
    )


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
        ids = probes["ids"] if probes else _seeded_ids(backend.model, PROBE_TOKENS)
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
        view.forwards_run = 0
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

    return HFBackend(model, None, root_ids=[int(_seeded_ids(model, 1)[0])], verify_at_load=verify).layout
