"""The GPU path on a real CUDA device: every test here is marked ``cuda`` and skips cleanly
without one (``pytest -m cuda`` selects them; ``contextdeque.eval.gpu_check`` runs them on a
lent accelerator and records the figures in docs/gpu.md).

- the Triton kernel against the float64 oracle of tests/kernel_oracle.py, within one ULP of the
  storage dtype (its tolerance): contiguous and paged destinations, fp32/bf16/fp16, head dims
  64-256, ranks 0-64, partial / interleaved rotation, MLA's rotation in v, the all-layers launch,
  chunks long enough for many token blocks; on CUDA bf16/fp16 operands reach ``tl.dot`` as they
  are (the interpreter widens them), so these are the tests the interpreter cannot stand in for;
- relocation on CUDA against transformers' own forward at the target positions (the
  ``verify-model`` gate) on a tiny llama and on SmolLM2-135M's architecture with random weights;
- the window's exact-policy state machine for a short run with the model and pages on CUDA;
- ``materialize()`` + generation with flash-attention 2 where flash-attn imports (else SDPA),
  next-token KL against a re-prefill;
- patch formation's top-m factors (the Gram route, ``contextdeque.patch.topm``) on the device
  against the CPU's float64 SVD, and the forming time split (forward, factors by route) printed.
"""

from __future__ import annotations

import pytest
import torch

from kernel_oracle import (
    DTYPES,
    HEAD_DIMS,
    RANKS,
    VARIANTS,
    _rank,
    assert_ulp_close,
    check_layers_against_oracle,
    make_inputs,
    oracle,
    stacked_layers_case,
)

