"""Decode-aware KV selection: keep, per layer and KV head, only the prompt rows decoding will need.

After a prefill, a selector ranks every cached prompt row of every layer and KV head and keeps
``budget`` of them per head (prefill-only: the kept set is fixed for the whole decode). Kept rows
keep their positions: keys stay rotated where they were cached, and decoding continues at the
position after the prompt, so a selection is a gather along the token axis and nothing else.

Selectors (one class each, registered in :data:`SELECTORS` by setting ``name``):

- ``mm-shiftkv`` (MM-ShiftKV, the paper's defaults): per layer, the prefilled tokens' attention
  inputs give a per-feature mean and std; ``N = 512`` proxy hidden states are drawn from
  ``N(mu, diag((gamma * sigma)^2))`` with ``gamma = 10``, projected by the layer's own query
  projection (and q-norm where the model has one) and rotated at synthetic future positions
  (spread over the next 64 positions). Per KV head, the proxies' attention (summed over the query
  heads of its group) is aggregated in ``G = 32`` groups of 16; each group votes for the smallest
  set of rows holding ``tau = 0.95`` of its mass. Score = votes + ``lambda`` (1) x the last real
  query's attention (mean over the group's heads, so below one vote: a tie-breaker); the last
  prompt row is always kept, the top ``budget - 1`` others by score join it.
- ``snapkv`` (SnapKV): the last ``window = 32`` prompt rows are always kept; the others are
  ranked by the attention the window's real queries pay them (summed over the window, averaged
  over the group's query heads, then average-pooled along the tokens with kernel 5).
- ``streamingllm`` (StreamingLLM): the first 4 rows (attention sinks) and the most recent
  ``budget - 4``.

Queries are rebuilt from the attention inputs a traced forward captures (a pre-hook on every
layer's ``q_proj``): ``q_norm(q_proj(h))`` rotated with the layout's own RoPE tables at the
token's position — the queries the model itself used (``tests/test_kvselect.py`` checks them
against the model's attention output). GQA/MHA layouts only (MLA is refused).

Composition with the patch: a selected slot's rows are ``R(pos[rows]) (K_content[rows] +
U[rows] W)`` — the canonical's rows plus the patch's *left-factor rows* — which
:func:`apply_rows` computes without materializing the unselected rows (equal to gathering the
full patched page, to fp32 rounding).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence

import torch

from ..core import compat
from ..core.errors import SelectionError, SelectionTypeError, UnsupportedLayoutError
from ..kernels.reference import rotate
from ..core.kv import LayerKV, kv_nbytes
from ..core.operator import placement_positions
from ..core.rotation import TableCache
from ..core.registry import Registered, Registry

SELECTORS: Registry["KVSelector"] = Registry("KV selector")

# MM-ShiftKV's published defaults (section 4.1 / appendix B of the paper).
MMSHIFT_PROXIES = 512
MMSHIFT_GROUPS = 32
MMSHIFT_GAMMA = 10.0
MMSHIFT_TAU = 0.95
MMSHIFT_LAMBDA = 1.0
MMSHIFT_FUTURE = 64  # the paper's maximum generation length: proxies sit at the next 64 positions
SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 5
STREAMING_SINKS = 4


def check_budget(budget: Any) -> int:
    """A per-head row budget: an int >= 1 (``SelectionTypeError`` / ``SelectionError`` otherwise)."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise SelectionTypeError(f"budget must be an int (rows per KV head), got {type(budget).__name__}")
    if budget < 1:
        raise SelectionError(f"budget must be >= 1 row per KV head, got {budget}")
    return int(budget)


# ---------------------------------------------------------------------------- traced forwards


