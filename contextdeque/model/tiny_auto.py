"""Tiny random-weight models of *any* architecture in the installed transformers' causal-LM
registry (``contextdeque verify-model --zoo``): each ``model_type``'s default config with every
size field it takes shrunk, built and run once. The architectures whose facts are documented and
tested one by one live in :mod:`contextdeque.model.testing`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from .testing import _INIT_RANGE, _MAX_POS, _VOCAB, _model_class

__all__ = ["AUTO_MAX_PARAMS", "TinyBuildError", "build_tiny_auto_model", "causal_lm_model_types", "tiny_auto_config"]


# Size fields of any transformers config (by the names configs use), set where the config's
# constructor takes them. 4 layers so patterned layouts (a NoPE layer every 4th, sliding:full
# mixes) show up; MLA fields small and consistent.
_AUTO_SIZES: dict[str, Any] = dict(
    vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=_MAX_POS,
    n_embd=64, n_layer=4, n_head=4, n_positions=_MAX_POS, n_inner=128, n_ctx=_MAX_POS,
    d_model=64, ffn_dim=128, decoder_layers=4, decoder_attention_heads=4, decoder_ffn_dim=128,
    encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=128,
    num_layers=4, num_heads=4, d_ff=128, n_layers=4, n_heads=4,
    moe_intermediate_size=64, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, shared_expert_intermediate_size=64,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_group=1, topk_group=1, rotary_dim=8, initializer_range=_INIT_RANGE,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
#: Largest parameter count ``tiny_auto_config`` accepts as tiny.
AUTO_MAX_PARAMS = 8_000_000


class TinyBuildError(RuntimeError):
    """No tiny random-weight model of this architecture could be built from its default config."""


def causal_lm_model_types() -> list[str]:
    """Every ``model_type`` of the installed transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrunk_kwargs(cfg: PreTrainedConfig, extra: dict[str, Any]) -> dict[str, Any]:
    import inspect

    params = inspect.signature(type(cfg).__init__).parameters
    sizes = {**_AUTO_SIZES, **extra}
    kw = {k: v for k, v in sizes.items() if k in params}
    old_layers = None
    for name in ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "n_layers"):
        if isinstance(getattr(cfg, name, None), int):
            old_layers = getattr(cfg, name)
            break
    new_layers = int(sizes.get("num_hidden_layers", 4))
    for name, val in cfg.to_dict().items():
        if name not in params or name in kw:
            continue
        if isinstance(val, list) and old_layers and len(val) == old_layers and old_layers != new_layers:
            kw[name] = val[:new_layers]  # per-layer lists (layer_types, no_rope_layers, ...)
        elif isinstance(val, dict) and val and all(str(k).isdigit() for k in val):
            kw[name] = {k: v for k, v in val.items() if int(k) < new_layers}
    for sub in ("text_config", "decoder", "decoder_config"):
        sub_cfg = getattr(cfg, sub, None)
        if isinstance(sub_cfg, PreTrainedConfig) and sub in params:
            kw[sub] = {**sub_cfg.to_dict(), **_shrunk_kwargs(sub_cfg, extra)}
    return kw


def tiny_auto_config(model_type: str, **extra: Any) -> PreTrainedConfig:
    """A tiny config of any ``model_type`` in transformers' auto mapping: its default config with
    every size field it takes (``_AUTO_SIZES``) shrunk, per-layer lists cut to 4 layers, and
    ``extra`` on top.

    Raises:
        TinyBuildError: the default config cannot be shrunk consistently.
    """
    from transformers import AutoConfig

    try:
        cfg0 = AutoConfig.for_model(model_type)
        return type(cfg0)(**_shrunk_kwargs(cfg0, extra))
    except Exception as exc:  # transformers validates configs with many exception types
        raise TinyBuildError(f"{model_type}: no tiny config: {type(exc).__name__}: {str(exc)[:200]}") from exc


def build_tiny_auto_model(model_type: str, seed: int = 0, **extra: Any) -> PreTrainedModel:
    """A tiny random-weight fp32 causal LM of any ``model_type`` in the auto mapping (see
    :func:`tiny_auto_config`), in eval mode. MLA-style models that need as many KV heads as query
    heads, and hybrids whose first attention layer comes late, are retried that way.

    Raises:
        TinyBuildError: no config, more than :data:`AUTO_MAX_PARAMS` parameters, or the model
            cannot be built or run one forward.
    """
    errors = []
    # retries: MLA-style models need as many KV heads as query heads; hybrids whose first attention
    # layer comes after layer 4 need more layers
    for attempt in ({}, {"num_key_value_heads": 4}, {"num_hidden_layers": 8, "n_layer": 8, "num_layers": 8}):
        try:
            config = tiny_auto_config(model_type, **{**attempt, **extra})
            cls = _model_class(config)
            want = getattr(cls, "config_class", None)
            if want is not None and not isinstance(config, want):  # a VL wrapper mapped to its text LM
                sub = config.get_text_config(decoder=True)
                if isinstance(sub, want):
                    config = sub
            with torch.device("meta"):
                n_params = sum(p.numel() for p in cls._from_config(config).parameters())
            if n_params > AUTO_MAX_PARAMS:
                raise TinyBuildError(
                    f"{model_type}: the shrunk default config still has {n_params / 1e6:.1f}M parameters"
                )
            attn = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
            with torch.no_grad():
                model(input_ids=torch.arange(4, 8).reshape(1, -1))
            return model
        except TinyBuildError as exc:
            errors.append(str(exc))
            if "parameters" in str(exc):
                break
        except Exception as exc:  # noqa: BLE001 - any failure of a foreign architecture's build
            errors.append(f"{model_type}: {type(exc).__name__}: {str(exc)[:200]}")
    raise TinyBuildError(errors[-1])