from contextdeque.eval.gpu_check import SMOLLM2_135M_CONFIG, SWEEP_VARIANTS
from contextdeque.kernels import (
    ContiguousDest,
    PagedDest,
    RopeSpec,
    fused_apply,
    fused_apply_layers,
    select_backend,
    slot_mapping_from_block_table,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")

def to_cuda(*ts):
    return [None if t is None else (tuple(x.to(CUDA) for x in t) if isinstance(t, tuple) else t.to(CUDA)) for t in ts]


def triton_vs_oracle(k, v, rope, cos, sin, kf, vf, what, out_dtype=None):
    """Run the Triton kernel on CUDA copies of CPU inputs; compare with the float64 oracle."""
    ck, cv, ccos, csin, ckf, cvf = to_cuda(k, v, cos, sin, kf, vf)
    # poison the destinations: an unwritten element cannot pass as a correct one
    out_k = torch.full((1, *k.shape), float("nan"), dtype=out_dtype or k.dtype, device=CUDA)
    out_v = torch.full((1, *v.shape), float("nan"), dtype=out_dtype or v.dtype, device=CUDA)
    fused_apply(ck, cv, rope, ccos, csin, ckf, cvf, ContiguousDest(out_k, out_v), backend="triton")
    torch.cuda.synchronize()
    ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
    assert_ulp_close(out_k[0].cpu(), ek, sk, out_k.dtype, _rank(kf), what=f"{what} k")
    assert_ulp_close(out_v[0].cpu(), ev, sv, out_v.dtype, _rank(vf), what=f"{what} v")


# ----------------------------------------------------------------------------- the kernel


def test_auto_selects_triton_on_cuda():
    assert select_backend("cuda") == "triton"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("rank", RANKS)
def test_cuda_head_dims_and_ranks(dtype, d, rank):
    rope = RopeSpec("k", 0, d)
    k, v, kf, vf, cos, sin = make_inputs(2, 77, d, rank, dtype, rope, seed=d * 7 + rank)  # 2 token blocks
    triton_vs_oracle(k, v, rope, cos, sin, kf, vf, f"cuda d={d} m={rank}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cuda_variants(dtype, name):
    H, T, d, rope, v_shape = VARIANTS[name]
    k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=41, v_shape=v_shape, v_rank=5)
    triton_vs_oracle(k, v, rope, cos, sin, kf, vf, f"cuda {name}")


# every launch variant the sweep times, with the dtypes it is timed with ("tf32x3": fp32 only)
SWEEP_CASES = [
    (name, dtype) for name in sorted(SWEEP_VARIANTS) for dtype in DTYPES
    if "fp32_precision" not in SWEEP_VARIANTS[name] or dtype == torch.float32
]


@pytest.mark.parametrize("sweep_variant,dtype", SWEEP_CASES, ids=str)
@pytest.mark.parametrize("case", ["partial_rotary_mid", "interleaved_partial", "mla_half", "multi_block"])
def test_cuda_sweep_variants(sweep_variant, dtype, case, monkeypatch):
    """Every launch variant the sweep times computes the same values (a faster one can become the default)."""
    from contextdeque.kernels import triton_fused

    over = SWEEP_VARIANTS[sweep_variant]
    for key, value in over.items():
        monkeypatch.setitem(triton_fused.LAUNCH_OVERRIDES, key, value)
    H, T, d, rope, v_shape = VARIANTS[case]
    k, v, kf, vf, cos, sin = make_inputs(H, 77, d, 32, dtype, rope, seed=48, v_shape=v_shape, v_rank=5)
    triton_vs_oracle(k, v, rope, cos, sin, kf, vf, f"cuda {sweep_variant} {case}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_long_chunk_rank_32(dtype):
    """Thousands of tokens (many blocks, offsets past 2**16 elements) at the benchmarks' rank."""
    rope = RopeSpec("k", 0, 128)
    k, v, kf, vf, cos, sin = make_inputs(8, 4099, 128, 32, dtype, rope, seed=5)
    triton_vs_oracle(k, v, rope, cos, sin, kf, vf, "cuda long")


def test_cuda_mixed_factor_dtype_and_fp32_out():
    rope = RopeSpec("k", 0, 64)
    k, v, kf, vf, cos, sin = make_inputs(2, 70, 64, 16, torch.bfloat16, rope, seed=45)
    kf32 = (kf[0].float(), kf[1])  # u fp32, w bf16
    triton_vs_oracle(k, v, rope, cos, sin, kf32, vf, "cuda mixed", out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,start", [(4, 5), (16, 13), (16, 0)])
def test_cuda_paged(dtype, block_size, start):
    H, T, d, num_blocks = 2, 83, 128, 40
    rope = RopeSpec("k", 0, 128)
    k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=block_size + start)
    g = torch.Generator().manual_seed(43)
    table = torch.randperm(num_blocks, generator=g)[: (start + T + block_size - 1) // block_size]
    slots = slot_mapping_from_block_table(table, start, T, block_size)
    slots[3] = -1  # padding: skipped
    caches = [torch.randn(num_blocks, block_size, H, d, generator=g).to(dtype) for _ in range(2)]
    ck, cv, ccos, csin, ckf, cvf, cslots = to_cuda(k, v, cos, sin, kf, vf, slots)
    dev_caches = [c.to(CUDA) for c in caches]
    fused_apply(ck, cv, rope, ccos, csin, ckf, cvf, PagedDest(dev_caches[0], dev_caches[1], cslots), backend="triton")
    got = [c.cpu() for c in dev_caches]
    ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
    live = slots >= 0
    blk, off = slots[live] // block_size, slots[live] % block_size
    for out, want, scale, f in ((got[0], ek, sk, kf), (got[1], ev, sv, vf)):
        assert_ulp_close(
            out[blk, off], want[:, live].transpose(0, 1), scale[:, live].transpose(0, 1), dtype, _rank(f), what="paged"
        )
    keep = torch.ones(num_blocks, block_size, dtype=torch.bool)
    keep[blk, off] = False
    for out, before in zip(got, caches):
        assert torch.equal(out[keep], before[keep])  # untouched slots keep their stale data


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_contiguous_dest_offset_touches_only_the_chunk(dtype):
    H, T, d = 2, 70, 128
    rope = RopeSpec("k", 0, 64, interleaved=True)
    k, v, kf, vf, cos, sin = make_inputs(H, T, d, 16, dtype, rope, seed=44)
    dk, dv = torch.randn(2, H, 100, d).to(dtype), torch.randn(2, H, 100, d).to(dtype)
    ck, cv, ccos, csin, ckf, cvf, gk, gv = to_cuda(k, v, cos, sin, kf, vf, dk, dv)
    fused_apply(ck, cv, rope, ccos, csin, ckf, cvf, ContiguousDest(gk, gv, 1, 17), backend="triton")
    gk, gv = gk.cpu(), gv.cpu()
    ek, ev, sk, sv = oracle(k, v, rope, cos, sin, kf, vf)
    assert_ulp_close(gk[1, :, 17:87], ek, sk, dtype, 16, what="offset k")
    assert_ulp_close(gv[1, :, 17:87], ev, sv, dtype, 16, what="offset v")
    keep = torch.ones_like(dk, dtype=torch.bool)
    keep[1, :, 17:87] = False
    assert torch.equal(gk[keep], dk[keep]) and torch.equal(gv[keep], dv[keep])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_all_layers_in_two_launches(dtype, monkeypatch):
    """A stacked chunk (stacked factors, per-layer tables) goes in two launches, and equals the oracle."""
    from contextdeque.kernels import triton_fused

    L, m = 4, 32
    rope, k, v, kf, vf, cos, sin, layers = stacked_layers_case(L, 3, 131, 64, m, dtype)
    launches = []
    real = triton_fused._launch
    monkeypatch.setattr(triton_fused, "_launch", lambda job, *a: (launches.append(a[:1] or (1,)), real(job, *a)))
    ck, cv, ccos, csin = to_cuda(k, v, cos, sin)
    ckf, cvf = tuple(t.to(CUDA) for t in kf), tuple(t.to(CUDA) for t in vf)
    out = fused_apply_layers(ck, cv, rope, ccos, csin, ckf, cvf)
    assert launches == [(L,), (L,)]
    check_layers_against_oracle(out, rope, layers, m, "cuda stacked")


# ----------------------------------------------------------------------------- models on CUDA


def _cuda_backend(config: dict, seed: int, dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from contextdeque.model.hf import HFBackend

    with torch.random.fork_rng(devices=[CUDA]):
        torch.manual_seed(seed)
        with torch.device(CUDA):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=dtype, attn_implementation=attn)
    return HFBackend(model.eval(), None, root_ids=[1, 5, 9, 13], name=f"random-llama-{config['num_hidden_layers']}L")


@pytest.fixture(scope="module")
def smollm2_random():
    """SmolLM2-135M's architecture on CUDA with random weights (its real weights do not travel to
    the lent device; relocation exactness does not depend on them)."""
    return _cuda_backend(SMOLLM2_135M_CONFIG, seed=0)


def test_cuda_verify_model_tiny_llama():
    from contextdeque.eval.verify import verify_backend
    from contextdeque.model.testing import tiny_backend

    cpu = tiny_backend("llama")
    from contextdeque.model.hf import HFBackend

    backend = HFBackend(cpu.model.to(CUDA), None, root_ids=cpu.root_ids, name="tiny-llama-cuda")
    assert backend.layout.num_layers > 0 and backend.device.type == "cuda"
    report = verify_backend(backend, offsets=[1, 37, 300])
    assert report.ok, report.to_json()
    assert report.details and all(d.ok for d in report.details)


def test_cuda_verify_model_cli(capsys):
    """``contextdeque verify-model --device cuda`` (added after the H200 run of docs/gpu.md)."""
    import json

    from contextdeque.cli import main

    rc = main(["verify-model", "--arch", "llama", "--random", "--device", "cuda", "--tokens", "48", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out


def test_cuda_verify_model_smollm2_architecture(smollm2_random):
    from contextdeque.eval.verify import verify_backend

    report = verify_backend(smollm2_random)
    assert report.ok, report.to_json()
    assert 4099 in report.offsets and len(report.details) == len(report.offsets)


def test_cuda_relocation_runs_on_the_device(smollm2_random, monkeypatch):
    """The chunk, the tables and the relocated KV stay on CUDA and go through the Triton kernel."""
    from contextdeque.core.operator import relocate
    from contextdeque.kernels import triton_fused

    calls = []
    real = triton_fused.run_all_layers
    monkeypatch.setattr(triton_fused, "run_all_layers", lambda *a: calls.append(1) or real(*a))
    chunk = smollm2_random.encode(token_ids=torch.arange(10, 74))
    assert chunk.keys.device.type == "cuda"
    out = relocate(chunk, 500)
    assert calls and all(k.device.type == "cuda" and v.device.type == "cuda" for k, v in out)


def test_cuda_window_state_machine_exact_policy():
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test
    from helpers import micro_llama
    from test_window_state_machine import make_machine, tiny_pool

    from contextdeque.model.hf import HFBackend

    backend = HFBackend(micro_llama(7).to(CUDA), None, root_ids=[1, 3], name="tiny-sm-llama-cuda")
    machine = make_machine(backend, tiny_pool(), ["exact"], (12, 48))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=15, stateful_step_count=8, deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        ),
    )


def _attention_implementation() -> str:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return "sdpa"
    return "flash_attention_2"


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_cuda_materialize_and_generate_vs_reprefill(dtype):
    """A window of pages on CUDA: the question's next-token distribution over ``materialize()``
    (exact policy) against one forward over root + pages + question, and greedy generation from
    the window's own cache. flash-attention 2 where flash-attn imports, else SDPA (recorded)."""
    from contextdeque.core.metrics import kl_divergence
    from contextdeque.window import ContextWindow

    impl = _attention_implementation()
    backend = _cuda_backend({**SMOLLM2_135M_CONFIG, "num_hidden_layers": 6}, seed=3, dtype=dtype, attn=impl)
    g = torch.Generator().manual_seed(0)
    pages = [torch.randint(10, 40000, (96,), generator=g).tolist() for _ in range(4)]
    question = torch.randint(10, 40000, (12,), generator=g).tolist()
    win = ContextWindow(backend, budget_tokens=4 * 96, rank=32, patch_policy="exact")
    for p in pages:
        win.append(token_ids=p)
    cache = win.materialize()
    from contextdeque.core import compat

    past = [tuple(t[0] for t in compat.cache_layer(cache, l)) for l in range(compat.cache_num_layers(cache))]
    assert past[0][0].device.type == "cuda"
    start = win.next_position()
    logits = backend.forward(
        input_ids=question, positions=backend.text_positions(start, len(question)), past=past
    ).logits[-1]
    ids = list(win.root_ids) + [t for p in pages for t in p] + question
    ref = backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids))).logits[-1]
    kl = kl_divergence(ref.float(), logits.float())
    print(f"attention={impl} dtype={dtype} KL(re-prefill || window)={kl:.3g}")
    assert kl < 1e-2, kl
    # generation from the window's own cache (model.generate over materialize()) vs from scratch
    reply = win.generate(question, max_new_tokens=8, chat=False).token_ids
    full = backend.model.generate(
        input_ids=torch.tensor([ids], device=CUDA), max_new_tokens=8, do_sample=False, min_new_tokens=8
    )[0, len(ids):].tolist()
    agree = sum(a == b for a, b in zip(reply, full))
    print(f"greedy tokens from the window's cache agreeing with a re-prefill's: {agree} of {len(full)}")
    assert 1 <= len(reply) <= 8


