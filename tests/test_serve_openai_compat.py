"""What `contextdeque serve` does with the parts of OpenAI's API it does not implement, driven with
the official `openai` client against a real server (a tiny random-weight model with the default
model's tokenizer and chat template, which has no tool support): refused with an OpenAI-shaped
4xx that says what is served, never accepted and ignored."""

from __future__ import annotations

import httpx
import openai
import pytest

from contextdeque.serve.compat import refusal, template_supports_tools

from serve_util import ServeProcess

KEY = "sk-compat-test-key-5678"
MODEL = "tiny-llama"
MAX_TOKENS = 24
HI = [{"role": "user", "content": "Say hi."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with ServeProcess("--model", "tiny:llama", "--patch-policy", "eager", "--max-tokens", str(MAX_TOKENS),
                      env={"CONTEXTDEQUE_API_KEY": KEY}) as s:
        yield s


def test_tools_are_refused_with_a_400_naming_the_missing_template_support(server) -> None:
    c = server.client(KEY)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=4)
    body = ei.value.body
    assert body["code"] == "tools_not_supported" and body["param"] == "tools"
    assert "chat template without tool support" in body["message"] and MODEL in body["message"]
    with pytest.raises(openai.BadRequestError) as ei:  # tool_choice alone asks for a tool call too
        c.chat.completions.create(model=MODEL, messages=HI, tool_choice="required", max_tokens=4)
    assert ei.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as ei:  # another parameter that would be ignored
        c.chat.completions.create(model=MODEL, messages=HI, logprobs=True, max_tokens=4)
    assert ei.value.body["code"] == "unsupported_parameter" and ei.value.body["param"] == "logprobs"
    # what a framework sends without asking for tools still works: tool_choice "none", a tool turn as text
    r = c.chat.completions.create(model=MODEL, messages=HI + [{"role": "tool", "content": "18 C", "tool_call_id": "1"}],
                                  tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1


def test_streaming_names_its_session_in_the_header(server) -> None:
    c = server.client(KEY)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    sid = raw.headers.get("x-session-id")
    usage = [ch.usage for ch in raw.parse() if ch.usage is not None]
    assert sid and usage and usage[-1].model_extra["contextdeque"]["session_id"] == sid
    # the header names the session the next turn continues (sent back, it is the same window)
    raw2 = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, stream=True,
        extra_headers={"X-Session-Id": sid})
    assert raw2.headers.get("x-session-id") == sid
    assert "".join(ch.choices[0].delta.content or "" for ch in raw2.parse() if ch.choices) is not None


def test_max_tokens_over_the_limit_is_a_400_naming_the_limit(server) -> None:
    c = server.client(KEY)
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(model=MODEL, messages=HI, **{param: 100000})
        body = ei.value.body
        assert body["param"] == param and body["code"] == "invalid_value"
        assert f"limit of {MAX_TOKENS}" in body["message"] and "100000" in body["message"]
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=MAX_TOKENS)  # at the limit: served
    assert 1 <= r.usage.completion_tokens <= MAX_TOKENS


def test_legacy_completions_and_embeddings_are_404s_naming_chat_completions(server) -> None:
    c = server.client(KEY)
    with pytest.raises(openai.NotFoundError) as ei:
        c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert "/v1/chat/completions" in ei.value.body["message"] and "legacy completions" in ei.value.body["message"]
    with pytest.raises(openai.NotFoundError) as ei:
        c.embeddings.create(model=MODEL, input="hello")
    assert "/v1/chat/completions" in ei.value.body["message"] and ei.value.body["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "POST /v1/chat/completions" in r.json()["error"]["message"]


def test_metrics_needs_the_key_and_healthz_does_not(server) -> None:
    assert httpx.get(server.url + "/healthz").status_code == 200
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_bad_messages_get_a_code_and_their_place(server) -> None:
    c = server.client(KEY)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=[*HI, {"role": "wizard", "content": "x"}], max_tokens=4)
    body = ei.value.body
    assert body["code"] == "invalid_value" and body["param"] == "messages[1].role" and "wizard" in body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "audio", "x": 1}]}], max_tokens=4)
    assert ei.value.body["code"] == "invalid_value" and ei.value.body["param"] == "messages[0].content[0].type"


def test_tool_support_is_read_off_the_chat_template() -> None:
    from transformers import AutoTokenizer

    from contextdeque.model.default_model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
    assert not template_supports_tools(tok)  # SmolLM2's template never mentions tools
    tok.chat_template = (
        "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert template_supports_tools(tok)
    # either way tools are refused (replies are not parsed into tool_calls yet), saying which case it is
    with_support = refusal({"tools": [WEATHER_TOOL]}, model_name="m", tools_supported=True)
    without = refusal({"tools": [WEATHER_TOOL]}, model_name="m", tools_supported=False)
    assert with_support is not None and without is not None and with_support.message != without.message
    assert refusal({"tool_choice": "none", "temperature": 0}, model_name="m", tools_supported=False) is None
