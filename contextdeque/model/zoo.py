"""The zoo sweep: every causal-LM architecture of the installed transformers, built tiny, through
structural detection and the proof at load, with a verdict each.

Verdicts: ``exact`` (relocation proven, the measured key error given), ``identity`` (no positional
rotation in the cache: NoPE/ALiBi, proven), ``refused`` (with the reason, and whether an
independent check confirms it), ``could-not-build`` (no tiny model of the default config).
An accepted model is re-checked at a farther offset with another chunk than the proof used, so
"used" always means "exact". ``contextdeque zoo`` prints the counts; ``tests/test_zoo.py`` runs it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch

from ..core.errors import UnsupportedLayoutError
from .detect import PROBE_SHIFT, check_chunk, memory_only, rel_err, tolerance
from .forward import run_forward
from .hf import HFBackend
from .tiny_auto import TinyBuildError, build_tiny_auto_model, causal_lm_model_types

#: Offset of the independent re-check of accepted models (farther than the proof's offsets).
RECHECK_OFFSET = 2500


@dataclass
class Verdict:
    model_type: str
    verdict: str  # exact | identity | refused | could-not-build (the sweep's test fails on inexact | error)
    reason: str = ""  # refusal reason (UnsupportedLayoutError.reason) or build failure
    reason_holds: bool | None = None  # refused: the independent check of the stated reason
    key_err: float | None = None  # accepted: worst relocation key error (proof and re-check)
    noise_floor: float | None = None
    layout: str = ""
    message: str = ""
    seconds: float = 0.0


def _layer0_keys_move(model: torch.nn.Module, hook_modules: Iterable[str] = ()) -> float:
    """Relative change of layer-0 cached K and V between the same tokens at positions 0.. and
    ``PROBE_SHIFT``.., with the output of ``hook_modules`` replaced by zeros."""
    mods = dict(model.named_modules())
    bufs = dict(model.named_buffers())
    handles = [mods[n].register_forward_hook(lambda m, i, o: torch.zeros_like(o)) for n in hook_modules
               if not n.startswith("buffer:")]
    saved = {n: bufs[n[7:]].clone() for n in hook_modules if n.startswith("buffer:")}
    for n in saved:
        bufs[n[7:]].zero_()
    try:
        ids = torch.arange(4, 12)
        kv = [run_forward(model, 1, input_ids=ids, positions=(torch.arange(8) + s).unsqueeze(0), logits="none")[0]
              for s in (0, PROBE_SHIFT)]
    finally:
        for h in handles:
            h.remove()
        for n, val in saved.items():
            bufs[n[7:]].copy_(val)
    (k0, v0), (k1, v1) = kv[0][0], kv[1][0]
    return max(rel_err(k1, k0), rel_err(v1, v0))


def _plain_cache(model: torch.nn.Module) -> Any:
    with torch.no_grad():
        out = model(input_ids=torch.arange(4, 12).reshape(1, -1), use_cache=True)
    return out


def check_reason(model: torch.nn.Module, exc: UnsupportedLayoutError) -> bool:
    """Whether the stated refusal reason holds, by a check independent of the one that refused."""
    reason = exc.reason
    if reason == "learned-positions":
        # the keys move with position, and stop moving once the named modules' outputs are zeroed
        return bool(exc.evidence) and _layer0_keys_move(model) > 1e-4 and _layer0_keys_move(model, exc.evidence) < 1e-6
    if reason == "positions-ignored":
        # one token's keys after a 5-token past differ from the same tokens at the same position_ids without
        # one: position comes from the cache length, not from position_ids
        ids = torch.arange(4, 12)
        past, _ = run_forward(model, 1, input_ids=ids[:5], positions=torch.arange(5).unsqueeze(0), logits="none")
        with_past, _ = run_forward(model, 1, input_ids=ids[5:6], positions=torch.tensor([[5]]), past=past, logits="none")
        alone, _ = run_forward(model, 1, input_ids=ids[5:6], positions=torch.tensor([[5]]), logits="none")
        # layer 0 sees no attention before its keys are cached: any difference is the position signal
        return rel_err(with_past[0][0], alone[0][0]) > 1e-4
    if reason == "recurrent":
        out = _plain_cache(model)
        cache = getattr(out, "past_key_values", None)
        if cache is None:
            return getattr(out, "cache_params", None) is not None or getattr(out, "state", None) is not None
        layers = getattr(cache, "layers", [])
        return any(not isinstance(getattr(l, "keys", None), torch.Tensor) or l.keys.dim() != 4 for l in layers)
    if reason == "no-kv-cache":
        out = _plain_cache(model)
        return getattr(out, "past_key_values", None) is None and getattr(out, "cache_params", None) is None
    if reason == "no-positions":
        import inspect

        return "position_ids" not in inspect.signature(type(model).forward).parameters
    if reason == "layer-shapes":
        cache = _plain_cache(model).past_key_values
        return len({(tuple(l.keys.shape), tuple(l.values.shape)) for l in cache.layers}) > 1
    if reason == "forward-failed":
        try:  # a positioned forward, then one more token after its cache
            ids = torch.arange(4, 12)
            kv, _ = run_forward(model, 1, input_ids=ids, positions=torch.arange(8).unsqueeze(0), logits="none")
            run_forward(model, 1, input_ids=ids[:2], positions=torch.arange(8, 10).unsqueeze(0), past=kv, logits="none")
        except Exception:  # noqa: BLE001 - the failure the refusal names, reproduced
            return True
        return False
    if reason in ("not-a-rotation", "proof-failed"):
        # the measured error is above the tolerance of the model's dtype (re-measured by the refusal
        # itself); the claim "not relocatable by a rotation of its tables" is what was measured
        return exc.measured is not None and exc.measured > tolerance(next(model.parameters()).dtype, 0.0)
    return False


def sweep_one(model_type: str) -> Verdict:
    t0 = time.perf_counter()
    try:
        model = build_tiny_auto_model(model_type)
    except TinyBuildError as exc:
        return Verdict(model_type, "could-not-build", message=str(exc), seconds=time.perf_counter() - t0)
    try:
        backend = HFBackend(model, None, root_ids=[1, 2, 3], name=f"tiny-{model_type}", verify_at_load=True)
    except UnsupportedLayoutError as exc:
        holds = check_reason(model, exc)
        return Verdict(model_type, "refused", exc.reason, holds, message=str(exc)[:300], seconds=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - a foreign architecture failing after the probe: a bug to see
        return Verdict(model_type, "error", type(exc).__name__, False, message=f"{type(exc).__name__}: {str(exc)[:240]}",
                       seconds=time.perf_counter() - t0)
    layout, proof = backend.layout, backend.proof
    assert proof is not None
    # independent re-check: another chunk, a farther offset, the same criterion
    offset = RECHECK_OFFSET
    if layout.max_exact_position is not None:
        offset = min(offset, layout.max_exact_position - backend.root_len - 16 - 1)
    chunk = backend.encode(token_ids=torch.arange(5, 21) % model.get_input_embeddings().weight.shape[0])
    rep = check_chunk(backend, chunk, [offset], "recheck")[0]
    err = max(proof.max_rel_err, rep.key_rel_err)
    verdict = "identity" if all(layout.identity_layers) else "exact"
    if not rep.ok:
        verdict = "inexact"  # used while inexact: the sweep's test fails on this
    return Verdict(model_type, verdict, key_err=err, noise_floor=max(proof.noise_floor, rep.noise_floor),
                   layout=layout.describe(), seconds=time.perf_counter() - t0)


def sweep(model_types: Iterable[str] | None = None, *, threads: int | None = 1) -> list[Verdict]:
    """Verdicts for ``model_types`` (default: every causal-LM model type of the installed
    transformers), on ``threads`` torch threads (None: as set). Nothing is written to the cache
    directory."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads or n)
    try:
        with memory_only():
            return [sweep_one(mt) for mt in (model_types or causal_lm_model_types())]
    finally:
        torch.set_num_threads(n)