@dataclass
class PrefillTrace:
    """What a selector reads from one prefill.

    ``kv``: per layer ``(k [H, S, d_k], v [H, S, d_v])``, every prompt row as cached (rotated);
    ``hidden``: per layer ``[n, hidden]`` fp32 attention inputs (the ``q_proj`` input) of the
    ``n`` tokens this prefill ran, which are the last ``n`` of the ``S`` rows; ``positions``:
    ``[n_axes, n]`` their positions; ``next_position``: where decoding continues; ``logits``:
    fp32 ``[vocab]`` after the last prefilled token (or ``[n, vocab]`` for every one of them).
    """

    kv: list[LayerKV]
    hidden: list[torch.Tensor]
    positions: torch.Tensor
    next_position: int
    logits: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        return int(self.kv[0][0].shape[1])

    @property
    def n_prefilled(self) -> int:
        return int(self.hidden[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.kv)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = compat.decoder_layers(model)
    mods = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            raise UnsupportedLayoutError(
                f"{type(model).__name__}: KV selection rebuilds queries from each layer's self_attn.q_proj; "
                "this model has none"
            )
        mods.append(attn)
    return mods


@contextmanager
def capture_attention_inputs(model: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """While active, every forward appends each layer's ``q_proj`` input (``[tokens, hidden]``
    fp32, batch 1) to ``captured[layer]``."""
    mods = _attention_modules(model)
    captured: list[list[torch.Tensor]] = [[] for _ in mods]
    handles = []
    for i, attn in enumerate(mods):
        def hook(_m: Any, args: tuple, i: int = i) -> None:
            x = args[0]
            captured[i].append(x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float32))

        handles.append(attn.q_proj.register_forward_pre_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def traced_prefill(
    backend: Any,
    *,
    positions: torch.Tensor,
    past: Sequence[LayerKV] | None = None,
    input_ids: torch.Tensor | Sequence[int] | None = None,
    inputs_embeds: torch.Tensor | None = None,
    logits: str = "last",
) -> PrefillTrace:
    """Prefill tokens after ``past`` (per layer ``[H, P, d]``, rotated) at ``positions``
    (``[n_axes, n]``) through ``backend.forward``, capturing every layer's attention inputs.
    Returns the trace with the full prompt KV (``P + n`` rows); ``logits="all"`` keeps every
    prefilled token's logits (``trace.logits [n, vocab]``), ``"last"`` the last one's (``[vocab]``)."""
    with capture_attention_inputs(backend.model) as cap:
        res = backend.forward(
            input_ids=input_ids, inputs_embeds=inputs_embeds, positions=positions, past=list(past) if past else None,
            logits=logits,
        )
    kv = [(torch.cat([p[0], k.to(p[0].dtype)], 1), torch.cat([p[1], v.to(p[1].dtype)], 1)) for p, (k, v) in zip(past, res.kv)] \
        if past else [(k.clone(), v.clone()) for k, v in res.kv]
    pos = torch.as_tensor(positions, dtype=torch.long)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    hidden = [torch.cat(c) for c in cap]
    lg = None if res.logits is None else (res.logits if logits == "all" else res.logits[-1])
    return PrefillTrace(kv=kv, hidden=hidden, positions=pos, next_position=int(pos.max()) + 1, logits=lg)


# ---------------------------------------------------------------------------- queries


class QueryModel:
    """Rebuilds the model's queries from attention inputs: ``q = rope(q_norm(q_proj(h)))`` per
    layer, ``[H_q, n, d]`` fp32, rotated with the layout's RoPE tables (the channels and pairing
    the keys use) and its attention scaling; plus attention probabilities over cached keys."""

    def __init__(self, backend: Any) -> None:
        lay = backend.layout
        if lay.family != "gqa" or lay.rope_tensor != "k":
            raise UnsupportedLayoutError(f"KV selection supports MHA/GQA layouts, not {lay.family} ({lay.model_type})")
        self.backend = backend
        self.layout = lay
        self.attn = _attention_modules(backend.model)
        cfg = compat.text_config(backend.model.config)
        self.n_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(lay.k_heads)
        if self.n_heads % self.kv_heads:
            raise UnsupportedLayoutError(f"{self.n_heads} query heads do not group evenly over {self.kv_heads} KV heads")
        self.group = self.n_heads // self.kv_heads
        self.head_dim = int(lay.k_dim)

    def scaling(self, layer: int) -> float:
        return float(getattr(self.attn[layer], "scaling", self.head_dim ** -0.5))

    @torch.no_grad()
    def queries(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden [n, hidden]`` at ``positions [n_axes, n]`` -> ``[H_q, n, d]`` fp32 queries."""
        attn = self.attn[layer]
        w = attn.q_proj.weight
        h = hidden.to(w.device, w.dtype)
        q = attn.q_proj(h).view(h.shape[0], self.n_heads, self.head_dim)
        q_norm = getattr(attn, "q_norm", None)  # Qwen3 / Gemma3 / Cohere: over [.., H, d]
        if q_norm is not None:
            q = q_norm(q)
        q = q.transpose(0, 1)
        if getattr(attn, "qk_layernorm", False):  # Phi / StableLM: on [B, H, n, d] (per head)
            q = attn.q_layernorm(q.unsqueeze(0))[0]
        q = q.to("cpu", torch.float32)
        lay = self.layout
        if lay.rope_dim:
            pos = torch.as_tensor(positions, dtype=torch.long)
            if pos.dim() == 1:
                pos = pos.unsqueeze(0)
            if pos.shape[0] != lay.n_pos_axes:
                pos = pos[:1].expand(lay.n_pos_axes, -1)
            cos, sin = TableCache(lay, pos).for_layer(layer)
            s = float(lay.attention_scaling)
            q = rotate(q, lay.rope_start, lay.rope_dim // 2, lay.interleaved, cos * s, sin * s)
        return q

    def logits(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``q [H_q, n, d]`` x ``keys [H_kv, S, d]`` -> scaled attention logits ``[H_q, n, S]`` fp32."""
        k = keys.to(torch.float32).repeat_interleave(self.group, dim=0)
        return torch.matmul(q, k.transpose(1, 2)) * self.scaling(layer)

    def probs(self, layer: int, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax attention ``[H_q, n, S]`` of queries over keys; ``visible [n, S]`` bool masks rows."""
        lg = self.logits(layer, q, keys)
        if visible is not None:
            lg = lg.masked_fill(~visible.unsqueeze(0), float("-inf"))
        return torch.softmax(lg, dim=-1)

    def visible(self, layer: int, q_rows: torch.Tensor, n_rows: int) -> torch.Tensor:
        """``[n, S]`` causal visibility of rows for queries sitting at sequence indices ``q_rows``
        (a sliding-window layer sees only its window)."""
        rows = torch.arange(n_rows)
        vis = rows.unsqueeze(0) <= q_rows.unsqueeze(1)
        wins = self.layout.sliding_windows
        win = wins[layer] if layer < len(wins) else None
        if win is not None:
            vis &= (q_rows.unsqueeze(1) - rows.unsqueeze(0)) < int(win)
        return vis

    def per_kv_head(self, x: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
        """``[H_q, ...]`` -> ``[H_kv, ...]`` over each KV head's group of query heads."""
        x = x.reshape(self.kv_heads, self.group, *x.shape[1:])
        return x.sum(1) if reduce == "sum" else x.mean(1)


# ---------------------------------------------------------------------------- selections


@dataclass
class Selection:
    """Kept prompt rows per layer and KV head. ``index``: per layer ``[H, C]`` int64 row indices
    in temporal order (``C = min(budget, S)``); ``n_rows``: S, the prompt rows it chose from."""

    method: str
    budget: int
    n_rows: int
    index: list[torch.Tensor]

    @property
    def kept(self) -> int:
        """Rows kept per KV head (every head keeps the same number)."""
        return int(self.index[0].shape[1])

    @property
    def keeps_everything(self) -> bool:
        return self.kept >= self.n_rows

    def mask(self, layer: int) -> torch.Tensor:
        """``[H, S]`` bool of the rows kept at ``layer``."""
        idx = self.index[layer]
        m = torch.zeros(idx.shape[0], self.n_rows, dtype=torch.bool)
        m.scatter_(1, idx, True)
        return m

    def gather(self, kv: Sequence[LayerKV]) -> list[LayerKV]:
        """The kept rows of ``kv`` (per layer ``[H, S, d]``): per layer ``(k [H, C, d], v [H, C, d])``."""
        out = []
        for (k, v), idx in zip(kv, self.index):
            if k.shape[1] != self.n_rows:
                raise SelectionError(f"this selection chose among {self.n_rows} rows; the KV holds {k.shape[1]}")
            if self.keeps_everything:
                out.append((k, v))
                continue
            ik = idx.unsqueeze(-1).expand(-1, -1, k.shape[-1])
            iv = idx.unsqueeze(-1).expand(-1, -1, v.shape[-1])
            out.append((torch.gather(k, 1, ik), torch.gather(v, 1, iv)))
        return out

    def kept_bytes(self, kv: Sequence[LayerKV]) -> int:
        """Bytes of the kept rows of ``kv``."""
        return kv_nbytes(kv, tokens=self.kept)


@dataclass
class Ranking:
    """One layer's ranking: ``score [H, S]`` (higher kept first) and ``forced [H, S]`` rows kept
    before any scored row, in order of ``forced_order [H, S]`` (higher first) when the budget
    cannot hold them all."""

    score: torch.Tensor
    forced: torch.Tensor
    forced_order: torch.Tensor


def _keep(r: Ranking, budget: int) -> torch.Tensor:
    H, S = r.score.shape
    if budget >= S:
        return torch.arange(S).unsqueeze(0).expand(H, -1).clone()
    # lexicographic: forced rows first (by their order), then the others by score; ties keep the
    # later row (stable sorts over rows in reverse order)
    secondary = torch.where(r.forced, r.forced_order.to(torch.float64), r.score.to(torch.float64)).flip(1)
    order = torch.sort(secondary, dim=1, descending=True, stable=True).indices
    primary = r.forced.flip(1).gather(1, order).to(torch.int8)
    order = order.gather(1, torch.sort(primary, dim=1, descending=True, stable=True).indices)
    top = (S - 1) - order[:, :budget]
    return torch.sort(top, dim=1).values


class KVSelector(Registered):
    """Base class of a selector. Subclasses set ``name`` and implement :meth:`rank`; keyword
    arguments of the constructor are the method's parameters."""

    registry = SELECTORS
    name: ClassVar[str] = ""

    def rank(self, trace: PrefillTrace, qm: QueryModel) -> list[Ranking]:  # pragma: no cover - abstract
        """Per layer the ranking of the trace's prompt rows (budget-independent)."""
        raise NotImplementedError

    def select(self, trace: PrefillTrace, budget: int, qm: QueryModel) -> Selection:
        """Keep ``budget`` rows per KV head of every layer of ``trace``."""
        return self.select_many(trace, [budget], qm)[budget]

    def select_many(self, trace: PrefillTrace, budgets: Sequence[int], qm: QueryModel) -> dict[int, Selection]:
        """One ranking, several budgets: ``{budget: Selection}``."""
        budgets = [check_budget(b) for b in budgets]
        ranks = self.rank(trace, qm)
        return {b: Selection(self.name, b, trace.n_rows, [_keep(r, b) for r in ranks]) for b in budgets}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_selector(name: str, **options: Any) -> KVSelector:
    """A registered selector by name with its options."""
    if not isinstance(name, str):
        raise SelectionTypeError(f"selector must be a name (str), got {type(name).__name__}")
    return SELECTORS.make(name, error=SelectionError, **options)


class StreamingLLMSelector(KVSelector):
    """Attention sinks (the first ``sinks`` rows) plus the most recent rows."""

    name = "streamingllm"

    def __init__(self, sinks: int = STREAMING_SINKS) -> None:
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise SelectionError(f"sinks must be an int >= 0, got {sinks!r}")
        self.sinks = sinks

    def rank(self, trace: PrefillTrace, qm: QueryModel) -> list[Ranking]:
        S = trace.n_rows
        rows = torch.arange(S, dtype=torch.float64)
        out = []
        for k, _ in trace.kv:
            H = k.shape[0]
            forced = (torch.arange(S) < self.sinks).unsqueeze(0).expand(H, -1)
            out.append(Ranking(rows.expand(H, -1), forced, -rows.expand(H, -1)))
        return out


class SnapKVSelector(KVSelector):
    """The observation window's real queries vote for the prefix rows (pooled attention)."""

    name = "snapkv"

    def __init__(self, window: int = SNAPKV_WINDOW, kernel: int = SNAPKV_KERNEL) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise SelectionError(f"window must be an int >= 1, got {window!r}")
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
            raise SelectionError(f"kernel must be an odd int >= 1, got {kernel!r}")
        self.window, self.kernel = window, kernel

    def rank(self, trace: PrefillTrace, qm: QueryModel) -> list[Ranking]:
        S, n = trace.n_rows, trace.n_prefilled
        w = min(self.window, S)
        nq = min(self.window, n)  # observation queries: the last prefilled tokens (at most the window)
        q_rows = torch.arange(S - nq, S)
        rows = torch.arange(S, dtype=torch.float64)
        out = []
        for layer, (k, _) in enumerate(trace.kv):
            q = qm.queries(layer, trace.hidden[layer][n - nq:], trace.positions[:, n - nq:])
            p = qm.probs(layer, q, k, qm.visible(layer, q_rows, S))  # [H_q, nq, S]
            votes = qm.per_kv_head(p.sum(1), reduce="mean")  # [H_kv, S]
            pooled = torch.nn.functional.avg_pool1d(votes.unsqueeze(1), self.kernel, stride=1,
                                                    padding=self.kernel // 2).squeeze(1)
            H = votes.shape[0]
            forced = (torch.arange(S) >= S - w).unsqueeze(0).expand(H, -1)
            out.append(Ranking(pooled.to(torch.float64), forced, rows.expand(H, -1)))
        return out


class MMShiftKVSelector(KVSelector):
    """Variance-expanded query proxies vote in groups; the last real query breaks ties; the last
    row is always kept. Defaults are the paper's (N=512, G=32, gamma=10, tau=0.95, lambda=1)."""

    name = "mm-shiftkv"

    def __init__(
        self,
        proxies: int = MMSHIFT_PROXIES,
        groups: int = MMSHIFT_GROUPS,
        gamma: float = MMSHIFT_GAMMA,
        tau: float = MMSHIFT_TAU,
        lam: float = MMSHIFT_LAMBDA,
        future: int = MMSHIFT_FUTURE,
        seed: int = 0,
    ) -> None:
        for what, v in (("proxies", proxies), ("groups", groups), ("future", future)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SelectionError(f"{what} must be an int >= 1, got {v!r}")
        if proxies % groups:
            raise SelectionError(f"{proxies} proxies do not split into {groups} equal groups")
        if not 0.0 < float(tau) < 1.0:
            raise SelectionError(f"tau must lie in (0, 1), got {tau}")
        if not float(gamma) > 0.0 or float(lam) < 0.0:
            raise SelectionError(f"gamma must be > 0 and lam >= 0, got gamma={gamma}, lam={lam}")
        self.proxies, self.groups, self.gamma, self.tau = proxies, groups, float(gamma), float(tau)
        self.lam, self.future, self.seed = float(lam), future, int(seed)

    def proxy_positions(self, next_position: int, n_axes: int) -> torch.Tensor:
        """``[n_axes, N]``: proxy i sits at ``next_position + floor(i * future / N)``."""
        off = torch.arange(self.proxies) * self.future // self.proxies
        return (off + int(next_position)).unsqueeze(0).expand(n_axes, -1)

    def votes(self, mass: torch.Tensor) -> torch.Tensor:
        """``mass [H, G, S]`` (each group's aggregated attention) -> ``[H, S]`` vote counts: every
        group votes for the smallest set of rows holding ``tau`` of its mass."""
        vals, order = torch.sort(mass, dim=-1, descending=True)
        csum = vals.cumsum(-1)
        total = csum[..., -1:]
        # a row is in the set iff the mass strictly before it is still short of tau * total
        before = csum - vals
        inset_sorted = before < self.tau * total
        inset = torch.zeros_like(inset_sorted)
        inset.scatter_(-1, order, inset_sorted)
        return inset.sum(1).to(torch.float64)

    def rank(self, trace: PrefillTrace, qm: QueryModel) -> list[Ranking]:
        S, n = trace.n_rows, trace.n_prefilled
        last_row = torch.tensor([S - 1])
        fut = self.proxy_positions(trace.next_position, trace.positions.shape[0])
        out = []
        for layer, (k, _) in enumerate(trace.kv):
            h = trace.hidden[layer].to(torch.float64)
            mu, sigma = h.mean(0), h.std(0, unbiased=False)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
            eps = torch.randn(self.proxies, h.shape[1], generator=gen, dtype=torch.float64)
            proxies = (mu + self.gamma * sigma * eps).to(torch.float32)
            q = qm.queries(layer, proxies, fut)  # [H_q, N, d]
            vis = qm.visible(layer, torch.full((self.proxies,), S), S)  # future queries: every row is behind them
            p = qm.probs(layer, q, k, vis)  # [H_q, N, S]
            per_group = p.reshape(p.shape[0], self.groups, self.proxies // self.groups, S).sum(2)  # [H_q, G, S]
            mass = qm.per_kv_head(per_group, reduce="sum")  # [H_kv, G, S]
            votes = self.votes(mass)
            q_last = qm.queries(layer, trace.hidden[layer][n - 1:], trace.positions[:, n - 1:])
            anchor = qm.per_kv_head(qm.probs(layer, q_last, k, qm.visible(layer, last_row, S))[:, 0], reduce="mean")
            score = votes + self.lam * anchor.to(torch.float64)
            H = score.shape[0]
            forced = (torch.arange(S) == S - 1).unsqueeze(0).expand(H, -1)
            out.append(Ranking(score, forced, torch.zeros(H, S, dtype=torch.float64)))
        return out


# ---------------------------------------------------------------------------- composition with patches


def apply_rows(
    chunk: Any,
    start: int,
    rows: Sequence[Sequence[torch.Tensor]],
    patches: Sequence[Any] = (),
    *,
    layout: Any = None,
    out_dtype: torch.dtype | None = None,
) -> list[list[LayerKV]]:
    """The kept rows of a placed, patched chunk without placing the rest.

    ``rows[l][h]``: ``[C_lh]`` row indices (into the chunk's ``T`` tokens) kept by KV head ``h`` at
    layer ``l``. Per layer and head returns ``(k [C_lh, d_k], v [C_lh, d_v])`` =
    ``R(pos[rows]) (K_content[h, rows] + sum_p U_p[rows] W_p[:, h])`` and
    ``V_content[h, rows] + sum_p U_p[rows] W_p[:, h]``: the canonical's rows plus the patches'
    left-factor rows, equal (to fp32 rounding) to gathering ``relocate(chunk, start, patch=patches)``.
    """
    from ..core.layout import layout_for

    lay = layout or layout_for(chunk.layout_signature)
    if lay.family != "gqa" or lay.rope_tensor != "k":
        raise UnsupportedLayoutError(f"apply_rows supports MHA/GQA layouts, not {lay.family}")
    if len(rows) != chunk.num_layers:
        raise SelectionError(f"rows needs one entry per layer ({chunk.num_layers}), got {len(rows)}")
    for p in patches:
        p.check_fits(chunk)
    dtype = out_dtype or lay.torch_compute_dtype
    pos = placement_positions(chunk, start)
    tables = TableCache(lay, pos)
    Hk, dk, Hv, dv = lay.k_heads, lay.k_dim, lay.v_heads, lay.v_dim
    out: list[list[LayerKV]] = []
    for layer in range(chunk.num_layers):
        k_c, v_c = chunk.layer(layer)
        cos, sin = tables.for_layer(layer)
        factors = [p.factors(layer) for p in patches]
        heads = []
        if len(rows[layer]) != Hk:
            raise SelectionError(f"rows[{layer}] needs one index tensor per KV head ({Hk})")
        for h, idx in enumerate(rows[layer]):
            idx = torch.as_tensor(idx, dtype=torch.long)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= chunk.n_tokens):
                raise SelectionError(f"row index out of range 0..{chunk.n_tokens - 1}")
            k = k_c[h, idx].to(torch.float32)
            v = v_c[h, idx].to(torch.float32)
            for fk, fv in factors:
                if fk is not None and fk[0].shape[1]:
                    k = k + fk[0][idx].to(torch.float32) @ fk[1][:, h * dk:(h + 1) * dk].to(torch.float32)
                if fv is not None and fv[0].shape[1]:
                    v = v + fv[0][idx].to(torch.float32) @ fv[1][:, h * dv:(h + 1) * dv].to(torch.float32)
            if lay.rope_dim:
                k = rotate(k.unsqueeze(0), lay.rope_start, lay.rope_dim // 2, lay.interleaved, cos[idx], sin[idx])[0]
            heads.append((k.to(dtype), v.to(dtype)))
        out.append(heads)
    assert Hv == Hk
    return out


def attention_coverage(
    qm: QueryModel, decode: PrefillTrace, n_prompt: int, selection: Selection
) -> float:
    """Share of the decode queries' attention mass on prompt rows that falls on kept rows.

    ``decode``: a traced teacher-forced continuation over the *full* prompt KV (its ``kv`` holds
    the ``n_prompt`` prompt rows then the continuation's rows). Mean over layers, query heads and
    continuation tokens of ``sum_{kept} p / sum_{prompt} p`` (the MM-ShiftKV paper's coverage).
    """
    S, n = decode.n_rows, decode.n_prefilled
    q_rows = torch.arange(S - n, S)
    vals = []
    for layer, (k, _) in enumerate(decode.kv):
        q = qm.queries(layer, decode.hidden[layer], decode.positions)
        p = qm.probs(layer, q, k, qm.visible(layer, q_rows, S))[..., :n_prompt]  # [H_q, n, P]
        kept = selection.mask(layer).repeat_interleave(qm.group, dim=0).unsqueeze(1)  # [H_q, 1, P]
        tot = p.sum(-1)
        vals.append(((p * kept).sum(-1) / tot.clamp_min(1e-30)).mean())
    return float(torch.stack(vals).mean())


# ---------------------------------------------------------------------------- the window policy


@dataclass(frozen=True)
class SelectionPolicy:
    """KV selection as a window policy under memory pressure.

    When ``ContextWindow.generate`` runs while the window (root + chunks + query) holds more
    than ``pressure_rows`` rows per KV head (default: ``budget``), the query is prefilled over
    the full window, ``selector`` keeps ``budget`` rows per layer and KV head, and decoding runs
    over the kept rows only (at their own positions). The kept rows of each slot are rebuilt from
    its canonical and the left-factor rows of its patches (:func:`apply_rows`), so the decode
    cache never holds an unselected row. ``options`` go to the selector.
    """

    selector: str = "mm-shiftkv"
    budget: int = 256
    pressure_rows: int | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.pressure_rows is not None:
            check_budget(self.pressure_rows)
        make_selector(self.selector, **dict(self.options))  # refuse a bad name or option now

    @property
    def threshold(self) -> int:
        return self.budget if self.pressure_rows is None else int(self.pressure_rows)

    def make(self) -> KVSelector:
        return make_selector(self.selector, **dict(self.options))


def select_window_kv(ctx: Any, slots: Sequence[Any], trace: PrefillTrace, selection: Selection) -> list[LayerKV]:
    """The decode cache of a selection over ``[root, slot pages..., prefilled query]``: per layer
    ``(k [H, C, d_k], v [H, C, d_v])``. Root and query rows are gathered from ``trace.kv``; each
    slot's kept rows are rebuilt from its canonical plus its patches' left-factor rows
    (:func:`apply_rows`) — equal to ``selection.gather(trace.kv)`` to fp32 rounding."""
    if selection.keeps_everything:
        return trace.kv
    bounds = [ctx.root_len]
    for s in slots:
        bounds.append(bounds[-1] + s.n_tokens)
    S = trace.n_rows
    dtype = trace.kv[0][0].dtype
    slot_rows: list[list[list[torch.Tensor]]] = [[] for _ in slots]  # [slot][layer][head]
    for layer, idx in enumerate(selection.index):
        for i in range(len(slots)):
            a, b = bounds[i], bounds[i + 1]
            slot_rows[i].append([row[(row >= a) & (row < b)] - a for row in idx])
    placed = [apply_rows(s.chunk, s.start, slot_rows[i], s.patches, layout=ctx.layout, out_dtype=dtype)
              for i, s in enumerate(slots)]
    out: list[LayerKV] = []
    for layer, idx in enumerate(selection.index):
        k_full, v_full = trace.kv[layer]
        ks, vs = [], []
        for h, row in enumerate(idx):
            head_k = [k_full[h, row[row < bounds[0]]]]
            head_v = [v_full[h, row[row < bounds[0]]]]
            for i in range(len(slots)):
                head_k.append(placed[i][layer][h][0])
                head_v.append(placed[i][layer][h][1])
            tail = row[(row >= bounds[-1]) & (row < S)]
            head_k.append(k_full[h, tail])
            head_v.append(v_full[h, tail])
            ks.append(torch.cat(head_k))
            vs.append(torch.cat(head_v))
        out.append((torch.stack(ks), torch.stack(vs)))
    return out


def generate_selected(
    ctx: Any,
    slots: Sequence[Any],
    query_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    policy: SelectionPolicy,
) -> tuple[list[int], dict[str, Any]]:
    """Answer ``query_ids`` after the window ``slots`` under ``policy``: prefill the query over
    the full window (traced), select, decode greedily over the kept rows. Returns the answer ids
    and what happened (``selected``, ``rows``, ``kept``, bytes before and after)."""
    from . import decode

    backend = ctx.backend
    layers = decode.assemble(ctx, slots)
    start = decode.next_position(ctx, slots)
    q = [int(t) for t in query_ids]
    trace = traced_prefill(backend, input_ids=q, positions=backend.text_positions(start, len(q)), past=layers)
    info: dict[str, Any] = {"selector": policy.selector, "budget": policy.budget, "rows": trace.n_rows}
    full_bytes = kv_nbytes(trace.kv)
    info["bytes_full"] = full_bytes
    if trace.n_rows <= policy.threshold:
        kv, info["selected"], info["kept"], info["bytes_kept"] = trace.kv, False, trace.n_rows, full_bytes
    else:
        sel = policy.make().select(trace, policy.budget, QueryModel(backend))
        kv = select_window_kv(ctx, slots, trace, sel)
        info["selected"], info["kept"] = True, sel.kept
        info["bytes_kept"] = kv_nbytes(kv)
    assert trace.logits is not None
    first = int(torch.argmax(trace.logits))
    answer = [first]
    eos = {int(e) for e in eos_ids}
    if first not in eos and max_new_tokens > 1:
        _, rest = decode.greedy(ctx, kv, start + len(q), [first], max_new_tokens - 1, eos_ids)
        answer += rest
    return answer, info


__all__ = [
    "SELECTORS",
    "KVSelector",
    "MMShiftKVSelector",
    "SnapKVSelector",
    "StreamingLLMSelector",
    "PrefillTrace",
    "QueryModel",
    "Ranking",
    "Selection",
    "SelectionPolicy",
    "generate_selected",
    "select_window_kv",
    "apply_rows",
    "attention_coverage",
    "capture_attention_inputs",
    "check_budget",
    "make_selector",
    "traced_prefill",
]
