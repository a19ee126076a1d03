"""An agent framework's chat-messages list kept in step with a context window (MessageWindow).

Each call hands the whole list, as frameworks do; `sync` turns the difference into window
operations and says what it cost beside a re-prefill and a prefix cache. A tool result is
dropped from the list and comes back: it is recalled, never re-encoded.

Run:  .venv/bin/python examples/chat_messages.py
"""

from __future__ import annotations

from typing import Any

from contextdeque.agents import MessageWindow


def main(backend: Any = None, max_new_tokens: int = 24) -> MessageWindow:
    if backend is None:
        from contextdeque.model import load_model

        backend = load_model()
    mw = MessageWindow(backend, rank=32)
    messages = [
        {"role": "system", "content": "You are a terse travel assistant with a weather tool."},
        {"role": "user", "content": "What is the weather in Oslo today?"},
        {"role": "assistant", "content": "call weather(city='Oslo')"},
        {"role": "tool", "content": "weather('Oslo') -> 4C, light rain"},
    ]
    print(mw.sync(messages).summary())
    reply = mw.generate(max_new_tokens=max_new_tokens)
    print("assistant:", reply.text)
    mw.window.heal()  # idle time, waiting on the user: form what the latency-first window deferred
    messages += [{"role": "assistant", "content": reply.text or "..."},
                 {"role": "user", "content": "And should I take an umbrella?"}]
    print(mw.sync(messages).summary())
    without_tool = messages[:3] + messages[4:]
    print(mw.sync(without_tool).summary(), " <- the tool result left the list")
    rc = mw.sync(messages)
    print(rc.summary(), f" <- it came back: recalled, {rc.returned_encodes} re-encodes")
    print("assistant:", mw.generate(max_new_tokens=max_new_tokens).text)
    print("totals:", dict(mw.stats))
    return mw


if __name__ == "__main__":
    main()
