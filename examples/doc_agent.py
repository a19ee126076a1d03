"""A document agent reading Python's language reference through a window smaller than the text.

The DocAgent skims every page once (encoded once, ever; the model says yes/no to "does this page
help?"), then for each question ranks the pages, lets the model decide which resident pages can be
dropped (`is_disposable`), recalls the pages it needs (never re-encoded) and answers. Each step
prints what the window did and what it cost beside a full re-prefill of the same window.

Run:  .venv/bin/python examples/doc_agent.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from contextdeque.agents.base import AgentConfig
from contextdeque.agents.doc import DocAgent
from contextdeque.agents.scenarios import DOC_QUESTIONS, demo_document


def main(backend: Any = None, max_new_tokens: int = 24, out_dir: str | Path | None = None) -> Any:
    if backend is None:
        from contextdeque.model import load_model

        backend = load_model()
    config = AgentConfig(budget_tokens=480, rank=32, max_new_tokens=max_new_tokens)
    agent = DocAgent(backend, config, page_tokens=120)
    document = demo_document(("pass", "break", "global", "nonlocal", "continue"))  # pydoc_data.topics
    run = agent.answer(document, list(DOC_QUESTIONS[:2]))
    print(f"{len(agent.pages)} pages, {sum(p.n_tokens for p in agent.pages)} tokens, window budget {config.budget_tokens}")
    for s in run.steps:
        cost = f"fwd {s.forwards:3d} encodes {s.encodes} tokens {s.tokens:4d}"
        if s.reprefill_tokens is not None:
            cost += f" | re-prefill {s.reprefill_tokens:4d} tokens, KL {s.kl:.1e}"
        print(f"{s.index:3d} {s.op:6s} {s.detail[:44]:44s} {cost}" + (f"  -> {s.answer!r}" if s.answer else ""))
    summary = run.summary()
    print(f"prefill avoided vs re-prefill: {100 * summary['prefill_avoided_vs_reprefill']:.0f}%, "
          f"encodes: {summary['encodes']} (one per page)")
    out = Path(out_dir or tempfile.mkdtemp(prefix="contextdeque-doc-"))
    print("replay trace:", run.write_trace(out / "doc.jsonl"))
    return run


if __name__ == "__main__":
    main()
