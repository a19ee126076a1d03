"""Exact relocation vs transformers' own forward at the shifted positions, for every layout we claim."""

from __future__ import annotations

import pytest
import torch

import contextdeque as cd
from contextdeque.model.testing import TINY_ARCHS, build_tiny_vl_processor
from contextdeque.core.errors import (
    ArgumentError,
    EmptyChunkError,
    FingerprintMismatchError,
    PositionError,
    StorageDtypeError,
    UnsupportedLayoutError,
)
from contextdeque.kernels import RopeSpec, fused_apply
from contextdeque.core.operator import placement_positions, relocate
from contextdeque.core.rotation import MAX_POSITION, rope_tables
from contextdeque.eval.verify import bf16_ulp, verify_backend
from contextdeque.model.detect import FP32_FLOOR

REGIME_LIMITED = {"llama-dynamic", "llama-longrope", "phi3-longrope", "gptj"}


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_relocation_matches_shifted_forward(arch, tiny_backend_factory):
    backend = tiny_backend_factory(arch)
    report = verify_backend(backend, offsets=[1, 37, 4099], n_tokens=24)
    assert report.details, "nothing was compared"
    for d in report.details:
        assert d.key_rel_err <= max(2 * d.noise_floor, FP32_FLOOR), d
        assert d.bf16_ulp <= 1.0, d
    assert report.ok
    if arch in REGIME_LIMITED:
        assert report.refused, "offsets past the exact regime must be refused, not silently relocated"
    if TINY_ARCHS[arch].multimodal:
        assert {d.chunk for d in report.details} == {"text", "image-span"}


def test_relocated_kv_is_the_per_layer_list_and_prints_as_one_line(tiny_backend_factory):
    be = tiny_backend_factory("llama")
    a, b = be.encode(token_ids=list(range(5, 25))), be.encode(token_ids=list(range(30, 48)))
    kv = cd.relocate(b, 100)
    assert isinstance(kv, list) and len(kv) == b.num_layers and isinstance(kv[0], tuple)
    assert kv == [(k, v) for k, v in kv] and kv.nbytes == sum(k.nbytes + v.nbytes for k, v in kv)
    k, v = kv[0]
    text = repr(kv)
    assert "\n" not in text and "tensor(" not in text and str(kv) == text
    for needle in (f"{b.num_layers} layers", f"k {list(k.shape)}", f"v {list(v.shape)}", "float32", "start 100", "KiB"):
        assert needle in text, (needle, text)
    patched = cd.apply(b, be.root_len + a.span, cd.form_patch(be, b, antecedents=[a], rank=4))
    assert "1 patch," in repr(patched) and all(torch.equal(x[0], y[0]) for x, y in zip(kv, cd.relocate(b, 100)))


def test_relocate_reads_any_layers_alone(tiny_backend_factory):
    """``relocate(..., layers=[...])`` returns those layers, in that order, equal to the full
    result's (pure relocation and patched); an index outside the model is a typed error."""
    be = tiny_backend_factory("llama")
    a, b = be.encode(token_ids=list(range(5, 25))), be.encode(token_ids=list(range(30, 48)))
    patch = cd.form_patch(be, b, antecedents=[a], rank=4)
    last = b.num_layers - 1
    for p in (None, patch):
        whole = relocate(b, 100, patch=p)
        some = relocate(b, 100, patch=p, layers=[last, 0])
        assert len(some) == 2 and some.n_patches == whole.n_patches
        for got, want in zip(some, (whole[last], whole[0])):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ArgumentError, match="layers"):
        relocate(b, 100, layers=[b.num_layers])


