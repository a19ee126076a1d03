"""A re-read workload on vLLM, with contextdeque's connector and with vLLM's own prefix caching,
side by side on one engine (``contextdeque bench-vllm``; the ``vllm`` tests drive the same
conversation).

The conversation: a system prompt, four pages (sections of Python's language reference, shipped
with Python in ``pydoc_data``), one user message each, and a question. Turn 1 reads the pages in
order; turn 2 looks back at two of them; turn 3 — the measured turn — reorders all four and
recalls the two that left. vLLM's prefix cache reuses only the leading blocks a turn shares with
an earlier prompt; the connector serves every page it has seen, wherever it sits.

Arms, on one engine (the same weights, threads and warm state), each after
``reset_prefix_cache()`` and the same two earlier turns: ``apc`` (the connector off for the
request: vLLM's automatic prefix caching alone), ``connector`` (the latency-first policy: no
forward on a re-read) and ``connector-exact`` (full-rank patches: equal to vLLM's own prefill to
float rounding), each loaded layer-wise (overlapping vLLM's forward) and, as ``*-serial``, with
every layer loaded before the forward. Reported per arm: time to first token of the measured
turn (vLLM's own first-token latency of the request), tokens vLLM prefilled (prompt - cached),
tokens contextdeque's forwards prefilled while loading, the greedy answer, and where the load's
time went (:data:`LOAD_TIMES`). One warm-up round runs every arm first (the exact arms' patches
are formed there and reused by the measured rounds); the measured turn's question is new to every
arm (its canonical, stored when a turn finishes, is forgotten after each turn).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

PAGE_TOPICS = ("pass", "break", "global", "nonlocal")
SYSTEM = "You answer questions about the pages the user shows you."
QUESTIONS = (
    "What happens when the pass statement is executed?",
    "Which loop does the break statement terminate?",
    "What does the nonlocal statement make the listed identifiers refer to?",
)
#: (page order, question) per turn; the last turn is the measured re-read (reorder + recall)
TURNS: tuple[tuple[tuple[int, ...], int], ...] = (((0, 1, 2, 3), 0), ((1, 3), 1), ((2, 0, 3, 1), 2))


def pages(chars: int = 1100) -> list[str]:
    """The four pages: a section of the language reference each, cut at ``chars`` characters."""
    from pydoc_data.topics import topics

    return [f"Page {i + 1}.\n" + topics[k].strip()[:chars] for i, k in enumerate(PAGE_TOPICS)]


def conversation(order: Sequence[int], question: int, page_text: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The messages of one turn: the system prompt, the pages in ``order``, the question."""
    text = list(page_text) if page_text is not None else pages()
    return ([{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": text[i]} for i in order]
            + [{"role": "user", "content": QUESTIONS[question]}])


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's token ids for ``messages`` with the generation prompt (what vLLM's
    ``chat`` prefills)."""
    got = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (got["input_ids"] if hasattr(got, "keys") else got)]


def engine_env() -> None:
    """vLLM on CPU in one process (the connector's two sides share it) with 1 GiB of KV cache;
    vLLM's own log set-up off (its INFO lines would go to stdout, beside a benchmark's JSON)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def make_engine(model: str, *, store: str | None, patch_policy: str = "latency", connector: bool = True,
                max_model_len: int = 2048, **engine_kw: Any) -> Any:
    """An offline vLLM engine on ``model`` (fp32, eager, stats on: requests carry their
    first-token latency), with contextdeque's connector unless ``connector=False``; ``engine_kw``
    go to vLLM's ``LLM`` (e.g. ``distributed_executor_backend="mp"``)."""
    engine_env()
    from vllm import LLM

    kw: dict[str, Any] = {}
    if connector:
        from .vllm import kv_transfer_config

        kw["kv_transfer_config"] = kv_transfer_config(store=store, patch_policy=patch_policy)
    return LLM(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True, disable_log_stats=False,
               **kw, **engine_kw)


#: the connector's load pipeline, in ms (``Runtime.stats``): the window's whole-model part, the
#: layers' relocation + patch + paged write (loading thread), vLLM blocked waiting for a layer,
#: and vLLM's compute between one layer's wait and the next
LOAD_TIMES = ("load_prepare_ms", "load_layers_ms", "load_wait_ms", "load_compute_ms")


@dataclass
class TurnResult:
    """One request's outcome: its prompt length, the tokens vLLM took as computed (its prefix cache
    plus the connector), the tokens contextdeque's own forwards prefilled while loading and after
    it (encoding the canonicals of the request's new messages when it finished), time to first
    token (ms), the greedy answer ids and the first token's top logprobs; ``load_ms``: the
    connector's load pipeline (:data:`LOAD_TIMES`, summed over the request's steps)."""

    prompt_tokens: int
    cached_tokens: int
    window_tokens: int
    encode_tokens: int
    ttft_ms: float
    answer_ids: list[int]
    top_logprobs: dict[int, float]
    load_ms: dict[str, float] = field(default_factory=dict)

    @property
    def vllm_prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefilled(self) -> int:
        """Every token some forward prefilled for this request: vLLM's and contextdeque's."""
        return self.vllm_prefilled + self.window_tokens + self.encode_tokens

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "vllm_prefilled": self.vllm_prefilled, "window_tokens": self.window_tokens,
                "encode_tokens": self.encode_tokens,
                "prefilled": self.prefilled, "ttft_ms": round(self.ttft_ms, 1), "answer_ids": self.answer_ids,
                "load_ms": self.load_ms}


