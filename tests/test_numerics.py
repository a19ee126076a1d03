"""Issue 10 item 4: numerics never fail silently. Patch factors and pages are checked for finite
values where they are formed and applied; float16 storage keeps factors in a dtype that cannot
overflow; positions past the model's trained context raise PositionError unless opted in."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import micro_llama

from contextdeque.core.chunk import Chunk
from contextdeque.core.errors import NumericsError, PositionError
from contextdeque.core.operator import relocate
from contextdeque.model.hf import HFBackend
from contextdeque.patch import Patch, form_patch
from contextdeque.window import ContextWindow

A = list(range(4, 40))
B = list(range(10, 50))
LONG_A = [4 + (7 * i) % 58 for i in range(120)]
LONG_B = [4 + (5 * i) % 58 for i in range(200)]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(micro_llama(0), None, root_ids=[1, 3], name="tiny-numerics-llama")


@pytest.fixture(scope="module")
def loud_backend() -> HFBackend:
    """K and V around 5e4: inside float16's range (the storage check passes), but the patch
    factors U_m S_m carry Δ's singular values, beyond it."""
    m = micro_llama(0)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.k_proj.weight.mul_(12500.0)
            layer.self_attn.v_proj.weight.mul_(12500.0)
    return HFBackend(m, None, root_ids=[1, 3], name="tiny-loud-llama")


def test_fp16_storage_never_turns_factors_into_inf(loud_backend, one_thread):
    """The issue's reproducer: with storage="fp16" and KV ~3e4, factors overflowed to inf, pages
    became NaN and generate returned token 0 over and over without an error."""
    win = ContextWindow(loud_backend, rank=4, storage="fp16")
    win.append(token_ids=LONG_A)
    ref = win.append(token_ids=LONG_B)
    chunk = win.chunk(ref)
    assert 1e4 < float(chunk.keys.abs().max()) < 65504 and chunk.keys.dtype == torch.float16
    (patch,) = win.patches(ref)
    for t in (patch.k_u, patch.k_w, patch.v_u, patch.v_w):
        assert bool(torch.isfinite(t).all())
    assert float(patch.k_u.abs().max()) > 65504  # would have overflowed float16
    assert patch.k_u.dtype == torch.float32
    for k, v in win.kv(ref):
        assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
    # the fp16 window's pages match an fp32 window's to fp16 rounding (not NaN, not garbage)
    ref32 = ContextWindow(loud_backend, rank=4)
    ref32.append(token_ids=LONG_A)
    r32 = ref32.append(token_ids=LONG_B)
    for (k16, v16), (k32, v32) in zip(win.kv(ref), ref32.kv(r32)):
        assert float((k16 - k32).abs().max()) <= 2e-3 * float(k32.abs().max())
        assert float((v16 - v32).abs().max()) <= 2e-3 * float(v32.abs().max())


def test_non_finite_values_are_refused_where_they_enter(backend):
    """Pages and factors are checked once, where they enter (encoded or formed, loaded from a store
    or a session, cast): a non-finite one raises ``NumericsError`` there, so applying needs no
    re-check."""
    a = backend.encode(token_ids=A)
    b = backend.encode(token_ids=B)
    patch = form_patch(backend, b, antecedents=[a], rank=2)
    bad_u = patch.k_u.clone()
    bad_u[0, 0, 0] = float("nan")
    with pytest.raises(NumericsError, match="patch factors"):
        dataclasses.replace(patch, k_u=bad_u)
    tensors, meta = patch.to_entry()
    with pytest.raises(NumericsError, match="patch factors"):  # a store or session entry
        Patch.from_entry({**tensors, "k_u": bad_u}, meta)
    tensors, meta = b.to_entry()
    bad_v = b.values.clone()
    bad_v[1, 0, 2, 3] = float("inf")
    with pytest.raises(NumericsError, match="pages of chunk"):
        Chunk.from_entry({**tensors, "values": bad_v}, meta)
    assert Patch.from_entry(*patch.to_entry()).id == patch.id  # a finite entry still loads


def test_float16_output_overflow_is_refused_where_applied(backend):
    """Finite pages plus finite factors can still overflow a float16 output (past 65504): that
    sum is checked where it is applied."""
    a = backend.encode(token_ids=A)
    b = backend.encode(token_ids=B)
    patch = form_patch(backend, b, antecedents=[a], rank=2)
    loud = dataclasses.replace(patch, k_u=patch.k_u * 1e6, v_u=patch.v_u * 1e6)
    assert len(relocate(b, 60, patch=loud)) == backend.layout.num_layers  # float32 output: fine
    with pytest.raises(NumericsError, match="non-finite"):
        relocate(b, 60, patch=loud, out_dtype=torch.float16)


def test_non_finite_delta_is_refused_where_formed(backend, monkeypatch):
    import contextdeque.patch.base as base

    a = backend.encode(token_ids=A)
    b = backend.encode(token_ids=B)
    real = base.truncated_svd
    monkeypatch.setattr(base, "truncated_svd", lambda d, r: tuple(t * float("inf") for t in real(d, r)))
    with pytest.raises(NumericsError, match="patch factors"):
        form_patch(backend, b, antecedents=[a], rank=2)


def test_positions_past_the_trained_context(backend, one_thread):
    """The issue's reproducer: ``relocate(start=10**7)`` on a model trained for fewer positions was
    accepted silently."""
    limit = backend.layout.max_trained_position
    assert limit == 512
    chunk = backend.encode(token_ids=A)
    with pytest.raises(PositionError, match="trained context"):
        relocate(chunk, 10**7)
    with pytest.raises(PositionError, match="trained context"):
        relocate(chunk, limit - len(A) + 1)
    relocate(chunk, limit - len(A))  # the last chunk that fits
    assert len(relocate(chunk, 10**6, beyond_trained=True)) == backend.layout.num_layers

    win = ContextWindow(backend, rank=2)
    for i in range(13):  # 2 + 13 * 36 = 470 positions
        win.append(token_ids=[4 + (i + j) % 50 for j in range(36)])
    before = (win.refs, win.generation, win.placement())
    with pytest.raises(PositionError, match="beyond_trained"):
        win.append(token_ids=list(range(4, 50)))
    assert (win.refs, win.generation, win.placement()) == before
    with pytest.raises(PositionError):
        win.generate([5, 6], max_new_tokens=60, chat=False)
    far = ContextWindow(backend, rank=2, beyond_trained=True)
    for i in range(15):
        far.append(token_ids=[4 + (i + j) % 50 for j in range(36)])
    assert far.next_position() > limit
    far.materialize()
