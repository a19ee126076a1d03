"""``python -m contextdeque.eval.gpu_check OUT_DIR``: the measurements of docs/gpu.md in one run
on a CUDA device (``scripts/gpu_check.sh`` installs, runs the ``cuda`` tests, then this).

Each step writes its own JSON file into ``OUT_DIR`` as soon as it ends, so a run cut short
keeps what it measured:

- ``env.json``: device, driver-visible memory, torch / triton / transformers versions, whether
  flash-attn imports; the host cost of one all-layers apply call (the time Python takes to check
  the arguments and launch, no device work waited for) at the SmolLM2 shape;
- ``bench_smollm2.json``: ``contextdeque bench --device cuda --json`` on SmolLM2-135M's
  architecture and tokenizer with random fp32 weights saved as a local checkpoint (the real
  weights are 0.5 GB and do not travel to the lent device; timings and relocation exactness do
  not depend on the weights);
- ``calibration.json``: ``contextdeque calibrate --device cuda`` on the same checkpoint (the replay's
  cost model: prefill speed by length up to 4,096 tokens, forming, apply, decode), which
  ``replay --idle-rate calibrated --calibration`` reads;
- ``sweep.json``: the Triton kernel's rank-32 apply time per variant (``SWEEP_VARIANTS``) at 8,192
  tokens on the SmolLM2 and Llama-3-8B shapes, against the true floor, per call and as a
  CUDA-graph replay (the kernels alone), to pick the defaults from;
- ``bench_llama3_8b.json``: the same bench on Meta-Llama-3-8B's published architecture (32
  layers, 8 KV heads of 128, vocabulary 128,256) with random bf16 weights built on the device,
  the SmolLM2 tokenizer's ids (all inside the larger vocabulary).

Nothing here asserts a threshold: it records what it measured.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from ..patch.rank import DEFAULT_RANK

#: SmolLM2-135M-Instruct's published architecture (its config.json).
SMOLLM2_135M_CONFIG: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

#: Meta-Llama-3-8B's published architecture (its config.json; no rope scaling).
LLAMA3_8B_CONFIG: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001,
)

BENCH_TOKENS = (1024, 2048, 8192)


def random_llama(config: dict[str, Any], *, dtype: torch.dtype, device: "torch.device | str", seed: int = 0) -> Any:
    """A ``LlamaForCausalLM`` of ``config`` with random weights, built directly on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with dev:
            model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def save_random_checkpoint(config: dict[str, Any], tokenizer_dir: Path, out_dir: Path) -> Path:
    """A local checkpoint (``config.json`` + random fp32 weights + the tokenizer files of
    ``tokenizer_dir``) that ``--model`` accepts."""
    import shutil

    model = random_llama(config, dtype=torch.float32, device="cpu")
    model.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        if f.name != "config.json" and f.suffix in (".json", ".jinja", ".model", ".txt"):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def _write(out: Path, name: str, data: Any) -> None:
    (out / name).write_text(json.dumps(data, indent=1, default=str))
    print(f"[gpu_check] wrote {name}", flush=True)


def environment() -> dict[str, Any]:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # recorded, not fatal: the bench then reports the torch path
        triton_version = f"unavailable: {e}"
    try:
        import flash_attn

        flash = f"flash-attn {flash_attn.__version__}"
    except Exception as e:
        flash = f"not importable ({type(e).__name__}): SDPA is used"
    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "l2_mib": round(props.L2_cache_size / 2**20, 1),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "flash_attention": flash,
    }


def host_cost_us(tokens: int = 16, repeats: int = 200) -> dict[str, float]:
    """Median host microseconds of one all-layers apply call at the SmolLM2 shape (rank 32 and 0,
    bf16), the device's work not waited for: with a chunk this small that is the call's floor."""
    from ..kernels.bench_util import apply_fn, make_case

    out = {}
    for rank in (32, 0):
        case = make_case(tokens, rank=rank, dtype=torch.bfloat16, device="cuda")
        fn = apply_fn(case)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
            if len(samples) % 50 == 0:
                torch.cuda.synchronize()  # keep the launch queue from filling
        out[f"rank{rank}_us"] = statistics.median(samples) * 1e6
    return out