# ----------------------------------------------------------------------------- patch formation's top-m factors


@pytest.mark.parametrize("name", ["gaussian", "ill-conditioned (s from 1 to 1e-12)", "rank 10", "outlier row (1e4)",
                                  "short (T < F)", "short, rank 5", "zero", "degenerate (40 equal, then 40 equal)",
                                  "slow decay (s from 1 to 0.5)"])
@pytest.mark.parametrize("eig", ["subspace", "eigh"])
@pytest.mark.parametrize("eig_device", [None, "cpu"], ids=["eig-on-cuda", "eig-on-host"])
def test_cuda_top_m_factors_against_the_float64_svd(name, eig, eig_device):
    """The Gram route on the device by either eigen-solver (float64 Gram on CUDA; ``subspace``:
    the iteration on CUDA, its small Rayleigh–Ritz eigenproblems and eigh fallback where
    ``eig_device`` says; ``eigh``: on CUDA or on the host) against the CPU's float64 SVD: the
    oracle checks of tests/test_patch_topm.py."""
    from test_patch_topm import CASES, assert_top_factors

    from contextdeque.patch.topm import truncated_svd

    delta = CASES[name]
    for rank in (1, 8, 32, 96):
        us, vt = truncated_svd(delta.to(CUDA), rank, eig=eig, eig_device=eig_device)
        assert us.device.type == vt.device.type == "cuda"
        assert_top_factors(delta, rank, us.cpu(), vt.cpu())


