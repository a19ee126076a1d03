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

The proof at load (the relocation oracle against the model's own forward) builds on this in
:mod:`contextdeque.model.detect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core import compat
from ..core.errors import UnsupportedLayoutError
from ..core.kv import LayerKV
from ..core.layout import REGIME_ROPE_TYPES, KVLayout, probe_freq_axis, trained_length
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


def seeded_ids(model: torch.nn.Module, n: int, seed: int = 0) -> torch.Tensor:
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
    ids = seeded_ids(model, PROBE_TOKENS)
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
        num_layers=n_layers, k_heads=int(k_heads), k_dim=int(k_dim), v_heads=int(v_heads), v_dim=int(v_dim),
        # the rotation: which tensor and channels, the pairing, the tables
        rope_tensor=spec.tensor, rope_start=spec.start, rope_dim=spec.dim, interleaved=spec.interleaved,
        inv_freqs=tuple(inv_tables),
        layer_table=tuple(layer_table), rope_type=rope_type, attention_scaling=max(scalings),
        n_pos_axes=n_axes, freq_axis=freq_axis, max_exact_position=limit, sliding_windows=sliding,
        compute_dtype=str(dtype).replace("torch.", ""),
        notes=tuple(notes),
        max_trained_position=trained_length(cfg),
    )
