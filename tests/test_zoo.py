"""Any decoder in transformers: structural detection, the proof at load, and the sweep over every
causal-LM architecture of the installed transformers (issue 9)."""

from __future__ import annotations

import json

import pytest
import torch

import contextdeque as cd
from contextdeque.core.errors import UnsupportedLayoutError
from contextdeque.model import detect, zoo
from contextdeque.model.hf import HFBackend
from contextdeque.model.testing import build_tiny_model
from contextdeque.model.tiny_auto import causal_lm_model_types
from contextdeque.window import ContextWindow

NAMED = ["olmo2", "granite", "mistral", "mixtral", "phi3", "gemma2", "qwen3_moe", "smollm3"]


@pytest.fixture(scope="session")
def verdicts():
    """The sweep over every causal-LM architecture (tiny configs, one thread, memory-only caches)."""
    return {v.model_type: v for v in zoo.sweep()}


def test_sweep_covers_every_architecture_and_reports_counts(verdicts, capsys):
    assert set(verdicts) == set(causal_lm_model_types())
    counts = zoo.counts(list(verdicts.values()))
    with capsys.disabled():
        print("\nzoo counts:", json.dumps(counts))
    assert counts["exact"] + counts["identity"] + sum(counts["refused"].values()) + counts["could-not-build"] == counts["total"]
    # nothing is used while inexact, and nothing failed outside a stated verdict
    assert "inexact" not in counts and "error" not in counts, [v for v in verdicts.values() if v.verdict in ("inexact", "error")]
    assert counts["exact"] >= 60  # the RoPE decoders of transformers 5.18 (83 when written)


def test_docs_counts_are_the_sweeps(verdicts):
    """docs/zoo.md and the README carry the counts of this sweep (regenerate with
    ``contextdeque zoo --write-docs .``), not hand-written ones."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    counts = zoo.counts(list(verdicts.values()))
    assert zoo.docs_counts((root / "docs" / "zoo.md").read_text()) == json.loads(json.dumps(counts))
    assert zoo.counts_line(counts) in (root / "README.md").read_text()


def test_every_refusal_reason_holds(verdicts):
    """Each refusal's reason is confirmed by an independent check (e.g. learned positions: zeroing
    the named position module's output makes the keys position-free)."""
    refused = [v for v in verdicts.values() if v.verdict == "refused"]
    assert refused
    for v in refused:
        assert v.reason in detect.REFUSAL_REASONS, v
        assert v.reason_holds, v


def test_accepted_architectures_are_exact(verdicts):
    for v in verdicts.values():
        if v.verdict in ("exact", "identity"):
            assert v.key_err is not None and v.key_err <= detect.tolerance(torch.float32, v.noise_floor), v


def test_verdicts_of_known_architectures(verdicts):
    for mt in NAMED + ["llama", "deepseek_v3", "gptj", "nanochat", "qwen2"]:
        assert verdicts[mt].verdict == "exact", verdicts[mt]
    for mt in ("bloom", "mpt"):  # ALiBi: nothing positional in the cache
        assert verdicts[mt].verdict == "identity", verdicts[mt]
    for mt in ("gpt2", "opt", "ctrl"):
        assert (verdicts[mt].verdict, verdicts[mt].reason) == ("refused", "learned-positions"), verdicts[mt]
    for mt in ("mamba", "rwkv", "qwen3_next"):
        assert (verdicts[mt].verdict, verdicts[mt].reason) == ("refused", "recurrent"), verdicts[mt]
    for mt in ("bart", "trocr"):  # learned positions taken from the cache length, position_ids ignored
        assert (verdicts[mt].verdict, verdicts[mt].reason) == ("refused", "positions-ignored"), verdicts[mt]
    assert "NoPE" in verdicts["smollm3"].layout


@pytest.mark.parametrize("arch", NAMED)
def test_named_architecture_through_window_generate(arch, one_thread):
    """load_model(model) -> ContextWindow -> generate equals a plain generate over the same ids."""
    backend = cd.load_model(build_tiny_model(arch), root_ids=[1, 3])
    assert backend.proof is not None and backend.proof.ok
    win = ContextWindow(backend, patch_policy="exact")
    for ids in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]):
        win.append(token_ids=ids)
    query = [40, 41, 42]
    ids = win.input_ids_for(query)
    answer = win.generate(query, max_new_tokens=4)
    plain = backend.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False,
                                   attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert answer.token_ids == plain[0, ids.shape[1]:].tolist()
    if arch == "smollm3":
        assert any(backend.layout.identity_layers) and not all(backend.layout.identity_layers)


def test_smollm3_nope_layers_are_the_configs(one_thread):
    model = build_tiny_model("smollm3")
    layout = HFBackend(model, None, root_ids=[1], verify_at_load=False).layout
    assert list(layout.identity_layers) == [not bool(x) for x in model.config.no_rope_layers]


def _count_forwards(model: torch.nn.Module) -> list[int]:
    """A counter of the model's top-level forwards (one per run_forward)."""
    n = [0]
    model.register_forward_pre_hook(lambda m, a: n.__setitem__(0, n[0] + 1))
    return n