#: Kernel variants the sweep times (``triton_fused.LAUNCH_OVERRIDES``); "tf32x3" only for fp32.
SWEEP_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "dot_then_add": {"dot_then_add": True},
    "dot_then_add_tf32x3": {"dot_then_add": True, "fp32_precision": "tf32x3"},
    # register use per thread for sm_90 (cuobjdump, compiled on a CPU machine; head dim 128, bf16):
    # the default 255 + 312 B spilled; pairs32 255, no spill; w8 196; t32 + pairs32 209
    "pairs32": {"block_p_max": 32, "block_n_max": 32},
    "pairs32_stages3": {"block_p_max": 32, "block_n_max": 32, "num_stages": 3},
    "hoist_u": {"hoist_u": True},
    "hoist_u_pairs32": {"hoist_u": True, "block_p_max": 32, "block_n_max": 32},
    "hoist_u_w8": {"hoist_u": True, "num_warps": 8},
    "hoist_u_w8_pairs32": {"hoist_u": True, "num_warps": 8, "block_p_max": 32, "block_n_max": 32},
    "hoist_u_t32_pairs32": {"hoist_u": True, "block_t": 32, "block_p_max": 32, "block_n_max": 32},
    "w8": {"num_warps": 8},
}


def sweep(tokens: int = 8192) -> list[dict[str, Any]]:
    """Apply time per kernel variant at 8,192 tokens, SmolLM2 and Llama-3-8B shapes, rank 32,
    per call and as a CUDA-graph replay (the kernels alone), vs the true floor."""
    from ..kernels import triton_fused
    from ..kernels.bench_util import apply_fn, device_time, make_case, measure_ceilings, time_interleaved

    ceilings = measure_ceilings("cuda", (torch.float32, torch.bfloat16), copy_bytes=1 << 30)
    shapes = {"smollm2": dict(layers=30, heads=3, head_dim=64), "llama3_8b": dict(layers=32, heads=8, head_dim=128)}
    rows = []
    for shape_name, shape in shapes.items():
        for dtype in (torch.bfloat16, torch.float32):
            case = make_case(tokens, rank=DEFAULT_RANK, dtype=dtype, device="cuda", **shape)
            floor = ceilings.floor_s(case)
            fns: dict[str, Callable[[], None]] = {}
            for name, over in SWEEP_VARIANTS.items():
                if "fp32_precision" in over and dtype != torch.float32:
                    continue

                def run(over: dict[str, Any] = over) -> None:
                    saved = dict(triton_fused.LAUNCH_OVERRIDES)
                    triton_fused.LAUNCH_OVERRIDES.clear()
                    triton_fused.LAUNCH_OVERRIDES.update(over)
                    try:
                        apply_fn(case)()
                    finally:
                        triton_fused.LAUNCH_OVERRIDES.clear()
                        triton_fused.LAUNCH_OVERRIDES.update(saved)

                fns[name] = run
            t = time_interleaved(fns, rounds=10, device="cuda")
            for name, tm in t.items():
                dev = device_time(fns[name], "cuda", rounds=10)
                assert dev is not None
                rows.append({
                    "shape": shape_name, "dtype": str(dtype).replace("torch.", ""), "rank": DEFAULT_RANK, "tokens": tokens,
                    "variant": name, "apply_s": tm.min_s, "median_s": tm.median_s, "true_floor_s": floor,
                    "vs_true_floor": tm.min_s / floor, "device_s": dev.min_s, "device_vs_true_floor": dev.min_s / floor,
                })
            del case
    return rows


def best_variant(rows: list[dict[str, Any]], shape: str = "llama3_8b", dtype: str = "bfloat16") -> str:
    """The sweep's fastest variant (device time) at ``shape`` and ``dtype``."""
    mine = [r for r in rows if r["shape"] == shape and r["dtype"] == dtype]
    return min(mine, key=lambda r: r["device_s"])["variant"]


