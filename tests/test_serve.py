"""`contextdeque serve` driven over HTTP with the official `openai` client: a running server
process on a tiny random-weight model (the default model's tokenizer and chat template)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from contextdeque.core.errors import BudgetError

from serve_util import ServeProcess, metric

KEY = "sk-test-KEY-never-in-logs-1234"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server():
    with ServeProcess("--model", "tiny:llama", "--patch-policy", "eager", "--max-tokens", "24", env={"CONTEXTDEQUE_API_KEY": KEY}) as s:
        yield s
    assert KEY not in s.log


def chat(client, messages, **kw):
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 12), **kw)
    return r.parse(), r.headers


def test_models_health_and_metrics(server) -> None:
    c = server.client(KEY)
    assert [m.id for m in c.models.list()] == [MODEL]
    h = httpx.get(server.url + "/healthz").json()
    assert h["status"] == "ok" and h["model"] == MODEL and [t["name"] for t in h["store"]] == ["device", "host"]
    m = server.metrics(KEY)
    assert metric(m, "contextdeque_requests_total", endpoint="/v1/models", status="200") >= 1


def test_streaming_and_not_agree_and_turns_reuse_the_window(server) -> None:
    c = server.client(KEY)
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name three rivers of Europe."}]
    r1, h1 = chat(c, msgs)
    u1 = r1.usage.model_extra["contextdeque"]
    assert r1.choices[0].finish_reason in ("stop", "length") and r1.usage.completion_tokens >= 1
    assert u1["encodes"] == 1 and u1["session_id"] == h1["x-session-id"]
    # the same request streamed, in a new session (header), from the store: same greedy text
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "streamed"})
    pieces, usage, finish = [], None, None
    for ch in stream:
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage
    assert "".join(pieces) == r1.choices[0].message.content and finish == r1.choices[0].finish_reason
    ux = usage.model_extra["contextdeque"]
    assert ux["encodes"] == 0 and ux["session_id"] == "streamed" and ux["restored"]
    # the next turn extends a session holding that history (matched by content; both do):
    # only the new messages cost
    msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And in Asia?"}]
    r2, h2 = chat(c, msgs2)
    u2 = r2.usage.model_extra["contextdeque"]
    assert h2["x-session-id"] in (h1["x-session-id"], "streamed")
    # two new messages: each encoded once and patched on what precedes it (two forwards over its
    # tokens); the first turn's messages and the root cost nothing; the generation prompt is a few tokens
    new = r2.usage.prompt_tokens - r1.usage.prompt_tokens
    assert u2["encodes"] == 2 and u2["patches_formed"] == 2
    assert 2 * new < u2["tokens_prefilled"] <= 2 * new + 8


def test_errors_are_openai_shaped_4xx(server) -> None:
    good = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as ei:
        server.client("sk-wrong").chat.completions.create(model=MODEL, messages=good)
    assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
    c = server.client(KEY)
    with pytest.raises(openai.NotFoundError) as ei:
        c.chat.completions.create(model="gpt-4o", messages=good)
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 3000}])
    assert ei.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=[])
    assert ei.value.body["param"] == "messages"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b"{not json", json.dumps({"model": MODEL}).encode(), json.dumps({"model": MODEL, "messages": "hi"}).encode(),
                 json.dumps({"model": MODEL, "messages": good, "max_tokens": -3}).encode()):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=auth)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "error" in r.json()
    for headers in ({}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):  # no / wrong auth scheme
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": good}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    m = server.metrics(KEY)
    assert metric(m, "contextdeque_requests_total", endpoint="/v1/chat/completions", status="401") >= 1
    assert KEY not in server.log and "sk-wrong" not in server.log


def test_queue_full_is_429() -> None:
    with ServeProcess("--model", "tiny:llama", "--patch-policy", "eager", "--queue", "1", "--max-tokens", "400") as s:
        c = s.client()
        msgs = [{"role": "user", "content": "Tell a long story."}]

        def one(i: int) -> str:
            try:
                c.chat.completions.create(model=MODEL, messages=msgs + [{"role": "user", "content": str(i)}], max_tokens=400)
                return "ok"
            except openai.RateLimitError as e:
                assert e.body["code"] == "rate_limit_exceeded"
                return "429"

        with cf.ThreadPoolExecutor(6) as ex:
            outcomes = list(ex.map(one, range(6)))
        assert "429" in outcomes and "ok" in outcomes


def test_sessions_evicted_under_budget_are_restored_from_the_store() -> None:
    with ServeProcess("--model", "tiny:llama", "--patch-policy", "eager", "--session-memory-mb", "0.05") as s:
        c = s.client()
        convs = [[{"role": "user", "content": f"Conversation {i}: what is {i} squared?"}] for i in range(4)]
        first = [chat(c, m)[0] for m in convs]
        m = s.metrics()
        assert metric(m, "contextdeque_sessions_evicted_total") >= 2
        again, _ = chat(c, convs[0])  # its window was closed: rebuilt from the store
        ux = again.usage.model_extra["contextdeque"]
        assert ux["encodes"] == 0 and ux["restored"]
        assert again.choices[0].message.content == first[0].choices[0].message.content
        assert metric(s.metrics(), "contextdeque_sessions_restored_total") >= 1


def test_prompt_is_the_templated_conversation() -> None:
    from transformers import AutoTokenizer

    from contextdeque.agents.messages import ChatTemplate
    from contextdeque.model.default_model import ensure_default_model
    from contextdeque.core.errors import AgentInputError
    from contextdeque.serve.conversation import check_budget, parse_prompt, prefix_digests, turns_digest

    tok = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
    tpl = ChatTemplate(tok)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "yo"}, {"role": "developer", "content": "be brief"}]
    p = parse_prompt(tpl, msgs)
    whole = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": "yo"}, {"role": "system", "content": "be brief"}],
                                    tokenize=False, add_generation_prompt=True)
    assert tok.decode(p.ids()) == whole and p.prompt_tokens == len(p.ids())
    keys = [m.key for m in p.messages]
    assert prefix_digests(keys)[-1] == turns_digest(keys) and prefix_digests(keys)[1] == turns_digest(keys[:2])
    with pytest.raises(AgentInputError, match="vision"):
        import numpy as np

        parse_prompt(tpl, [{"role": "user", "content": [{"type": "image", "image": np.zeros((16, 16, 3), dtype=np.uint8)}]}])
    with pytest.raises(BudgetError):
        check_budget(p, 10, p.prompt_tokens + 9)
    check_budget(p, 10, p.prompt_tokens + 10)


def test_loadtest_command(server, tmp_path) -> None:
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "contextdeque.cli", "loadtest", "--url", server.url, "--clients", "2", "--turns", "2",
         "--max-tokens", "4", "--json", "--plot", str(tmp_path / "load.png"), "--responses", str(tmp_path / "r.json")],
        capture_output=True, text=True, env={**os.environ, "CONTEXTDEQUE_API_KEY": KEY}, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    assert rep["total"]["ok"] == 4 and rep["total"]["errors"] == 0 and rep["total"]["ttft_p50_s"] > 0
    assert set(rep["by_turn"]) == {"0", "1"} and rep["total"]["prompt_tokens"] > rep["total"]["prefill_avoided"] >= 0
    assert (tmp_path / "load.png").stat().st_size > 10_000
    replies = json.loads((tmp_path / "r.json").read_text())
    assert [len(v) for v in replies.values()] == [2, 2]


def test_idle_healing_gives_way_to_a_request_and_resumes() -> None:
    """In-process engine, latency-first policy (``latency-shared``: healing computes canonicals, so
    a heal step runs forwards), healing as soon as the queue is empty: a request
    that arrives during a heal step interrupts it at the next decoder layer (the window is left
    as it was), is answered as a server that never heals answers it, and healing then finishes;
    the healed window answers as a fresh engine rebuilding the conversation from the store."""
    import torch

    from contextdeque.cli.model_spec import load_backend
    from contextdeque.core.cooperative import in_background
    from contextdeque.serve.engine import Engine, GenerationRequest, serve_config
    from contextdeque.serve.metrics import parse_text
    from contextdeque.window import default_store

    from serve_util import wait_until

    torch.set_num_threads(1)
    b = load_backend("tiny:llama", chat=True)
    sys_msg = {"role": "system", "content": "You are brief."}
    msgs1 = [sys_msg, {"role": "user", "content": "first page: " + "alpha beta gamma " * 12}]
    other = [sys_msg, {"role": "user", "content": "an unrelated question about delta"}]

    def run(engine: Engine, messages: list, session: str | None = None) -> object:
        return engine.submit(GenerationRequest(messages=messages, max_new_tokens=6, session_id=session)).result(600)

    ref = Engine(b, default_store(b.device), model_name="t", config=serve_config(patch_policy="latency-shared"),
                 heal_idle_ms=None)
    r1 = run(ref, msgs1)
    msgs2 = msgs1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "second page: " + "epsilon zeta " * 12}]
    run(ref, msgs2)
    assert ref.pending_chunks() >= 1  # never healed
    other_ref = run(ref, other).text
    ref.close()

    store = default_store(b.device)
    e = Engine(b, store, model_name="t", config=serve_config(patch_policy="latency-shared"), heal_idle_ms=0)
    layer0 = next(m for n, m in b.model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))[0]
    box: dict = {}

    def arrive(_m, _a) -> None:  # a request lands while the first heal step runs its first layer
        if in_background() and "fut" not in box:
            box["fut"] = e.submit(GenerationRequest(messages=other, max_new_tokens=6))

    hook = layer0.register_forward_pre_hook(arrive)
    try:
        assert run(e, msgs1, "s1").text == r1.text
        run(e, msgs2, "s1")
        assert wait_until(lambda: "fut" in box, 600)
        assert box["fut"].result(600).text == other_ref
        assert wait_until(lambda: e.pending_chunks() == 0, 600)
    finally:
        hook.remove()
    m = parse_text(e.metrics.render().decode())
    assert m["contextdeque_heal_interrupted_total"] >= 1 and m["contextdeque_heal_steps_total"] >= 1
    assert m["contextdeque_heal_errors_total"] == 0
    healed = run(e, msgs2, "s1")  # the healed window itself (nothing to sync)
    e.close()
    assert healed.encodes == 0 and healed.patches_formed == 0 and not healed.restored
    fresh = Engine(b, store, model_name="t", config=serve_config(patch_policy="latency-shared"), heal_idle_ms=None)
    again = run(fresh, msgs2)  # rebuilt from what healing stored
    fresh.close()
    assert again.encodes == 0 and again.patches_formed == 0 and again.text == healed.text


def _png_data_url(seed: int, shape=(60, 80, 3)) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    img = (np.random.default_rng(seed).random(shape) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_parts_refused_by_a_text_only_model(server) -> None:
    c = server.client(KEY)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url(0)}},
                                         {"type": "text", "text": "what is this?"}]}]
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert "vision" in ei.value.body["message"] and ei.value.body["param"] == "messages"


def test_image_parts_through_a_vision_model() -> None:
    """``serve --model tiny:qwen2_vl``: image parts (OpenAI ``image_url`` data URLs) go through the
    model's own vision tower and image processor; the picture is a chunk of the session's window,
    counted in the prompt at its grid size; another session with the same messages is rebuilt
    from the store with no encode; an unreadable image is a 400."""
    with ServeProcess("--model", "tiny:qwen2_vl", "--patch-policy", "eager", "--max-tokens", "8") as s:
        c = s.client()
        name = c.models.list().data[0].id
        msgs = [{"role": "system", "content": "You describe pictures."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url(1)}},
                                             {"type": "text", "text": "What is in the picture?"}]}]
        r1 = c.chat.completions.create(model=name, messages=msgs, max_tokens=6)
        u1 = r1.usage.model_extra["contextdeque"]
        assert u1["encodes"] >= 2  # the text before the picture, the picture (through the tower), the text after
        text_only = [msgs[0], {"role": "user", "content": "What is in the picture?"}]
        r_text = c.chat.completions.create(model=name, messages=text_only, max_tokens=6, extra_headers={"X-Session-Id": "t"})
        assert r1.usage.prompt_tokens > r_text.usage.prompt_tokens + 4  # the picture's grid counts
        r2 = c.chat.completions.create(model=name, messages=msgs, max_tokens=6, extra_headers={"X-Session-Id": "again"})
        u2 = r2.usage.model_extra["contextdeque"]
        assert u2["encodes"] == 0 and u2["restored"] and r2.choices[0].message.content == r1.choices[0].message.content
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=name, messages=bad, max_tokens=4)


def test_idle_time_prepares_the_next_request() -> None:
    """Between a session's requests the worker heals and then prepares what the next request
    likely needs (``MessageWindow.idle``): two messages are dropped, one comes back where it
    stood, behind other messages than when it was read; the request that brings it back forms no
    patch (what it needs was prepared while the engine was idle), and idle time then runs dry
    (``idle_sessions() == 0``: nothing is prepared twice)."""
    import torch

    from contextdeque.cli.model_spec import load_backend
    from contextdeque.serve.engine import Engine, GenerationRequest, serve_config
    from contextdeque.window import default_store

    from serve_util import wait_until

    torch.set_num_threads(1)
    b = load_backend("tiny:llama", chat=True)
    turns = [{"role": "system", "content": "You are brief."}]
    for i in range(4):
        turns += [{"role": "user", "content": f"note {i}: " + "alpha beta gamma " * (3 + i)},
                  {"role": "assistant", "content": f"noted {i}"}]
    e = Engine(b, default_store(b.device), model_name="t", config=serve_config(patch_policy="latency-shared"), heal_idle_ms=0)

    def run(messages: list) -> object:
        return e.submit(GenerationRequest(messages=messages, max_new_tokens=2, session_id="s")).result(600)

    try:
        run(turns)
        assert wait_until(lambda: e.idle_sessions() == 0, 600)
        run(turns[:2] + turns[3:4] + turns[5:])  # two messages dropped
        assert wait_until(lambda: e.idle_sessions() == 0, 600)
        back = run(turns[:2] + turns[3:])  # the later one comes back where it stood
        assert back.patches_formed == 0 and back.encodes == 0 and back.patches_reused >= 1
        assert wait_until(lambda: e.idle_sessions() == 0, 600)
    finally:
        e.close()
