"""Tiny random-weight transformers models, one per attention/RoPE layout contextdeque handles.

``build_tiny_model(arch)`` gives a 2–3 layer fp32 model in eval mode (hidden 128, 4 query / 2 KV
heads, head_dim 32, vocab 256, max_position_embeddings 512); ``TINY_ARCHS`` lists the archs with
the facts below in structured form. ``build_tiny_vl_processor(arch)`` gives the real Qwen-VL image
processor sized for a small grid (there is no checkpoint here).

Facts verified with transformers 5.18.0 by running these models (tests/test_models.py: cached keys
equal a hand-written RoPE of the pre-RoPE keys captured by forward hooks, bit for bit, and do NOT
equal the other pairing), not only by reading the code.

Common to every arch: keys are cached AFTER RoPE (and after q/k-norm where there is one) through
the standard ``Cache.update``; values are never rotated (except MLA, below). ``cache.layers[i].keys``
/ ``.values`` are ``[batch, H_kv, T, d]``. Angles are ``fp32(inv_freq[f] * pos[t])`` (a K=1
matmul, identical to an elementwise product), then ``cos/sin * attention_scaling``. 5.x configs
keep RoPE settings in ``config.rope_parameters`` (a flat dict ``{"rope_type", "rope_theta", ...}``
unless noted); the rotary module keeps ``inv_freq`` and ``original_inv_freq`` buffers and a float
``attention_scaling``.

=============  ===========  ===============================  =================================  ======================================
arch           pairing      inv_freq                         rotated channels                   cache / config / quirks
=============  ===========  ===============================  =================================  ======================================
llama          half-split   model.model.rotary_emb           all head_dim                       K,V [B,Hkv,T,d]
qwen2          half-split   model.model.rotary_emb           all head_dim                       q/k/v bias
qwen2_vl       half-split   model.model.language_model       all head_dim; M-RoPE chunked:      rope_parameters on config.text_config:
               (M-RoPE)     .rotary_emb                      freqs [0,t) axis T, [t,t+h) H,     {"rope_type","rope_theta","mrope_section"}
                                                             rest W                             ([16,24,24] real, [4,6,6] tiny)
qwen2_5_vl     as qwen2_vl  as qwen2_vl                      as qwen2_vl                        get_rope_index adds second_per_grid_ts
qwen3_vl       half-split   model.model.language_model       M-RoPE interleaved: freq f is H    q_norm/k_norm (RMSNorm per head) before
               (M-RoPE)     .rotary_emb                      if f%3==1, f<3h; W if f%3==2,      RoPE; "mrope_interleaved" key is
                                                             f<3w; else T ([24,20,20] real)     ignored: always interleaved
gemma3_text    half-split   model.model.rotary_emb           all head_dim                       per layer type, see notes
                            .{sliding,full}_attention_
                            inv_freq (+ _attention_scaling)
deepseek_v3    half-split   model.model.rotary_emb           k_pe only (qk_rope_head_dim),      MLA: .keys = kv_a_layernorm(latent)
               in cache     (dim qk_rope_head_dim)           cached in .values                  [B,1,T,kv_lora_rank], un-rotated;
                                                                                                .values = rotated k_pe [B,1,T,r_dim]
deepseek_v2    interleaved  model.model.rotary_emb           k_pe only, in .values              complex multiply on (2i,2i+1);
                                                                                                <=1 ulp from the real formula
phi            half-split   model.model.rotary_emb           first int(d*partial_rotary_factor) rope_parameters["partial_rotary_factor"]
                            (rotary_dim/2 entries)           (0.4 phi-2, 0.5 tiny)              (0.5 tiny); rest cached as projected
stablelm       half-split   model.model.rotary_emb           first d*0.25                       qk_layernorm: per-head LayerNorm
                                                                                                before RoPE
glm            interleaved  model.model.rotary_emb           first d*0.5 (partial default 0.5)  cos/sin = repeat_interleave(half)
cohere         interleaved  model.model.rotary_emb           all head_dim                       use_qk_norm LayerNorm [B,T,H,d] before
                                                                                                RoPE; rotation done in fp32
gptj           interleaved  NONE: per-layer buffer           first rotary_dim (16 of 32)        theta=10000 hard-coded; no GQA; eager
                            attn.embed_positions                                                only; positions >= n_positions fail
                            [n_positions, rotary_dim] =
                            cat(sin, cos)
llama-linear   half-split   model.model.rotary_emb           all                                inv_freq / factor; scaling 1
llama-llama3   half-split   model.model.rotary_emb           all                                band-wise inv_freq; scaling 1
llama-yarn     half-split   model.model.rotary_emb           all                                attention_scaling = 0.1 ln(factor) + 1
                                                                                                (1.1386) folded into cached keys
llama-dynamic  half-split   model.model.rotary_emb           all                                inv_freq changes with sequence length
llama-longrope half-split   model.model.rotary_emb           all                                short/long factors; scaling
                                                                                                sqrt(1 + ln f / ln L0) (1.1339)
phi3-longrope  half-split   model.model.rotary_emb           all                                fused qkv_proj; as llama-longrope
=============  ===========  ===============================  =================================  ======================================

Notes (5.18.0):

- Half-split pairs channel i with i + dim/2 (``rotate_half``); interleaved pairs 2i with 2i+1.
  Partial rotary rotates channels ``[0, rotary_dim)`` in the model's own pairing; ``inv_freq`` then
  has ``rotary_dim/2`` entries, so ``rotary_dim = 2 * inv_freq.numel()``.
- YaRN and LongRoPE multiply cos/sin by ``attention_scaling`` != 1, so cached keys (and queries)
  carry that factor; a shift rotation built from ``inv_freq`` alone preserves it exactly. Llama3,
  linear and dynamic have ``attention_scaling == 1``.
- Dynamic NTK: before each forward, ``seq_len = max(position_ids) + 1``; if it exceeds
  ``max_seq_len_cached`` (initially ``max_position_embeddings``) ``inv_freq`` is recomputed for that
  seq_len (so it changes at every decode step past the limit); a later forward with seq_len <
  ``max_position_embeddings`` restores ``original_inv_freq``. Keys cached earlier are not re-rotated.
  A single prefill past the limit rotates all its tokens, even position 0, with the grown inv_freq.
- LongRoPE: ``short_factor`` while ``max(position_ids) + 1 <= original_max_position_embeddings``,
  ``long_factor`` beyond, decided per forward and written into the ``inv_freq`` buffer (model state
  depends on the last forward). A long prefill rotates its early tokens with the long factors; a
  token-by-token decode does not. ``attention_scaling`` is the same in both regimes.
- Gemma3: ``rope_parameters = {"sliding_attention": {"rope_type", "rope_theta": 1e4},
  "full_attention": {"rope_type", "rope_theta": 1e6}}`` (``rope_scaling`` goes to full layers only);
  ``config.layer_types`` names each layer's kind; the rotary module is called with ``layer_type``.
  ``DynamicCache(config=...)`` (also what a forward without a cache builds) makes
  ``DynamicSlidingWindowLayer`` for sliding layers, which keep only the last ``sliding_window - 1``
  tokens while ``get_seq_length()`` stays cumulative; ``DynamicCache()`` keeps every token in every
  layer and gives the same logits (the sliding mask is applied either way).
- MLA: the latent (``.keys``) is position-free; only ``.values`` (k_pe) rotates. DeepSeek-V3's
  ``rope_interleave=True`` rotates raw (2i, 2i+1) pairs but writes them de-interleaved
  (``[evens', odds']``), so the cache is half-split over k_pe. YaRN in MLA: ``attention_factor`` =
  mscale(f, mscale)/mscale(f, mscale_all_dim) (1.0 for the real V3 config) on cos/sin, and the
  softmax scale ``attn.scaling`` is multiplied by mscale(f, mscale_all_dim)^2. A tiny V3 needs
  ``n_group=1, topk_group=1`` and a few routed experts or the grouped router fails.
- Qwen-VL M-RoPE: ``position_ids`` are ``[3, B, T]`` (a ``[B, T]`` tensor is broadcast to the three
  axes; ``[4, B, T]`` means text positions + 3 axes). Text tokens use the same value on all axes,
  which is exactly 1-D RoPE. ``get_rope_index`` lives on the inner model (``model.model``):
  ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
  attention_mask=None, **kw) -> (position_ids [3,B,T], mrope_position_deltas [B,1])`` (Qwen2.5-VL:
  ``second_per_grid_ts`` before ``attention_mask``). An image of merged grid gh x gw starting at
  position s gets t = s, h = s + row, w = s + col, and the next text token s + max(gh, gw) (the
  temporal extent is ignored). The model keeps ``model.model.rope_deltas`` from the last
  multimodal prefill and uses it for later cached steps without explicit ``position_ids``.
  A forward with pixels needs ``mm_token_type_ids`` (1 at image tokens). Shifting a chunk by d on
  all axes equals a 1-D rotation by d (to fp32 rounding, ~5e-6 here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from transformers import PreTrainedConfig, PreTrainedModel

__all__ = [
    "TINY_ARCHS",
    "TinyArch",
    "build_tiny_model",
    "build_tiny_vl_processor",
    "tiny_config",
    "VL_IMAGE_TOKEN_ID",
    "VL_VIDEO_TOKEN_ID",
    "VL_VISION_START_TOKEN_ID",
    "VL_VISION_END_TOKEN_ID",
]

# Small but not degenerate: 4 query heads / 2 KV heads (GQA), head_dim 32 so M-RoPE sections
# and partial-rotary slices have several frequencies each.
_HIDDEN = 128
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 32
_INTERMEDIATE = 256
_LAYERS = 2
_VOCAB = 256
# Long enough for tests that place chunks far out, short enough that scaled RoPE regimes
# (dynamic NTK, LongRoPE) switch within a few hundred tokens.
_MAX_POS = 512
_ORIG_MAX_POS = 128
# Larger than transformers' 0.02 so random attention is far from uniform: conditioning
# deltas (KV(B|A) - KV(B|root)) are then clearly non-zero in tests.
_INIT_RANGE = 0.08

# Special token ids of the tiny VL models (inside the tiny vocabulary).
VL_IMAGE_TOKEN_ID = 250
VL_VIDEO_TOKEN_ID = 251
VL_VISION_START_TOKEN_ID = 252
VL_VISION_END_TOKEN_ID = 253


@dataclass(frozen=True)
class TinyArch:
    """One tiny architecture and the RoPE/cache facts verified for it under transformers 5.18.

    Attributes:
        name: registry key (``contextdeque verify-model tiny:NAME``).
        model_type: transformers ``config.model_type`` of the built model.
        family: ``"gqa"`` (cache holds per-head K/V), ``"mrope"`` (GQA with 3-axis positions),
            or ``"mla"`` (cache ``.keys`` = latent ``[B, 1, T, kv_lora_rank]``, ``.values`` = rotated
            k_pe ``[B, 1, T, qk_rope_head_dim]``).
        rope_tensor: which cached tensor carries the rotated channels (``"k"`` or ``"v"``; MLA: ``"v"``).
        interleaved: True when rotation pairs are (2i, 2i+1); False for half-split (i, i + dim/2),
            in the layout the *cache* holds.
        partial_rotary: True when only the first ``rope_dim`` channels rotate.
        inv_freq_attr: dotted path from the model to the module holding ``inv_freq`` (GPT-J has
            none: its sin/cos table lives per attention layer as ``embed_positions``).
        description: one line for listings.
        build: ``overrides -> config`` (use :func:`build_tiny_model` to get a model).
        multimodal: a VL model (``…ForConditionalGeneration`` with a vision tower).
    """

    name: str
    model_type: str
    family: Literal["gqa", "mrope", "mla"]
    rope_tensor: Literal["k", "v"]
    interleaved: bool
    partial_rotary: bool
    inv_freq_attr: str | None
    description: str
    build: Callable[[dict[str, Any]], PreTrainedConfig] = field(repr=False)
    multimodal: bool = False


_TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _rope(theta: float = 10_000.0, **extra: Any) -> dict[str, Any]:
    """Plain (unscaled) ``rope_parameters`` with base ``theta`` and any extra keys."""
    return {"rope_type": "default", "rope_theta": theta, **extra}


def _common(**kw: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE, num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, head_dim=_HEAD_DIM,
        max_position_embeddings=_MAX_POS, initializer_range=_INIT_RANGE, tie_word_embeddings=False, **_TOKEN_IDS,
    )
    base.update(kw)
    return base


def _config(name: str, over: dict[str, Any], *, derive_head_dim: bool = False, **kw: Any) -> PreTrainedConfig:
    """``transformers.<name>`` from the common tiny sizes with ``kw`` and then ``over`` on top;
    ``derive_head_dim``: the config derives head_dim itself (hidden / heads, = 32 here)."""
    import transformers

    args = _common(**kw)
    if derive_head_dim:
        args.pop("head_dim")
    args.update(over)
    return getattr(transformers, name)(**args)


def _llama(rope: dict[str, Any] | None = None) -> Callable[[dict[str, Any]], PreTrainedConfig]:
    params = _rope() if rope is None else {"rope_theta": 10_000.0, **rope}
    return lambda over: _config("LlamaConfig", over, rope_parameters=params)


def _qwen2(over: dict[str, Any]) -> PreTrainedConfig:
    return _config("Qwen2Config", over, derive_head_dim=True, rope_parameters=_rope(1_000_000.0))


def _gemma3_text(over: dict[str, Any]) -> PreTrainedConfig:
    return _config(
        "Gemma3TextConfig", over,
        num_hidden_layers=3,
        # Real pattern is 5 sliding : 1 full; 2 : 1 keeps both kinds with 3 layers.
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=16,
        query_pre_attn_scalar=_HEAD_DIM,
        rope_parameters={"sliding_attention": _rope(), "full_attention": _rope(1_000_000.0)},
        tie_word_embeddings=True,
    )


# What the tiny DeepSeek-V2 / V3 (MLA + MoE) configs share: 4 KV heads (one per query head), a
# 4-expert MoE after a dense layer 0 (first_k_dense_replace), latent rank 32, rope / nope dims 16 / 32.
# The DeepSeek configs set head_dim = qk_rope_head_dim themselves.
_MLA = dict(
    num_key_value_heads=_HEADS, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=4,
    num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
    v_head_dim=32, rope_parameters=_rope(),
)


def _deepseek_v3(over: dict[str, Any]) -> PreTrainedConfig:
    # The grouped router needs n_group | n_routed_experts and topk_group <= n_group.
    return _config("DeepseekV3Config", over, derive_head_dim=True, **_MLA, n_group=1, topk_group=1, q_lora_rank=48,
                   rope_interleave=True)


def _deepseek_v2(over: dict[str, Any]) -> PreTrainedConfig:
    # V2-Lite has no query compression
    return _config("DeepseekV2Config", over, derive_head_dim=True, **_MLA, topk_method="greedy", q_lora_rank=None)


def _phi(over: dict[str, Any]) -> PreTrainedConfig:
    return _config("PhiConfig", over, derive_head_dim=True, rope_parameters=_rope(partial_rotary_factor=0.5))


def _stablelm(over: dict[str, Any]) -> PreTrainedConfig:
    # qk_layernorm: per-head LayerNorm on keys before RoPE (StableLM-2 style)
    return _config("StableLmConfig", over, derive_head_dim=True, rope_parameters=_rope(partial_rotary_factor=0.25),
                   qk_layernorm=True)


def _glm(over: dict[str, Any]) -> PreTrainedConfig:
    return _config("GlmConfig", over, rope_parameters=_rope(partial_rotary_factor=0.5))


def _cohere(over: dict[str, Any]) -> PreTrainedConfig:
    # use_qk_norm: Command-R+ style per-head LayerNorm on keys before RoPE
    return _config("CohereConfig", over, derive_head_dim=True, rope_parameters=_rope(), use_qk_norm=True)


def _gptj(over: dict[str, Any]) -> PreTrainedConfig:
    from transformers import GPTJConfig

    kw = dict(
        vocab_size=_VOCAB, n_embd=_HIDDEN, n_layer=_LAYERS, n_head=_HEADS, n_inner=_INTERMEDIATE,
        rotary_dim=16,  # GPT-J-6B rotates 64 of 256 channels; here 16 of 32
        n_positions=_MAX_POS, initializer_range=_INIT_RANGE, **_TOKEN_IDS,
    )
    kw.update(over)
    return GPTJConfig(**kw)


def _phi3_longrope(over: dict[str, Any]) -> PreTrainedConfig:
    half = _HEAD_DIM // 2
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": _ORIG_MAX_POS,
        "factor": _MAX_POS / _ORIG_MAX_POS,
    }
    return _config("Phi3Config", over, derive_head_dim=True, rope_parameters=longrope,
                   original_max_position_embeddings=_ORIG_MAX_POS)


def _vl_text(**over: Any) -> dict[str, Any]:
    kw = _common()
    kw.pop("tie_word_embeddings")  # a top-level field of the VL config
    kw.update(over)
    return kw


def _vl_tokens() -> dict[str, Any]:
    return dict(
        image_token_id=VL_IMAGE_TOKEN_ID,
        video_token_id=VL_VIDEO_TOKEN_ID,
        vision_start_token_id=VL_VISION_START_TOKEN_ID,
        vision_end_token_id=VL_VISION_END_TOKEN_ID,
        tie_word_embeddings=False,
    )


def _vl_config(config_cls: type, text: dict[str, Any], vision: dict[str, Any], over: dict[str, Any]) -> PreTrainedConfig:
    """A VL config from its text and vision settings, each updated by ``over``'s own
    (``text_config`` / ``vision_config``), the VL special tokens and the rest of ``over``."""
    text.update(over.pop("text_config", {}))
    vision.update(over.pop("vision_config", {}))
    return config_cls(text_config=text, vision_config=vision, **{**_vl_tokens(), **over})


def _qwen2_vl_text() -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL text settings: M-RoPE sections (4, 6, 6), head_dim from the sizes."""
    text = _vl_text(
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
    )
    text.pop("head_dim")
    return text