def test_proof_is_cached_per_fingerprint(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("CONTEXTDEQUE_CACHE", str(tmp_path))
    monkeypatch.setattr(detect, "_PROOFS", {})
    monkeypatch.setattr(detect, "_LAYOUTS", {})
    model = build_tiny_model("granite", seed=3)
    n = _count_forwards(model)
    first = cd.load_model(model)
    assert first.proof.ok and not first.proof.cached and first.proof.offsets == [detect.PROBE_SHIFT, 257]
    # the detection's two probe forwards, then the proof's own two (it reuses the probes as oracles)
    assert first.proof.forwards == 2 and n[0] == 4
    assert list((tmp_path / "proofs").glob("*.json"))
    monkeypatch.setattr(detect, "_PROOFS", {})  # a new process: only the disk cache remains
    monkeypatch.setattr(detect, "_LAYOUTS", {})
    calls = []
    monkeypatch.setattr(detect, "read_layout", lambda m, **kw: calls.append(m))
    n[0] = 0
    second = cd.load_model(model)
    assert second.proof.cached and second.proof.key == first.proof.key and calls == []
    assert second.layout == first.layout and n[0] == 0  # a cached load runs no forward at all
    skipped = cd.load_model(model, verify_at_load=False)
    assert skipped.proof is None


def test_proof_reuses_the_detection_forwards_soundly(one_thread):
    """The probe forwards the proof reuses are bitwise the shifted forwards it would run, and the
    proof without them (layout cached, proof not) reaches the same verdict at the same offsets."""
    model = build_tiny_model("llama", seed=2)
    with detect.memory_only():
        keep: dict = {}
        detect.read_layout(model, keep=keep)
        backend = HFBackend(model, None, root_ids=[1, 3], verify_at_load=False)
        view = backend.with_root([int(keep["ids"][0])])
        chunk = view.encode(token_ids=keep["ids"][1:])
        for off in (0, detect.PROBE_SHIFT):
            fresh = detect.shifted_forward(view, chunk, off)
            assert all(torch.equal(k[:, 1:], fk) and torch.equal(v[:, 1:], fv)
                       for (k, v), (fk, fv) in zip(keep["kv"][off], fresh))
        reused = detect.prove_layout(backend, use_cache=False, probes=keep)
        alone = detect.prove_layout(backend, use_cache=False)
    assert reused.ok and alone.ok and reused.offsets == alone.offsets
    assert (reused.forwards, alone.forwards) == (2, 5)
    assert backend._root_kv is None  # the proof ran on a view: the window root's cache is untouched


def test_monkeypatched_rotary_is_refused_by_the_proof(one_thread):
    """A rotary module patched to something non-standard (angles of position + 1 on one path):
    structural detection still reads a RoPE layout, the proof at load refuses it with the error."""
    model = build_tiny_model("llama", seed=5)
    rotary = model.model.rotary_emb
    real = type(rotary).forward

    def skewed(self, x, position_ids, *a, **kw):
        # a non-standard rotary: positions squared past 40 (not a shift-invariant rotation)
        pos = torch.where(position_ids > 40, position_ids + (position_ids - 40) // 7, position_ids)
        return real(self, x, pos, *a, **kw)

    rotary.forward = skewed.__get__(rotary)
    with detect.memory_only(), pytest.raises(UnsupportedLayoutError) as info:
        cd.load_model(model)
    assert info.value.reason in ("proof-failed", "not-a-rotation") and info.value.measured > 1e-3
    # verify_at_load=False trusts the user: the layout is read, no proof is run
    with detect.memory_only():
        try:
            backend = cd.load_model(model, verify_at_load=False)
        except UnsupportedLayoutError as exc:  # the structural probe alone may already see it
            assert exc.reason == "not-a-rotation"
        else:
            assert backend.proof is None


def test_detect_layout_is_structural_and_proven(one_thread):
    with detect.memory_only():
        lay = cd.detect_layout(build_tiny_model("olmo2"))
    assert (lay.rope_tensor, lay.interleaved, lay.k_heads) == ("k", False, 2)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with detect.memory_only(), pytest.raises(UnsupportedLayoutError, match="wpe") as info:
        cd.detect_layout(gpt2)
    assert info.value.reason == "learned-positions"


@pytest.mark.parametrize("arch", ["olmo2", "bloom", "granite"])
def test_verify_model_cli_any_architecture(arch, capsys):
    from contextdeque.cli import main

    rc = main(["verify-model", "--arch", arch, "--random", "--json", "--tokens", "16", "--offsets", "1,99"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] is True, out


def test_verify_model_cli_refusal_names_the_reason(capsys):
    from contextdeque.cli import main

    rc = main(["verify-model", "--arch", "gpt2", "--random", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["ok"] is False and "learned-positions" in out["error"]


def test_proof_in_a_16bit_compute_dtype(monkeypatch, one_thread):
    """A bf16 model is proven in bf16 (a few ULPs of the keys' scale), and the bound still refuses
    a relocation that is one position off."""
    model = build_tiny_model("olmo2").to(torch.bfloat16)
    with detect.memory_only():
        backend = cd.load_model(model, root_ids=[1, 3])
    assert backend.proof.ok and backend.layout.compute_dtype == "bfloat16"
    real = detect.relocate
    monkeypatch.setattr(detect, "relocate", lambda chunk, start, **kw: real(chunk, start + 1, **kw))
    with detect.memory_only(), pytest.raises(UnsupportedLayoutError) as info:
        cd.load_model(build_tiny_model("olmo2", seed=1).to(torch.bfloat16), root_ids=[1, 3])
    assert info.value.reason == "proof-failed" and info.value.measured > 0.1