def bench_large(tokenizer_dir: Path) -> dict[str, Any]:
    """The bench on the Llama-3-8B architecture with random bf16 weights (see the module doc)."""
    from transformers import AutoTokenizer

    from ..kernels import triton_fused
    from ..model.hf import HFBackend
    from .bench import run_bench

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = random_llama(LLAMA3_8B_CONFIG, dtype=torch.bfloat16, device="cuda")
    # fingerprinted by how the weights were made: hashing 16 GB of random weights proves nothing.
    # No proof at load: a bf16 forward's own noise between positions (~6e-2 of scale with random
    # weights, seen on an H200) exceeds the proof's bound; exactness is proven on the fp32 models
    # (tests/test_cuda.py), this model is for timings
    backend = HFBackend(
        model, tok, name="Meta-Llama-3-8B architecture, random bf16 weights", fingerprint="random-llama3-8b-seed0-bf16",
        verify_at_load=False,
    )
    res = run_bench(backend, BENCH_TOKENS, rank=DEFAULT_RANK, dtypes=("bfloat16",), rounds=20, progress=False, window_step_tokens=2048)
    res["weights"] = "random (torch.manual_seed(0)), bf16, built on the device"
    res["triton_launch"] = dict(triton_fused.LAUNCH_OVERRIDES) or "defaults"
    return res


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory for the JSON files")
    p.add_argument("--tokenizer-dir", type=Path, required=True, help="SmolLM2-135M-Instruct's tokenizer files")
    p.add_argument("--steps", default="env,smollm2,calibrate,sweep,llama3_8b", help="comma-separated steps to run")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    failed = []

    def step(name: str, fn: Callable[[], Any], file: str | None) -> None:
        if name not in steps:
            return
        t0 = time.perf_counter()
        try:
            data = fn()
        except Exception as e:  # recorded; the other steps still run
            import traceback

            traceback.print_exc()
            failed.append(name)
            data = {"error": f"{type(e).__name__}: {e}"}
        if isinstance(data, dict):
            data["wall_s"] = round(time.perf_counter() - t0, 1)
        if file is not None:
            _write(args.out, file, data)
        else:
            print(f"[gpu_check] {name}: {json.dumps(data, default=str)}", flush=True)

    step("env", lambda: {**environment(), "host_cost_us": host_cost_us()}, "env.json")

    def smollm2() -> dict[str, Any]:
        ckpt = save_random_checkpoint(SMOLLM2_135M_CONFIG, args.tokenizer_dir, Path("/tmp/smollm2-135m-random"))
        proc = subprocess.run(
            [sys.executable, "-m", "contextdeque.cli", "bench", "--model", str(ckpt), "--device", "cuda",
             "--tokens", ",".join(map(str, BENCH_TOKENS)), "--json"],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["weights"] = "random (torch.manual_seed(0)), fp32, SmolLM2-135M-Instruct's config and tokenizer"
        res["triton_launch"] = os.environ.get("CONTEXTDEQUE_TRITON_LAUNCH") or "defaults"
        return res

    step("smollm2", smollm2, "bench_smollm2.json")

    def calibration() -> dict[str, Any]:
        # the replay's cost model measured on the device (issue 21: the idle rate a GPU gives the
        # anticipation hit rate; `replay --idle-rate calibrated --calibration calibration.json`)
        ckpt = save_random_checkpoint(SMOLLM2_135M_CONFIG, args.tokenizer_dir, Path("/tmp/smollm2-135m-random"))
        with tempfile.TemporaryDirectory() as cache:
            proc = subprocess.run(
                [sys.executable, "-m", "contextdeque.cli", "calibrate", "--model", str(ckpt), "--device", "cuda",
                 "--lengths", "64,256,1024,2048,4096", "--repeats", "5", "--cache-dir", cache,
                 # the agents' traces' chunks: median 324-866 tokens; both lengths take the Gram
                 # route (T >= F = 192), whose factorization is flat in T
                 "--form-lengths", "256,1024"],
                capture_output=True, text=True, check=False,
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            saved = next(Path(cache, "calibration").glob("*.json"))
            cal = json.loads(saved.read_text())
        cal["extra"]["weights"] = "random (torch.manual_seed(0)), fp32, SmolLM2-135M-Instruct's config and tokenizer"
        _write(args.out, "calibration.json", cal)  # as saved: `replay --calibration` reads it
        return {"prefill": cal["prefill"], "svd_s_per_token": cal["svd_s_per_token"], "form_fixed_s": cal["form_fixed_s"],
                "form_overhead_s": cal["extra"]["form_overhead_s"], "forward_fixed_s": cal["forward_fixed_s"],
                "prefill_measured": cal["extra"]["prefill_measured"]}

    step("calibrate", calibration, None)  # writes calibration.json itself
    step("sweep", lambda: {"rows": sweep()}, "sweep.json")
    step("llama3_8b", lambda: bench_large(args.tokenizer_dir), "bench_llama3_8b.json")
    print(f"[gpu_check] done; failed steps: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
