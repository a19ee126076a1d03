"""MessageWindow: a window kept in step with an OpenAI-style chat-messages list.

The acceptance scenario runs on the real default model (SmolLM2-135M-Instruct) under full-rank
patches: a scripted 20-turn conversation with tool results, then an edited, a dropped and a
returning message; after every sync the window's next-token distribution matches a re-prefill of
the chat template applied to the whole list (KL <= 1e-4), and a returning message is recalled,
never re-encoded. The rest runs on tiny random-weight models that share the default model's
tokenizer (so the real chat template cuts the messages).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from contextdeque.agents import MessageWindow, normalize_messages
from contextdeque.core.metrics import kl_divergence
from contextdeque.model.hf import HFBackend
from contextdeque.model.testing import build_tiny_model, build_tiny_vl_processor
from contextdeque.core.errors import (
    BudgetError,
    MediaError,
    MessageFormatError,
    MessageTypeError,
    UnsupportedMediaError,
)

SYSTEM = {"role": "system", "content": "You are a terse travel assistant. Use the tools when asked."}


def scripted_conversation() -> list[dict]:
    """20 turns after the system prompt: questions, tool calls written out by the assistant, tool
    results and answers."""
    cities = [("Oslo", "4C, light rain"), ("Rome", "19C, sunny"), ("Lima", "16C, overcast"),
              ("Cairo", "27C, clear"), ("Quito", "12C, showers")]
    out = []
    for city, weather in cities:
        out += [
            {"role": "user", "content": f"What is the weather in {city} today?"},
            {"role": "assistant", "content": f"call weather(city={city!r})"},
            {"role": "tool", "content": f"weather({city!r}) -> {weather}"},
            {"role": "assistant", "content": f"{city}: {weather}."},
        ]
    assert len(out) == 20
    return [SYSTEM] + out


def reprefill_logits(backend: HFBackend, messages: list[dict]) -> tuple[torch.Tensor, list[int]]:
    """The reference: the chat template applied to the whole list, prefilled in one forward."""
    ids = backend.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    res = backend.forward(input_ids=ids, positions=backend.text_positions(0, len(ids)), logits="last")
    return res.logits[-1], ids


@pytest.mark.slow
def test_twenty_turn_conversation_equals_a_reprefill_of_the_template(default_backend, one_thread):
    backend = default_backend
    mw = MessageWindow(backend, patch_policy="exact")
    conv = scripted_conversation()
    worst = 0.0

    def check(msgs):
        nonlocal worst
        ref, ids = reprefill_logits(backend, msgs)
        assert mw.template_ids() == ids  # the window holds exactly the templated list's tokens
        d = kl_divergence(ref, mw.next_token_logits().logits)
        worst = max(worst, d)
        assert d <= 1e-4, d

    for k in range(2, len(conv) + 1):  # the framework calls the model after every message
        rc = mw.sync(conv[:k])
        assert rc.appended == 1 and rc.kept == k - 2 and rc.evicted == 0
        assert rc.reprefill_tokens == len(mw.template_ids(add_generation_prompt=False))
        check(conv[:k])

    edited = [dict(m) for m in conv]
    edited[5] = {"role": "user", "content": "What is the weather in Bergen today?"}  # an edited message
    rc = mw.sync(edited)
    assert rc.appended == 1 and rc.evicted == 1 and rc.moved == len(conv) - 6
    check(edited)

    dropped = edited[:3] + edited[4:]  # a tool result leaves the list
    rc = mw.sync(dropped)
    assert rc.evicted == 1 and rc.appended == 0 and rc.encodes == 0
    check(dropped)

    rc = mw.sync(edited)  # ... and comes back: recalled, never re-encoded
    assert rc.returned == 1 and rc.appended == 0
    assert rc.encodes == 0 and rc.returned_encodes == 0
    assert [o.op for o in rc.ops if o.why == "returned"] == ["recall"]
    check(edited)

    rc = mw.sync(conv)  # the edit is undone: the original message returns too
    assert rc.returned == 1 and rc.encodes == 0
    check(conv)
    assert mw.stats["returned"] == 2 and mw.stats["returned_encodes"] == 0
    answer = mw.generate(max_new_tokens=8)
    assert answer.token_ids
    print(f"worst KL over {mw.stats['syncs']} syncs: {worst:.2e}")


@pytest.fixture(scope="module")
def chat_backend(default_backend) -> HFBackend:
    """A tiny random llama with the default model's vocabulary and tokenizer (chat template)."""
    model = build_tiny_model("llama", vocab_size=default_backend.tokenizer.vocab_size + 17, seed=3)
    return HFBackend(model, default_backend.tokenizer, name="tiny-llama-chat")


def state_of(mw: MessageWindow):
    w = mw.window
    return (mw.messages, w.refs, w.evicted_refs, w.generation, dict(mw.stats))


