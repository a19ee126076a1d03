"""contextdeque as a vLLM KV connector: a chat prompt's earlier messages come from contextdeque's
stores, relocated and patched, instead of vLLM's prefill.

Run vLLM with it (``docs/vllm.md``)::

    from contextdeque.integrations.vllm import kv_transfer_config
    llm = LLM(model=path, kv_transfer_config=kv_transfer_config(store="valkey://host:6379/0"))

How a request is served:

- **Scheduler side** (``get_num_new_matched_tokens``): the prompt's token ids are cut along the
  chat template (:class:`~contextdeque.integrations.paged.PromptCutter`: the root, one chunk per
  whole message, the generation prompt); each chunk's content address is the one a
  ``ContextWindow`` gives it (``HFBackend.chunk_id_for`` under that root), and the leading run
  of chunks whose canonical the store holds — fetched and verified (checksum, model fingerprint,
  layout) — is the matched prefix vLLM takes as computed. A corrupt, foreign or evicted entry ends
  the run there: vLLM prefills the rest itself.
- **Worker side** (``start_load_kv`` / ``wait_for_layer_load``): layer-wise, on a background
  thread (:class:`~contextdeque.integrations.layerwise.LayerPipeline`) while vLLM's forward runs.
  Per request, a ``ContextWindow`` on that root first appends the matched chunks (0 encodes: the
  canonicals are stored) under the connector's patch policy — the whole-model part: canonicals
  and patches fetched, and the conditioned forwards the policy may ask for (``exact``), which
  run through every layer and are not split. Then, layer by layer, it relocates that layer to
  vLLM's positions, applies the patches the policy chose (the fused kernel) and writes it into
  vLLM's paged cache (:class:`~contextdeque.integrations.paged.PagedLayout`: vLLM's CPU layout,
  the flash-attention layout); ``wait_for_layer_load(layer)`` waits for that layer only, so vLLM
  computes layer ``l`` while ``l + 1`` loads. ``layerwise=False`` loads every layer in
  ``start_load_kv`` instead (the same work, no overlap). A load that fails, in its window or on
  any layer, is reported (``get_block_ids_with_load_errors``) and vLLM recomputes those blocks.
- **Saving**: the first message after the root is conditioned on the root alone, so the KV vLLM
  computed for it *is* its canonical: it is read back from the paged cache after the forward,
  un-rotated into the content frame and stored (0 forwards). Later new messages were computed
  conditioned on what precedes them; their canonicals are encoded once when the request finishes
  (one forward each, ``encodes``), so the next turn finds every message.
- **vLLM's prefix cache**: blocks a connector loads enter it under the prompt's exact token hashes.
  KV served under an approximate policy (anything but ``exact``) must never be reused as if exact,
  so such a request's block hashes are re-salted (``cache_salt``) before its blocks are allocated:
  its blocks can only be found again through the connector.

Refused at load, with the reason (:class:`UnsupportedLayoutError`): a model whose rotary vLLM
computes differently from the layout contextdeque proved for it (checked numerically against
vLLM's own rotary embedding), and layouts the paged writers do not carry (MLA, M-RoPE, per-layer
RoPE tables, sliding windows). At run time the connector also compares the root's KV that vLLM
computed with contextdeque's own; a mismatch switches loading off (``refused`` in the stats).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..core.chunk import Chunk
from ..core.kv import LayerKV
from ..core.errors import ContextDequeError, UnsupportedLayoutError
from ..core.layout import REGIME_ROPE_TYPES, KVLayout
from ..core.operator import rope_spec, to_content_frame
from ..core.rotation import TableCache
from ..kernels import fused_apply
from ..stores.traffic import TierTraffic
from ..window import ContextWindow
from ..window.policy import make_policy
from ..window.store import WindowStore, default_store
from .layerwise import LayerPipeline
from .stats import RuntimeStats
from .paged import PagedLayout, PromptCut, PromptCutter, paged_layout_for
from ..patch.rank import DEFAULT_RANK

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("contextdeque.vllm")

CONNECTOR_NAME = "ContextDequeConnector"
#: The request's ``kv_transfer_params`` key that turns the connector off for that request (a
#: benchmark's baseline arm on the same engine): ``{"contextdeque": "off"}``.
PARAMS_KEY = "contextdeque"
SALT_PREFIX = "contextdeque-approx:"
#: Relative error above which vLLM's root KV is not the KV contextdeque computes (fp32 runs agree
#: to ~1e-6; a rotary convention or weights that differ show up at 1e-2 and above).
ROOT_KV_TOLERANCE = 1e-3


def kv_transfer_config(
    store: str | None = None, *, patch_policy: str = "latency", rank: int = DEFAULT_RANK, model: str | None = None,
    encode_on_finish: bool = True, layerwise: bool = True,
) -> KVTransferConfig:
    """vLLM's ``kv_transfer_config`` for this connector.

    Args:
        store: where canonicals live: ``"valkey://host:port/db"`` (shared by every engine pointing
            at it), a directory (a disk tier there), or None (contextdeque's default store: memory
            tiers spilling to the per-user disk cache).
        patch_policy: the window's patch policy (``"latency"``: no forward on a re-read, the
            served KV is approximate; ``"exact"``: full-rank patches, equal to vLLM's own prefill
            to float rounding, one conditioned forward per re-read chunk; any registered name).
        rank: patch rank.
        model: the checkpoint contextdeque loads beside vLLM (default: vLLM's ``model``).
        encode_on_finish: encode the canonicals of a finished request's new messages.
        layerwise: load layer by layer on a background thread while vLLM's forward runs (each
            attention layer waits for its own layer only); False: every layer is loaded in
            ``start_load_kv``, before the forward (no overlap: the benchmark's baseline).
    """
    extra = {"store": store, "patch_policy": patch_policy, "rank": int(rank), "model": model,
             "encode_on_finish": bool(encode_on_finish), "layerwise": bool(layerwise)}
    # a load that fails on the worker side is recomputed by vLLM, never served wrong or failed
    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_connector_extra_config=extra, kv_load_failure_policy="recompute")


# ---------------------------------------------------------------------------- load-time checks


def check_vllm_rotary(layout: KVLayout, hf_config: Any, max_position: int, vllm_config: Any = None) -> None:
    """Refuse (``UnsupportedLayoutError`` with the reason) a model whose KV vLLM caches otherwise
    than contextdeque relocates it: structure the paged writers do not carry, or a rotary table
    vLLM computes differently (vLLM's own ``get_rope`` for the model's ``rope_parameters`` against
    contextdeque's tables, on random keys at positions up to ``max_position``). ``vllm_config``:
    the engine's (vLLM builds its custom ops under one; default: vLLM's defaults)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def refuse(why: str, reason: str, measured: float | None = None) -> None:
        raise UnsupportedLayoutError(f"contextdeque's vLLM connector refuses {layout.model_type}: {why}",
                                     reason=reason, measured=measured)

    if layout.family != "gqa" or layout.rope_tensor != "k":
        refuse("its cache holds MLA latents, not per-head K/V in vLLM's paged layout", "vllm-mla")
    if layout.n_pos_axes != 1:
        refuse("M-RoPE positions (t/h/w) are not what vLLM's text path passes the connector", "vllm-mrope")
    if len(layout.inv_freqs) != 1 or any(layout.identity_layers):
        refuse("its layers use different RoPE tables (or none); vLLM builds one rotary for all", "vllm-rope-per-layer")
    if any(w is not None for w in layout.sliding_windows):
        refuse("sliding-window layers keep another block table in vLLM", "vllm-sliding-window")
    if layout.rope_type in REGIME_ROPE_TYPES:
        refuse(f"{layout.rope_type} RoPE switches tables with length; vLLM computes one table for the whole context",
               "vllm-rope-regime")
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    with set_current_vllm_config(vllm_config if vllm_config is not None else VllmConfig()):
        rope = get_rope(layout.k_dim, max_position=max_position, is_neox_style=not layout.interleaved,
                        rope_parameters=params, dtype=torch.float32)
    if int(getattr(rope, "rotary_dim", layout.k_dim)) != layout.rope_dim:
        refuse(f"vLLM rotates {getattr(rope, 'rotary_dim', '?')} channels per head, contextdeque {layout.rope_dim}",
               "vllm-rope-mismatch")
    gen = torch.Generator().manual_seed(0)
    T, H, d = 64, layout.k_heads, layout.k_dim
    content = torch.randn(H, T, d, generator=gen)
    pos = torch.randint(0, max(1, max_position), (T,), generator=gen)
    cos, sin = TableCache(layout, pos.unsqueeze(0)).for_layer(0)
    ours, _ = fused_apply(content, content, rope_spec(layout), cos, sin, out_dtype=torch.float32)
    q = torch.zeros(T, H * d)
    _, theirs = rope.forward_native(pos, q, content.transpose(0, 1).reshape(T, H * d).clone())
    theirs = theirs.view(T, H, d).transpose(0, 1)
    err = float((ours - theirs).abs().max() / ours.abs().max().clamp_min(1e-30))
    if not math.isfinite(err) or err > ROOT_KV_TOLERANCE:
        refuse(f"vLLM's rotary embedding differs from the layout contextdeque proved (relative error {err:.2e} "
               f"on keys at positions < {max_position}); its cached keys could not be relocated exactly",
               "vllm-rope-mismatch", err)


# ---------------------------------------------------------------------------- the shared runtime


def open_store(spec: str | None, backend: Any) -> Any:
    """The connector's store: contextdeque's default store, plus a Valkey tier (``valkey://...``)
    or with its disk tier in a given directory."""
    from ..stores import TieredStore, ValkeyTier

    if spec is None:
        return default_store(backend.device)
    if spec.startswith(("valkey://", "valkeys://", "valkey+cluster://")):
        local = default_store(backend.device, disk=False)
        return TieredStore([*local.tiers, ValkeyTier(spec, namespace=backend.fingerprint)], write_through=True)
    return default_store(backend.device, disk_dir=spec)


@dataclass(frozen=True)
class LoadSpec:
    """What the worker loads for one request: the window's root and chunks (token ids), the
    positions ``[start, end)`` vLLM takes from the connector, the request's block table, its
    patch policy, and whether it may load layer-wise (a step loads in the background only when
    all its requests may)."""

    req_id: str
    root: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    start: int
    end: int
    block_ids: tuple[int, ...]
    policy: str
    layerwise: bool = True


@dataclass(frozen=True)
class SaveSpec:
    """A chunk whose canonical vLLM computes in this step: ``tokens`` at positions
    ``[start, start + len)`` right after ``root`` (read back after the forward, with the root's KV
    for the run-time comparison with contextdeque's)."""

    req_id: str
    root: tuple[int, ...]
    tokens: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]