def run_turn(llm: Any, ids: list[int], *, mode: str = "on", policy: str | None = None, max_tokens: int = 16,
             fresh_prefill: bool = False, layerwise: bool | None = None) -> TurnResult:
    """One greedy request. ``mode``: ``"on"`` (the connector serves what it can, under ``policy``
    or the connector's, layer-wise or not as ``layerwise`` says, else as the connector's
    configuration), ``"off"`` (vLLM alone, its prefix cache included); ``fresh_prefill``: vLLM
    ignores its prefix cache too (the reference: a full prefill)."""
    from vllm import SamplingParams

    from .vllm import PARAMS_KEY, runtimes

    asked: dict[str, Any] = {"patch_policy": policy} if policy else {}
    if layerwise is not None:
        asked["layerwise"] = bool(layerwise)
    params: Any = "off" if mode == "off" else (asked or "on")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, skip_reading_prefix_cache=fresh_prefill,
                        extra_args={"kv_transfer_params": {PARAMS_KEY: params}})
    def counted(name: str) -> int:
        return int(sum(rt.stats[name] for rt in runtimes()))

    def summed(name: str) -> float:
        return float(sum(rt.stats[name] for rt in runtimes()))

    before = {k: counted(k) for k in ("window_tokens_prefilled", "encode_tokens")}
    before_ms = {k: summed(k) for k in LOAD_TIMES}
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    wall_ms = (time.perf_counter() - t0) * 1000.0
    metrics = getattr(out, "metrics", None)
    first = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    comp = out.outputs[0]
    return TurnResult(
        prompt_tokens=len(out.prompt_token_ids), cached_tokens=int(out.num_cached_tokens or 0),
        window_tokens=counted("window_tokens_prefilled") - before["window_tokens_prefilled"],
        encode_tokens=counted("encode_tokens") - before["encode_tokens"],
        ttft_ms=first * 1000.0 if first else wall_ms, answer_ids=list(comp.token_ids),
        top_logprobs={int(t): float(lp.logprob) for t, lp in (comp.logprobs[0] if comp.logprobs else {}).items()},
        load_ms={k: round(summed(k) - before_ms[k], 2) for k in LOAD_TIMES},
    )


#: name -> (connector on/off, patch policy, layer-wise loading)
ARMS: dict[str, tuple[str, str | None, bool | None]] = {
    "apc": ("off", None, None),
    "connector": ("on", "latency", True),
    "connector-serial": ("on", "latency", False),
    "connector-exact": ("on", "exact", True),
    "connector-exact-serial": ("on", "exact", False),
}


def run_bench(model: str, *, store: str | None = None, max_tokens: int = 16, repeats: int = 1) -> dict[str, Any]:
    """The arms (:data:`ARMS`) on one engine (see the module docstring); ``repeats`` measured rounds
    after one warm-up round, each running every arm once in turn (so a change in the machine's
    load falls on all arms alike); the median TTFT per arm is reported. ``*-serial``: the same load with every layer loaded
    before vLLM's forward starts (``layerwise=False``), beside the layer-wise load that overlaps it."""
    import statistics

    llm = make_engine(model, store=store)
    tok = llm.get_tokenizer()
    text = pages()
    turns = [prompt_ids(tok, conversation(order, q, text)) for order, q in TURNS]
    from .vllm import runtimes

    out: dict[str, Any] = {"turn_tokens": [len(t) for t in turns], "layers": runtimes()[0].backend.layout.num_layers,
                           "arms": {}}
    rt = runtimes()[0]
    cut = rt.cutter.cut(turns[-1])
    question_key = rt.chunk_key(cut.root, cut.chunks[-1])
    results: dict[str, list[TurnResult]] = {name: [] for name in ARMS}
    for round_ in range(repeats + 1):  # round 0 warms up (and forms the exact patches every later round reuses)
        for name, (mode, policy, layerwise) in ARMS.items():
            llm.reset_prefix_cache()
            for ids in turns[:-1]:
                run_turn(llm, ids, mode=mode, policy=policy, layerwise=layerwise, max_tokens=1)
            got = run_turn(llm, turns[-1], mode=mode, policy=policy, layerwise=layerwise, max_tokens=max_tokens)
            # the measured turn's question is new in every arm: forget the canonical stored after it
            rt.store.delete(question_key)
            if round_:
                results[name].append(got)
    for name, got in results.items():
        arm = got[-1].as_dict()
        arm["ttft_ms"] = round(statistics.median(r.ttft_ms for r in got), 1)
        arm["ttft_ms_all"] = [round(r.ttft_ms, 1) for r in got]
        arm["load_ms"] = {k: round(statistics.median(r.load_ms.get(k, 0.0) for r in got), 2) for k in LOAD_TIMES}
        out["arms"][name] = arm
    arms = out["arms"]
    apc, conn, exact = arms["apc"], arms["connector"], arms["connector-exact"]
    out["prefill_ratio"] = apc["prefilled"] / max(1, conn["prefilled"])
    out["ttft_ratio"] = apc["ttft_ms"] / max(1e-9, conn["ttft_ms"])
    out["layerwise_ttft_ratio"] = {p: arms[f"{a}-serial"]["ttft_ms"] / max(1e-9, arms[a]["ttft_ms"])
                                   for p, a in (("latency", "connector"), ("exact", "connector-exact"))}
    out["exact_identical"] = exact["answer_ids"] == apc["answer_ids"]
    out["exact_serial_identical"] = arms["connector-exact-serial"]["answer_ids"] == apc["answer_ids"]
    out["latency_identical"] = conn["answer_ids"] == apc["answer_ids"]
    return out
