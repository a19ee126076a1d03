"""``contextdeque loadtest``: N concurrent clients replaying multi-turn agent conversations
against one or more ``serve`` replicas (or any OpenAI-compatible endpoint).

Each conversation is generated from a seed: a system prompt, then turns whose user message
carries a document excerpt (tool output / page text, from Python's own documentation topics)
and a question; every reply is appended as the assistant message before the next turn, as an
agent framework does. Client ``i`` plays conversations ``i, i+N, ...`` against replica
``i % R`` (streaming, so time-to-first-token is measured at the client). With ``--failover``,
a request that cannot reach its replica is retried on the next one (counted), so a
conversation survives a replica's death. ``think_s`` pauses each client between turns (an agent
running its tools or a user reading): the idle time a latency-first server heals in.

Reports throughput, p50/p99 latency and TTFT (overall, per replica and per turn), prompt
tokens vs tokens the servers prefilled (from the ``usage.contextdeque`` extension), encode
forwards, errors; ``--responses FILE`` writes every reply (JSONL), ``--plot FILE`` draws TTFT
per turn and the latency timeline.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..core.errors import FetchError

SYSTEM = "You are a research agent. Read the tool output and answer in one sentence."
QUESTIONS = ("What is the main point of this section?", "Which keyword does it explain?",
             "Summarize the last paragraph.", "What should the agent do next?")


def make_conversations(n: int, turns: int, seed: int = 0, doc_words: int = 60) -> list[list[str]]:
    """``n`` conversations of ``turns`` user messages each (deterministic in ``seed``)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = []
        for t in range(turns):
            words = topics[rng.choice(keys)].split()
            start = rng.randrange(max(1, len(words) - doc_words))
            doc = " ".join(words[start : start + doc_words])
            conv.append(f"Tool output (step {t + 1}):\n{doc}\n\n{rng.choice(QUESTIONS)}")
        out.append(conv)
    return out


@dataclass
class Sample:
    """One request as the client saw it."""

    conversation: int
    turn: int
    replica: str
    start_s: float
    latency_s: float | None = None
    ttft_s: float | None = None
    ok: bool = False
    error: str | None = None
    failover: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_prefilled: int | None = None
    encodes: int | None = None
    text: str | None = None


