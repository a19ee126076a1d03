"""WebAgent: browses a real HTTP site with a sliding window of the last few pages over a growing
transcript, and answers questions about what it read.

By default the site is the documentation server that ships with Python (``python -m pydoc``),
started and stopped by :class:`PydocServer`. Pages are fetched with httpx; their HTML becomes
text through inscriptis (an HTML-to-text renderer) and their links are read with lxml — no
hand-written parsing. What the agent keeps of a page is its first ``max_page_tokens`` tokens
(what a browser agent sees of it first; ``None``: the whole page, refused with ``BudgetError`` if
it is larger than the window).

Each step visits one URL:

- a page never seen (or whose content changed) is appended: encoded once, patched on what is
  in front of it;
- a page seen before with the same content is **recalled** (canonical + a fresh patch; it is
  never re-encoded, whatever tier the store keeps it in);
- the window keeps at most ``pages_in_window`` pages: the oldest page steps out (evicted,
  recallable; the transcript and the other pages only re-rotate);
- after a question, the question and the model's answer are appended to the transcript;
- the page's load is the agent's idle time (``AgentRun.idle``): once the pages that step out have
  left, the window heals and, for a page read before, prepares its recall (``window.expect``),
  off the step's clock, so a revisit runs no forward on the critical path. The page is fetched
  before the step (a failed fetch leaves the window untouched); with the local pydoc server the
  load is instant, so the heal stands in for the wait a real site's load gives.

Navigation is a seeded scripted policy (:meth:`WebAgent.tour`: index → topics → topic pages
chosen by the seed → back to pages already seen); **the model answers** the questions.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urljoin, urlsplit

from contextdeque.core.errors import AgentInputError, BudgetError, ContentTypeError, FetchError
from contextdeque.window import DEFAULT_RANK

from .base import AgentConfig, AgentRun, Step, chunk_hash


# ---------------------------------------------------------------------------- the site


class PydocServer:
    """Python's own documentation server (``python -m pydoc -n 127.0.0.1 -p 0``) in a child process.

    ``with PydocServer() as srv: srv.url`` — started on a free port of 127.0.0.1, stopped (``q``
    on its stdin, then a kill if it lingers) on exit.
    """

    def __init__(self, *, python: str | None = None, start_timeout: float = 60.0) -> None:
        self.python = python or sys.executable
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> "PydocServer":
        if self.proc is not None:
            return self
        self.proc = subprocess.Popen(
            [self.python, "-m", "pydoc", "-n", "127.0.0.1", "-p", "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if m:
                self.url = m.group(1)
                return self
        self.stop()
        raise FetchError(f"the pydoc server did not start (last output: {line.strip()!r})")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write("q\n")
                proc.stdin.flush()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait(timeout=10)
        finally:
            for f in (proc.stdin, proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass

    def __enter__(self) -> "PydocServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass(frozen=True)
class WebPage:
    """A fetched page: its final ``url``, ``title``, extracted ``text`` and same-site ``links``."""

    url: str
    title: str
    text: str
    links: tuple[str, ...]


def html_to_text(html: str) -> str:
    """Visible text of an HTML page (inscriptis renders it as a browser would lay it out), with
    runs of blanks folded."""
    from inscriptis import get_text

    lines = [re.sub(r"[ \t\u00a0]+", " ", ln).strip() for ln in get_text(html).splitlines()]
    text = "\n".join(ln for ln in lines if ln)
    return text


def page_links(html: str, base: str) -> tuple[str, ...]:
    """Absolute same-site links of an HTML page (lxml), in document order, without duplicates."""
    import lxml.html

    doc = lxml.html.fromstring(html)
    site = urlsplit(base).netloc
    out: dict[str, None] = {}
    for el, attr, link, _ in doc.iterlinks():
        if el.tag != "a" or attr != "href":
            continue
        u = urljoin(base, link).split("#", 1)[0]
        if urlsplit(u).netloc == site:
            out[u] = None
    return tuple(out)


def fetch_page(client: Any, url: str) -> WebPage:
    """GET ``url`` and extract it.

    Raises:
        FetchError: the host is unreachable, the request timed out, or the server answered an
            HTTP error status.
        ContentTypeError: the response is not HTML.
    """
    import httpx

    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise AgentInputError(f"url must be an http(s) URL, got {url!r}")
    try:
        resp = client.get(url, follow_redirects=True)
    except httpx.TimeoutException as exc:
        raise FetchError(f"{url}: timed out ({exc})") from exc
    except httpx.HTTPError as exc:
        raise FetchError(f"{url}: unreachable ({type(exc).__name__}: {exc})") from exc
    if resp.status_code >= 400:
        raise FetchError(f"{url}: HTTP {resp.status_code}")
    ctype = resp.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in ("text/html", "application/xhtml+xml"):
        raise ContentTypeError(f"{url}: not an HTML page (content-type {ctype or 'missing'!r})")
    html = resp.text
    m = re.search(r"<title>(.*?)</title>", html, flags=re.S | re.I)
    title = re.sub(r"\s+", " ", m.group(1)).strip() if m else url
    return WebPage(url=str(resp.url), title=title, text=html_to_text(html), links=page_links(html, str(resp.url)))


# ---------------------------------------------------------------------------- the agent


class WebAgent:
    """Browses with a sliding window of pages over a growing transcript (see the module).

    Args:
        backend: an ``HFBackend`` with a tokenizer.
        config: window and measurement settings.
        pages_in_window: most pages kept in the window at once.
        max_page_tokens: tokens kept of each page (None: all; a larger-than-window page is refused).
        timeout: HTTP timeout in seconds.
        on_step: called with every finished step.
    """

    kind = "web"
    default_rank = DEFAULT_RANK  # (its config's rank=None)

    def __init__(self, backend: Any, config: AgentConfig | None = None, *, pages_in_window: int = 3,
                 max_page_tokens: int | None = 160, timeout: float = 10.0,
                 on_step: Callable[[Step], None] | None = None) -> None:
        import httpx

        self.backend = backend
        self.config = (config or AgentConfig()).with_default_rank(self.default_rank)
        self.pages_in_window = int(pages_in_window)
        self.max_page_tokens = max_page_tokens
        self.client = httpx.Client(timeout=timeout)
        self.run = AgentRun(backend, self.config, generator="web", agent="WebAgent", on_step=on_step)
        self.history: list[str] = []           # urls visited, in order
        self.pages: dict[str, WebPage] = {}    # url -> last fetched page
        self._label_of_content: dict[str, str] = {}  # content hash -> chunk label
        self._page_labels: list[str] = []      # page chunks in the window, oldest first
        self._notes = 0

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "WebAgent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _page_ids(self, page: WebPage) -> list[int]:
        ids = self.backend.tokenize(f"[page {page.title} | {urlsplit(page.url).path or '/'}]\n{page.text}\n\n")
        if self.max_page_tokens is not None:
            ids = ids[: self.max_page_tokens]
        return ids

    def visit(self, url: str, question: str | None = None) -> Step:
        """Fetch ``url`` into the window (append, or recall when it was read before), keep at most
        ``pages_in_window`` pages, and answer ``question`` if given.

        Raises:
            FetchError / ContentTypeError: the page could not be had (the window is unchanged).
            BudgetError: the page alone is larger than the window (the window is unchanged).
        """
        page = fetch_page(self.client, url)
        ids = self._page_ids(page)
        budget = self.config.budget_tokens
        if len(ids) > budget:
            raise BudgetError(
                f"{url}: the page has {len(ids)} tokens, more than the window budget of {budget}; "
                "set max_page_tokens or a larger budget"
            )
        run = self.run
        key = chunk_hash(tuple(ids))
        label = self._label_of_content.get(key)
        path = urlsplit(page.url).path or "/"
        st = run.begin("visit", path)
        if label is not None and run.in_window(label):
            st.detail = f"{path} (already in the window)"
        else:
            while len(self._page_labels) >= self.pages_in_window:
                old = self._page_labels.pop(0)
                run.evict(old)
                st.notes.append(f"page {old} steps out")
            self._make_room(len(ids), st)
            if label is not None:  # a page read before: say so, so the wait prepares its recall
                run.expect([label])
            run.idle("page load")
            if label is not None:
                run.recall(label)
                st.detail = f"{path} (revisit: recalled, not re-encoded)"
            else:
                label = f"page{len(self._label_of_content) + 1}"
                self._label_of_content[key] = label
                run.append(label, token_ids=ids, content_key=key)
                st.detail = f"{path} (new: {len(ids)} tokens)"
            self._page_labels.append(label)
        self.history.append(page.url)
        self.pages[page.url] = page
        if question is not None:
            run.ask(question)
        run.end()
        if question is not None and run.steps[-1].answer is not None:
            self._note(question, run.steps[-1].answer)
        return run.steps[-1]

    def _make_room(self, need: int, st: Step) -> None:
        """Evict the oldest transcript notes, then the oldest pages, until ``need`` tokens fit."""
        run = self.run
        budget = self.config.budget_tokens
        while run.window.tokens_used + need > budget:
            notes = [lab for lab in run.labels if lab.startswith("note")]
            victim = notes[0] if notes else (self._page_labels.pop(0) if self._page_labels else None)
            if victim is None:
                break
            run.evict(victim)
            st.notes.append(f"{victim} steps out (budget)")

    def _note(self, question: str, answer: str) -> None:
        """Append the question and the model's answer to the transcript."""
        ids = self.backend.tokenize(f"[note] Q: {question} A: {answer}\n\n")[:64]
        run = self.run
        st = run.begin("note", f"transcript +{len(ids)} tokens")
        self._make_room(len(ids), st)
        self._notes += 1
        run.append(f"note{self._notes}", token_ids=ids, content_key=chunk_hash(tuple(ids)))
        run.end()

    def tour(self, base_url: str, *, topics: int = 3, seed: int | None = None) -> AgentRun:
        """The scripted browse: the index, the topics list, ``topics`` topic pages (seeded), then
        back to the topics list and to the first topic (revisits), asking about each topic page."""
        rng = random.Random(self.config.seed if seed is None else seed)
        self.visit(base_url)
        topics_url = urljoin(base_url, "topics.html")
        self.visit(topics_url)
        links = [u for u in self.pages[self.history[-1]].links if "topic?key=" in u]
        if not links:
            raise FetchError(f"{topics_url}: no topic links found")
        chosen = rng.sample(links, min(topics, len(links)))
        for u in chosen:
            key = u.split("key=", 1)[1]
            self.visit(u, question=f"What does the documentation page about {key} describe? Answer in one sentence.")
        self.visit(topics_url)  # back: a revisit
        key = chosen[0].split("key=", 1)[1]
        self.visit(chosen[0], question=f"Going back to {key}: what is its first rule?")
        return self.run


def run_tour(backend: Any, config: AgentConfig, on_step: Callable[[Step], None] | None = None, *,
             topics: int = 3, pages_in_window: int = 3, max_page_tokens: int | None = 160) -> AgentRun:
    """Start the pydoc server, run :meth:`WebAgent.tour` on it, stop the server."""
    with PydocServer() as srv, WebAgent(backend, config, pages_in_window=pages_in_window,
                                        max_page_tokens=max_page_tokens, on_step=on_step) as agent:
        return agent.tour(srv.url, topics=topics)


__all__ = ["WebAgent", "PydocServer", "WebPage", "fetch_page", "html_to_text", "page_links", "run_tour"]
