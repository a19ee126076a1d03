"""The safety envelope on the probe set: does Δ's captured energy predict η, and what η does each
``fidelity_target`` reach, at what bytes, against fixed ranks?

Per probe item (its chunks in order, as in the harness's main group): the re-prefill reference,
blind reuse, and exact full-rank patches chained as a window holds them. Each patch's singular
spectrum is read off its factors (``U S`` columns), so every rank is a truncation of the same
patch: fixed ranks ``m`` for every chunk, and the adaptive rule (per chunk, the smallest m whose
directions capture the target energy pooled over layers, K and V separately, capped at
``max_patch_fraction`` of the page's bytes) for each target. Each variant's next-token KL against
re-prefill gives η (items with a measurable blind gap only); its patch bytes are summed.

    python -m contextdeque.eval.fidelity.envelope --items 36 --json out.json --plot docs/envelope.png
    python -m contextdeque.eval.fidelity.envelope --arch qwen2   # a tiny random non-llama family
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...patch.ops import truncate_patch
from ..arms import BlindArm, PatchArm, ReprefillArm, ReuseRequest
from ...patch import captured_energy, form_patch, rank_for_energy
from .harness import score_query
from ...core.metrics import kl_divergence
from .metrics import DEFAULT_MIN_GAP, eta
from .probes import materialize, probe_set

FIXED_RANKS = (4, 8, 16, 32, 64)
TARGETS = (0.9, 0.95, 0.99, 0.995)


def _s2(u: torch.Tensor) -> torch.Tensor:
    """Squared singular values per layer from ``U S`` factors ``[L, T, r]`` -> ``[L, r]``."""
    return u.to(torch.float64).pow(2).sum(1)


def _byte_cap(T: int, F: int, fraction: float) -> int:
    return max(1, min(T, F, int(fraction * T * F / (T + F))))


@dataclass
class Variant:
    name: str
    kind: str  # "fixed" / "adaptive"
    param: float
    kl: list[float] = field(default_factory=list)
    eta: list[float | None] = field(default_factory=list)
    energy: list[float] = field(default_factory=list)
    bytes: int = 0
    ranks: list[int] = field(default_factory=list)


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties)."""
    if len(x) < 3:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else None


@torch.no_grad()
def run_envelope(backend: Any, items: Sequence[Any], *, ranks: Sequence[int] = FIXED_RANKS, targets: Sequence[float] = TARGETS,
                 max_patch_fraction: float = 0.5, max_chunk_tokens: int = 512, image_grid: tuple[int, int] | None = None,
                 min_gap: float = DEFAULT_MIN_GAP) -> dict[str, Any]:
    """Measure every variant on ``items`` (probe items); returns the summary dict (see module doc)."""
    lay = backend.layout
    fk, fv = lay.k_heads * lay.k_dim, lay.v_heads * lay.v_dim
    variants = [Variant(f"fixed-r{r}", "fixed", r) for r in ranks] + [Variant(f"target-{t:g}", "adaptive", t) for t in targets]
    blind_kls: list[float] = []
    limit = getattr(lay, "max_trained_position", None)
    too_long = 0
    for item in items:
        mat = materialize(item, backend, max_chunk_tokens=max_chunk_tokens, image_grid=image_grid)
        if len(mat.chunks) < 2:
            continue
        req = ReuseRequest(backend, mat.chunks)
        start = req.next_position
        if limit is not None and start + len(mat.query_ids) > limit:
            too_long += 1  # past the model's trained context: left out, and counted
            continue
        ref_logits, _ = score_query(backend, ReprefillArm().run(req).kv, start, mat.query_ids, 0)
        blind_logits, _ = score_query(backend, BlindArm().run(req).kv, start, mat.query_ids, 0)
        kl_blind = kl_divergence(ref_logits, blind_logits)
        blind_kls.append(kl_blind)
        full: dict[int, list] = {}
        for i in range(1, len(req.chunks)):
            ants = [(req.chunks[j], full.get(j)) for j in range(i)]
            full[i] = [form_patch(backend, req.chunks[i], ants, rank="full", kind="exact")]
        tokens = [c.n_tokens for c in req.chunks[1:]]
        for v in variants:
            pats: dict[int, list] = {}
            energies = []
            for i, (p,) in full.items():
                T = p.n_tokens
                sk, sv = _s2(p.k_u), _s2(p.v_u)
                if v.kind == "fixed":
                    mk, mv = min(int(v.param), sk.shape[1]), min(int(v.param), sv.shape[1])
                else:
                    mk, _ = rank_for_energy(sk, v.param, _byte_cap(T, fk, max_patch_fraction))
                    mv, _ = rank_for_energy(sv, v.param, _byte_cap(T, fv, max_patch_fraction))
                q = truncate_patch(p, mk, mv)
                pats[i] = [q]
                v.bytes += q.nbytes
                v.ranks.append(mk + mv)
                energies.append(0.5 * (captured_energy(sk, mk) + captured_energy(sv, mv)))
            kv = PatchArm("full").run(req.with_patches(pats)).kv
            logits, _ = score_query(backend, kv, start, mat.query_ids, 0)
            kl = kl_divergence(ref_logits, logits)
            v.kl.append(kl)
            v.eta.append(eta(kl_blind, kl, min_gap))
            v.energy.append(sum(e * t for e, t in zip(energies, tokens)) / sum(tokens))
    out = summarize(variants, blind_kls)
    out["items_past_trained_context"] = too_long
    return out


