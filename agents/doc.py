"""DocAgent: reads a document larger than its window, page by page, and answers questions about it.

Coarse to fine:

1. **skim** — every page is read once, in order (``append``: encoded once, ever), and **the model
   is asked** whether it helps with the questions (yes / no from its next-token logits: a model
   call per page, as an agent reading a document makes). The window is smaller than the
   document, so the oldest pages slide out as it fills (survivors only re-rotate); every page
   stays recallable. The next page is known before its step: it is read ahead in the idle time
   before it (``AgentRun.read_ahead``: its canonical and the patches it gets where it will land),
   so the step itself runs only the question's forward.
2. **filter** — for each question the pages are ranked (the scripted part: an idf-weighted
   word-overlap score, weighted up where the model said yes, ties broken by the seed) and the
   top ``pages_per_question`` are chosen.
3. **drop** (its own step) — when the chosen pages do not fit beside what is in the window, the least relevant
   resident pages are put to the model first: ``is_disposable`` decodes the question with the
   page's conditioning off and with the page dropped, and the page is evicted only if the
   model's answer does not change (**the model decides**). If that frees too little, the least
   relevant pages are evicted anyway (said in the step's notes).
4. **re-read** — the chosen pages that left are ``recall``-ed (canonical + a fresh patch on what
   now precedes them; never re-encoded) and **the model answers** from the window. The agent
   says which pages it will re-read (``window.expect``) before the step, so the idle time before
   it prepares those patches and the re-read runs no forward on the critical path.

Input: plain text (paged by token count at paragraph boundaries), a list of page texts, or a
PDF file (one page per PDF page, text extracted with pypdf). A page larger than the window is
refused (``BudgetError``) before the window is touched.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from contextdeque.core.errors import AgentInputError, BudgetError, MediaError, MediaTypeError

from .base import AgentConfig, AgentRun, Step, chunk_hash

_WORD = re.compile(r"[a-z][a-z0-9_]{2,}")
_STOP = frozenset(
    "the and for that this with are was were from which when what does into not but can has have its "
    "any all one may must each also other only than then there their they them will would such".split()
)


DOC_RANK = 64
"""The DocAgent's patch rank where its config names none (``AgentConfig.rank=None``), measured on the
default model (SmolLM2-135M, the demo's 160-token pages): at the first question's arrangement (three
patched pages behind the front one, every one valid: the window equals the eager policy's), the mean
next-token KL over the question and the first 8 answer tokens against a re-prefill was 3.4e-3 at rank
32, 1.2e-3 at 48, 6.2e-4 at 64 and 4.5e-4 at 96 (the first token: 6.6e-3 / 4.4e-3 / 2.2e-3 /
1.4e-3). A page this short carries a conditioning deficit of high rank (Δ is at most 160 x 192 per
layer): rank 32 keeps a fifth of its directions, and several patched pages add their residuals up.
Rank 64 is the knee; its patches are about three quarters of a page's bytes (formed in idle time,
the same forward as at rank 32)."""


@dataclass(frozen=True)
class Page:
    """One page: its ``label`` (``p3``), text and token ids (``n_tokens`` of them)."""

    label: str
    text: str
    token_ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def paginate(text: str, backend: Any, page_tokens: int, *, prefix: str = "p") -> list[Page]:
    """Cut ``text`` into pages of at most ``page_tokens`` tokens at paragraph boundaries (a longer
    paragraph is cut at token boundaries)."""
    if page_tokens < 1:
        raise AgentInputError(f"page_tokens must be >= 1, got {page_tokens}")
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    pages_text: list[str] = []
    cur: list[str] = []
    cur_n = 0
    for para in paras:
        n = len(backend.tokenize(para)) + 2
        if n > page_tokens:
            if cur:
                pages_text.append("\n\n".join(cur))
                cur, cur_n = [], 0
            ids = backend.tokenize(para)
            for i in range(0, len(ids), page_tokens - 2):
                pages_text.append(backend.tokenizer.decode(ids[i : i + page_tokens - 2]))
            continue
        if cur and cur_n + n > page_tokens:
            pages_text.append("\n\n".join(cur))
            cur, cur_n = [], 0
        cur.append(para)
        cur_n += n
    if cur:
        pages_text.append("\n\n".join(cur))
    return make_pages(pages_text, backend, prefix=prefix)


def make_pages(texts: Sequence[str], backend: Any, *, prefix: str = "p") -> list[Page]:
    """Pages from page texts, as given (empty pages are skipped; labels count the kept ones)."""
    out = []
    for t in texts:
        if not isinstance(t, str):
            raise MediaTypeError(f"a page must be text, got {type(t).__name__}")
        if not t.strip():
            continue
        label = f"{prefix}{len(out) + 1}"
        ids = tuple(backend.tokenize(f"[{label}]\n{t.strip()}\n\n"))
        out.append(Page(label, t.strip(), ids))
    return out


def pdf_pages(path: str | Path) -> list[str]:
    """The text of every page of a PDF file (pypdf).

    Raises:
        MediaError: the file is missing, not a PDF, encrypted, or has no extractable text.
    """
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(str(path))
        if reader.is_encrypted:
            raise MediaError(f"{path}: the PDF is encrypted")
        texts = [page.extract_text() or "" for page in reader.pages]
    except MediaError:
        raise
    except (PyPdfError, OSError, ValueError, KeyError) as exc:
        raise MediaError(f"{path}: not a readable PDF ({exc})") from exc
    if not any(t.strip() for t in texts):
        raise MediaError(f"{path}: the PDF has no extractable text (a scan? run OCR first)")
    return texts


def load_pages(document: Any, backend: Any, page_tokens: int) -> list[Page]:
    """Pages of ``document``: a ``Path`` to a ``.pdf`` (one page per PDF page) or a text file
    (paginated), a ``str`` of text (paginated), or a list of page texts (as given)."""
    if isinstance(document, Path):
        if document.suffix.lower() == ".pdf":
            return make_pages(pdf_pages(document), backend)
        try:
            text = document.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MediaError(f"{document}: cannot read the document ({exc})") from exc
        return paginate(text, backend, page_tokens)
    if isinstance(document, str):
        return paginate(document, backend, page_tokens)
    if isinstance(document, Sequence):
        return make_pages(list(document), backend)
    raise MediaTypeError(f"document must be a Path, text or a list of page texts, got {type(document).__name__}")


def _words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class Relevance:
    """The scripted filter: idf-weighted overlap of a question's words with a page's (seeded ties)."""

    def __init__(self, pages: Sequence[Page], seed: int = 0) -> None:
        self.pages = list(pages)
        self.words = [set(_words(p.text)) for p in self.pages]
        n = len(self.pages)
        df: dict[str, int] = {}
        for ws in self.words:
            for w in ws:
                df[w] = df.get(w, 0) + 1
        self.idf = {w: math.log((n + 1) / (c + 0.5)) for w, c in df.items()}
        rng = random.Random(seed)
        self.jitter = [rng.random() * 1e-6 for _ in self.pages]

    def scores(self, question: str) -> dict[str, float]:
        q = set(_words(question))
        return {p.label: sum(self.idf.get(w, 0.0) for w in q & ws) + j
                for p, ws, j in zip(self.pages, self.words, self.jitter)}

    def ranked(self, question: str) -> list[str]:
        s = self.scores(question)
        return sorted(s, key=lambda k: -s[k])


class DocAgent:
    """Answers questions over a document read through a window smaller than it (see the module).

    Args:
        backend: an ``HFBackend`` with a tokenizer.
        config: window and measurement settings (:class:`AgentConfig`).
        page_tokens: page size when paginating text.
        pages_per_question: pages re-read for each question.
        disposable_tests: at most this many ``is_disposable`` verdicts asked per question.
        judge_pages: while skimming, ask the model about every page (its yes/no weighs in the filter).
        on_step: called with every finished step (live display).
    """

    kind = "doc"
    default_rank = DOC_RANK

    def __init__(self, backend: Any, config: AgentConfig | None = None, *, page_tokens: int = 160,
                 pages_per_question: int = 2, disposable_tests: int = 2, judge_pages: bool = True,
                 on_step: Callable[[Step], None] | None = None) -> None:
        self.backend = backend
        self.config = (config or AgentConfig()).with_default_rank(self.default_rank)
        self.page_tokens = int(page_tokens)
        self.pages_per_question = int(pages_per_question)
        self.disposable_tests = int(disposable_tests)
        self.judge_pages = bool(judge_pages)
        self.on_step = on_step
        self.pages: list[Page] = []
        self.run: AgentRun | None = None

    def _drop(self, run: AgentRun, q: str, chosen: list[str], scores: dict[str, float], need_tokens: int,
              by_label: dict[str, Page], name: str) -> None:
        """Make room for the pages ``q`` needs: the least relevant resident pages are put to the
        model (``is_disposable``) and evicted if its answer does not change without them; past
        ``disposable_tests`` verdicts, the least relevant are evicted anyway."""
        cfg = self.config
        st = run.begin("drop", f"{name}: make room for {need_tokens} tokens")
        free = cfg.budget_tokens - run.window.tokens_used
        tests = 0
        for lab in sorted((x for x in run.labels if x not in chosen), key=lambda x: scores[x]):
            if free >= need_tokens:
                break
            if tests < self.disposable_tests:
                tests += 1
                if not run.is_disposable(lab, q).disposable:
                    st.notes.append(f"kept {lab}: the model's answer changes without it")
                    continue
                st.notes.append(f"dropped {lab}: the model's answer does not change")
            else:
                st.notes.append(f"dropped {lab}: least relevant")
            run.evict(lab)
            free += by_label[lab].n_tokens
        run.end()

    def answer(self, document: Any, questions: Sequence[str]) -> AgentRun:
        """Skim ``document``, then answer each question (filter, drop, re-read). Returns the run
        (``steps``, ``summary()``, ``write_trace()``, ``window``).

        Raises:
            BudgetError: a page is larger than the window budget (nothing was read).
            MediaError / MediaTypeError: the document cannot be read.
        """
        cfg = self.config
        if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
            raise AgentInputError("questions must be a non-empty list of non-empty strings")
        pages = load_pages(document, self.backend, self.page_tokens)
        if not pages:
            raise MediaError("the document has no text")
        too_big = [p for p in pages if p.n_tokens > cfg.budget_tokens]
        if too_big:
            p = too_big[0]
            raise BudgetError(
                f"page {p.label} has {p.n_tokens} tokens, more than the window budget of {cfg.budget_tokens}; "
                "use smaller pages or a larger budget"
            )
        self.pages = pages
        run = self.run = AgentRun(self.backend, cfg, generator="doc", agent="DocAgent", on_step=self.on_step)
        by_label = {p.label: p for p in pages}
        judge = "Does this page help answer any of these questions? " + " ".join(questions) + " Answer yes or no."
        votes: dict[str, bool] = {}
        for p in pages:  # skim: the model reads every page once and says whether it matters
            run.begin("read", p.label, ahead=[{"token_ids": list(p.token_ids)}])  # read ahead in the idle time before it
            run.append(p.label, token_ids=list(p.token_ids), content_key=chunk_hash(p.text))
            if self.judge_pages:
                votes[p.label] = run.ask(judge, choices=("yes", "no")).answer == "yes"
            run.end()
        rel = Relevance(pages, seed=cfg.seed)
        for i, q in enumerate(questions):
            scores = {lab: v * (1.5 if votes.get(lab) else 1.0) for lab, v in rel.scores(q).items()}
            chosen = sorted(scores, key=lambda k: -scores[k])[: self.pages_per_question]
            need = [lab for lab in chosen if not run.in_window(lab)]
            need_tokens = sum(by_label[lab].n_tokens for lab in need)
            if cfg.budget_tokens - run.window.tokens_used < need_tokens:
                self._drop(run, q, chosen, scores, need_tokens, by_label, f"q{i + 1}")
            run.expect(need)  # the pages it will re-read: prepared in the idle time before the step
            st = run.begin("query", f"q{i + 1}")
            for lab in need:
                run.recall(lab)
            st.detail = f"q{i + 1}: " + ", ".join(
                [f"re-read {lab}" for lab in need] + [f"{lab} in window" for lab in chosen if lab not in need]
            )
            run.ask(q)
            run.end()
        return run


__all__ = ["DocAgent", "Page", "paginate", "make_pages", "pdf_pages", "load_pages", "Relevance"]