def test_cuda_subspace_solver_converges_on_the_device():
    """The subspace iteration itself (not its eigh fallback) answers on CUDA: the fast items of a
    mixed batch pass the residual test on the device, as on the CPU."""
    from test_patch_topm import CASES

    from contextdeque.patch.topm import FIRST_CHECK, subspace_top_eigenvectors

    import contextdeque.patch.topm as topm

    names = ["decaying (s from 1 to 1e-4)", "slow decay (s from 1 to 0.5)", "rank 10"]
    x = torch.stack([CASES[n] for n in names]).to(CUDA, torch.float64)
    vecs, done = subspace_top_eigenvectors(x.mT @ x, 8, max_steps=FIRST_CHECK)
    assert vecs.device.type == "cuda" and done.tolist() == [True, False, True]
    assert topm.CUDA_GRAPHS, "the power steps' CUDA graph capture failed (they ran eagerly)"
    # the graphed steps compute what the eager ones do
    topm.CUDA_GRAPHS = False
    try:
        eager, done_eager = subspace_top_eigenvectors(x.mT @ x, 8, max_steps=FIRST_CHECK)
    finally:
        topm.CUDA_GRAPHS = True
    assert done_eager.tolist() == done.tolist()
    torch.testing.assert_close(vecs, eager, rtol=0, atol=1e-10)