def test_sync_turns_a_diff_into_window_operations(chat_backend, one_thread):
    mw = MessageWindow(chat_backend, rank=8, patch_policy="eager")  # encodes counted per sync
    conv = scripted_conversation()[:9]
    rc = mw.sync(conv)
    assert rc.appended == 8 and rc.encodes == 8 and not rc.rebuilt
    assert len(mw.window.refs) == 8 and mw.root_ids  # the system prompt is the root
    rc = mw.sync(conv)
    assert rc.kept == 8 and not rc.ops and rc.forwards == 0 and rc.prefix_cache_tokens == 0

    rc = mw.sync(conv + [{"role": "user", "content": "Thanks!"}])
    assert rc.appended == 1 and rc.kept == 8
    assert rc.tokens_prefilled > 0 and rc.prefix_cache_tokens < rc.reprefill_tokens
    mw.sync(conv)

    rc = mw.sync(conv[:4] + conv[5:])  # drop one: the window evicts it, the rest survive
    assert rc.evicted == 1 and rc.forwards == 0 and rc.encodes == 0
    rc = mw.sync(conv)  # it returns: recalled in place
    assert rc.returned == 1 and rc.encodes == 0 and [o.op for o in rc.ops] == ["recall"]
    assert rc.ops[0].receipt.encodes == 0 and rc.ops[0].receipt.forwards <= 1

    perm = [conv[0], conv[2], conv[1]] + conv[3:]
    rc = mw.sync(perm)
    assert rc.reordered and rc.kept == 8 and rc.encodes == 0
    assert [o.op for o in rc.ops] == ["reorder"]

    twice = conv + [conv[1]]  # the same content twice: two chunks, one canonical
    rc = mw.sync(twice)
    assert rc.appended == 1 and rc.encodes == 0 and len(mw.window.refs) == 9
    assert mw.window.refs[0].chunk_id == mw.window.refs[-1].chunk_id

    rc = mw.sync([{"role": "system", "content": "Another system prompt."}] + conv[1:])
    assert rc.rebuilt and rc.appended == 8  # a new root: the window is rebuilt
    summary = rc.summary()
    assert "rebuilt" in summary and rc.as_dict()["appended"] == 8


def test_idle_time_prepares_a_dropped_message_coming_back(chat_backend, one_thread):
    """Messages the last sync dropped are expected back where they stood: ``idle()`` (the time
    between requests) prepares their recall. Two messages leave, one comes back (behind other
    messages than when it was first read, so no stored patch fits it): the recall and the
    re-conditioning of the messages behind it, which were conditioned on it, run no forward on
    the critical path and equal what the eager policy builds; once nothing is left, idle time has
    no work until the window changes. Without ``anticipate`` the same return is served deferred.
    (The server's policy, ``latency-shared``: healing gives every message its canonical; under
    ``latency`` a message keeps its own forward's KV, which a heal re-runs rather than patches.)"""
    conv = scripted_conversation()[:9]

    def run(policy: str, anticipate: bool):
        mw = MessageWindow(chat_backend, rank=8, patch_policy=policy, anticipate=anticipate)
        for msgs in (conv, conv[:2] + conv[3:4] + conv[5:]):  # then messages 2 and 4 are dropped
            mw.sync(msgs)
            while mw.idle_work:
                mw.idle()
        assert mw.idle() is not None and not mw.idle_work  # nothing left until the window changes
        rc = mw.sync(conv[:2] + conv[3:])  # message 4 comes back where it stood
        assert rc.returned == 1 and [o.op for o in rc.ops] == ["recall"]
        return mw, rc.ops[0].receipt

    fast, r_fast = run("latency-shared", True)
    assert r_fast.forwards == 0 and not r_fast.deferred and r_fast.cascade.implied
    assert r_fast.served and all(what == "anticipated" for _, what in r_fast.served)
    eager, r_eager = run("eager", False)
    assert r_eager.forwards > 0
    assert kl_divergence(eager.next_token_logits().logits, fast.next_token_logits().logits) <= 1e-6
    plain, r_plain = run("latency-shared", False)
    assert r_plain.forwards == 0 and r_plain.deferred


def test_exact_policy_matches_the_template_on_a_tiny_model(chat_backend, one_thread):
    mw = MessageWindow(chat_backend, patch_policy="exact")
    conv = scripted_conversation()[:7]
    for msgs in (conv, conv[:2] + conv[3:], [conv[0], conv[3], conv[1], conv[2]] + conv[4:],
                 conv[:3] + [{"role": "user", "content": "inserted"}] + conv[3:]):
        mw.sync(msgs)
        ref, ids = reprefill_logits(chat_backend, msgs)
        assert mw.template_ids() == ids
        assert kl_divergence(ref, mw.next_token_logits().logits) <= 1e-4
    out = chat_backend.model.generate(
        input_ids=mw.input_ids(), past_key_values=mw.materialize(), attention_mask=torch.ones_like(mw.input_ids()),
        max_new_tokens=4, do_sample=False,
    )
    assert out[0, : mw.input_ids().shape[1]].tolist() == mw.input_ids()[0].tolist()
    assert mw.generate(max_new_tokens=4).token_ids == out[0, mw.input_ids().shape[1] :].tolist()


