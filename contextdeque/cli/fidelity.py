"""``contextdeque fidelity``: every reuse arm against a full re-prefill on the probe set.

Prints a table per arm (median / mean / pooled η, median KL, flip-recover, bytes and recompute
fractions), the η-vs-rank curve, and the acceptance targets beside the measured figures;
``--json`` prints one JSON object instead, ``--plot`` writes a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

from ..eval.arms.vlcache import check_schedule
from ..core.chunk import storage_dtype
from ..eval.fidelity.harness import FAMILIES, HarnessConfig, run_fidelity
from ..eval.fidelity.metrics import DEFAULT_MIN_GAP
from ..eval.fidelity.probes import probe_set
from .model_spec import MODEL_HELP, add_threads_argument, load_backend
from .window_options import add_fidelity_target_arguments, fraction


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _arm_list(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in vals if v not in FAMILIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown arm families {bad}; choose from {', '.join(FAMILIES)}")
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--ranks", type=_int_list, default=(8, 16, 32, 64), help="patch ranks (default 8,16,32,64)")
    parser.add_argument("--arms", type=_arm_list, default=FAMILIES,
                        help=f"arm families to run (blind and re-prefill always run); default {','.join(FAMILIES)}")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write the eta-vs-rank plot here")
    parser.add_argument("--json", action="store_true", help="print one JSON object (no tables)")
    parser.add_argument("--items", type=int, default=None, help="run only the first N probe items")
    parser.add_argument("--storage", choices=("fp32", "bf16"), default="fp32", help="chunk/patch storage dtype")
    parser.add_argument("--min-gap", type=float, default=DEFAULT_MIN_GAP,
                        help="blind KL below which an item has no measurable gap (excluded from eta medians)")
    parser.add_argument("--per-item", action="store_true", help="with --json: also every sample's KLs and answers")
    add_threads_argument(parser)
    parser.add_argument("--max-chunk-tokens", type=int, default=512, help="cut longer text chunks (test models)")
    parser.add_argument("--image-grid", default=None, metavar="RxC", help="override every image span's patch grid")
    parser.add_argument("--capsule-retention", type=fraction, default=0.4,
                        help="kvcapsule-linear: mean kept fraction of the pyramid schedule (default 0.4)")
    parser.add_argument("--select-budgets", type=_int_list, default=(64, 128, 256, 512),
                        help="KV selection budgets, rows per KV head (default 64,128,256,512)")
    add_fidelity_target_arguments(
        parser, "also run a window's fidelity rule per η target (arms target-T, with the patch family): per-layer "
                "ranks allocated through the model's calibrated envelope (measured now when not cached) under "
                "--max-patch-fraction; reports median and 10th-percentile η, ranks, bytes and misses per arm",
        several=True)
    parser.add_argument("--vlcache-schedule", default=None, metavar="R0,R1,...",
                        help="VLCache per-layer recompute ratios, non-increasing, one per layer "
                             "(default: a linear ramp with mean 0.15)")


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return format(v, spec)


def _print_tables(summary: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    for group in ("main", "orbit", "recall"):
        rows = {k: v for k, v in summary["arms"].items() if v["group"] == group}
        if not rows:
            continue
        table = Table(title=f"{group} (samples: {summary['n_samples'].get(group, 0)})")
        for col in ("arm", "median η", "mean η", "pooled η", "median KL", "flip-recover", "bytes frac", "recompute frac"):
            table.add_column(col, justify="right" if col != "arm" else "left")
        for name, a in rows.items():
            fr = "-" if a["flip_recover"] is None else f"{a['flip_recover']:.2f} ({a['n_flips']})"
            table.add_row(name, _fmt(a["median_eta"]), _fmt(a["mean_eta"]), _fmt(a["pooled_eta"]),
                          _fmt(a["median_kl"], ".2e"), fr, _fmt(a["bytes_fraction"]), _fmt(a["recompute_fraction"]))
        console.print(table)
    rows = {k: v for k, v in summary["arms"].items() if v["group"] == "select"}
    if rows:
        table = Table(title=f"select: KV selection vs full KV (samples: {summary['n_samples'].get('select', 0)})")
        for col in ("arm", "median KL", "mean KL", "median coverage", "mean coverage", "kept frac", "answer agrees"):
            table.add_column(col, justify="right" if col != "arm" else "left")
        for name, a in rows.items():
            table.add_row(name, _fmt(a["median_kl"], ".2e"), _fmt(a["mean_kl"], ".2e"), _fmt(a.get("median_coverage")),
                          _fmt(a.get("mean_coverage")), _fmt(a.get("median_kept_fraction")), _fmt(a["agreement"], ".2f"))
        console.print(table)
    for name, a in summary["arms"].items():
        if name.startswith("kvcapsule") and a.get("median_bytes_saved_fraction") is not None:
            console.print(f"{name}: stored bytes saved (median) {_fmt(a['median_bytes_saved_fraction'])}, "
                          f"reconstruction error (relative Frobenius, median) K {_fmt(a.get('median_recon_error_k'))} "
                          f"V {_fmt(a.get('median_recon_error_v'))}; median η {_fmt(a['median_eta'])}")
    curve = summary.get("eta_vs_rank", {})
    if curve:
        console.print("η vs rank (median over items with a gap):")
        for r, e in curve.items():
            bar = "" if e is None else "█" * max(0, int(round(40 * max(0.0, min(1.0, e)))))
            console.print(f"  r={r:>4}  {_fmt(e)}  {bar}")
    console.print(f"patch-r32 beats matched cacheblend and epic on: {_fmt(summary.get('patch_beats_matched_share'))} "
                  f"of items with a gap ({summary.get('n_items_with_gap')}), "
                  f"{_fmt(summary.get('patch_beats_matched_share_all_items'))} of all items")
    for k, v in summary.get("kv_ulp", {}).items():
        console.print(f"KV error vs re-prefill, {k} ({summary['storage']} ULPs): elementwise median "
                      f"{_fmt(v.get('median'), '.1f')}, p99 {_fmt(v.get('p99'), '.1f')}; at each tensor's scale "
                      f"median {_fmt(v.get('at_scale_median'), '.1f')}, max {_fmt(v.get('at_scale_max'), '.1f')}")
    fams = summary.get("by_family", {})
    if fams:
        from rich.table import Table

        names = [n for n in ("patch-r16", "patch-r32", "patch-r64", "cacheblend-matched", "epic-matched", "kvcapsule-linear")
                 if any(n in f["median_eta"] for f in fams.values())]
        table = Table(title="median η by probe family (main group)")
        for col in ("family", "n", "median blind KL", *names):
            table.add_column(col, justify="right" if col != "family" else "left")
        for fam, f in fams.items():
            table.add_row(fam, str(f["n"]), _fmt(f["median_blind_kl"], ".3g"),
                          *(_fmt(f["median_eta"].get(n)) for n in names))
        console.print(table)
    table = _patch_budget_table(summary)
    if table is not None:
        console.print(table)
    console.print(summary.get("fidelity_envelope_note", ""))
    table = _targets_table(summary)
    console.print(table)


def _patch_budget_table(summary: dict[str, Any]) -> Any:
    """Per patch arm (fixed ranks, full, fidelity targets): median and 10th-percentile η, mean
    directions per patch (K / V, over all layers), patch bytes, fidelity misses."""
    from rich.table import Table

    rows = {k: v for k, v in summary["arms"].items() if v["group"] == "main" and "patch_bytes" in v
            and (k.startswith("patch-") or k.startswith("target-"))}
    if not any(k.startswith("target-") for k in rows):
        return None
    table = Table(title=f"patch arms: η, ranks and bytes (fidelity targets under a byte cap of "
                        f"{summary.get('max_patch_fraction')} of the page, on_miss={summary.get('on_miss')})")
    for col in ("arm", "median η", "p10 η", "dirs K / V", "patch MiB", "misses", "over cap", "est. η (median)"):
        table.add_column(col, justify="right" if col != "arm" else "left")
    for name, a in rows.items():
        table.add_row(name, _fmt(a["median_eta"]), _fmt(a.get("p10_eta")),
                      f"{a['mean_directions_k']:.0f} / {a['mean_directions_v']:.0f}", _fmt(a["patch_bytes"] / 2**20, ".2f"),
                      str(a.get("misses", "-")), str(a.get("over_cap", "-")), _fmt(a.get("median_estimated_eta")))
    return table


def _targets_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="acceptance targets (measured, never tuned)")
    for col in ("target", "wanted", "measured", "met"):
        table.add_column(col)
    for name, t in summary.get("targets", {}).items():
        met = t.get("met")
        table.add_row(name, t.get("target", "-"), _fmt(t.get("measured"), ".4g"),
                      "-" if met is None else ("yes" if met else "NO"))
    return table


def write_plot(summary: dict[str, Any], path: str) -> None:
    """η vs patch rank (median and mean) with the token arms as reference lines; KL per arm."""
    import matplotlib  # the plot extra (checked before the run: run())

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    ranks = [r for r in summary.get("ranks", []) if f"patch-r{r}" in arms]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if ranks:
        ax.plot(ranks, [arms[f"patch-r{r}"]["median_eta"] for r in ranks], "o-", label="patch (median η)")
        ax.plot(ranks, [arms[f"patch-r{r}"]["mean_eta"] for r in ranks], "s--", label="patch (mean η)")
    for i, (name, style) in enumerate((("cacheblend-15", ":"), ("epic-32", "-."), ("vlcache-15", "--"),
                                       ("cacheblend-matched", ":"), ("epic-matched", "-."))):
        if name in arms and arms[name]["median_eta"] is not None:
            ax.axhline(arms[name]["median_eta"], linestyle=style, linewidth=1.2, color=f"C{i + 2}",
                       label=f"{name} (median η)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("patch rank m")
    ax.set_ylabel("η (fraction of blind-reuse KL gap closed)")
    ax.set_title("η vs rank")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    names = [n for n, a in arms.items() if a["group"] == "main" and n != "reprefill"]
    kls = [max(arms[n]["median_kl"] or 0.0, 1e-14) for n in names]
    ax2.barh(names, kls)
    ax2.set_xscale("log")
    ax2.set_xlabel("median next-token KL(re-prefill ‖ arm), nats")
    ax2.set_title(f"{summary.get('n_items')} items, storage {summary.get('storage')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if args.plot:
        import matplotlib  # noqa: F401  (the plot extra: named now, not after the run)
    err = Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 132) if not args.json else err
    t0 = time.perf_counter()
    backend = load_backend(args.model, threads=args.threads)
    grid = None
    if args.image_grid:
        r, c = (int(x) for x in args.image_grid.lower().split("x"))
        grid = (r, c)
    schedule = None
    if args.vlcache_schedule:
        schedule = check_schedule([float(x) for x in args.vlcache_schedule.split(",") if x.strip()])
    cfg = HarnessConfig(
        ranks=tuple(args.ranks),
        arms=tuple(args.arms),
        storage=storage_dtype(args.storage),
        min_gap=float(args.min_gap),
        max_chunk_tokens=int(args.max_chunk_tokens),
        image_grid=grid,
        vlcache_schedule=schedule,
        vlcache_ratio=0.15 if schedule is None else sum(schedule) / len(schedule),
        select_budgets=tuple(args.select_budgets),
        capsule_retention=float(args.capsule_retention),
    )
    envelope, note = None, "fidelity envelope: not calibrated"
    if args.fidelity_target:
        from ..eval.fidelity.envelope import ensure_envelope

        envelope = ensure_envelope(backend, max_chunk_tokens=int(args.max_chunk_tokens), image_grid=grid)
    else:
        from ..model.envelope import load_envelope

        envelope = load_envelope(backend.fingerprint)
    if envelope is not None:
        note = f"fidelity envelope: {envelope.summary()}"
    cfg.fidelity_targets, cfg.envelope = tuple(args.fidelity_target), envelope
    cfg.max_patch_fraction, cfg.on_miss = float(args.max_patch_fraction), args.on_miss
    from ..patch.factors import DEFAULT_PATCH_PRECISIONS

    cfg.patch_precisions = tuple(args.patch_precisions or DEFAULT_PATCH_PRECISIONS)  # as a window's target
    items = probe_set(args.items)
    with Progress(TextColumn("[bold]fidelity"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err, transient=False) as progress:
        task = progress.add_task("", total=len(items))
        done = [0]

        def step(item_id: str) -> None:
            done[0] += 1
            progress.update(task, advance=1, description=item_id)
            if not err.is_terminal:  # a log file gets one line per item instead of a live bar
                err.print(f"[{done[0]}/{len(items)}] {item_id} {time.perf_counter() - t0:.0f} s", highlight=False)

        result = run_fidelity(backend, items, cfg, progress=step)
    summary = result.summary
    summary["model"] = backend.name
    summary["fidelity_envelope"] = None if envelope is None else envelope.as_dict()
    summary["fidelity_envelope_note"] = note
    summary["fidelity_targets"], summary["max_patch_fraction"] = list(args.fidelity_target), args.max_patch_fraction
    summary["on_miss"] = args.on_miss
    summary["threads"] = torch.get_num_threads()
    summary["wall_s"] = time.perf_counter() - t0
    summary["image_spans"] = ("EMULATED: scikit-image pixels through a fixed seeded random projection into "
                              "the LM embedding space (no VLM checkpoint)")
    for name, failed in summary["failures"].items():  # the run completed without them: say so
        items = ", ".join(failed["items"][:4]) + (", ..." if len(failed["items"]) > 4 else "")
        err.print(f"fidelity: arm {name} failed on {failed['n_failed']} of {summary['n_items']} items ({items}): "
                  f"{failed['error']}", markup=False, highlight=False)
    if args.plot:
        write_plot(summary, args.plot)
    if args.per_item:
        summary["samples"] = result.per_sample()
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1, default=str) + "\n")
    else:
        out.print(f"model {backend.name}; {summary['n_items']} items; storage {summary['storage']}; "
                  f"{summary['wall_s']:.0f} s on {summary['threads']} thread(s)")
        _print_tables(summary, out)
        if args.plot:
            out.print(f"plot written to {args.plot}")
    return 0