def _qwen2_vl(over: dict[str, Any]) -> PreTrainedConfig:
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=2, embed_dim=32, hidden_size=_HIDDEN, num_heads=2, mlp_ratio=2,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=_INIT_RANGE,
    )
    return _vl_config(Qwen2VLConfig, _qwen2_vl_text(), vision, over)


def _qwen2_5_vl(over: dict[str, Any]) -> PreTrainedConfig:
    from transformers import Qwen2_5_VLConfig

    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_HIDDEN,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        window_size=56, fullatt_block_indexes=[1], initializer_range=_INIT_RANGE,
    )
    return _vl_config(Qwen2_5_VLConfig, _qwen2_vl_text(), vision, over)


def _qwen3_vl(over: dict[str, Any]) -> PreTrainedConfig:
    from transformers import Qwen3VLConfig

    text = _vl_text(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_HIDDEN,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        num_position_embeddings=64, deepstack_visual_indexes=[0], initializer_range=_INIT_RANGE,
    )
    return _vl_config(Qwen3VLConfig, text, vision, over)


TINY_ARCHS: dict[str, TinyArch] = {
    a.name: a
    for a in [
        TinyArch("llama", "llama", "gqa", "k", False, False, "model.rotary_emb",
                 "Llama: GQA, half-split RoPE", _llama()),
        TinyArch("qwen2", "qwen2", "gqa", "k", False, False, "model.rotary_emb",
                 "Qwen2: GQA with qkv bias, half-split RoPE", _qwen2),
        TinyArch("qwen2_vl", "qwen2_vl", "mrope", "k", False, False, "model.language_model.rotary_emb",
                 "Qwen2-VL: M-RoPE (chunked sections), vision tower", _qwen2_vl, multimodal=True),
        TinyArch("qwen2_5_vl", "qwen2_5_vl", "mrope", "k", False, False, "model.language_model.rotary_emb",
                 "Qwen2.5-VL: M-RoPE (chunked sections), windowed vision tower", _qwen2_5_vl, multimodal=True),
        TinyArch("qwen3_vl", "qwen3_vl", "mrope", "k", False, False, "model.language_model.rotary_emb",
                 "Qwen3-VL: interleaved M-RoPE sections, q/k RMSNorm, deepstack", _qwen3_vl, multimodal=True),
        TinyArch("gemma3_text", "gemma3_text", "gqa", "k", False, False, "model.rotary_emb",
                 "Gemma3: sliding/full layers, per-layer-type RoPE bases, q/k RMSNorm", _gemma3_text),
        TinyArch("deepseek_v3", "deepseek_v3", "mla", "v", False, False, "model.rotary_emb",
                 "DeepSeek-V3: MLA, rope_interleave (cache holds de-interleaved half-split k_pe)", _deepseek_v3),
        TinyArch("deepseek_v2", "deepseek_v2", "mla", "v", True, False, "model.rotary_emb",
                 "DeepSeek-V2: MLA, complex (interleaved-pair) RoPE on k_pe", _deepseek_v2),
        TinyArch("phi", "phi", "gqa", "k", False, True, "model.rotary_emb",
                 "Phi-2: partial rotary (half-split over the first half of head_dim)", _phi),
        TinyArch("stablelm", "stablelm", "gqa", "k", False, True, "model.rotary_emb",
                 "StableLM-2: partial rotary 0.25, per-head key LayerNorm", _stablelm),
        TinyArch("glm", "glm", "gqa", "k", True, True, "model.rotary_emb",
                 "GLM-4 (glm): interleaved pairs over the first half of head_dim", _glm),
        TinyArch("cohere", "cohere", "gqa", "k", True, False, "model.rotary_emb",
                 "Cohere: interleaved pairs over all of head_dim, key LayerNorm", _cohere),
        TinyArch("gptj", "gptj", "gqa", "k", True, True, None,
                 "GPT-J: interleaved pairs over rotary_dim, sin/cos table per layer", _gptj),
        TinyArch("llama-linear", "llama", "gqa", "k", False, False, "model.rotary_emb",
                 "Llama + linear position interpolation (factor 4)",
                 _llama({"rope_type": "linear", "factor": 4.0})),
        TinyArch("llama-llama3", "llama", "gqa", "k", False, False, "model.rotary_emb",
                 "Llama + llama3 frequency-band scaling",
                 _llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": _ORIG_MAX_POS})),
        TinyArch("llama-yarn", "llama", "gqa", "k", False, False, "model.rotary_emb",
                 "Llama + YaRN (attention_scaling != 1)",
                 _llama({"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": _ORIG_MAX_POS})),
        TinyArch("llama-dynamic", "llama", "gqa", "k", False, False, "model.rotary_emb",
                 "Llama + dynamic NTK (inv_freq changes past max_position_embeddings)",
                 _llama({"rope_type": "dynamic", "factor": 2.0})),
        TinyArch("llama-longrope", "llama", "gqa", "k", False, False, "model.rotary_emb",
                 "Llama + LongRoPE (short/long factors switch past original_max_position_embeddings)",
                 _llama({"rope_type": "longrope", "factor": _MAX_POS / _ORIG_MAX_POS,
                          "short_factor": [1.0 + 0.05 * i for i in range(_HEAD_DIM // 2)],
                          "long_factor": [1.0 + 0.5 * i for i in range(_HEAD_DIM // 2)],
                          "original_max_position_embeddings": _ORIG_MAX_POS})),
        TinyArch("phi3-longrope", "phi3", "gqa", "k", False, False, "model.rotary_emb",
                 "Phi-3 + LongRoPE (the architecture real LongRoPE checkpoints use)", _phi3_longrope),
    ]
}


def tiny_config(arch: str, **overrides: Any) -> PreTrainedConfig:
    """The tiny config of ``arch`` (see ``TINY_ARCHS``) with ``overrides`` applied.

    For the VL archs, ``text_config=`` / ``vision_config=`` dicts update those sub-configs.

    Raises:
        KeyError: unknown arch (the message lists the known ones).
    """
    try:
        spec = TINY_ARCHS[arch]
    except KeyError:
        raise KeyError(f"unknown tiny arch {arch!r}; known: {', '.join(TINY_ARCHS)}") from None
    return spec.build(dict(overrides))


def build_tiny_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build a tiny random-weight model of ``arch`` in fp32, eval mode, on CPU.

    2–3 decoder layers, hidden 128, 4 query / 2 KV heads (MLA: 4 heads), vocab 256,
    max_position_embeddings 512 (scaled-RoPE variants: original length 128). Weights are drawn
    from ``seed`` without touching the global RNG, so equal seeds give equal models.

    Args:
        arch: a key of ``TINY_ARCHS``, or any ``model_type`` of the causal-LM auto mapping
            (:func:`build_tiny_auto_model`: its default config shrunk, 4 layers).
        seed: weight seed.
        **overrides: config fields to change; ``attn_implementation=`` picks the attention kernel
            (default ``"sdpa"`` where the architecture supports it, else ``"eager"``).

    Returns:
        The model (``…ForCausalLM``, or ``…ForConditionalGeneration`` for the VL archs).
    """
    if arch not in TINY_ARCHS:
        from .tiny_auto import build_tiny_auto_model, causal_lm_model_types  # it builds on this module's sizes

        if arch in causal_lm_model_types():
            return build_tiny_auto_model(arch, seed=seed, **overrides)
    attn = overrides.pop("attn_implementation", None)
    config = tiny_config(arch, **overrides)
    cls = _model_class(config)
    if attn is None:
        attn = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


#: The root of a tiny backend without a tokenizer (token ids of its random vocabulary).
TINY_ROOT_IDS = (1, 2, 3)


def tiny_backend(arch: str = "llama", seed: int = 0, *, tokenizer: Any = None, verify_at_load: bool = True,
                 **overrides: Any) -> Any:
    """The one way to put a tiny random-weight model behind an ``HFBackend`` (``--model tiny:<arch>``
    on the command line, the test fixtures).

    Without a ``tokenizer`` the root is :data:`TINY_ROOT_IDS`. With one (a command that takes chat
    messages, e.g. ``serve``), the vocabulary is sized to it and the root is its chat header; the
    model's replies are noise. ``verify_at_load`` goes to ``HFBackend``, ``overrides`` to
    :func:`build_tiny_model`."""
    from .hf import HFBackend

    if tokenizer is None:
        return HFBackend(build_tiny_model(arch, seed=seed, **overrides), None, root_ids=list(TINY_ROOT_IDS),
                         name=f"tiny-{arch}", verify_at_load=verify_at_load)
    sizes = {"vocab_size": len(tokenizer), "max_position_embeddings": 2048}
    vl = arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # their text sizes live in text_config
    model = build_tiny_model(arch, seed=seed, **({"text_config": sizes} if vl else sizes), **overrides)
    return HFBackend(model, tokenizer, name=f"tiny-{arch}", verify_at_load=verify_at_load)


def _model_class(config: PreTrainedConfig) -> type[PreTrainedModel]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        mapping = auto._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise KeyError(f"no causal-LM class for config {type(config).__name__}")


def build_tiny_vl_processor(arch: str = "qwen2_vl") -> Any:
    """The real Qwen-VL image processor, sized so an image becomes a small grid.

    Images are resized to between 2x2 and 4x4 merged tokens (a 4x4 grid for a square image):
    ``min_pixels = (2·f)²``, ``max_pixels = (4·f)²`` with ``f = patch_size · merge_size``
    (28 for Qwen2-VL/Qwen2.5-VL, 32 for Qwen3-VL). Uses the torchvision backend when torchvision
    is installed, else the PIL backend (same outputs, no torchvision needed).

    Returns:
        An image processor; ``processor(images=[img], return_tensors="pt")`` gives
        ``pixel_values`` ``[grid_t·grid_h·grid_w, 3·2·p·p]`` and ``image_grid_thw`` ``[n_images, 3]``.
    """
    if arch not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        raise KeyError(f"no tiny VL processor for {arch!r}; VL archs: qwen2_vl, qwen2_5_vl, qwen3_vl")
    patch = 16 if arch == "qwen3_vl" else 14
    factor = patch * 2
    try:
        import torchvision  # noqa: F401

        from transformers import Qwen2VLImageProcessor as Proc
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Proc,
        )
    return Proc(
        min_pixels=(2 * factor) ** 2,
        max_pixels=(4 * factor) ** 2,
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
    )
