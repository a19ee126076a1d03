"""Issue 21: what a patch's top-m factorization costs on a device, per candidate setting of the
subspace iteration (``contextdeque.patch.topm``'s ``CUDA_PRESETS``), each checked against the
float64 SVD; and where calibrate's forming overhead (72 ms a patch on an H200) goes.

Usage, from the repository root (contextdeque need not be installed):

    python scripts/gpu_forming_sweep.py OUT_DIR                 # a CUDA device; ~2 minutes on an H200
    python scripts/gpu_forming_sweep.py OUT_DIR --device cpu    # checks the script (< 1 minute)

What it does, with SmolLM2-135M's architecture and random fp32 weights (timings do not depend on
the weights; random weights' flatter spectra make the iteration take more steps than real ones):

1. Two sets of Δs per chunk length (``--lengths``, calibrate's 128 and 512), ``1 + --distinct``
   patches each (every layer's K and V Δ, ``[30, T, 192]`` each): ``random-weights``, measured
   as ``form_patch`` measures them (a chunk on a 256-token antecedent, calibrate's
   ``FORM_CONTEXT``); ``real-spectra``, Δs with the singular values the real default model's Δs
   have (per layer, K and V, on real text: scripts/data/smollm2_delta_spectra.safetensors, made
   by ``--save-spectra`` on a machine with the default model) in random directions. The
   iteration's speed depends on the spectrum alone, and random weights' spectra are flatter
   (more steps) than real ones: the default is picked on ``real-spectra``. A third group in
   each set, ``short``: one patch each of 72, 96, 120, 144 and 168 tokens (shorter than
   ``F = 192``: a ``T × T`` Gram, a new size per length, so a new CUDA graph shape unless the
   preset pads the tokens).
2. Per host thread count (``--threads``; calibrate ran with 2 on the H200's 16 cores) and per
   variant (``--variants``: preset names, ``eigh`` = cuSOLVER's ``eigh`` for reference): the time of a
   patch's factorization (K and V, rank 32) as ``best`` of ``--repeats`` on one Δ after a warm-up
   (what the bench measured) and ``fresh``, the mean over the distinct Δs each factored once
   (what anticipation meets: new Δs, new batch sizes as items converge, so new CUDA graph
   captures unless the batch is padded); the solver's counts (iterations, checks, captures,
   items left to ``eigh``) per patch. Every variant starts with no captured graphs.
3. Each variant's factors (every layer, every Δ, at the first thread count) against the float64
   SVD computed on the device, by tests/test_patch_topm.py's own checks (``assert_top_factors``:
   the test's tolerance).
4. The forming split per length: ``form_patch`` whole, its conditioned forward + Δ
   (``PATCH_KINDS["exact"].target``), its factorization, and calibrate's estimate of the
   conditioned forward (an encode of antecedent + chunk less one of the antecedent: a difference
   of two forwards cancels a forward's fixed cost, which ``form_patch``'s forward pays), so
   calibrate's ``form_overhead_s`` is reproduced and explained; for the current preset and the
   fastest accurate one, at each thread count.

Prints one table and writes ``forming_sweep.json`` to OUT_DIR. The variant to make CUDA's default
is the fastest (``fresh``, on ``real-spectra``) whose factors pass on every Δ: the one-line change is
``CUDA_PRESET = "<name>"`` in contextdeque/patch/topm.py.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def _import_contextdeque() -> None:
    """contextdeque from this checkout: its kernels/ and agents/ live at the repository's top and
    install inside the package (pyproject's package-dir); without an install they are found there."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))  # test_patch_topm's checks, helpers
    import contextdeque

    if importlib.util.find_spec("contextdeque.kernels") is None:
        contextdeque.__path__.append(str(ROOT))


_import_contextdeque()

import torch  # noqa: E402

from contextdeque.eval.gpu_check import SMOLLM2_135M_CONFIG, random_llama  # noqa: E402
from contextdeque.model.hf import HFBackend  # noqa: E402
from contextdeque.patch import form_patch  # noqa: E402
from contextdeque.patch import topm  # noqa: E402
from contextdeque.patch.base import PATCH_KINDS, FormContext  # noqa: E402
from contextdeque.replay.calibrate import FORM_CONTEXT  # noqa: E402

RANK = 32
SPECTRA = ROOT / "scripts" / "data" / "smollm2_delta_spectra.safetensors"
SPECTRA_OFFSETS = (0, 300, 600, 900, 1200)  # where each patch's antecedent starts in the demo document
#: the "short" group: one patch per length, each shorter than F = 192 (a T x T Gram: a new size, a
#: new CUDA graph shape per length unless the tokens are padded)
SHORT_LENGTHS = (72, 96, 120, 144, 168)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="where forming_sweep.json goes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default=None,
                   help="comma-separated: CUDA_PRESETS names and 'eigh' (default: all of them)")
    p.add_argument("--lengths", default=None, help="chunk lengths (default 128,512: calibrate's)")
    p.add_argument("--threads", default=None, help="host thread counts (default 2,16; CPU 1)")
    p.add_argument("--repeats", type=int, default=None, help="best of (default 5; CPU 1)")
    p.add_argument("--distinct", type=int, default=None, help="fresh Δs per length (default 4; CPU 2)")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 30: SmolLM2's; CPU 1)")
    p.add_argument("--soft-limit-s", type=float, default=150.0,
                   help="past this many seconds the thread counts after the first are skipped (the device run has 4 minutes)")
    p.add_argument("--hard-limit-s", type=float, default=200.0,
                   help="past this many seconds no further variant is timed and the forming split is skipped")
    p.add_argument("--save-spectra", action="store_true",
                   help=f"instead: measure the default model's Δ spectra on the CPU into {SPECTRA.relative_to(ROOT)}")
    a = p.parse_args(argv)
    cpu = torch.device(a.device).type == "cpu"
    a.lengths = [int(x) for x in (a.lengths or "128,512").split(",")]
    a.threads = [int(x) for x in (a.threads or ("1" if cpu else "2,16")).split(",")]
    a.repeats = a.repeats or (1 if cpu else 5)
    a.distinct = a.distinct if a.distinct is not None else (1 if cpu else 4)
    a.layers = a.layers or (1 if cpu else SMOLLM2_135M_CONFIG["num_hidden_layers"])
    # the current preset, then the combinations (the likely picks), then one factor at a time: a
    # run cut by the time limits loses the diagnostic tail
    combos = [v for v in topm.CUDA_PRESETS if v.startswith("squared-")]
    default = [topm.CUDA_PRESET, *combos, *(v for v in topm.CUDA_PRESETS if v not in combos and v != topm.CUDA_PRESET), "eigh"]
    a.variants = [v.strip() for v in a.variants.split(",")] if a.variants else default
    for v in a.variants:
        if v != "eigh" and v not in topm.CUDA_PRESETS:
            p.error(f"unknown variant {v!r}; presets: {', '.join(topm.CUDA_PRESETS)}, eigh")
    return a


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def once(fn: Callable[[], Any]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return once


def factorize(variant: str, dk: torch.Tensor, dv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One patch's K and V factors by ``variant`` (a preset, or ``eigh``), as ``PatchKind.factorize``
    runs them (K and V in one batch where the preset says ``kv_one_call``): ``[(us, vt) of K, of V]``."""
    settings = topm.CUDA_PRESETS.get(variant)
    kw: dict[str, Any] = {"eig": "eigh"} if settings is None else {"eig": "subspace", "subspace": settings}
    m = min(RANK, *dk.shape[1:])
    if settings is not None and topm.kv_in_one_call(dk, dv, m, m, settings):
        us, vt = topm.truncated_svd(torch.cat([dk, dv]), m, **kw)
        return [(us[:len(dk)], vt[:len(dk)]), (us[len(dk):], vt[len(dk):])]
    return [topm.truncated_svd(d, m, **kw) for d in (dk, dv)]


def counts_per(n: int) -> dict[str, float]:
    c = topm.SUBSPACE_COUNTS.as_dict()
    return {k: round(v / max(n, 1), 2) for k, v in c.items()}


class Oracle:
    """The float64 SVD of every layer of a Δ, computed on Δ's device once, and
    tests/test_patch_topm.py's ``assert_top_factors`` run against it (its ``oracle`` swapped for
    this one's answer, so the checks and tolerance are the test's own)."""

    def __init__(self, delta: torch.Tensor) -> None:
        _, s, vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
        self.delta, self.s, self.vh = delta.cpu(), s.cpu(), vh.cpu()

    def failures(self, us: torch.Tensor, vt: torch.Tensor) -> list[str]:
        import test_patch_topm as checks

        real, out = checks.oracle, []
        try:
            for layer in range(self.delta.shape[0]):
                s, vh = self.s[layer], self.vh[layer]
                checks.oracle = lambda d, r, s=s, vh=vh: (None, vh[:min(r, s.shape[0])], s)
                try:
                    checks.assert_top_factors(self.delta[layer], RANK, us[layer].cpu(), vt[layer].cpu())
                except AssertionError as exc:
                    out.append(f"layer {layer}: {str(exc).splitlines()[0][:120]}")
        finally:
            checks.oracle = real
        return out


def save_spectra(lengths: list[int]) -> None:
    """The singular values of the embedded default model's Δs (every layer, K and V) for a chunk
    of each length on a 256-token antecedent, at :data:`SPECTRA_OFFSETS` of the demo document:
    ``{"k_<T>": [patches, layers, min(T, F)], "v_<T>": ...}`` (float16: the iteration's speed
    depends on their ratios, not on their last digits)."""
    from safetensors.torch import save_file

    from contextdeque.agents.scenarios import demo_document
    from contextdeque.model import load_model

    backend = load_model()
    ids = backend.tokenizer(demo_document())["input_ids"]
    exact, out = PATCH_KINDS["exact"](), {}
    for T in lengths:
        ks, vs = [], []
        for start in SPECTRA_OFFSETS:
            ante = backend.encode(token_ids=ids[start:start + FORM_CONTEXT])
            chunk = backend.encode(token_ids=ids[start + FORM_CONTEXT:start + FORM_CONTEXT + T])
            dk, dv = exact.target(FormContext(backend, chunk, [(ante, [])], {}))
            ks.append(torch.linalg.svdvals(dk.double()))
            vs.append(torch.linalg.svdvals(dv.double()))
        out[f"k_{T}"], out[f"v_{T}"] = torch.stack(ks).half(), torch.stack(vs).half()
    for start, T in zip(SPECTRA_OFFSETS, SHORT_LENGTHS):
        ante = backend.encode(token_ids=ids[start:start + FORM_CONTEXT])
        chunk = backend.encode(token_ids=ids[start + FORM_CONTEXT:start + FORM_CONTEXT + T])
        dk, dv = exact.target(FormContext(backend, chunk, [(ante, [])], {}))
        out[f"k_{T}"], out[f"v_{T}"] = (torch.linalg.svdvals(d.double())[None].half() for d in (dk, dv))
    SPECTRA.parent.mkdir(parents=True, exist_ok=True)
    tmp = SPECTRA.with_suffix(".tmp")
    save_file(out, str(tmp), metadata={"model": str(getattr(backend, "name", "")), "offsets": str(SPECTRA_OFFSETS),
                                       "antecedent_tokens": str(FORM_CONTEXT)})
    tmp.replace(SPECTRA)
    print(f"wrote {SPECTRA} ({', '.join(f'{k} {tuple(v.shape)}' for k, v in out.items())})")


def groups_of(lengths: list[int], count: int) -> dict[str, list[int]]:
    """The Δ groups timed: ``count`` patches of each length (the first timed best of, the others
    fresh), and ``short``: one patch of each of :data:`SHORT_LENGTHS`."""
    return {**{str(T): [T] * count for T in lengths}, "short": list(SHORT_LENGTHS)}


def real_spectra_deltas(groups: dict[str, list[int]], layers: int, device: torch.device) -> dict[str, list[dict[str, Any]]]:
    """The groups' K and V Δs with the real default model's spectra (its first ``layers``
    layers), in seeded random directions (tests/test_patch_topm.py's ``spectrum_delta``)."""
    from safetensors.torch import load_file

    from test_patch_topm import spectrum_delta

    spectra = load_file(str(SPECTRA))
    out: dict[str, list[dict[str, Any]]] = {}
    for name, lengths in groups.items():
        seen: dict[int, int] = {}
        for T in lengths:
            i = seen[T] = seen.get(T, -1) + 1
            if f"k_{T}" not in spectra or i >= spectra[f"k_{T}"].shape[0]:
                continue
            pair = [torch.stack([spectrum_delta(T, 192, s.double(), seed=1000 * i + 2 * l + j)
                                 for l, s in enumerate(spectra[f"{kv}_{T}"][i, :layers])]).to(device)
                    for j, kv in enumerate("kv")]
            out.setdefault(name, []).append({"tokens": T, "dk": pair[0], "dv": pair[1]})
    return out


def micro(dev: torch.device, once: Callable[[Callable[[], Any]], float], repeats: int) -> dict[str, float]:
    """The parts a check and an iteration cost, in seconds (best of ``repeats``): one power-step
    iteration (graphed on CUDA) at a patch's batch sizes and block widths, the capture of a new
    graph shape, and a check's ``[b, k, k]`` eigenproblems by each place they may run."""
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(1)
    for b, k in ((32, 64), (64, 64), (32, 48), (64, 48)):
        a = torch.randn(b, 256, 192, generator=g, dtype=torch.float64).to(dev)
        gram = a.mT @ a
        gram = gram / gram.diagonal(dim1=-2, dim2=-1).amax(-1)[:, None, None]
        x = topm._start_block(192, k, dev).expand(b, 192, k)
        topm._graphs.clear()
        out[f"first_call_with_capture_b{b}_k{k}_s"] = once(lambda: topm._power_steps(gram, x, 1))
        out[f"iteration_b{b}_k{k}_s"] = min(once(lambda: topm._power_steps(gram, x, 10)) for _ in range(repeats)) / 10
        h = (x.mT @ gram @ x).contiguous()
        for how in ("host-pool", "host-serial", "host-1", "numpy", "numpy-pool"):
            out[f"ritz_{how}_b{b}_k{k}_s"] = min(once(lambda: topm._host_eigh(h.cpu(), how)) for _ in range(repeats))
        out[f"ritz_device_b{b}_k{k}_s"] = min(once(lambda: torch.linalg.eigh(h)) for _ in range(repeats))
    topm._graphs.clear()
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.save_spectra:
        save_spectra(a.lengths)
        return 0
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    once = timer(dev)
    env = {
        "torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "host_cores": os.cpu_count(), "torch_threads_at_start": torch.get_num_threads(),
        "env": os.environ.get(topm.CUDA_SETTINGS_ENV, ""), "current_preset": topm.CUDA_PRESET,
        "presets": {k: vars(v) for k, v in topm.CUDA_PRESETS.items()},
        "loadavg": os.getloadavg(), "args": {k: str(v) for k, v in vars(a).items()},
    }
    print(f"[sweep] {env['device']}, torch {env['torch']}, {env['host_cores']} host cores, layers {a.layers}", flush=True)
    if env["env"]:
        print(f"[sweep] note: ${topm.CUDA_SETTINGS_ENV}={env['env']} sets the default preset of this process")

    cfg = dict(SMOLLM2_135M_CONFIG, num_hidden_layers=a.layers)
    backend = HFBackend(random_llama(cfg, dtype=torch.float32, device=dev), None, root_ids=[1, 5, 9, 13],
                        name="random-smollm2-arch")
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 40000, (n,), generator=g).tolist()

    ctx_ids = ids(FORM_CONTEXT)
    ante = backend.encode(token_ids=ctx_ids)
    exact = PATCH_KINDS["exact"]()
    groups = groups_of(a.lengths, 1 + a.distinct)
    measured: dict[str, list[dict[str, Any]]] = {}
    for name, lengths in groups.items():
        for T in lengths:
            chunk = backend.encode(token_ids=ids(T))
            dk, dv = exact.target(FormContext(backend, chunk, [(ante, [])], {}))
            measured.setdefault(name, []).append({"tokens": T, "chunk": chunk, "dk": dk, "dv": dv})
    sets = {"random-weights": measured}
    if SPECTRA.exists():  # first: the default is picked on it
        sets = {"real-spectra": real_spectra_deltas(groups, a.layers, dev), **sets}
    else:
        print(f"[sweep] {SPECTRA} missing: the random-weights Δs only", flush=True)
    t_svd = {}
    for data in sets.values():
        for T, items in data.items():
            for it in items:
                t0 = time.perf_counter()
                it["oracle"] = [Oracle(it["dk"]), Oracle(it["dv"])]
                t_svd[T] = time.perf_counter() - t0
    print(f"[sweep] Δs and their float64 SVDs ready ({time.perf_counter() - t_start:.1f} s; the SVD of one "
          f"patch's K and V on the {'device' if cuda else 'host'}: "
          + ", ".join(f"{T}: {s * 1e3:.0f} ms" for T, s in t_svd.items()) + ")", flush=True)

    torch.set_num_threads(a.threads[0])
    parts = micro(dev, once, a.repeats)
    print("[micro] " + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f} ms" for k, v in parts.items()), flush=True)
    rows: list[dict[str, Any]] = []
    failures: dict[str, list[str]] = {}
    skipped: list[str] = []
    for threads, (set_name, data), variant in ((t, d, v) for t in a.threads for d in sets.items() for v in a.variants):
        elapsed = time.perf_counter() - t_start
        if (threads != a.threads[0] and elapsed > a.soft_limit_s) or elapsed > a.hard_limit_s:
            skipped.append(f"{set_name} {variant} at {threads} threads")
            continue
        torch.set_num_threads(threads)
        topm._graphs.clear()  # every variant captures its own graphs
        for T, items in data.items():
            main_item, fresh_items = items[0], items[1:]
            topm.SUBSPACE_COUNTS.reset()
            factorize(variant, main_item["dk"], main_item["dv"])  # warm
            best = min(once(lambda: factorize(variant, main_item["dk"], main_item["dv"])) for _ in range(a.repeats))
            counts_best = counts_per(1 + a.repeats)
            topm.SUBSPACE_COUNTS.reset()
            fresh, outs = [], []
            for it in fresh_items:
                box: list[Any] = []
                fresh.append(once(lambda it=it: box.append(factorize(variant, it["dk"], it["dv"]))))
                outs.append((it, box[0]))
            counts_fresh = counts_per(len(fresh_items))
            if threads == a.threads[0]:  # accuracy once per variant and length: two Δs (each check is per layer, on the host)
                outs = [(main_item, factorize(variant, main_item["dk"], main_item["dv"]))] + outs[:1]
                bad = [f"{set_name} T={it['tokens']} {'KV'[j]}: {msg}" for it, fac in outs for j, (us, vt) in enumerate(fac)
                       for msg in it["oracle"][j].failures(us, vt)]
                failures.setdefault(variant, []).extend(bad)
            row = {"deltas": set_name, "variant": variant, "threads": threads, "group": T, "best_s": best,
                   "fresh_s": statistics.mean(fresh) if fresh else None,
                   "counts_per_patch_best": counts_best, "counts_per_patch_fresh": counts_fresh}
            rows.append(row)
            print(f"[sweep] {set_name:<14} threads {threads:>2} {variant:<30} {T:<5} best {best * 1e3:7.2f} ms  fresh "
                  f"{(row['fresh_s'] or 0) * 1e3:7.2f} ms  iterations/patch {counts_fresh['iterations']:5.1f} "
                  f"checks {counts_fresh['checks']:4.1f} captures {counts_fresh['graph_captures']:4.1f} "
                  f"eigh items {counts_fresh['fallback_items']:4.1f}", flush=True)

    ran = {r["variant"] for r in rows if r["threads"] == a.threads[0]}
    accurate = [v for v in a.variants if v in ran and not failures.get(v)]
    first = a.threads[0]

    pick_set = "real-spectra" if "real-spectra" in sets else "random-weights"

    def mean_fresh(v: str, threads: int, set_name: str = pick_set) -> float:
        ts = [r["fresh_s"] if r["fresh_s"] is not None else r["best_s"] for r in rows
              if r["variant"] == v and r["threads"] == threads and r["deltas"] == set_name]
        return statistics.mean(ts) if ts else float("nan")

    pick_threads = 2 if 2 in a.threads else first  # calibrate's and the CLI's thread count for this model
    fastest = min((v for v in accurate if v != "eigh"), key=lambda v: mean_fresh(v, pick_threads), default=None)

    # the forming split: form_patch whole vs its parts vs calibrate's estimate of its forward
    split: list[dict[str, Any]] = []
    split_variants = [topm.CUDA_PRESET] + ([fastest] if fastest and fastest != topm.CUDA_PRESET else [])
    saved_preset = topm.CUDA_PRESET
    for threads in a.threads if time.perf_counter() - t_start < a.hard_limit_s else []:
        torch.set_num_threads(threads)
        for preset in split_variants:
            topm.CUDA_PRESET = preset  # what form_patch's truncated_svd takes by default (no env set)
            topm._graphs.clear()
            for T, items in ((k, v) for k, v in measured.items() if k.isdigit()):
                chunk = items[0]["chunk"]
                ctx = FormContext(backend, chunk, [(ante, [])], {})
                both = ctx_ids + chunk.token_ids.tolist()
                form_patch(backend, chunk, [ante], rank=RANK)  # warm
                parts = {
                    "form_patch_s": lambda: form_patch(backend, chunk, [ante], rank=RANK),
                    "forward_and_delta_s": lambda: exact.target(ctx),
                    # what form_patch runs: the kind's factorize with the device's default solver, now this preset
                    "factorize_s": lambda: exact.factorize(ctx, items[0]["dk"], items[0]["dv"], RANK, RANK,
                                                           exact.layers(ctx)),
                    "encode_ctx_plus_chunk_s": lambda: backend.encode(token_ids=both),
                    "encode_ctx_s": lambda: backend.encode(token_ids=ctx_ids),
                }
                times = {k: [once(f) for _ in range(a.repeats)] for k, f in parts.items()}
                med = {k: statistics.median(v) for k, v in times.items()}
                cond = med["encode_ctx_plus_chunk_s"] - med["encode_ctx_s"]
                rec = {"preset": preset, "threads": threads, "tokens": int(T),
                       **{k: {"median": med[k], "best": min(v)} for k, v in times.items()},
                       "calibrate_conditioned_forward_s": cond,
                       "calibrate_form_overhead_s": max(0.0, med["form_patch_s"] - max(cond, 0.0)),
                       "form_beyond_its_forward_s": med["form_patch_s"] - med["forward_and_delta_s"]}
                split.append(rec)
                print(f"[split] threads {threads:>2} {preset:<30} T={T:<4} form_patch {med['form_patch_s'] * 1e3:6.1f} ms = "
                      f"forward+Δ {med['forward_and_delta_s'] * 1e3:6.1f} + factors {med['factorize_s'] * 1e3:6.1f} "
                      f"(+ {(med['form_patch_s'] - med['forward_and_delta_s'] - med['factorize_s']) * 1e3:5.1f} rest); "
                      f"calibrate's forward estimate {cond * 1e3:6.1f} ms -> its overhead "
                      f"{rec['calibrate_form_overhead_s'] * 1e3:6.1f} ms", flush=True)
    topm.CUDA_PRESET = saved_preset

    # the table: ms a patch (K and V), best on one Δ and mean over fresh ones, per Δ set and length
    print()
    cols = [(d, T) for d in sets for T in sets[d]]
    print(f"{'variant':<32}{'threads':>8}" + "".join(f"{d[:4] + ' ' + ('T=' if T.isdigit() else '') + T:>20}" for d, T in cols)
          + f"{'vs current':>12}  factors vs float64 SVD")
    print(f"{'':<40}" + "".join(f"{'best / fresh ms':>20}" for _ in cols))
    base_v = topm.CUDA_PRESET
    for threads in a.threads:
        base = mean_fresh(base_v, threads) if base_v in a.variants else None
        for v in a.variants:
            cells = ""
            for d, T in cols:
                r = next((r for r in rows if r["variant"] == v and r["threads"] == threads and r["group"] == T
                          and r["deltas"] == d), None)
                cells += f"{'skipped':>20}" if r is None else f"{r['best_s'] * 1e3:12.2f} /{(r['fresh_s'] or 0) * 1e3:6.2f}"
            mine = mean_fresh(v, threads)
            ratio = f"{base / mine:11.2f}x" if base and mine == mine else f"{'':>12}"
            verdict = ("not run" if v not in ran else "pass" if not failures.get(v)
                       else f"FAIL ({len(failures[v])}: {failures[v][0]})")
            print(f"{v:<32}{threads:>8}{cells}{ratio}  {verdict}")
    print(f"('vs current': the mean fresh time of {base_v} over the lengths of {pick_set} / the variant's, same threads)")
    if fastest and base_v in a.variants:
        print(f"\nfastest accurate variant on {pick_set} at {pick_threads} host threads: {fastest} "
              f"({mean_fresh(fastest, pick_threads) * 1e3:.2f} ms a patch vs {mean_fresh(base_v, pick_threads) * 1e3:.2f} ms "
              f"for {base_v}) -> contextdeque/patch/topm.py: CUDA_PRESET = \"{fastest}\"")
    if skipped:
        print(f"[sweep] past --soft-limit-s / --hard-limit-s: skipped {len(skipped)} runs ({skipped[0]}, ...)")
    result = {"environment": env, "micro": parts, "rows": rows, "failures": failures, "accurate": accurate, "skipped": skipped,
              "fastest_accurate": fastest, "picked_at_threads": pick_threads, "picked_on": pick_set, "forming_split": split,
              "wall_s": time.perf_counter() - t_start}
    (a.out / "forming_sweep.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"[sweep] wrote {a.out / 'forming_sweep.json'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