def test_conversation_without_a_system_message_uses_the_templates_header(chat_backend, one_thread):
    mw = MessageWindow(chat_backend, patch_policy="exact")
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    mw.sync(msgs)
    ref, ids = reprefill_logits(chat_backend, msgs)
    assert mw.template_ids() == ids and len(mw.window.refs) == 2
    assert kl_divergence(ref, mw.next_token_logits().logits) <= 1e-4


def test_tool_calls_and_parts_are_normalized():
    msgs = normalize_messages([
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ])
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[1].text == "ab" and '"name": "f"' in msgs[2].text
    assert len({m.key for m in msgs}) == 4


@pytest.mark.parametrize(
    "bad, err",
    [
        ("not a list", MessageTypeError),
        ([], MessageFormatError),
        ([42], MessageTypeError),
        ([{"role": "wizard", "content": "x"}], MessageFormatError),
        ([{"role": 3, "content": "x"}], MessageTypeError),
        ([{"role": "user"}], MessageFormatError),
        ([{"role": "user", "content": 5}], MessageTypeError),
        ([{"role": "user", "content": [{"type": "audio", "data": "x"}]}], MessageFormatError),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], MessageTypeError),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}], MediaError),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}], MediaError),
    ],
)
def test_malformed_lists_raise_typed_errors_and_change_nothing(chat_backend, bad, err, one_thread):
    mw = MessageWindow(chat_backend, rank=4)
    mw.sync(scripted_conversation()[:3])
    before = state_of(mw)
    with pytest.raises(err):
        mw.sync(bad)
    assert state_of(mw) == before
    assert issubclass(MessageTypeError, TypeError) and issubclass(MessageFormatError, ValueError)


def test_budget_exceeded_is_refused_and_the_window_is_unchanged(chat_backend, one_thread):
    conv = scripted_conversation()
    mw = MessageWindow(chat_backend, rank=4, budget_tokens=60)
    mw.sync(conv[:4])
    before = state_of(mw)
    with pytest.raises(BudgetError):
        mw.sync(conv[:12])
    assert state_of(mw) == before
    mw.sync(conv[:5])  # still usable


def _png(pixels: np.ndarray, mode: str | None = None) -> str:
    from PIL import Image

    img = Image.fromarray(pixels)
    if mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="TIFF" if mode == "CMYK" else "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_parts_on_a_text_only_model_use_the_emulation(chat_backend, one_thread):
    from skimage import data

    mw = MessageWindow(chat_backend, patch_policy="exact", image_tokens=16)
    url = _png(data.astronaut()[::8, ::8])
    msgs = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                {"type": "image_url", "image_url": {"url": url}}]},
            {"role": "assistant", "content": "An astronaut."}]
    rc = mw.sync(msgs)
    assert len(mw.refs_of(1)) == 3  # text, image span, end of turn
    assert mw.window.chunk(mw.refs_of(1)[1]).modality == "image-emulated"
    assert mw.images.projections == 1 and rc.appended == 2
    assert mw.fidelity()["kl"] <= 1e-4  # window vs a re-prefill of the same contents
    mw.sync([SYSTEM, msgs[2]])
    rc = mw.sync(msgs)  # the picture returns: recalled, the emulated tower does not run again
    assert rc.returned == 1 and rc.encodes == 0 and mw.images.projections == 1

    before = state_of(mw)
    with pytest.raises(UnsupportedMediaError):
        mw.sync(msgs + [{"role": "user", "content": [{"type": "image", "image": np.zeros((8, 8, 4), np.uint8)}]}])
    from PIL import Image

    with pytest.raises(UnsupportedMediaError):
        mw.sync(msgs + [{"role": "user", "content": [{"type": "image", "image": Image.new("CMYK", (8, 8))}]}])
    assert state_of(mw) == before


def test_image_parts_through_the_qwen2_vl_vision_tower(default_backend, one_thread):
    """A tiny Qwen2-VL (the default model's vocabulary) with its real image processor: image parts
    become vision-tower chunks placed with M-RoPE; the window equals a re-prefill of its contents
    under full-rank patches, and a returning picture never re-runs the tower."""
    from skimage import data

    model = build_tiny_model("qwen2_vl", text_config={"vocab_size": default_backend.tokenizer.vocab_size + 17})
    backend = HFBackend(model, default_backend.tokenizer, name="tiny-qwen2-vl-chat")
    mw = MessageWindow(backend, patch_policy="exact", processor=build_tiny_vl_processor("qwen2_vl"))
    msgs = [SYSTEM, {"role": "user", "content": [{"type": "image", "image": data.coffee()},
                                                {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "A cup of coffee."}]
    mw.sync(msgs)
    refs = mw.refs_of(1)
    image = mw.window.chunk(refs[1])
    assert image.modality == "image" and image.span != image.n_tokens  # an M-RoPE grid
    vs = int(model.config.vision_start_token_id)
    assert mw.window.chunk(refs[0]).token_ids[-1].item() == vs
    assert mw.images.tower_calls(mw.window) == 1
    assert mw.fidelity()["kl"] <= 1e-4
    mw.sync([SYSTEM, msgs[2]])
    rc = mw.sync(msgs)
    assert rc.returned == 1 and rc.encodes == 0 and mw.images.tower_calls(mw.window) == 1
    assert mw.generate(max_new_tokens=3).token_ids