def test_layout_detection_facts(tiny_backend_factory):
    lay = tiny_backend_factory("gemma3_text").layout
    assert len(lay.inv_freqs) == 2 and any(w is not None for w in lay.sliding_windows)
    lay = tiny_backend_factory("deepseek_v3").layout
    assert lay.family == "mla" and lay.rope_tensor == "v"
    lay = tiny_backend_factory("deepseek_v2").layout
    assert lay.family == "mla" and lay.interleaved
    lay = tiny_backend_factory("stablelm").layout
    assert lay.rope_dim < lay.k_dim
    assert tiny_backend_factory("glm").layout.interleaved
    lay = tiny_backend_factory("qwen3_vl").layout
    assert lay.n_pos_axes == 3 and lay.freq_axis is not None
    # Qwen3-VL interleaves sections, Qwen2-VL chunks them
    assert list(lay.freq_axis[:3]) == [0, 1, 2]
    chunked = tiny_backend_factory("qwen2_vl").layout.freq_axis
    assert list(chunked) == sorted(chunked)
    assert tiny_backend_factory("llama-yarn").layout.attention_scaling != 1.0


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@torch.no_grad()
def test_real_vision_tower_image_chunk(arch, tiny_backend_factory):
    """An image through the model's own processor, vision tower and get_rope_index, relocated, equals
    the VL model's own forward with pixels at the shifted positions."""
    from skimage import data

    from contextdeque.model.vision import encode_image

    backend = tiny_backend_factory(arch)
    model = backend.model
    proc = build_tiny_vl_processor(arch)
    img = data.chelsea()
    chunk = encode_image(backend, img, proc)
    assert chunk.modality == "image" and chunk.embeds is not None
    grid = proc(images=[img], return_tensors="pt")
    n = chunk.n_tokens
    ids = torch.tensor([list(backend.root_ids) + [model.config.image_token_id] * n])
    mm = torch.zeros_like(ids, dtype=torch.int)
    mm[0, backend.root_len :] = 1
    pos, _ = model.model.get_rope_index(ids, mm, image_grid_thw=grid["image_grid_thw"])
    pos = pos[-3:]
    # the span is the model's own: the next text position after the image, not the token count
    assert chunk.span == int(pos[0, 0, -1]) - backend.root_len + 1 or chunk.span < n
    outs = {}
    for delta in (0, 4099):
        from transformers import DynamicCache

        out = model(
            input_ids=ids, pixel_values=grid["pixel_values"], image_grid_thw=grid["image_grid_thw"],
            mm_token_type_ids=mm, position_ids=pos + delta, past_key_values=DynamicCache(),
            attention_mask=torch.ones_like(ids), use_cache=True,
        )
        outs[delta] = [(l.keys[0, :, backend.root_len :], l.values[0, :, backend.root_len :]) for l in out.past_key_values.layers]
    for delta in (0, 4099):
        kv = relocate(chunk, backend.root_len + delta, beyond_trained=True)  # the tiny model's trained range is 512
        for l, (k, v) in enumerate(outs[delta]):
            scale = float(k.abs().max())
            err = float((kv[l][0] - k).abs().max()) / scale
            floor = float((outs[0][l][1] - v).abs().max()) / float(v.abs().max())
            assert err <= max(2 * floor, FP32_FLOOR), (delta, l, err, floor)


def test_section_shift_matches_model_rotary(tiny_backend_factory):
    """Per-M-RoPE-section shifts (re-timing) against the model's own rotary module and rotate_half."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    backend = tiny_backend_factory("qwen2_vl")
    lay = backend.layout
    chunk = backend.encode(token_ids=torch.arange(5, 17))
    pos = placement_positions(chunk, 40, section_shift=(7, 0, 3))
    assert torch.equal(pos, chunk.rel_positions + 40 + torch.tensor([[7], [0], [3]]))
    ours = relocate(chunk, 40, section_shift=(7, 0, 3))
    rotary = backend.model.model.language_model.rotary_emb
    x = torch.zeros(1, 1, 1)
    cos, sin = rotary(x, pos.unsqueeze(1))
    for l in range(lay.num_layers):
        k = chunk.keys[l].unsqueeze(0)  # [1, H, T, d] content frame
        _, k_model = apply_rotary_pos_emb(k, k, cos, sin)
        assert torch.allclose(ours[l][0], k_model[0], rtol=0, atol=2e-6 * float(k.abs().max()))


def test_rotation_reference_against_float64_complex():
    """The operator's rotation (half-split and interleaved, partial) vs an explicit float64 complex rotation."""
    torch.manual_seed(0)

    for interleaved in (False, True):
        spec = RopeSpec("k", 2, 6, interleaved)
        x = torch.randn(2, 5, 8)
        pos = torch.arange(5) * 13 + 3
        cos, sin = rope_tables(torch.tensor([1.0, 0.1, 0.01]), pos)
        got, _ = fused_apply(x, x.clone(), spec, cos, sin)
        seg = x[..., 2:8].double()
        if interleaved:
            z = torch.complex(seg[..., 0::2], seg[..., 1::2])
        else:
            z = torch.complex(seg[..., :3], seg[..., 3:])
        ang = pos.double()[:, None] * torch.tensor([1.0, 0.1, 0.01], dtype=torch.float64)
        r = z * torch.polar(torch.ones_like(ang), ang)
        want = x.double().clone()
        if interleaved:
            want[..., 2:8][..., 0::2], want[..., 2:8][..., 1::2] = r.real, r.imag
        else:
            want[..., 2:5], want[..., 5:8] = r.real, r.imag
        assert torch.allclose(got.double(), want, atol=1e-5)
        assert torch.equal(got[..., :2], x[..., :2])  # pass-through channels untouched
        back, _ = fused_apply(got, got.clone(), spec, cos, -sin)
        assert torch.allclose(back, x, atol=1e-6)


# ----------------------------------------------------------------------------- real model


def test_default_model_verify(default_backend):
    report = verify_backend(default_backend, offsets=[1, 999, 4099], n_tokens=64)
    assert report.layers == 30
    assert report.ok, report
    assert report.max_ulp_bf16 <= 1.0
    for d in report.details:
        assert d.key_rel_err <= max(2 * d.noise_floor, FP32_FLOOR)


