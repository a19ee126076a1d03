"""``contextdeque bench``: the cost measurements of ``contextdeque.eval.bench`` as tables, or one
JSON object with ``--json``."""

from __future__ import annotations

import argparse
import json


from ..eval.bench import DEFAULT_TOKENS, run_bench
from .model_spec import MODEL_HELP, add_threads_argument, load_backend
from .window_options import add_window_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="chunk sizes, comma-separated")
    add_window_arguments(p, with_policy=False)
    p.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds for the kernel measurements")
    add_threads_argument(p)
    p.add_argument("--device", default="cpu", help="where the model and the kernels run: cpu or cuda (default cpu)")
    p.add_argument(
        "--window-step-tokens", type=int, default=None,
        help="also time a window step's TTFT (slide + recall + question) vs re-prefill on a window of this many "
             "tokens (default: 2048 on cuda, off on cpu; 0 turns it off)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    backend = load_backend(args.model, device=args.device, threads=args.threads)
    step_tokens = args.window_step_tokens
    if step_tokens is None:
        step_tokens = 2048 if backend.device.type == "cuda" else 0
    res = run_bench(
        backend, tuple(int(x) for x in args.tokens.split(",") if x), rank=args.rank, rounds=args.rounds,
        progress=not args.json, window_step_tokens=step_tokens,
    )
    if args.json:
        print(json.dumps(res))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{res['model']}[/] on {res['device']} · {res['threads']} threads · kernel backend "
        f"[cyan]{res['kernel_backend']}[/] · rank {res['rank']}"
    )
    if res["ceilings"]:
        c = res["ceilings"]
        console.print(
            f"measured ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write); GEMM "
            + ", ".join(f"{dt} {r / 1e12:.0f} TFLOP/s" for dt, r in c["gemm_flops_per_s"].items())
        )
    for dt, rows in res["by_dtype"].items():
        table = Table(
            "tokens", "re-prefill ms", "apply ms", "apply: x faster", "memcpy ms", "GEMM ms", "apply / floor",
            "relocate ms", "relocate / memcpy", title=f"storage {dt}",
        )
        for T, r in rows.items():
            table.add_row(
                T, f"{res['reprefill_s'][T] * 1e3:.0f}", f"{r['apply_s'] * 1e3:.2f}", f"{r['apply_vs_reprefill']:.0f}x",
                f"{r['memcpy_s'] * 1e3:.2f}", f"{(r['gemm_s'] or 0) * 1e3:.2f}", f"{r['apply_vs_floor']:.2f}x",
                f"{r['relocate_s'] * 1e3:.2f}", f"{r['relocate_vs_memcpy']:.2f}x",
            )
        console.print(table)
        if res["ceilings"]:
            console.print(
                f"storage {dt}, vs the true floor (bytes / copy bandwidth, FLOPs / GEMM rate): "
                + "; ".join(
                    f"{T}: apply {r['apply_vs_true_floor']:.2f}x (kernels alone {r['apply_device_vs_true_floor']:.2f}x), "
                    f"relocate {r['relocate_vs_true_floor']:.2f}x (kernels alone {r['relocate_device_vs_true_floor']:.2f}x)"
                    for T, r in rows.items()
                )
            )
    for T, s in res["operator_apply_s"].items():
        console.print(f"operator end to end (relocate + patch, {T} tokens, new tensors): {s * 1e3:.2f} ms")
    console.print(
        f"forming the rank-{res['rank']} patch: {res['form_patch_s']:.2f} s; repaid after "
        f"[bold]{res['breakeven_reuses']:.2f}[/] reuses ({res['breakeven_tokens']} tokens)"
    )
    for T, f in res.get("forming", {}).items():
        fs = f["factorize_s"]
        console.print(
            f"forming on {T} tokens: {f['form_patch_s']:.3f} s = forward {f['forward_s']:.3f} s + top-m factors "
            f"{fs['auto']:.3f} s (the float64 SVD: {fs['svd']:.3f} s, [bold]{f['svd_vs_auto']:.1f}x[/] slower); "
            f"by solver: subspace {fs['subspace']:.3f} s, eigh {fs['eigh']:.3f} s"
            + (f", eigh on the host {fs['eigh_host']:.3f} s" if "eigh_host" in fs else "")
        )
    console.print(
        "patch bytes / page bytes: " + ", ".join(f"r{m}: {f:.1%}" for m, f in res["patch_bytes_fraction"].items())
    )
    for row in res.get("window_step", []):
        console.print(
            f"window step (slide + recall + question), {row['window_tokens']} tokens, {row['policy']}: TTFT "
            f"{row['ttft_ms']:.2f} ms vs re-prefill {row['reprefill_ms']:.2f} ms = [bold]{row['ttft_vs_reprefill']:.1f}x[/]"
        )
    return 0
