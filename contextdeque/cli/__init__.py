"""``contextdeque`` command line, the top layer. Each command is one module of this package
exposing ``add_arguments(parser)`` and ``run(args) -> int`` (exit code), listed in ``COMMANDS``;
the measurements themselves live in the layers below (``contextdeque.eval``, ``contextdeque.serve``).
Every command names its model the same way (``model_spec``)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("contextdeque.cli.demo", "the main job: an agent answering questions through a window smaller than its material, vs re-prefill"),
    "verify-model": ("contextdeque.cli.verify_model", "exactness gate: relocation vs transformers' own forward, layer by layer"),
    "zoo": ("contextdeque.cli.zoo", "every causal-LM architecture of the installed transformers, tiny: exact / identity / refused (why) / could not build"),
    "fidelity": ("contextdeque.cli.fidelity", "every reuse arm vs a full re-prefill on the probe set"),
    "bench": ("contextdeque.cli.bench", "apply (relocate+patch) vs re-prefill and vs its roofline floor"),
    "window-bench": ("contextdeque.cli.window_bench", "slide and fork cost on a 4x512-token window"),
    "serve": ("contextdeque.cli.serve", "an OpenAI-compatible chat endpoint whose conversations are context windows"),
    "loadtest": ("contextdeque.cli.loadtest", "concurrent multi-turn agent conversations against serve replicas: throughput, latency, TTFT"),
    "load-bench": ("contextdeque.cli.load_bench", "overlapped vs sequential tier loading: a window half on disk, half missing"),
    "bench-vllm": ("contextdeque.cli.bench_vllm", "a re-read turn on vLLM: contextdeque's KV connector vs vLLM's prefix caching, side by side"),
    "store-bench": ("contextdeque.cli.store_bench", "Valkey store tier vs the local disk tier: put/get GB/s for one real chunk"),
    "traces": ("contextdeque.cli.traces", "generate agent traces (web/video/doc), import Mooncake traces, validate"),
    "replay": ("contextdeque.cli.replay", "replay traces under placement x eviction x reuse-arm policies (cost model, --fidelity)"),
    "replay-bench": ("contextdeque.cli.replay_bench", "replay throughput, scheduler vs arrival order, heuristic/exact, Mooncake under every policy"),
    "soak": ("contextdeque.cli.soak", "random window operations on the default (bounded) store: the resident-memory curve"),
    "calibrate": ("contextdeque.cli.calibrate", "measure the replay cost model on this machine's backend and save it"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contextdeque", description="position-free KV-cache chunks for agent context windows")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