def test_default_model_layout(default_backend):
    lay = default_backend.layout
    assert (lay.family, lay.k_heads, lay.k_dim, lay.rope_dim, lay.interleaved) == ("gqa", 3, 64, 64, False)
    assert lay.inv_freqs[0][1] == pytest.approx(100000.0 ** (-2 / 64), rel=1e-6)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_are_typed(tiny_backend_factory):
    b1 = tiny_backend_factory("llama", seed=0)
    b2 = tiny_backend_factory("llama", seed=1)
    assert b1.fingerprint != b2.fingerprint and b1.layout.signature == b2.layout.signature
    chunk = b1.encode(token_ids=torch.arange(4, 20))
    with pytest.raises(FingerprintMismatchError):
        relocate(chunk, 10, fingerprint=b2.fingerprint)
    with pytest.raises(FingerprintMismatchError):
        relocate(chunk, 10, layout=tiny_backend_factory("qwen2").layout)
    with pytest.raises(StorageDtypeError):
        b1.encode(token_ids=torch.arange(4, 20), storage="int8")
    with pytest.raises(StorageDtypeError):
        b1.encode(token_ids=torch.arange(4, 20), storage=torch.float64)
    big = cd.Chunk(**{**chunk.__dict__, "values": chunk.values * 1e6})
    with pytest.raises(StorageDtypeError):
        big.to(torch.float16)
    with pytest.raises(PositionError):
        relocate(chunk, -1)
    with pytest.raises(PositionError):
        relocate(chunk, MAX_POSITION, beyond_trained=True)
    with pytest.raises(PositionError):
        relocate(chunk, 0, positions=torch.arange(3))
    with pytest.raises(EmptyChunkError):
        b1.encode(token_ids=[])
    with pytest.raises(EmptyChunkError):
        b1.encode(text=None)


def test_dynamic_ntk_beyond_switch_point_refused(tiny_backend_factory):
    b = tiny_backend_factory("llama-dynamic")
    limit = b.layout.max_exact_position
    chunk = b.encode(token_ids=torch.arange(4, 12))
    relocate(chunk, limit - chunk.span)  # last exact placement works
    with pytest.raises(PositionError, match="switch point"):
        relocate(chunk, limit - chunk.span + 1)


def test_unsupported_layout_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(UnsupportedLayoutError, match="gpt2") as info:
        cd.load_model(model)
    assert info.value.reason == "learned-positions"


def test_unlisted_rope_kind_is_accepted_by_proof_not_by_list():
    """A RoPE kind no list names (``proportional``) is used because the proof at load shows it exact."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0,
                                                              "factor": 2.0, "partial_rotary_factor": 1.0})
    torch.manual_seed(0)
    backend = cd.load_model(LlamaForCausalLM(cfg).eval(), root_ids=[1])
    assert backend.proof.ok and "proportional" in backend.layout.rope_type
    assert verify_backend(backend, offsets=[3, 1999], n_tokens=12).ok


def test_bf16_ulp_definition():
    assert bf16_ulp(1.0) == 2.0**-7
    assert bf16_ulp(1.99) == 2.0**-7
    assert bf16_ulp(2.0) == 2.0**-6
    assert bf16_ulp(0.75) == 2.0**-8
    # one ULP is exactly the gap to the next bf16 number (bit pattern + 1)
    for x in (0.3, 1.0, 5.5, 1000.0, 3e-5):
        t = torch.tensor([x], dtype=torch.bfloat16)
        nxt = (t.view(torch.int16) + 1).view(torch.bfloat16)
        assert float(nxt) - float(t) == bf16_ulp(float(t))


# ----------------------------------------------------------------------------- the CLI gate


def _cli_json(capsys, *argv):
    import json

    from contextdeque.cli import main

    rc = main(list(argv))
    return rc, json.loads(capsys.readouterr().out)


def test_verify_model_cli_json(capsys):
    rc, out = _cli_json(capsys, "verify-model", "tiny:qwen2_vl", "--json", "--tokens", "24")
    assert rc == 0 and out["ok"] is True
    for key in ("model", "max_rel_err", "noise_floor", "max_ulp_bf16", "layers"):
        assert key in out
    assert out["layers"] == 2 and {d["chunk"] for d in out["details"]} == {"text", "image-span"}


def test_verify_model_gate_fails_on_a_wrong_relocation(capsys, monkeypatch):
    """The gate can fail: a relocation off by one position is caught and exits non-zero."""
    import contextdeque.model.detect as detect

    real = detect.relocate

    def off_by_one(chunk, start, **kw):
        return real(chunk, start + 1, **kw)

    monkeypatch.setattr(detect, "relocate", off_by_one)
    rc, out = _cli_json(capsys, "verify-model", "--arch", "llama", "--random", "--json", "--tokens", "24")
    assert rc == 1 and out["ok"] is False
