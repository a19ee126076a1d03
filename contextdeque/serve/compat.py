"""What of OpenAI's API ``contextdeque serve`` implements, and how it refuses the rest: a request
parameter the server would otherwise accept and silently ignore is answered with an
OpenAI-shaped 400 naming it (never a 200 that pretends), and an endpoint it does not serve with
a 404 naming the one it does. The choices are listed in ``docs/serve.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

SERVED_ENDPOINTS = ("POST /v1/chat/completions", "GET /v1/models", "GET /healthz", "GET /metrics")

# endpoints of OpenAI's API a client may try, with why this server does not serve them
UNSERVED_ENDPOINTS: dict[str, str] = {
    "/v1/completions": (
        "legacy completions are not served: a context window is built from chat messages (one chunk per "
        "message, cut along the model's chat template), and a raw prompt has none; send the prompt as a "
        "user message to POST /v1/chat/completions"
    ),
    "/v1/embeddings": "embeddings are not served: this server answers POST /v1/chat/completions only",
}


@dataclass(frozen=True)
class Refusal:
    """A request the server will not serve as asked: the 400's ``param``, ``code`` and message."""

    param: str
    code: str
    message: str


def _set(v: Any) -> bool:
    return v is not None and v != [] and v != {}


# parameter -> (is it asking for something; what the server would have to do)
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (bool, "log-probabilities are not returned"),
    "top_logprobs": (_set, "log-probabilities are not returned"),
    "logit_bias": (_set, "logit_bias is not applied"),
    "presence_penalty": (lambda v: _set(v) and v != 0, "presence_penalty is not applied"),
    "frequency_penalty": (lambda v: _set(v) and v != 0, "frequency_penalty is not applied"),
    "response_format": (lambda v: _set(v) and not (isinstance(v, dict) and v.get("type") == "text"),
                        "structured output (response_format) is not enforced"),
    "functions": (_set, "the legacy functions parameter is not served"),
    "function_call": (_set, "the legacy function_call parameter is not served"),
    "audio": (_set, "audio output is not served"),
    "prediction": (_set, "predicted outputs are not served"),
}


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders tool definitions (a template without tool
    support renders the same text with and without ``tools=``)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    msgs = [{"role": "user", "content": "x"}]
    probe = [{"type": "function", "function": {"name": "cdq_probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails with tools does not support them
        return False
    return with_tools != plain and "cdq_probe_tool" in with_tools


def refusal(body: dict[str, Any], *, model_name: str, tools_supported: bool) -> Refusal | None:
    """Why this server will not serve ``body`` (a chat completion request, as sent) as asked, or
    None. ``tools_supported``: `template_supports_tools` of the served model's tokenizer.

    Tools: a model whose chat template has no tool support (SmolLM2, the default) cannot be
    given tools at all; one whose template has them is refused too, because the server does not
    parse tool calls out of replies yet. Either way a 400, never tools accepted and ignored."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if _set(tools) or (choice is not None and choice != "none"):
        param = "tools" if _set(tools) else "tool_choice"
        if not tools_supported:
            why = (f"the served model ({model_name}) has a chat template without tool support, so it cannot be "
                   f"given tools: send tool results as messages and ask for answers in text")
        else:
            why = (f"tool calls are not served yet: the chat template of {model_name} renders tools, but "
                   f"contextdeque serve does not turn replies into tool_calls")
        return Refusal(param, "tools_not_supported", f"{param} refused: {why}")
    for name, (asks, what) in _UNSUPPORTED.items():
        if name in body and asks(body[name]):
            return Refusal(name, "unsupported_parameter", f"{name} refused: {what} by contextdeque serve")
    return None


def unserved_endpoint(method: str, path: str) -> str:
    """The 404 message of a path this server does not serve."""
    why = UNSERVED_ENDPOINTS.get(path.rstrip("/"))
    if why is not None:
        return f"{method} {path}: {why}"
    return f"{method} {path} is not an endpoint of this server; it serves {', '.join(SERVED_ENDPOINTS)}"