def _stream_chat(client: Any, url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                 headers: dict[str, str], t0: float, timeout: float) -> tuple[str, float | None, dict[str, Any]]:
    """One streamed chat completion: (text, ttft seconds, usage)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    text, ttft, usage, done = [], None, {}, False
    with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error'].get('message')}")
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            if ev.get("usage"):
                usage = ev["usage"]
    if not done:
        raise RuntimeError("the stream ended before [DONE] (server gone?)")
    return "".join(text), ttft, usage


def run_loadtest(
    urls: Sequence[str], *, model: str | None = None, clients: int = 8, conversations: int | None = None,
    turns: int = 4, max_tokens: int = 16, seed: int = 0, api_key: str | None = None, failover: bool = False,
    timeout: float = 300.0, doc_words: int = 60, stop_after_s: float | None = None, think_s: float = 0.0,
) -> dict[str, Any]:
    """Run the load test; returns the report (see the module docstring) with every sample."""
    import httpx

    urls = [u.rstrip("/") for u in urls]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if model is None:
        try:
            reply = httpx.get(urls[0] + "/v1/models", headers=headers, timeout=30)
            reply.raise_for_status()
            model = reply.json()["data"][0]["id"]
        except httpx.HTTPError as exc:
            raise FetchError(f"{urls[0]}: no contextdeque serve answers there ({type(exc).__name__}: {exc})") from exc
    convs = make_conversations(conversations or clients, turns, seed, doc_words)
    samples: list[Sample] = []
    replies: dict[int, list[str]] = {}
    lock = threading.Lock()
    t_start = time.perf_counter()

    def play(client_id: int) -> None:
        home = client_id % len(urls)
        with httpx.Client() as http:
            for ci in range(client_id, len(convs), clients):
                messages = [{"role": "system", "content": SYSTEM}]
                replies[ci] = []
                for turn, user in enumerate(convs[ci]):
                    if turn and think_s > 0:
                        time.sleep(think_s)
                    if stop_after_s is not None and time.perf_counter() - t_start > stop_after_s:
                        return
                    messages.append({"role": "user", "content": user})
                    reply = None
                    for attempt in range(len(urls) if failover else 1):
                        url = urls[(home + attempt) % len(urls)]
                        t0 = time.perf_counter()
                        s = Sample(ci, turn, url, t0 - t_start, failover=attempt > 0)
                        try:
                            text, ttft, usage = _stream_chat(http, url, model, messages, max_tokens, headers, t0, timeout)
                            ext = usage.get("contextdeque") or {}
                            s.ok, s.latency_s, s.ttft_s, s.text = True, time.perf_counter() - t0, ttft, text
                            s.prompt_tokens = int(usage.get("prompt_tokens", 0))
                            s.completion_tokens = int(usage.get("completion_tokens", 0))
                            s.tokens_prefilled = ext.get("tokens_prefilled")
                            s.encodes = ext.get("encodes")
                            reply = text
                        except (httpx.HTTPError, RuntimeError, ValueError) as e:
                            s.latency_s, s.error = time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300]
                        with lock:
                            samples.append(s)
                        if reply is not None:
                            break
                    if reply is None:
                        break  # without a reply the conversation cannot go on the same way
                    replies[ci].append(reply)
                    messages.append({"role": "assistant", "content": reply})

    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(play, range(clients)))
    wall = time.perf_counter() - t_start
    return summarize(samples, wall, urls, replies, model)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _stats(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    lat = [s.latency_s for s in ok if s.latency_s is not None]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    prefilled = [s.tokens_prefilled for s in ok if s.tokens_prefilled is not None]
    return {
        "requests": len(samples), "ok": len(ok), "errors": len(samples) - len(ok),
        "failovers": sum(s.failover for s in samples),
        "throughput_rps": len(ok) / wall if wall > 0 else 0.0,
        "completion_tokens_per_s": sum(s.completion_tokens for s in ok) / wall if wall > 0 else 0.0,
        "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "tokens_prefilled": sum(prefilled) if prefilled else None,
        "prefill_avoided": (sum(s.prompt_tokens for s in ok if s.tokens_prefilled is not None) - sum(prefilled)) if prefilled else None,
        "encodes": sum(s.encodes for s in ok if s.encodes is not None),
    }


def summarize(samples: list[Sample], wall: float, urls: Sequence[str], replies: dict[int, list[str]], model: str) -> dict[str, Any]:
    samples = sorted(samples, key=lambda s: s.start_s)
    turns = sorted({s.turn for s in samples})
    return {
        "model": model, "wall_s": wall, "replicas": list(urls),
        "total": _stats(samples, wall),
        "by_replica": {u: _stats([s for s in samples if s.replica == u], wall) for u in urls},
        "by_turn": {t: {"ttft_mean_s": statistics.fmean(x) if (x := [s.ttft_s for s in samples if s.turn == t and s.ttft_s is not None]) else None,
                        "latency_mean_s": statistics.fmean(y) if (y := [s.latency_s for s in samples if s.turn == t and s.ok and s.latency_s is not None]) else None,
                        "requests": sum(s.turn == t for s in samples)} for t in turns},
        "replies": {str(k): v for k, v in sorted(replies.items())},
        "errors": sorted({s.error for s in samples if s.error})[:20],
        "samples": [asdict(s) for s in samples],
    }


def plot(report: dict[str, Any], path: str, baseline: dict[str, Any] | None = None) -> None:
    """TTFT per turn (with a baseline run when given) and the latency timeline per replica."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for rep, label in ((report, "this run"), (baseline, "baseline")):
        if rep is None:
            continue
        turns = sorted(int(t) for t in rep["by_turn"])
        ys = [rep["by_turn"][t if t in rep["by_turn"] else str(t)]["ttft_mean_s"] for t in turns]
        a.plot([t + 1 for t in turns], [None if y is None else y * 1000 for y in ys], marker="o", label=f"{label}: {rep['replicas'][0]}")
    from matplotlib.ticker import MaxNLocator

    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_xlabel("turn"), a.set_ylabel("mean TTFT (ms)"), a.set_title("time to first token per turn"), a.legend(fontsize=7)
    for i, u in enumerate(report["replicas"]):
        ok = [s for s in report["samples"] if s["replica"] == u and s["ok"]]
        bad = [s for s in report["samples"] if s["replica"] == u and not s["ok"]]
        b.scatter([s["start_s"] for s in ok], [s["latency_s"] * 1000 for s in ok], s=8, label=f"{u} ok")
        if bad:
            b.scatter([s["start_s"] for s in bad], [s["latency_s"] * 1000 for s in bad], s=30, marker="x", label=f"{u} failed")
    b.set_xlabel("request start (s)"), b.set_ylabel("latency (ms)"), b.set_title("requests over time"), b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
