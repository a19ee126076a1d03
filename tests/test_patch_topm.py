"""The top-m factorization (contextdeque.patch.topm) against its oracle, the float64 SVD: on
random Δs shaped to break a Gram route (ill-conditioned, rank-deficient, an outlier row,
degenerate, zero, shorter than wide, a slowly decaying spectrum), on real Δs of the default model
and of tiny models, and through a window (a patched window's next-token KL against a re-prefill
equals the SVD's within 1e-6), by both eigen-solvers (``eigh``; ``subspace``: block subspace
iteration with a residual test and an ``eigh`` fallback per item). The checker itself is shown to
fail on wrong factors, and on a subspace solver without its residual test or with one step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import contextdeque.patch.base as patch_base
from contextdeque.core.errors import PatchError
from contextdeque.core.metrics import kl_divergence
from contextdeque.patch import form_patch
from contextdeque.patch.base import FormContext
from contextdeque.patch.ops import combine_patches
from contextdeque.patch.alloc import layer_spectra
import contextdeque.patch.topm as topm
from contextdeque.patch.topm import gram_serves, subspace_top_eigenvectors, truncated_svd
from contextdeque.stores import MemoryTier, TieredStore
from helpers import assert_relocates_as_dense, seeded_ids, window_answer_logits

# float32 factors of a float32 Δ: every comparison is relative to the Δ's scale, at a few float32
# ulps (eps32 = 6e-8) times the dimensions' growth
REL = 2e-6


def oracle(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 SVD of ``delta [T, F]``: ``(U_m S_m, V_mᵀ, all singular values)``, float64."""
    U, S, Vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    m = min(rank, S.shape[0])
    return U[:, :m] * S[:m], Vh[:m], S


def assert_top_factors(delta: torch.Tensor, rank: int, us: torch.Tensor, vt: torch.Tensor) -> None:
    """``(us, vt)`` are the top-``rank`` factors of ``delta [T, F]`` as the float64 SVD has them:
    shapes and dtype; ``vt``'s rows orthonormal; the spectrum ``s²`` (column energies of ``us``, what
    rank allocation reads) equal to the SVD's, descending; the rank-m reconstruction error equal to
    the SVD's (the best possible: Eckart–Young); where the spectrum has a gap, the same top
    subspace; at full rank, Δ itself."""
    T, F = delta.shape
    m = min(rank, T, F)
    assert us.shape == (T, m) and vt.shape == (m, F)
    assert us.dtype == vt.dtype == torch.float32
    d = delta.to(torch.float64)
    u64, v64 = us.to(torch.float64), vt.to(torch.float64)
    _, ref_vt, S = oracle(delta, rank)
    scale = float(S[0]) if S.numel() and float(S[0]) > 0 else 1.0
    assert torch.allclose(v64 @ v64.T, torch.eye(m, dtype=torch.float64), atol=REL), "V_mᵀ rows not orthonormal"
    s2 = u64.pow(2).sum(0)
    assert torch.allclose(s2, S[:m].pow(2), rtol=0, atol=REL * scale**2), "spectrum differs from the SVD's"
    assert bool((s2[1:] <= s2[:-1] + REL * scale**2).all()), "directions not in descending order"
    err = float((d - u64 @ v64).norm())
    best = float(S[m:].pow(2).sum().sqrt())
    assert abs(err - best) <= REL * max(float(d.norm()), 1e-30), f"rank-{m} error {err:.3e} vs the SVD's {best:.3e}"
    if m == min(T, F):
        assert err <= REL * max(float(d.norm()), 1e-30), "full rank does not reproduce Δ"
    # the top-k subspace for every k <= m at which the spectrum has a clear gap: sinθ ≲ noise / gap
    for k in range(1, m + 1):
        gap = float(S[k - 1] ** 2 - (S[k] ** 2 if k < S.shape[0] else 0.0)) / scale**2
        if gap > 1e-3:
            cross = torch.linalg.svdvals(ref_vt[:k] @ v64[:k].T)
            assert float(cross.min()) >= 1.0 - 1e-6 / gap, f"top-{k} subspace differs from the SVD's"


