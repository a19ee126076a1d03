"""A sliding context window over Python's own documentation, on the embedded default model.

The window holds three documentation topics at a time. As new topics arrive the oldest slides
out: the survivors are only re-rotated (no forward). A question about a topic that already
left is answered by *recalling* it: its canonical KV comes back from the store with a fresh
conditioning patch on what now precedes it; it is never re-encoded. Every operation prints
its receipt (forwards, tokens prefilled, bytes moved per tier, wall time).

Run:  .venv/bin/python examples/sliding_window.py
"""

from __future__ import annotations

from pydoc_data.topics import topics

import contextdeque as cd
from contextdeque.window import ContextWindow

TOPICS = ["assert", "pass", "del", "break", "continue"]
TOKENS_PER_TOPIC = 96


def main(backend=None, max_new_tokens: int = 40) -> ContextWindow:
    backend = backend or cd.load_model()
    tok = backend.tokenizer
    docs = {}
    for name in TOPICS:
        ids = tok(topics[name], add_special_tokens=False)["input_ids"][:TOKENS_PER_TOPIC]
        docs[name] = tok.decode(ids)

    window = ContextWindow(backend, budget_tokens=3 * (TOKENS_PER_TOPIC + 8), rank=32)
    print(f"{backend!r}\nwindow budget: {window.budget_tokens} tokens after a {backend.root_len}-token root\n")

    refs = {}
    for name in TOPICS[:3]:
        refs[name] = window.append(docs[name])
        print(f"append {name!r:12} {refs[name].receipt.summary()}")

    print("\nthe window slides: the oldest topic leaves, the survivors only re-rotate")
    receipt = window.slide()
    print(f"slide()             {receipt.summary()}")
    for name in TOPICS[3:]:
        refs[name] = window.append(docs[name])  # the budget pushes the next-oldest out too
        left = ", ".join(n for n, r in refs.items() if r in refs[name].receipt.left)
        print(f"append {name!r:12} {refs[name].receipt.summary()}" + (f"  [slid out: {left}]" if left else ""))

    print("\nin the window:", [n for n, r in refs.items() if r in window])
    print("evicted (recallable):", [n for n, r in refs.items() if r in window.evicted_refs])

    question = "What does the assert statement do when its expression is false?"
    print(f"\nrecall 'assert' to answer: {question!r}")
    receipt = window.recall(refs["assert"])
    print(f"recall(assert)      {receipt.summary()}")
    print("                    placed: " + "; ".join(f"at {i} ({why})" for _, i, why in receipt.placed))
    print(f"                    patch kind(s): {[p.kind for p in window.patches(refs['assert'])]}, "
          f"cascade: {len(receipt.cascade.implied)} dependent(s) {receipt.cascade.action}ed")
    print("in the window:", [n for n, r in refs.items() if r in window])

    answer = window.generate(question, max_new_tokens=max_new_tokens)
    print(f"generate()          {answer.receipt.summary()}")
    print(f"\nanswer: {answer.text.strip()}")
    return window


if __name__ == "__main__":
    main()
