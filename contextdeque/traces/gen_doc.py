"""Document agent: coarse-to-fine over a document's pages, then re-access after filtering.

The agent first reads low-resolution thumbnails of every page (a few hundred tokens each) and
asks which pages matter; it drops the thumbnails and reads the selected pages at full
resolution (1,000-2,500 tokens of page image plus their extracted text); after filtering again it
goes back to earlier thumbnails and pages (recalls) and moves the most relevant page next to
the question (a reorder). Steps record their idle time: none while the model selects, a page's
rendering (300-1,500 ms) before it is read, and before the re-access; the agent names the pages
and thumbnails it goes back to (``expect``), and the order it will then move the most relevant
page into (``expect`` with ``order``).
"""

from __future__ import annotations

from .builder import TraceBuilder, content_hash
from .generators import header, register_generator, rng_for
from .io import Trace


@register_generator("doc")
def generate_doc(seed: int = 0, pages: int = 10, select: int = 4, rounds: int = 4) -> Trace:
    rng = rng_for("doc", seed)
    idle = rng_for("doc-idle", seed)  # its own stream: the trace's other draws do not change
    b = TraceBuilder(header("doc", seed, pages=pages, select=select, rounds=rounds))
    t = 0.0
    b.step(t=t, label="question", idle=0.0)
    b.arrive("question", rng.randint(40, 160), content_hash("doc", seed, "question"))
    thumbs = [f"thumb{p}" for p in range(pages)]
    thumb_tokens = rng.choice([196, 256, 324])
    full_tokens = {p: rng.randint(1000, 2500) for p in range(pages)}
    text_tokens = {p: rng.randint(150, 700) for p in range(pages)}
    b.step(t=(t := t + 500.0), label="overview", idle=idle.uniform(300, 1500))
    for p in range(pages):
        b.arrive(thumbs[p], thumb_tokens, content_hash("doc", seed, "thumb", p), "image")
    b.query(rng.randint(30, 80), rng.randint(10, 40))
    read: list[int] = []
    for r in range(rounds):
        b.step(t=(t := t + rng.uniform(3000, 9000)), label=f"round{r}", idle=0.0)
        chosen = sorted(rng.sample(range(pages), select))
        for c in list(b.window):
            if c.startswith("thumb") and int(c[5:]) not in chosen:
                b.evict(c)
        for p in chosen:  # read page by page, asking about each
            for c in (f"page{p}.image", f"page{p}.text"):  # a page read before comes back: the agent names it
                b.expect(c)
            b.step(label=f"read{r}.{p}", idle=idle.uniform(300, 1500))  # the page is rendered
            b.arrive(f"page{p}.image", full_tokens[p], content_hash("doc", seed, "page", p), "image")
            b.arrive(f"page{p}.text", text_tokens[p], content_hash("doc", seed, "text", p))
            read.append(p)
            b.query(rng.randint(20, 60), rng.randint(10, 60))
        b.query(rng.randint(30, 80), rng.randint(20, 120))
        # filter: keep the two most relevant pages, drop the rest
        keep = set(rng.sample(chosen, 2))
        for p in chosen:
            if p not in keep:
                b.evict(f"page{p}.image")
                b.evict(f"page{p}.text")
        for c in list(b.window):
            if c.startswith("thumb"):
                b.evict(c)
        # re-access: earlier pages and thumbnails come back, ordered by relevance
        back = rng.sample(sorted(set(read)), min(2, len(set(read))))
        thumbs_back = rng.sample(range(pages), 3)
        again = [c for p in back for c in (f"page{p}.image", f"page{p}.text")] + [thumbs[p] for p in thumbs_back]
        for c in again:  # the agent says what it goes back to, in order
            b.expect(c)
        # the window once they are back; the agent knows now whether it will move the most
        # relevant page next to the question at the end, and says so too
        after = list(b.window) + [c for c in again if c not in b.window]
        order = None
        if rng.random() < 0.7:
            pages_in = sorted({c.split(".")[0] for c in after if c.startswith("page")})
            if pages_in:
                top = rng.choice(pages_in)
                moved = [c for c in after if c.split(".")[0] == top]
                order = [c for c in after if c not in moved] + moved
        if order is not None and order != after:
            b.expect_order(order)
        b.step(label=f"reaccess{r}", idle=idle.uniform(300, 1500))
        for c in again:
            b.recall(c)
        if order is not None:
            b.reorder(order)
        for _ in range(rng.randint(1, 3)):  # cross-page questions over the re-accessed set
            b.query(rng.randint(30, 80), rng.randint(20, 120))
    return b.build(name=f"doc-{seed}")