def spectrum_delta(T: int, F: int, s: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A float32 ``[T, F]`` Δ with singular values ``s`` (zero-padded) in random directions."""
    g = torch.Generator().manual_seed(seed)
    r = min(T, F)
    U = torch.linalg.qr(torch.randn(T, r, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(F, r, generator=g, dtype=torch.float64))[0]
    full = torch.zeros(r, dtype=torch.float64)
    full[: min(r, s.numel())] = s[:r].to(torch.float64)
    return ((U * full) @ V.T).to(torch.float32)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    T, F = 300, 96
    noisy = torch.randn(T, F, generator=g)
    return {
        "gaussian": noisy,
        "ill-conditioned (s from 1 to 1e-12)": spectrum_delta(T, F, torch.logspace(0, -12, F, dtype=torch.float64)),
        "decaying (s from 1 to 1e-4)": spectrum_delta(T, F, torch.logspace(0, -4, F, dtype=torch.float64)),
        "rank 10": spectrum_delta(T, F, torch.ones(10, dtype=torch.float64)),
        "outlier row (1e4)": torch.cat([noisy[:1] * 1e4, noisy[1:]]),
        "degenerate (40 equal, then 40 equal)": spectrum_delta(
            T, F, torch.cat([torch.ones(40, dtype=torch.float64), torch.full((40,), 0.1, dtype=torch.float64)])),
        "zero": torch.zeros(T, F),
        "short (T < F)": torch.randn(40, F, generator=g),
        "short, rank 5": spectrum_delta(40, F, torch.ones(5, dtype=torch.float64)),
        "tiny entries (1e-30)": noisy * 1e-30,
        "huge entries (1e30)": noisy * 1e30,
        # λ_{m+p+1} / λ_m near 1: subspace iteration needs many steps (its residual test decides)
        "slow decay (s from 1 to 0.5)": spectrum_delta(T, F, torch.linspace(1, 0.5, F, dtype=torch.float64)),
        "slower decay (s from 1 to 0.8)": spectrum_delta(T, F, torch.linspace(1, 0.8, F, dtype=torch.float64)),
    }


CASES = _cases()


EIGS = ["eigh", "subspace"]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("method", ["auto", "gram"])
@pytest.mark.parametrize("eig", EIGS)
@pytest.mark.parametrize("rank", [1, 8, 32, 96])
def test_top_factors_match_the_float64_svd(name, method, eig, rank):
    delta = CASES[name]
    us, vt = truncated_svd(delta, rank, method=method, eig=eig)
    assert us.is_contiguous() and vt.is_contiguous()  # stored and multiplied as laid out
    assert_top_factors(delta, rank, us, vt)


@pytest.mark.parametrize("eig", EIGS)
def test_both_routes_return_the_same_factors_signs_included(eig):
    """One sign per direction (the peak entry of each V_mᵀ row positive): the Gram route (either
    solver) and the SVD give the same factors element by element where the spectrum is distinct."""
    delta = spectrum_delta(500, 64, torch.linspace(4.0, 0.5, 64, dtype=torch.float64), seed=5)
    for rank in (8, 64):
        us_g, vt_g = truncated_svd(delta, rank, method="gram", eig=eig)
        us_s, vt_s = truncated_svd(delta, rank, method="svd")
        peak = vt_g.gather(1, vt_g.abs().argmax(1, keepdim=True))
        assert bool((peak > 0).all())
        torch.testing.assert_close(vt_g, vt_s, rtol=0, atol=1e-5)
        torch.testing.assert_close(us_g, us_s, rtol=0, atol=1e-5 * float(us_s.abs().max()))


def test_batched_equals_one_by_one_and_groups_cut_the_batch(monkeypatch):
    import contextdeque.patch.topm as topm

    g = torch.Generator().manual_seed(1)
    batch = torch.randn(2, 3, 120, 48, generator=g)
    us, vt = truncated_svd(batch, 12)
    assert us.shape == (2, 3, 120, 12) and vt.shape == (2, 3, 12, 48)
    monkeypatch.setattr(topm, "GROUP_BYTES", 1)  # one item per group
    us1, vt1 = truncated_svd(batch, 12)
    for i in range(2):
        for j in range(3):
            one_us, one_vt = truncated_svd(batch[i, j], 12)
            torch.testing.assert_close(us[i, j], one_us, rtol=0, atol=1e-5)
            torch.testing.assert_close(vt[i, j], one_vt, rtol=0, atol=1e-6)
            torch.testing.assert_close(us1[i, j], one_us, rtol=0, atol=1e-5)


def test_the_route_auto_takes():
    assert gram_serves(512, 192, 32) and gram_serves(512, 192, 192) and gram_serves(192, 192, 192)
    assert gram_serves(100, 192, 50) and not gram_serves(100, 192, 51) and not gram_serves(100, 192, 100)


def test_zero_rank_and_bad_input():
    us, vt = truncated_svd(torch.randn(7, 5), 0)
    assert us.shape == (7, 0) and vt.shape == (0, 5) and us.dtype == torch.float32
    us, vt = truncated_svd(torch.randn(4, 7, 5, dtype=torch.float64), 9)  # rank above the cap: min(T, F)
    assert us.shape == (4, 7, 5) and vt.shape == (4, 5, 5) and us.dtype == torch.float32
    with pytest.raises(PatchError):
        truncated_svd(torch.randn(5), 2)
    with pytest.raises(PatchError):
        truncated_svd(torch.randn(5, 4), -1)
    with pytest.raises(PatchError):
        truncated_svd(torch.randn(5, 4), 2, method="qr")
    with pytest.raises(PatchError):
        truncated_svd(torch.randn(5, 4), 2, eig="lanczos")


def test_a_non_finite_delta_takes_the_svd_as_before():
    delta = torch.randn(50, 8)
    delta[3, 2] = float("nan")
    try:
        want = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    except RuntimeError as exc:  # LAPACK may refuse a NaN matrix: then the routine refuses it alike
        with pytest.raises(type(exc)):
            truncated_svd(delta, 4)
        return
    us, vt = truncated_svd(delta, 4)
    assert not bool(torch.isfinite(us).all()) or not bool(torch.isfinite(want[1]).all())


# ---------------------------------------------------------------------------- the checker fails on wrong factors


def _wrong_factors(delta: torch.Tensor, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    us, vt, _ = oracle(delta, rank + 1)
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(delta.shape[1], rank, generator=g, dtype=torch.float64))[0].T
    f32 = lambda a, b: (a.to(torch.float32), b.to(torch.float32))  # noqa: E731
    return {
        "drops the top direction": f32(us[:, 1:], vt[1:]),
        "ascending order": f32(us[:, :rank].flip(1), vt[:rank].flip(0)),
        "a random subspace": f32(delta.to(torch.float64) @ q.T, q),
        "float16 factors": f32(us[:, :rank].half().double(), vt[:rank].half().double()),
        "one direction too few, zero-padded": f32(torch.cat([us[:, : rank - 1], us[:, :1] * 0], 1),
                                                  torch.cat([vt[: rank - 1], vt[rank:rank + 1]], 0)),
    }


@pytest.mark.parametrize("wrong", list(_wrong_factors(CASES["gaussian"], 8)))
def test_the_checker_fails_on_a_wrong_routine(wrong):
    delta = CASES["gaussian"]
    us, vt = _wrong_factors(delta, 8)[wrong]
    with pytest.raises(AssertionError):
        assert_top_factors(delta, 8, us, vt)


# ---------------------------------------------------------------------------- the subspace solver's own guards


def _gram(delta: torch.Tensor) -> torch.Tensor:
    x = delta.to(torch.float64)
    return x.mT @ x


def test_the_solver_auto_takes_per_device(monkeypatch):
    """``eig="auto"`` is DEFAULT_EIG's entry for Δ's device type: swapping the CPU's entry swaps
    the solver the CPU runs."""
    calls = []
    real = topm.subspace_top_eigenvectors
    monkeypatch.setattr(topm, "subspace_top_eigenvectors", lambda *a, **k: calls.append(1) or real(*a, **k))
    delta = CASES["decaying (s from 1 to 1e-4)"]
    monkeypatch.setitem(topm.DEFAULT_EIG, "cpu", "eigh")
    truncated_svd(delta, 8)
    assert not calls
    monkeypatch.setitem(topm.DEFAULT_EIG, "cpu", "subspace")
    assert_top_factors(delta, 8, *truncated_svd(delta, 8))
    assert calls


def test_real_layers_converge_without_falling_back(default_deltas):
    """The route is the subspace iteration itself on real Δs (not its eigh fallback): every layer
    whose Δ is not all zero passes the residual test (layer 0's V Δ is zero: its token embedding
    does not see the antecedent; a zero Gram takes eigh, as before)."""
    _, _, _, dk, dv = default_deltas
    for d in (dk, dv):
        g = d.to(torch.float64).mT @ d.to(torch.float64)
        _, done = subspace_top_eigenvectors(g, 32)
        zero = g.flatten(1).abs().amax(1) == 0
        assert bool((done == ~zero).all()), (done, zero)


def test_items_that_do_not_converge_fall_back_to_eigh(monkeypatch):
    """One step (MAX_STEPS = 1): no item passes the residual test, so every item takes eigh, and
    the factors are still the float64 SVD's."""
    batch = torch.stack([CASES["gaussian"], CASES["decaying (s from 1 to 1e-4)"], CASES["slow decay (s from 1 to 0.5)"]])
    _, done = subspace_top_eigenvectors(torch.stack([_gram(d) for d in batch]), 8, max_steps=1)
    assert not bool(done.any())
    fell_back = []
    real = topm._eigh_top
    monkeypatch.setattr(topm, "_eigh_top", lambda g, m, dev: fell_back.append(len(g)) or real(g, m, dev))
    monkeypatch.setattr(topm, "MAX_STEPS", 1)
    us, vt = truncated_svd(batch, 8, eig="subspace")
    assert fell_back == [3]
    for i in range(3):
        assert_top_factors(batch[i], 8, us[i], vt[i])


def test_a_batch_mixing_converging_and_fallen_back_items(monkeypatch):
    """With the step budget at the first check, the fast-converging items pass and the slow ones
    (λ_{m+p+1}/λ_m near 1) fall back to eigh, only those: every item's factors are the SVD's."""
    names = ["decaying (s from 1 to 1e-4)", "slow decay (s from 1 to 0.5)", "rank 10",
             "ill-conditioned (s from 1 to 1e-12)", "gaussian"]
    batch = torch.stack([CASES[n] for n in names])
    _, done = subspace_top_eigenvectors(torch.stack([_gram(d) for d in batch]), 8, max_steps=topm.FIRST_CHECK)
    assert done.tolist() == [True, False, True, True, False]
    fell_back = []
    real = topm._eigh_top
    monkeypatch.setattr(topm, "_eigh_top", lambda g, m, dev: fell_back.append(len(g)) or real(g, m, dev))
    monkeypatch.setattr(topm, "MAX_STEPS", topm.FIRST_CHECK)
    us, vt = truncated_svd(batch, 8, eig="subspace")
    assert fell_back == [2]
    for i, name in enumerate(names):
        assert_top_factors(batch[i], 8, us[i], vt[i])


@pytest.mark.parametrize("wrong", ["no residual test", "one step"])
def test_the_oracle_fails_a_subspace_solver_without_its_guards(monkeypatch, wrong, default_deltas):
    """A solver that accepts its first Rayleigh–Ritz step without the residual test, or stops
    after one step, returns wrong factors: a slowly decaying spectrum (and, after one step, real
    layers) fail the oracle."""
    monkeypatch.setattr(topm, "RESIDUAL_TOL", float("inf"))  # every item "passes" at its first check
    if wrong == "one step":
        monkeypatch.setattr(topm, "FIRST_CHECK", 1)
    cases = [CASES["slower decay (s from 1 to 0.8)"]]
    if wrong == "one step":
        cases.append(default_deltas[3][5])  # a real layer's K Δ
    for delta in cases:
        us, vt = truncated_svd(delta, 8, eig="subspace")
        with pytest.raises(AssertionError):
            assert_top_factors(delta, 8, us, vt)


def test_host_eigenproblems_over_threads_equal_one_call(monkeypatch):
    """The host's batch of eigenproblems cut over threads gives the one call's answer."""
    g = torch.stack([_gram(CASES[n]) for n in ("gaussian", "rank 10", "outlier row (1e4)", "zero", "decaying (s from 1 to 1e-4)")])
    want = torch.linalg.eigh(g)
    monkeypatch.setattr(topm, "HOST_EIG_THREADS", 3)
    vals, vecs = topm._eigh(g, None)
    # the same problems, the same answers to rounding (a threaded LAPACK sums in another order:
    # measured 1.4e-7 on a Gram whose largest eigenvalue is ~1e8): eigenvalues to 1e-13 of each
    # item's largest, and each item rebuilt from its eigenpairs (degenerate eigenvectors are not unique)
    scale = want[0].abs().amax(-1, keepdim=True).clamp_min(1e-300)
    assert ((vals - want[0]).abs() <= 1e-13 * scale).all()
    rebuilt = vecs @ torch.diag_embed(vals) @ vecs.mT
    assert ((rebuilt - g).abs() <= 1e-12 * scale.unsqueeze(-1)).all()


# ---------------------------------------------------------------------------- real Δs


def _real_deltas(backend, a_ids, b_ids):
    a = backend.encode(token_ids=a_ids)
    b = backend.encode(token_ids=b_ids)
    ctx = FormContext(backend, b, [(a, [])], {})
    dk, dv = patch_base.PATCH_KINDS["exact"]().target(ctx)
    return a, b, dk, dv


@pytest.fixture(scope="module")
def default_deltas(default_backend, one_thread):
    """The default model's Δ of a 256-token page after a 200-token page (real text)."""
    from contextdeque.agents.scenarios import demo_document

    ids = default_backend.tokenizer(demo_document())["input_ids"]
    return (default_backend, *_real_deltas(default_backend, ids[:200], ids[200:456]))


@pytest.mark.parametrize("eig", EIGS)
@pytest.mark.parametrize("rank", [8, 32, "full"])
def test_the_default_models_deltas(default_deltas, rank, eig):
    """Every layer's K and V Δ of a real page (T = 256 ≥ F = 192: the Gram route)."""
    _, _, _, dk, dv = default_deltas
    for d in (dk, dv):
        m = min(d.shape[1:]) if rank == "full" else rank
        us, vt = truncated_svd(d, m, eig=eig)  # all layers in one batch, as a patch forms them
        for l in range(d.shape[0]):
            assert_top_factors(d[l], m, us[l], vt[l])


@pytest.mark.parametrize("eig", EIGS)
def test_a_patch_formed_now_relocates_as_the_svds(default_deltas, monkeypatch, eig):
    """form_patch on the default model (its device's solver set to ``eig``): the spectra rank
    allocation reads are the SVD's, and the relocated page equals the one the float64 SVD's
    factors give, within float32 rounding."""
    backend, a, b, _, _ = default_deltas
    monkeypatch.setitem(topm.DEFAULT_EIG, backend.device.type, eig)
    new = form_patch(backend, b, [a], rank=32)
    monkeypatch.setattr(patch_base, "truncated_svd", lambda d, r: truncated_svd(d, r, method="svd"))
    old = form_patch(backend, b, [a], rank=32)
    for x, y in zip(layer_spectra(new), layer_spectra(old)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * float(y.max()))
    assert_relocates_as_dense(backend, b, new)
    from contextdeque.core.operator import relocate

    for (k1, v1), (k2, v2) in zip(relocate(b, 300, patch=new), relocate(b, 300, patch=old)):
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-4 * float(k2.abs().max()))
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-4 * float(v2.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("rank", [2, 8, "full"])
@pytest.mark.parametrize("eig", EIGS)
def test_tiny_models_deltas(tiny_backend_factory, one_thread, arch, rank, eig):
    """Tiny models: T = 40 ≥ F (deepseek's 32 / 16) and T < F (llama's 64): both Gram routes and the
    SVD fallback, K and V widths that differ."""
    be = tiny_backend_factory(arch)
    _, _, dk, dv = _real_deltas(be, seeded_ids(24, 1, 200).tolist(), seeded_ids(40, 2, 200).tolist())
    for d in (dk, dv):
        m = min(d.shape[1:]) if rank == "full" else rank
        us, vt = truncated_svd(d, m, eig=eig)
        for l in range(d.shape[0]):
            assert_top_factors(d[l], m, us[l], vt[l])


def test_combined_and_shared_factorizations(tiny_backend_factory, one_thread):
    """The other two callers (orbit combination, a shared basis) batch their layers through it."""
    from contextdeque.patch import SharedBasis

    be = tiny_backend_factory("llama")
    a, c, b = (be.encode(token_ids=seeded_ids(n, s, 200).tolist()) for n, s in ((20, 4), (22, 5), (150, 6)))
    p1, p2 = form_patch(be, b, [a, c], rank="full"), form_patch(be, b, [c, a], rank="full")
    combined = combine_patches([p1, p2], rank=6)
    for l in combined.layers:
        mean_k = ((p1.layer_delta(l)[0] + p2.layer_delta(l)[0]) / 2).transpose(0, 1).reshape(b.n_tokens, -1)
        assert_top_factors(mean_k, 6, *combined.layer_factors("k", l))
    basis = SharedBasis.fit(be, [(b, [a]), (b, [c])], rank=4)
    w = basis.k_w.to(torch.float64)
    assert torch.allclose(w @ w.mT, torch.eye(4, dtype=torch.float64).expand_as(w @ w.mT), atol=1e-6)


# ---------------------------------------------------------------------------- the window's fidelity


def test_a_patched_windows_kl_is_the_svds(default_backend, one_thread, monkeypatch):
    """The default model, three real 200-token pages, reversed under the eager policy (two patches
    formed on the new prefix): the next-token KL against a re-prefill is the float64 SVD's within
    1e-6."""
    from contextdeque.agents.scenarios import demo_document
    from contextdeque.window import ContextWindow

    be = default_backend
    ids = be.tokenizer(demo_document())["input_ids"]
    pages = [ids[i * 200:(i + 1) * 200] for i in range(3)]
    query = ids[700:708]

    def drop_top(d, r):  # a wrong routine: the top direction zeroed
        us, vt = truncated_svd(d, r)
        return torch.cat([us[..., 1:], us[..., :1] * 0], -1), vt

    def kl_after_reverse(method: str) -> float:
        calls = []
        routine = drop_top if method == "drop-top" else (lambda d, r: truncated_svd(d, r, method=method))
        monkeypatch.setattr(patch_base, "truncated_svd", lambda d, r: calls.append(r) or routine(d, r))
        store = TieredStore([MemoryTier("cpu", None, name="device")])  # nothing formed by the other run
        win = ContextWindow(be, store=store, rank=32, patch_policy="eager", anticipate=False)
        refs = [win.append(chunk=be.encode(token_ids=p)) for p in pages]
        win.reorder(refs[::-1])
        win.heal()
        assert calls, "no patch was formed"
        cache_ids = list(win.root_ids) + [t for r in win.refs for t in win.chunk(r).token_ids.tolist()]
        full = cache_ids + query
        ref = be.forward(input_ids=full, positions=be.text_positions(0, len(full))).logits[-1]
        return kl_divergence(ref, window_answer_logits(be, win, query))

    kl_new, kl_old = kl_after_reverse("auto"), kl_after_reverse("svd")
    monkeypatch.setitem(topm.DEFAULT_EIG, "cpu", "subspace")
    kl_subspace = kl_after_reverse("auto")
    print(f"next-token KL(re-prefill || window) after the reverse: Gram route {kl_new:.9e}, by subspace "
          f"iteration {kl_subspace:.9e}, SVD {kl_old:.9e}, difference {abs(kl_new - kl_old):.1e}, "
          f"{abs(kl_subspace - kl_old):.1e}")
    assert abs(kl_new - kl_old) <= 1e-6, (kl_new, kl_old)
    assert abs(kl_subspace - kl_old) <= 1e-6, (kl_subspace, kl_old)
    assert kl_new < 0.05  # a patched window, not a blind one
    assert kl_after_reverse("drop-top") > 2 * kl_new  # the patches' factors decide the window's KL


# ---------------------------------------------------------------------------- the subspace iteration's settings (CUDA's presets)

PRESETS = list(topm.CUDA_PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_cuda_preset_matches_the_float64_svd_on_the_host(preset):
    """Every candidate setting of the subspace iteration (issue 21: the presets CUDA may take by
    default), run on the host with its own settings (padding, G² iterations, its Rayleigh–Ritz
    eigenproblems where it puts them, its budget), gives the float64 SVD's factors on every
    oracle case at ranks 1, 8 and 32."""
    settings = topm.CUDA_PRESETS[preset]
    for name, delta in CASES.items():
        for rank in (1, 8, 32):
            us, vt = truncated_svd(delta, rank, eig="subspace", subspace=settings)
            assert us.is_contiguous() and vt.is_contiguous()
            assert_top_factors(delta, rank, us, vt)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_cuda_preset_on_the_default_models_deltas(default_deltas, preset):
    """Every layer's K and V Δ of a real page, rank 32, all layers in one batch (as a patch forms
    them: items converge at different iterations, so padded batches really repeat rows)."""
    _, _, _, dk, dv = default_deltas
    for d in (dk, dv):
        us, vt = truncated_svd(d, 32, eig="subspace", subspace=topm.CUDA_PRESETS[preset])
        for l in range(d.shape[0]):
            assert_top_factors(d[l], 32, us[l], vt[l])


def _mixed_batch() -> torch.Tensor:
    names = ["decaying (s from 1 to 1e-4)", "slow decay (s from 1 to 0.5)", "rank 10", "gaussian", "outlier row (1e4)"]
    return torch.stack([_gram(CASES[n]) for n in names])


@pytest.mark.parametrize("pad", ["pow2", "full"])
def test_a_padded_batch_gives_each_item_its_own_answer(pad):
    """Padding the shrinking batch (stable CUDA graph shapes) repeats rows whose results are
    dropped: every item's eigenvectors are the unpadded run's (to rounding)."""
    grams = _mixed_batch()
    plain, done = subspace_top_eigenvectors(grams, 8, settings=topm.SubspaceSettings())
    assert not bool(done.all()) and bool(done.any())  # items converge at different checks: the batch shrinks
    padded, done_p = subspace_top_eigenvectors(grams, 8, settings=topm.SubspaceSettings(pad=pad))
    assert done_p.tolist() == done.tolist()
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("guarded", [True, False], ids=["with-residual-test", "without"])
def test_a_padding_that_mixes_items_is_caught(monkeypatch, guarded):
    """A padded batch whose rows come back as other items' (the run's rows rotated by one, as an
    off-by-one in the padding would) is caught by the residual test: the items do not pass and
    take eigh, and the factors are still the SVD's. Without the residual test the oracle fails it."""
    real = topm._power_steps

    def shifted(g, x, steps, batch=None):
        out = real(g, x, steps, batch)
        return out.roll(1, 0) if batch is not None and batch > x.shape[0] else out

    monkeypatch.setattr(topm, "_power_steps", shifted)
    if not guarded:
        monkeypatch.setattr(topm, "RESIDUAL_TOL", float("inf"))
    names = ["gaussian", "slow decay (s from 1 to 0.5)", "decaying (s from 1 to 1e-4)"]
    batch = torch.stack([CASES[n] for n in names])
    topm.SUBSPACE_COUNTS.reset()
    us, vt = truncated_svd(batch, 8, eig="subspace", subspace=topm.SubspaceSettings(pad="pow2"))
    if guarded:
        assert topm.SUBSPACE_COUNTS.fallback_items > 0
        for i in range(len(names)):
            assert_top_factors(batch[i], 8, us[i], vt[i])
    else:
        with pytest.raises(AssertionError):
            for i in range(len(names)):
                assert_top_factors(batch[i], 8, us[i], vt[i])


@pytest.mark.parametrize("preset", PRESETS)
def test_the_oracle_fails_every_preset_without_its_residual_test(monkeypatch, preset):
    """Each preset's answers are right because of its residual test: accepted at its first check
    without it, a slowly decaying spectrum's factors fail the oracle."""
    monkeypatch.setattr(topm, "RESIDUAL_TOL", float("inf"))
    settings = dataclasses.replace(topm.CUDA_PRESETS[preset], first_check=4)
    delta = CASES["slower decay (s from 1 to 0.8)"]
    us, vt = truncated_svd(delta, 8, eig="subspace", subspace=settings)
    with pytest.raises(AssertionError):
        assert_top_factors(delta, 8, us, vt)


def test_squared_iterations_take_half_the_iterations_and_the_checks_stay_on_g():
    """``power=2`` multiplies by G² (one iteration does two steps' work) and its answers are G's:
    the same converged items, the same eigenvectors, in about half the iterations. A spectrum
    wider than G² resolves (the outlier row's) is left to eigh: the factors are still the SVD's."""
    grams = _mixed_batch()[:4]  # (not the outlier row: its top-8 spectrum spans λ_8/λ_1 ≈ 1e-8, below what G² resolves)
    counts = []
    for power in (1, 2):
        topm.SUBSPACE_COUNTS.reset()
        vecs, done = subspace_top_eigenvectors(grams, 8, max_steps=80, settings=topm.SubspaceSettings(power=power))
        counts.append((topm.SUBSPACE_COUNTS.iterations, done.tolist(), vecs))
    (it1, done1, v1), (it2, done2, v2) = counts
    assert done1 == done2 and all(done1)
    assert it2 <= 0.6 * it1, (it1, it2)
    # the same directions (signs free): |v1ᵀ v2| is the identity on each item
    overlap = (v1.mT @ v2).abs()
    torch.testing.assert_close(overlap, torch.eye(8, dtype=torch.float64).expand_as(overlap), rtol=0, atol=1e-6)
    outlier = CASES["outlier row (1e4)"]
    topm.SUBSPACE_COUNTS.reset()
    us, vt = truncated_svd(outlier, 8, eig="subspace", subspace=topm.SubspaceSettings(power=2, max_steps=80))
    assert topm.SUBSPACE_COUNTS.fallback_items == 1
    assert_top_factors(outlier, 8, us, vt)


@pytest.mark.parametrize("ritz", ["host-pool", "host-serial", "host-1", "numpy", "numpy-pool"])
def test_every_host_eigensolver_choice_gives_the_same_eigenpairs(ritz):
    """The Rayleigh–Ritz eigenproblems on the host, by each choice, equal one LAPACK call (to
    rounding), and ``host-1`` gives torch its thread count back."""
    h = _mixed_batch()[:, :40, :40].contiguous()
    want = torch.linalg.eigh(h)
    before = torch.get_num_threads()
    vals, vecs = topm._host_eigh(h, ritz)
    assert torch.get_num_threads() == before
    scale = want[0].abs().amax(-1, keepdim=True)
    assert ((vals - want[0]).abs() <= 1e-12 * scale).all()
    rebuilt = vecs @ torch.diag_embed(vals) @ vecs.mT
    assert ((rebuilt - h).abs() <= 1e-12 * scale.unsqueeze(-1)).all()


def test_a_zero_gram_takes_eighs_answer_without_the_solver(monkeypatch):
    """An all-zero Gram (every patch's first-layer V Δ) is answered as ``eigh`` answers it, the
    identity's last columns, without calling it; the items that do not converge still call it."""
    zero = torch.zeros(1, 96, 96, dtype=torch.float64)
    want = topm._eigh_top(zero, 8, None)
    calls = []
    real = topm._eigh_top
    monkeypatch.setattr(topm, "_eigh_top", lambda g, m, dev: calls.append(len(g)) or real(g, m, dev))
    grams = torch.cat([zero, _gram(CASES["slow decay (s from 1 to 0.5)"])[None], zero])
    monkeypatch.setattr(topm, "MAX_STEPS", 1)
    vecs = topm.top_eigenvectors(grams, 8, "subspace")
    assert calls == [1]  # the slow item only
    assert torch.equal(vecs[0], want[0]) and torch.equal(vecs[2], want[0])


def test_cuda_settings_come_from_the_preset_or_the_environment(monkeypatch):
    """The host runs the module constants; CUDA the default preset, or what
    ``$CONTEXTDEQUE_TOPM_CUDA`` says (a preset's name, or JSON fields over it); a bad value is a
    PatchError, and so are settings out of range."""
    monkeypatch.delenv(topm.CUDA_SETTINGS_ENV, raising=False)
    monkeypatch.setattr(topm, "FIRST_CHECK", 5)
    host = topm.solver_settings("cpu")
    assert (host.oversample, host.first_check, host.max_steps, host.ritz, host.pad, host.power) == (
        topm.OVERSAMPLE, 5, topm.MAX_STEPS, "host-pool", "none", 1)
    assert topm.solver_settings("cuda") == topm.CUDA_PRESETS[topm.CUDA_PRESET]
    other = next(p for p in PRESETS if p != topm.CUDA_PRESET)
    monkeypatch.setenv(topm.CUDA_SETTINGS_ENV, other)
    assert topm.solver_settings("cuda") == topm.CUDA_PRESETS[other]
    monkeypatch.setenv(topm.CUDA_SETTINGS_ENV, '{"preset": "squared", "ritz": "numpy", "first_check": 12}')
    got = topm.solver_settings("cuda")
    assert (got.power, got.ritz, got.first_check) == (2, "numpy", 12)
    for bad in ("nonsense", '{"ritz": "gpu"}', '{"power": 3}', '{"unknown": 1}', '[1, 2]', '{"preset": "none"}'):
        monkeypatch.setenv(topm.CUDA_SETTINGS_ENV, bad)
        with pytest.raises(PatchError):
            topm.solver_settings("cuda")
    assert topm.solver_settings("cpu") == host  # the host never reads it


def test_the_solver_counts_what_it_did():
    topm.SUBSPACE_COUNTS.reset()
    grams = _mixed_batch()
    topm.top_eigenvectors(torch.cat([grams, torch.zeros(1, 96, 96, dtype=torch.float64)]), 8, "subspace")
    c = topm.SUBSPACE_COUNTS.as_dict()
    assert c["solves"] == 1 and c["items"] == 6 and c["checks"] >= 2 and c["iterations"] >= topm.FIRST_CHECK
    assert c["graph_captures"] == 0  # the host runs no graphs


def test_k_and_v_in_one_call_give_the_two_calls_factors(default_deltas, monkeypatch):
    """``kv_one_call`` (a CUDA preset's choice, here on the host): form_patch factors K and V in
    one batch, one call, and the patch is the two calls' (to rounding), the same layers and ranks."""
    backend, a, b, _, _ = default_deltas
    calls = []
    real = patch_base.truncated_svd
    monkeypatch.setattr(patch_base, "truncated_svd", lambda d, r: calls.append(d.shape[0]) or real(d, r))
    two = form_patch(backend, b, [a], rank=32)
    assert calls == [backend.layout.num_layers] * 2
    calls.clear()
    host = topm.solver_settings("cpu")
    monkeypatch.setattr(topm, "solver_settings", lambda device: dataclasses.replace(host, kv_one_call=True))
    one = form_patch(backend, b, [a], rank=32)
    assert calls == [2 * backend.layout.num_layers]
    assert (one.rank_k, one.rank_v, one.layers) == (two.rank_k, two.rank_v, two.layers)
    for x, y in zip((one.k_u, one.k_w, one.v_u, one.v_w), (two.k_u, two.k_w, two.v_u, two.v_w)):
        assert x.shape == y.shape and x.is_contiguous()
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5 * float(y.abs().max()))
    assert not topm.kv_in_one_call(torch.zeros(2, 5, 4), torch.zeros(2, 5, 3), 2, 2, dataclasses.replace(host, kv_one_call=True))
    assert not topm.kv_in_one_call(torch.zeros(2, 5, 4), torch.zeros(2, 5, 4), 2, 3, dataclasses.replace(host, kv_one_call=True))


def test_short_chunks_pad_their_gram_to_a_few_sizes(monkeypatch):
    """``pad_tokens``: a chunk shorter than F solves a Gram padded with zero tokens to 64, 128, ...
    (at most F), whatever its length, and its factors are still the SVD's (also where Δ has fewer
    directions than the rank: the directions reaching into the padding have eigenvalue 0)."""
    assert [topm._token_bucket(t, 192) for t in (1, 40, 64, 65, 100, 128, 129, 191)] == [64, 64, 64, 128, 128, 128, 192, 192]
    assert topm._token_bucket(40, 48) == 48
    sizes = []
    real = topm.top_eigenvectors
    monkeypatch.setattr(topm, "top_eigenvectors", lambda g, *a, **k: sizes.append(g.shape[-1]) or real(g, *a, **k))
    settings = topm.SubspaceSettings(pad_tokens=True)
    g = torch.Generator().manual_seed(7)
    for T, rank, delta in [(40, 8, torch.randn(40, 96, generator=g)), (40, 8, CASES["short, rank 5"]),
                           (70, 16, torch.randn(70, 192, generator=g)), (50, 4, spectrum_delta(50, 192, torch.ones(3, dtype=torch.float64)))]:
        sizes.clear()
        us, vt = truncated_svd(delta, rank, eig="subspace", subspace=settings)
        assert sizes == [topm._token_bucket(T, delta.shape[1])]
        assert_top_factors(delta, rank, us, vt)
    sizes.clear()
    truncated_svd(CASES["short (T < F)"], 8, eig="eigh", subspace=settings)  # eigh: as it was
    assert sizes == [40]
