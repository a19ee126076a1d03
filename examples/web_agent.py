"""A web agent browsing Python's own documentation server with a sliding window of pages.

`PydocServer` starts `python -m pydoc` on a free local port; the WebAgent fetches pages with httpx
(HTML to text through inscriptis), keeps the last two pages over a growing transcript of questions
and answers, and revisits a page it read before: the revisit is a recall, never a re-encode.

Run:  .venv/bin/python examples/web_agent.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

from contextdeque.agents.base import AgentConfig
from contextdeque.agents.web import PydocServer, WebAgent


def main(backend: Any = None, max_new_tokens: int = 24, out_dir: str | Path | None = None) -> Any:
    if backend is None:
        from contextdeque.model import load_model

        backend = load_model()
    config = AgentConfig(budget_tokens=520, rank=32, max_new_tokens=max_new_tokens)
    with PydocServer() as srv, WebAgent(backend, config, pages_in_window=2, max_page_tokens=140) as agent:
        print("pydoc serving at", srv.url)
        topics = urljoin(srv.url, "topics.html")
        for url, question in [
            (srv.url, None),
            (topics, None),
            (urljoin(srv.url, "topic?key=ASSERTION"), "What does the assert statement do?"),
            (urljoin(srv.url, "topic?key=LOOPING"), "Which statements loop in Python?"),
            (topics, None),  # a revisit: recalled
            (urljoin(srv.url, "topic?key=ASSERTION"), "When is an assert statement ignored?"),
        ]:
            st = agent.visit(url, question=question)
            line = f"{st.index:3d} {st.op:5s} {st.detail[:52]:52s} fwd {st.forwards:3d} encodes {st.encodes}"
            if st.question:
                line += f" | KL {st.kl:.1e} -> {st.answer!r}"
            print(line + (f"  ({'; '.join(st.notes)})" if st.notes else ""))
        run = agent.run
    print("window:", run.labels)
    summary = run.summary()
    print(f"prefill avoided vs re-prefill: {100 * summary['prefill_avoided_vs_reprefill']:.0f}%")
    out = Path(out_dir or tempfile.mkdtemp(prefix="contextdeque-web-"))
    print("replay trace:", run.write_trace(out / "web.jsonl"))
    return run


if __name__ == "__main__":
    main()