#: topm's CUDA_PRESETS, spelled out: a preset added without a device run shows here as missing
CUDA_PRESET_NAMES = ["graphed", "p16", "budget80", "ritz-serial", "ritz-1", "ritz-numpy", "ritz-numpy-pool", "ritz-device",
                     "pow2", "full", "kv", "pad-tokens", "squared", "squared-pow2-host-1", "squared-pow2-host-1-kv",
                     "squared-pow2-numpy-pool", "squared-pow2-numpy-pool-kv", "squared-pow2-device",
                     "squared-p16-pow2-host-1", "squared-p16-pow2-host-1-kv", "squared-p16-pow2-numpy-pool",
                     "squared-p16-pow2-numpy-pool-kv"]


@pytest.mark.parametrize("preset", CUDA_PRESET_NAMES)
def test_cuda_subspace_presets_against_the_float64_svd(preset):
    """Every candidate CUDA setting of the subspace iteration (issue 21: ``CUDA_PRESETS``; the
    list is spelled out so that a preset added without a device run shows here as missing) on the
    device, graphed, against the CPU's float64 SVD: the oracle checks of tests/test_patch_topm.py on
    the cases that break solvers (a batch of them, so items converge at different checks and
    padded batches repeat rows), ranks 1, 8 and 32. (The preset's ``kv_one_call`` is
    PatchKind.factorize's choice, tested on the host: test_patch_topm.py.)"""
    from test_patch_topm import CASES, assert_top_factors

    from contextdeque.patch import topm

    assert set(topm.CUDA_PRESETS) == set(CUDA_PRESET_NAMES)
    names = ["gaussian", "ill-conditioned (s from 1 to 1e-12)", "rank 10", "outlier row (1e4)", "zero",
             "degenerate (40 equal, then 40 equal)", "slow decay (s from 1 to 0.5)", "decaying (s from 1 to 1e-4)"]
    batch = torch.stack([CASES[n] for n in names])
    for rank in (1, 8, 32):
        us, vt = topm.truncated_svd(batch.to(CUDA), rank, eig="subspace", subspace=topm.CUDA_PRESETS[preset])
        assert us.device.type == vt.device.type == "cuda"
        for i in range(len(names)):
            assert_top_factors(batch[i], rank, us[i].cpu(), vt[i].cpu())
    assert topm.CUDA_GRAPHS, "the power steps' CUDA graph capture failed (they ran eagerly)"


@pytest.mark.parametrize("pad", ["pow2", "full"])
def test_cuda_subspace_padded_batches_keep_captured_graph_shapes(pad):
    """As items converge the batch shrinks; padded (``pow2``: to a power of two; ``full``: the first
    batch's size) the graphs captured are of those sizes only, and a second batch with another
    convergence pattern replays them (no new capture) with the same answers as unpadded steps."""
    from test_patch_topm import CASES

    from contextdeque.patch import topm

    # distinct spectra (a degenerate one's eigenvectors are not unique: rounding may turn them)
    names = ["decaying (s from 1 to 1e-4)", "slow decay (s from 1 to 0.5)", "gaussian", "outlier row (1e4)",
             "ill-conditioned (s from 1 to 1e-12)", "slower decay (s from 1 to 0.8)", "huge entries (1e30)"]
    x = torch.stack([CASES[n] for n in names]).to(CUDA, torch.float64)
    grams = x.mT @ x
    settings = topm.SubspaceSettings(oversample=32, first_check=8, pad=pad)
    topm._graphs.clear()
    vecs, done = topm.subspace_top_eigenvectors(grams, 8, settings=settings)
    sizes = {key[1] for key in topm._graphs}
    assert sizes and all(b & (b - 1) == 0 for b in sizes) if pad == "pow2" else sizes == {len(names)}
    topm.SUBSPACE_COUNTS.reset()
    again, done_again = topm.subspace_top_eigenvectors(grams.flip(0), 8, settings=settings)
    if pad == "full":
        assert topm.SUBSPACE_COUNTS.graph_captures == 0
    assert done_again.flip(0).tolist() == done.tolist()
    plain, _ = topm.subspace_top_eigenvectors(grams, 8, settings=topm.SubspaceSettings(oversample=32, first_check=8))
    torch.testing.assert_close(vecs, plain, rtol=0, atol=1e-8)
    torch.testing.assert_close(again.flip(0), plain, rtol=0, atol=1e-8)