@dataclass
class ContextDequeConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(frozen=True)
class Match:
    """A prompt's matched prefix: its cut and how many chunks the store serves."""

    cut: PromptCut
    n_chunks: int

    @property
    def n_tokens(self) -> int:
        return self.cut.prefix_len(self.n_chunks)


class Runtime:
    """What both sides of the connector share in one process: contextdeque's backend on the same
    checkpoint, the store, the prompt cutter and the counters (``stats``)."""

    _instances: dict[tuple, "Runtime"] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, model: str, store: str | None, policy: str, rank: int, encode_on_finish: bool) -> "Runtime":
        key = (model, store, policy, rank, encode_on_finish)
        with cls._lock:
            rt = cls._instances.get(key)
            if rt is None:
                rt = cls._instances[key] = Runtime(model, store, policy, rank, encode_on_finish)
            return rt

    def __init__(self, model: str, store: str | None, policy: str, rank: int, encode_on_finish: bool) -> None:
        from ..model.load import load_model

        self.backend = load_model(model)
        self.store = open_store(store, self.backend)
        self.window_store = WindowStore.wrap(self.store, self.backend.device)
        self.policy_name = policy
        make_policy(policy)  # an unknown name fails at load, not on the first request
        self.rank = int(rank)
        self.encode_on_finish = encode_on_finish
        self.cutter = PromptCutter(self.backend.tokenizer)
        self.stats = RuntimeStats()  # counted from the scheduler and the loading thread: under its one lock
        self.refused: str | None = None
        self._views: dict[tuple[int, ...], Any] = {}
        self._lock = threading.RLock()

    def view(self, root: Sequence[int]) -> Any:
        """The backend under ``root`` (kept: its root KV is computed once)."""
        root = tuple(root)
        with self._lock:
            v = self._views.get(root)
            if v is None:
                if len(self._views) > 64:
                    self._views.clear()
                v = self._views[root] = self.backend.with_root(root)
            return v

    def chunk_key(self, root: Sequence[int], tokens: Sequence[int]) -> str:
        view = self.view(root)
        return WindowStore.chunk_key(view.chunk_id_for(token_ids=list(tokens)), view.fingerprint)

    # ------------------------------------------------------------------ scheduler side
    def match(self, prompt: Sequence[int]) -> Match | None:
        """The leading chunks of ``prompt`` whose canonicals the store serves, fetched and verified
        now (a corrupt copy is quarantined, a foreign one refused: the run ends before it)."""
        if self.refused is not None:
            return None
        cut = self.cutter.cut(prompt)
        if cut is None or not cut.chunks:
            return None
        view = self.view(cut.root)
        traffic = TierTraffic()
        n = 0
        for tokens in cut.chunks:
            key = self.chunk_key(cut.root, tokens)
            try:
                found = self.window_store.get_chunk(key, fingerprint=view.fingerprint, layout=view.layout.signature,
                                                    traffic=traffic)
            except ContextDequeError as exc:  # another model's or layout's entry under this key
                log.warning("contextdeque: stored chunk %s refused (%s); vLLM prefills from there", key[:24], exc)
                self.stats.count(refused_entries=1)
                found = None
            if found is None:
                break
            n += 1
        self.stats.count(quarantined=len(traffic.quarantined))
        return Match(cut, n) if n else None

    def encode_missing(self, prompt: Sequence[int]) -> None:
        """Encode (once) the canonicals of ``prompt``'s whole messages the store lacks."""
        cut = self.cutter.cut(prompt)
        if cut is None:
            return
        view = self.view(cut.root)
        for tokens in cut.chunks:
            key = self.chunk_key(cut.root, tokens)
            if self.window_store.has(key):
                continue
            chunk = view.encode(token_ids=list(tokens))
            self.window_store.put_chunk(chunk, traffic=TierTraffic())
            self.stats.count(encodes=1, encode_tokens=len(tokens))

    # ------------------------------------------------------------------ worker side
    def window_reader(self, spec: LoadSpec) -> Callable[[int], LayerKV]:
        """``read(layer) -> (k [H, S, d], v [H, S, d])``: the root and the chunks placed by a window
        under the connector's policy (positions ``0..S-1``, rotated as vLLM caches them), one
        layer per call (``ContextWindow.kv_layer_reader``). The window's whole-model work — the
        canonicals and patches fetched, any conditioned forward the policy asks for — is done
        here; relocation and patch apply happen per layer, in ``read``."""
        with self._lock:
            win = ContextWindow(self.view(spec.root), store=self.store, patch_policy=spec.policy, rank=self.rank,
                                overflow="error")
            try:
                for tokens in spec.chunks:
                    rec = win.append(token_ids=list(tokens)).receipt
                    self.stats.count(**{f"window_{k}": float(n) for k, n in rec.counts().items()})
                held = win.tokens_used + len(spec.root)
                read = win.kv_layer_reader()
            finally:
                win.close()
        if held < spec.end:
            raise ContextDequeError(f"the window holds {held} tokens, vLLM expects {spec.end}")
        return read

    def save_canonical(self, spec: SaveSpec, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store the canonical of ``spec``'s chunk from the KV vLLM cached for it (un-rotated)."""
        view = self.view(spec.root)
        n = len(spec.tokens)
        pos = view.text_positions(spec.start, n)
        keys, values = to_content_frame([(k.to(torch.float32), v.to(torch.float32)) for k, v in layers], view.layout, pos)
        inp = view._encode_inputs(None, list(spec.tokens), None, None, None, torch.float32)
        chunk = Chunk(
            id=inp.chunk_id, fingerprint=view.fingerprint, layout_signature=view.layout.signature,
            root_digest=view.root_digest, keys=keys.contiguous(), values=values.contiguous(),
            rel_positions=inp.rel_positions, span=inp.span, canonical_start=spec.start, token_ids=inp.token_ids,
            modality="text", meta={"input_digest": inp.input_digest, "source": "vllm"},
        )
        self.window_store.put_chunk(chunk, traffic=TierTraffic())
        self.stats.count(saved_from_vllm=1)

    def check_root(self, root: Sequence[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Compare the root's KV vLLM cached with contextdeque's (the run-time proof); a mismatch
        switches loading off for good."""
        ours = self.view(root).root_kv()
        err = 0.0
        for (k, v), (k2, v2) in zip(layers, ours):
            for a, b in ((k, k2), (v, v2)):
                err = max(err, float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)))
        self.stats.count_max("root_check_max_rel_err", err)
        if not math.isfinite(err) or err > ROOT_KV_TOLERANCE:
            self.refused = (f"vLLM's cached KV of the root differs from contextdeque's (relative error {err:.2e}): "
                            "its rotary or weights are not the ones contextdeque relocates; loading is off")
            log.error("contextdeque: %s", self.refused)


# ---------------------------------------------------------------------------- the connector


class ContextDequeConnector(KVConnectorBase_V1):
    """vLLM's KV connector over contextdeque (see the module docstring). Configured through
    ``kv_connector_extra_config`` (:func:`kv_transfer_config` builds it)."""

    #: called on the loading thread before each layer is loaded (tests gate the pipeline with it)
    before_layer: Callable[[int], None] | None = None

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        model_cfg = vllm_config.model_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.rt = Runtime.get(
            extra.get("model") or model_cfg.model, extra.get("store"), str(extra.get("patch_policy") or "latency"),
            int(extra.get("rank", DEFAULT_RANK)), bool(extra.get("encode_on_finish", True)),
        )
        layout = self.rt.backend.layout
        check_vllm_rotary(layout, model_cfg.hf_config, int(model_cfg.max_model_len), vllm_config)
        self.layout = layout
        # scheduler side
        self._matches: dict[str, tuple[Match, int, str]] = {}
        self._to_load: dict[str, LoadSpec] = {}
        self.layerwise = bool(extra.get("layerwise", True))
        # worker side
        self._paged: PagedLayout | None = None
        self._pipeline: LayerPipeline[str] | None = None
        self._load_specs: dict[str, LoadSpec] = {}
        #: the last step's finished pipeline (its ``times`` and ``trace``)
        self.last_pipeline: LayerPipeline[str] | None = None
        self._saving: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
        self._failed_blocks: set[int] = set()

    @property
    def stats(self) -> dict[str, float]:
        """Counters shared by both sides in this process (loads, tokens loaded, encodes, ...)."""
        return self.rt.stats

    # ------------------------------------------------------------------ scheduler side
    @staticmethod
    def _params(request: Any) -> Any:
        """The request's ``kv_transfer_params[PARAMS_KEY]`` (a scheduler ``Request`` or the
        ``NewRequestData`` the worker metadata is built from)."""
        params = getattr(request, "kv_transfer_params", None)
        if params is None:
            sampling = getattr(request, "sampling_params", None)
            params = ((getattr(sampling, "extra_args", None) or {}).get("kv_transfer_params")) if sampling is not None else None
        return (params or {}).get(PARAMS_KEY)

    def _off(self, request: Any) -> bool:
        return self._params(request) == "off"

    def _policy(self, request: Any) -> str:
        """The request's patch policy: ``kv_transfer_params={"contextdeque": {"patch_policy": P}}``,
        else the connector's."""
        p = self._params(request)
        return str(p.get("patch_policy")) if isinstance(p, dict) and p.get("patch_policy") else self.rt.policy_name

    def _layerwise(self, request: Any) -> bool:
        """Whether the request loads layer-wise: ``{"contextdeque": {"layerwise": False}}`` turns it
        off for one request (a benchmark's baseline on the same engine), else the connector's."""
        p = self._params(request)
        return bool(p["layerwise"]) if isinstance(p, dict) and "layerwise" in p else self.layerwise

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if self._off(request):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        t0 = time.perf_counter()
        match = self.rt.match(prompt)
        self.stats.count(match_ms=(time.perf_counter() - t0) * 1000.0)
        if match is None:
            return 0, False
        n = match.n_chunks
        while n and match.cut.prefix_len(n) >= request.num_tokens:  # vLLM computes at least the last token
            n -= 1
        match = Match(match.cut, n)
        if not n or match.n_tokens <= num_computed_tokens:
            return 0, False
        policy = self._policy(request)
        try:
            regime = make_policy(policy).regime
        except ContextDequeError as exc:  # a request naming no registered policy is vLLM's alone
            log.warning("contextdeque: request %s: %s; vLLM prefills it", request.request_id, exc)
            return 0, False
        if regime != "exact" and not (request.cache_salt or "").startswith(SALT_PREFIX):
            # approximate KV: this request's blocks get their own hashes, never found as exact ones
            request.cache_salt = SALT_PREFIX + request.request_id + (":" + request.cache_salt if request.cache_salt else "")
            request.block_hashes = []
            request.update_block_hashes()
        self._matches[request.request_id] = (match, num_computed_tokens, policy)
        return match.n_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        got = self._matches.pop(request.request_id, None)
        if got is None or num_external_tokens <= 0:
            return
        match, start, policy = got
        end = start + int(num_external_tokens)
        chunks = match.cut.chunks[: match.n_chunks]
        self._to_load[request.request_id] = LoadSpec(request.request_id, match.cut.root, chunks, start, end, (), policy,
                                                     self._layerwise(request))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = ContextDequeConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            blocks = tuple(int(b) for b in req.block_ids[0])
            spec = self._to_load.pop(req.req_id, None)
            if spec is not None:
                meta.loads.append(dataclasses.replace(spec, block_ids=blocks))
            save = self._save_spec(req, blocks, scheduler_output.num_scheduled_tokens.get(req.req_id, 0), spec)
            if save is not None:
                meta.saves.append(save)
        # a preempted request that comes back is looked up again; its (new) block table comes whole
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            spec = self._to_load.pop(req_id, None)
            if spec is None:
                continue
            if req_id not in cached.resumed_req_ids or cached.new_block_ids[i] is None:
                raise RuntimeError(f"contextdeque: request {req_id} was matched but its whole block table is not known")
            meta.loads.append(dataclasses.replace(spec, block_ids=tuple(int(b) for b in cached.new_block_ids[i][0])))
        self._to_load.clear()
        return meta

    def _save_spec(self, req: Any, blocks: tuple[int, ...], scheduled: int, load: LoadSpec | None) -> SaveSpec | None:
        """The first message after the root, when vLLM computes it (whole) in this step and the
        store lacks its canonical."""
        if self.rt.refused is not None or not req.prompt_token_ids or self._off(req):
            return None
        cut = self.rt.cutter.cut(req.prompt_token_ids)
        if cut is None or not cut.chunks:
            return None
        start, n = len(cut.root), len(cut.chunks[0])
        computed_before = int(req.num_computed_tokens)
        if computed_before > start or computed_before + int(scheduled) < start + n or (load is not None and load.end > start):
            return None
        if self.rt.window_store.has(self.rt.chunk_key(cut.root, cut.chunks[0])):
            return None
        return SaveSpec(req.req_id, cut.root, cut.chunks[0], start, blocks)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matches.pop(request.request_id, None)
        if self.rt.encode_on_finish and not self._off(request) and self.rt.refused is None:
            try:
                self.rt.encode_missing(list(request.prompt_token_ids or []))
            except ContextDequeError as exc:  # a store fault costs a future miss, never the request
                log.warning("contextdeque: could not store this request's messages: %s", exc)
        return False, None

    # ------------------------------------------------------------------ worker side
    @staticmethod
    def _layer_cache(layer: Any) -> torch.Tensor:
        cache = layer.kv_cache
        if isinstance(cache, (list, tuple)):
            cache = cache[0]
        return cache

    def _paged_layout(self, cache: torch.Tensor) -> PagedLayout:
        if self._paged is None:
            self._paged = paged_layout_for(cache, self.block_size, self.layout.k_heads, self.layout.k_dim)
        return self._paged

    @staticmethod
    def _layer_index(layer_name: str) -> int:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(layer_name))

    def _caches(self, forward_context: "ForwardContext") -> dict[int, torch.Tensor]:
        """Each attention layer's paged cache this step, by layer index."""
        return {self._layer_index(name): self._layer_cache(layer)
                for name, layer in forward_context.no_compile_layers.items() if hasattr(layer, "kv_cache")}

    def _load_task(self, spec: LoadSpec, caches: dict[int, torch.Tensor]) -> Callable[[], Callable[[int], None]]:
        """The pipeline's task for ``spec``: build its window (whole-model work), then per layer
        relocate + patch that layer and write positions ``[start, end)`` into vLLM's cache."""
        def prepare() -> Callable[[int], None]:
            if self.rt.refused is not None:  # this process's run-time check refused (the scheduler may be another's)
                raise ContextDequeError(self.rt.refused)
            read = self.rt.window_reader(spec)

            def load_layer(layer: int) -> None:
                cache = caches.get(layer)
                if cache is None:
                    raise ContextDequeError(f"vLLM's forward context has no KV cache for layer {layer}")
                k, v = read(layer)
                self._paged_layout(cache).write(cache, spec.block_ids, spec.start, k[:, spec.start : spec.end],
                                                v[:, spec.start : spec.end])

            return load_layer

        return prepare

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ContextDequeConnectorMetadata)
        self._finish_load()  # a step whose wait_for_save never came (none should)
        if not meta.loads:
            return
        caches = self._caches(forward_context)
        self._load_specs = {spec.req_id: spec for spec in meta.loads}
        tasks = [(spec.req_id, self._load_task(spec, caches)) for spec in meta.loads]
        background = all(spec.layerwise for spec in meta.loads)
        self._pipeline = LayerPipeline(self.layout.num_layers, tasks, background=background,
                                       before_layer=self.before_layer).start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pipeline is not None:
            self._pipeline.wait(self._layer_index(layer_name))

    def _finish_load(self) -> None:
        """After the step's forward: wait for the loading thread, count, and report the blocks of
        the loads that failed (vLLM recomputes them: nothing half-loaded is served)."""
        pipe, self._pipeline = self._pipeline, None
        if pipe is None:
            return
        failed = pipe.join()
        t = pipe.times
        self.stats.count(load_prepare_ms=t.prepare, load_layers_ms=sum(t.load), load_wait_ms=sum(t.wait),
                      load_compute_ms=sum(t.compute), load_steps=1)
        self.last_pipeline = pipe
        for req_id, spec in self._load_specs.items():
            exc = failed.get(req_id)
            if exc is None:
                self.stats.count(loads=1, tokens_loaded=spec.end - spec.start)
                continue
            log.warning("contextdeque: load of request %s failed (%s); vLLM recomputes it", req_id, exc)
            first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
            self._failed_blocks.update(spec.block_ids[first : last + 1])
            self.stats.count(load_failures=1)
        self._load_specs = {}

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ContextDequeConnectorMetadata) or not meta.saves:
            return
        cache = kv_layer[0] if isinstance(kv_layer, (list, tuple)) else kv_layer
        paged = self._paged_layout(cache)
        idx = self._layer_index(layer_name)
        for spec in meta.saves:
            # the root too: the run-time proof compares it with contextdeque's root KV
            self._saving[spec.req_id][idx] = paged.read(cache, spec.block_ids, 0, spec.start + len(spec.tokens))

    def wait_for_save(self) -> None:
        self._finish_load()
        meta = self._get_connector_metadata()
        if not isinstance(meta, ContextDequeConnectorMetadata):
            return
        for spec in meta.saves:
            got = self._saving.pop(spec.req_id, {})
            if len(got) != self.layout.num_layers:
                continue
            layers = [got[i] for i in range(self.layout.num_layers)]
            try:
                self.rt.check_root(spec.root, [(k[:, : spec.start], v[:, : spec.start]) for k, v in layers])
                if self.rt.refused is None:
                    self.rt.save_canonical(spec, [(k[:, spec.start :], v[:, spec.start :]) for k, v in layers])
            except ContextDequeError as exc:
                log.warning("contextdeque: could not save request %s's first message: %s", spec.req_id, exc)
        self._saving.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


def runtimes() -> list[Runtime]:
    """The connector runtimes of this process (one per configuration): their ``stats``."""
    return list(Runtime._instances.values())