def summarize(variants: Sequence[Variant], blind_kls: Sequence[float]) -> dict[str, Any]:
    rows = []
    xs, ys = [], []
    for v in variants:
        etas = [e for e in v.eta if e is not None]
        rows.append({
            "variant": v.name, "kind": v.kind, "param": v.param,
            "median_eta": statistics.median(etas) if etas else None,
            "mean_eta": statistics.fmean(etas) if etas else None,
            "n_eta": len(etas), "median_kl": statistics.median(v.kl) if v.kl else None,
            "median_energy": statistics.median(v.energy) if v.energy else None,
            "patch_bytes": v.bytes, "mean_rank_kv": statistics.fmean(v.ranks) if v.ranks else None,
        })
        for e, en in zip(v.eta, v.energy):
            if e is not None:
                xs.append(en)
                ys.append(e)
    out: dict[str, Any] = {"variants": rows, "items": len(blind_kls),
                           "items_with_gap": sum(1 for k in blind_kls if k > DEFAULT_MIN_GAP),
                           "energy_eta_spearman": rank_correlation(xs, ys), "points": list(zip(xs, ys))}
    # the acceptance comparison: the cheapest fixed rank whose median η reaches the 0.99 target's
    adapt = next((r for r in rows if r["kind"] == "adaptive" and abs(r["param"] - 0.99) < 1e-9), None)
    if adapt and adapt["median_eta"] is not None:
        fixed_ok = [r for r in rows if r["kind"] == "fixed" and r["median_eta"] is not None and r["median_eta"] >= adapt["median_eta"]]
        cheapest = min(fixed_ok, key=lambda r: r["patch_bytes"]) if fixed_ok else None
        out["target_0.99"] = {
            "median_eta": adapt["median_eta"], "patch_bytes": adapt["patch_bytes"],
            "cheapest_fixed_reaching_it": None if cheapest is None else cheapest["variant"],
            "its_patch_bytes": None if cheapest is None else cheapest["patch_bytes"],
        }
    return out


def plot_envelope(summary: dict[str, Any], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    pts = summary["points"]
    a.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, alpha=0.5)
    a.set_xlabel("captured energy of Δ (token-weighted, K/V mean)")
    a.set_ylabel("η (gap closed vs blind)")
    rho = summary["energy_eta_spearman"]
    a.set_title(f"energy vs η: Spearman ρ = {rho:.3f}" if rho is not None else "energy vs η")
    a.set_ylim(-0.5, 1.05)
    rows = summary["variants"]
    fixed = [r for r in rows if r["kind"] == "fixed" and r["median_eta"] is not None]
    adapt = [r for r in rows if r["kind"] == "adaptive" and r["median_eta"] is not None]
    b.plot([r["patch_bytes"] / 2**20 for r in fixed], [r["median_eta"] for r in fixed], "o-", label="fixed rank m")
    for r in fixed:
        b.annotate(f"m={int(r['param'])}", (r["patch_bytes"] / 2**20, r["median_eta"]), fontsize=7)
    b.plot([r["patch_bytes"] / 2**20 for r in adapt], [r["median_eta"] for r in adapt], "s-", label="fidelity_target τ")
    for r in adapt:
        b.annotate(f"τ={r['param']:g}", (r["patch_bytes"] / 2**20, r["median_eta"]), fontsize=7)
    b.set_xlabel("patch bytes over the probe set (MiB)")
    b.set_ylabel("median η")
    b.set_title("η reached per target vs fixed ranks")
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m contextdeque.eval.fidelity.envelope", description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=None, help="first N probe items (default: all 36)")
    ap.add_argument("--arch", default=None, help="a tiny random architecture (contextdeque.model.testing) instead of the default model")
    ap.add_argument("--max-patch-fraction", type=float, default=0.5)
    ap.add_argument("--max-chunk-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared, busy CPU)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--plot", default=None, help="write the figure here (PNG)")
    args = ap.parse_args(argv)
    from ...model.threads import apply_threads

    apply_threads(max(1, args.threads))  # explicit: a model loaded below keeps it
    if args.arch:
        from ...model.testing import tiny_backend

        be = tiny_backend(args.arch)
        grid = (4, 4)
    else:
        from ...model import load_model

        be = load_model()
        grid = None
    s = run_envelope(be, probe_set(args.items), max_patch_fraction=args.max_patch_fraction,
                     max_chunk_tokens=args.max_chunk_tokens, image_grid=grid)
    s["model"] = be.name if hasattr(be, "name") else str(args.arch)
    for r in s["variants"]:
        print(json.dumps(r))
    print(json.dumps({k: v for k, v in s.items() if k not in ("variants", "points")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1, sort_keys=True)
    if args.plot:
        plot_envelope(s, args.plot, title=str(s["model"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