def test_cuda_subspace_zero_gram_is_cusolvers_answer():
    """An all-zero Gram (every patch's first-layer V Δ) takes, without a solver call, the answer
    cuSOLVER's ``eigh`` gives for it (as LAPACK's on the host: the identity's last columns)."""
    from contextdeque.patch import topm

    zero = torch.zeros(2, 192, 192, dtype=torch.float64, device=CUDA)
    want = topm._eigh_top(zero, 32, None)
    got = topm._zero_gram_top(192, 32, torch.float64, CUDA)
    assert torch.equal(got.expand_as(want), want)


def test_cuda_patch_forming_split_and_factors(smollm2_random):
    """Rank-32 patches of 256- and 1,024-token chunks on SmolLM2-135M's architecture on CUDA: the
    real Δ's factors (every layer, all in one batch) by the route CUDA takes (``auto``) and by
    each eigen-solver against the float64 SVD, and the forming time split (conditioned forward vs
    factorization: subspace iteration on the device, eigh on the device, eigh on the host, the
    float64 SVD) printed for docs/gpu.md: no threshold."""
    from test_patch_topm import assert_top_factors

    from contextdeque.eval.bench import forming_split
    from contextdeque.patch.base import PATCH_KINDS, FormContext
    from contextdeque.patch.topm import DEFAULT_EIG, truncated_svd

    g = torch.Generator().manual_seed(0)
    a = smollm2_random.encode(token_ids=torch.randint(10, 40000, (256,), generator=g))
    for T in (256, 1024):
        b = smollm2_random.encode(token_ids=torch.randint(10, 40000, (T,), generator=g))
        dk, dv = PATCH_KINDS["exact"]().target(FormContext(smollm2_random, b, [(a, [])], {}))
        assert dk.device.type == "cuda"
        for eig in ("auto", "subspace", "eigh"):
            for d in (dk, dv):
                us, vt = truncated_svd(d, 32, eig=eig)
                for layer in range(d.shape[0]):
                    assert_top_factors(d[layer].cpu(), 32, us[layer].cpu(), vt[layer].cpu())
        split = forming_split(smollm2_random, b, a, 32, CUDA, repeats=3)
        fs = split["factorize_s"]
        print(f"forming a rank-32 patch on {T} tokens (CUDA, {torch.cuda.get_device_name()}, host threads "
              f"{torch.get_num_threads()}): {split['form_patch_s'] * 1e3:.1f} ms = forward "
              f"{split['forward_s'] * 1e3:.1f} ms + factors {fs['auto'] * 1e3:.1f} ms (auto = {DEFAULT_EIG['cuda']}); "
              f"subspace on the device {fs['subspace'] * 1e3:.1f} ms, eigh on the device {fs['eigh'] * 1e3:.1f} ms, "
              f"eigh on the host {fs['eigh_host'] * 1e3:.1f} ms, the float64 SVD {fs['svd'] * 1e3:.1f} ms "
              f"({split['svd_vs_auto']:.1f}x auto); factors / forward: subspace "
              f"{fs['subspace'] / split['forward_s']:.2f}, eigh {fs['eigh'] / split['forward_s']:.2f}, "
              f"eigh on the host {fs['eigh_host'] / split['forward_s']:.2f}")
        assert set(fs) == {"auto", "subspace", "eigh", "svd", "eigh_host"} and min(fs.values()) > 0
