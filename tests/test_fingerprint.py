"""Issue 10 item 5: a model's fingerprint sees every weight that can change K/V; computed once per
loaded model; cached by file digest for the default model."""

from __future__ import annotations

import pytest
import torch
from helpers import micro_llama

from contextdeque.core.errors import FingerprintMismatchError
from contextdeque.model.hf import HFBackend, hash_weights, model_fingerprint
from contextdeque.window import ContextWindow

A = [5, 6, 7, 8]


def test_one_element_of_k_proj_changes_the_fingerprint():
    """The issue's reproducer: same config, ``k_proj`` differing by one element used to share a
    fingerprint (it hashed a sample of each weight), so one model's chunk was accepted by the other."""
    m1, m2 = micro_llama(0), micro_llama(0)
    with torch.no_grad():
        w = m2.model.layers[1].self_attn.k_proj.weight
        w.view(-1)[w.numel() // 2 + 1] += 1.0  # an element a strided sample skips
    b1 = HFBackend(m1, None, root_ids=[1, 3])
    b2 = HFBackend(m2, None, root_ids=[1, 3])
    assert b1.fingerprint != b2.fingerprint
    chunk = b1.encode(token_ids=A)
    with pytest.raises(FingerprintMismatchError):
        ContextWindow(b2, rank=2).append(chunk=chunk)


@pytest.mark.parametrize("where", ["embed_tokens", "v_proj", "input_layernorm", "rotary"])
def test_every_kv_weight_is_covered(where):
    base = micro_llama(0)
    fp = hash_weights(base)
    m = micro_llama(0)
    with torch.no_grad():
        if where == "embed_tokens":
            m.model.embed_tokens.weight[7, 3] += 1e-3
        elif where == "v_proj":
            m.model.layers[0].self_attn.v_proj.weight[-1, -1] += 1e-3
        elif where == "input_layernorm":
            m.model.layers[1].input_layernorm.weight[5] += 1e-3
        else:  # config: another rope base changes every rotated key
            m.config.rope_theta = 20000.0
    assert hash_weights(m) != fp


def test_computed_once_per_model_and_recomputed_after_an_edit(monkeypatch):
    import contextdeque.model.hf as hf

    m = micro_llama(2)
    calls = []
    real = hf.hash_weights
    monkeypatch.setattr(hf, "hash_weights", lambda model: calls.append(1) or real(model))
    fp = model_fingerprint(m)
    HFBackend(m, None, root_ids=[1, 3])
    HFBackend(m, None, root_ids=[1, 2])
    assert model_fingerprint(m) == fp and len(calls) == 1
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0  # in place: the version counter moves
    assert model_fingerprint(m) != fp and len(calls) == 2


def test_default_model_fingerprint_is_cached_by_file_digest(tmp_path, monkeypatch):
    """The default model's fingerprint file is keyed by the weights file's digest and metadata;
    a stale key is recomputed, a matching one is read back without hashing."""
    import json

    import contextdeque.model.hf as hf
    from contextdeque.model.default_model import default_fingerprint

    m = micro_llama(3)
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights")
    fp = default_fingerprint(d, m)
    assert fp == hash_weights(m)
    saved = json.loads((d / "fingerprint.json").read_text())
    assert saved["fingerprint"] == fp
    monkeypatch.setattr(hf, "hash_weights", lambda model: pytest.fail("hashed although cached"))
    assert default_fingerprint(d, m) == fp
    monkeypatch.undo()
    (d / "model.safetensors").write_bytes(b"other weights!")  # another file: the key no longer matches
    m2 = micro_llama(4)
    assert default_fingerprint(d, m2) == hash_weights(m2) != fp


def test_tied_weights_hashed_once_but_still_seen():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    fp = hash_weights(m)
    with torch.no_grad():
        m.lm_head.weight[3, 3] += 1.0  # the same storage as the embeddings: K/V change
    assert hash_weights(m) != fp