def counts(verdicts: list[Verdict]) -> dict[str, Any]:
    """``{"exact": n, "identity": n, "refused": {reason: n}, "could-not-build": n, "total": n}``."""
    c = Counter(v.verdict for v in verdicts)
    refused = Counter(v.reason for v in verdicts if v.verdict == "refused")
    out: dict[str, Any] = {
        "total": len(verdicts),
        "exact": c["exact"],
        "identity": c["identity"],
        "refused": dict(sorted(refused.items())),
        "could-not-build": c["could-not-build"],
    }
    for bad in ("inexact", "error"):
        if c[bad]:
            out[bad] = c[bad]
    return out


def to_json(verdicts: list[Verdict]) -> dict[str, Any]:
    import transformers

    return {"transformers": transformers.__version__, "counts": counts(verdicts), "verdicts": [asdict(v) for v in verdicts]}


README_START = "<!-- zoo-counts:start (generated by `contextdeque zoo --write-docs`) -->"
README_END = "<!-- zoo-counts:end -->"


def counts_line(counts_: dict[str, Any]) -> str:
    """One sentence of counts, the form the README and ``docs/zoo.md`` carry."""
    refused = ", ".join(f"{n} {r}" for r, n in counts_["refused"].items())
    return (
        f"Of the {counts_['total']} causal-LM architectures of transformers {_tf_version()}: "
        f"**{counts_['exact']} relocate exactly**, **{counts_['identity']} as the identity** (no positional "
        f"rotation in the cache), **{sum(counts_['refused'].values())} are refused** ({refused}), and "
        f"{counts_['could-not-build']} could not be built tiny from their default config."
    )


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def render_markdown(verdicts: list[Verdict]) -> str:
    """``docs/zoo.md``: the counts (and their JSON, which the zoo test compares with a fresh sweep)
    and one row per architecture."""
    c = counts(verdicts)
    lines = [
        "# Every causal-LM architecture of transformers, tiny",
        "",
        "Generated by `contextdeque zoo --write-docs` (do not edit by hand; `tests/test_zoo.py` fails when",
        "these counts differ from a fresh sweep). Each architecture's default config is shrunk to a tiny",
        "random-weight model, its KV layout is read off its structure and proven at load against its own",
        "forward (`contextdeque.model.detect`), accepted models are re-checked at a farther offset, and every",
        "refusal's reason is confirmed by an independent check.",
        "",
        counts_line(c),
        "",
        f"counts: `{json.dumps(c, sort_keys=True)}`",
        "",
        "| model_type | verdict | reason | key error | layout / message |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        detail = (v.layout if v.verdict in ("exact", "identity") else v.message).replace("|", "/").replace("\n", " ")
        err = f"{v.key_err:.1e}" if v.key_err is not None else ""
        lines.append(f"| {v.model_type} | {v.verdict} | {v.reason} | {err} | {detail[:160]} |")
    return "\n".join(lines) + "\n"


def docs_counts(markdown: str) -> dict[str, Any] | None:
    """The counts JSON a rendered ``docs/zoo.md`` carries (None if absent)."""
    for line in markdown.splitlines():
        if line.startswith("counts: `") and line.endswith("`"):
            return json.loads(line[len("counts: `") : -1])
    return None


def update_readme(readme: str, counts_: dict[str, Any]) -> str:
    """``readme`` with the text between the zoo markers replaced by :func:`counts_line`."""
    a, b = readme.index(README_START) + len(README_START), readme.index(README_END)
    return readme[:a] + "\n" + counts_line(counts_) + " See [docs/zoo.md](docs/zoo.md).\n" + readme[b:]


__all__ = ["Verdict", "sweep", "sweep_one", "counts", "check_reason", "to_json", "render_markdown", "update_readme",
           "docs_counts", "counts_line"]
