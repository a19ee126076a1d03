"""Web agent: a sliding window over the last few pages on top of a growing transcript, with
revisits (back button, returning to a results page) and exploratory forks.

Per step the agent acts (a short message), lands on a page (a screenshot + its accessibility
text), and queries the model. Steps record their idle time: none while the model writes its
action, the page's load time (500-3,000 ms) before the page lands; a revisit's action names the
page it goes back to (``expect``). Only the last ``keep_pages`` pages stay in the window; the task
prompt and the transcript of actions stay. A revisit of an unchanged page recalls its chunks;
a changed page arrives as new content. Now and then the agent forks to peek at a link and
discards (or keeps) the branch.
"""

from __future__ import annotations

from .builder import TraceBuilder, content_hash
from .generators import header, register_generator, rng_for
from .io import Trace


@register_generator("web")
def generate_web(seed: int = 0, steps: int = 24, keep_pages: int = 3, revisit: float = 0.25, fork: float = 0.1) -> Trace:
    rng = rng_for("web", seed)
    idle = rng_for("web-idle", seed)  # its own stream: the trace's other draws do not change
    b = TraceBuilder(header("web", seed, steps=steps, keep_pages=keep_pages))
    b.step(t=0.0, label="task", idle=0.0)
    b.arrive("task", rng.randint(120, 400), content_hash("web", seed, "task"))
    pages: list[tuple[int, int]] = []  # (page, version) in visit order
    version: dict[int, int] = {}
    in_window: list[tuple[int, int]] = []
    t = 0.0
    n_pages = 0

    def chunks_of(p: int, v: int) -> list[str]:
        return [f"page{p}.v{v}.shot", f"page{p}.v{v}.text"]

    def land(p: int, v: int, new: bool) -> None:
        shot, text = chunks_of(p, v)
        r = random_sizes[(p, v)]
        b.arrive(shot, r[0], content_hash("web", seed, p, v, "shot"), "image")
        b.arrive(text, r[1], content_hash("web", seed, p, v, "text"))
        in_window.append((p, v))
        while len(in_window) > keep_pages:
            old = in_window.pop(0)
            for c in chunks_of(*old):
                b.evict(c)

    random_sizes: dict[tuple[int, int], tuple[int, int]] = {}
    for s in range(steps):
        t += rng.uniform(800, 6000)
        b.step(t=round(t, 1), label=f"step{s}", idle=0.0)
        b.arrive(f"act{s}", rng.randint(20, 120), content_hash("web", seed, "act", s))
        if pages and rng.random() < revisit:
            p, v = rng.choice(pages[:-1] or pages)
            if rng.random() < 0.3:  # the page changed since: a new version
                v = version[p] = version[p] + 1
                random_sizes[(p, v)] = (rng.randint(900, 2400), rng.randint(200, 1500))
                pages.append((p, v))
        else:
            p, v = n_pages, 0
            n_pages += 1
            version[p] = 0
            random_sizes[(p, v)] = (rng.randint(900, 2400), rng.randint(200, 1500))
            pages.append((p, v))
        if (p, v) in in_window:
            in_window.remove((p, v))
            for c in chunks_of(p, v):
                b.evict(c)
        for c in chunks_of(p, v):  # a revisit: the action names the page it goes back to
            b.expect(c)
        b.step(label=f"load{s}", idle=idle.uniform(500, 3000))  # the page loads
        land(p, v, True)
        b.query(rng.randint(30, 90), rng.randint(15, 80))
        if rng.random() < fork:
            b.fork(f"peek{s}")
            q = n_pages
            n_pages += 1
            version[q] = 0
            random_sizes[(q, 0)] = (rng.randint(900, 2400), rng.randint(200, 1500))
            saved = list(in_window)
            land(q, 0, True)
            b.query(rng.randint(30, 90), rng.randint(5, 30))
            if rng.random() < 0.7:
                b.discard(f"peek{s}")
                in_window[:] = saved
            else:
                b.commit(f"peek{s}")
                pages.append((q, 0))
    return b.build(name=f"web-{seed}")
