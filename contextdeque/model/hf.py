"""The Hugging Face transformers backend: encode canonical chunks, run conditioned forwards, decode.

Every forward goes through :meth:`HFBackend.forward`, which takes explicit positions and an
explicit past (per-layer KV), so callers can prefill any tokens at any positions after any
assembled context. That one entry point serves chunk encoding, patch formation, token-recompute
arms and the re-prefill oracle alike.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..core.counters import Counters
from ..core.chunk import Chunk, check_representable, chunk_id, digest, storage_dtype
from ..core.args import check_instance, check_str, check_token_ids
from ..core.errors import ArgumentError, EmptyChunkError, FingerprintMismatchError, ModelLoadError
from ..core.layout import KVLayout, register_layout
from ..core.kv import LayerKV
from ..core.operator import to_content_frame
from . import chat
from .forward import position_ids, run_forward

DEFAULT_SYSTEM = "You are a helpful AI assistant."


@dataclass
class ForwardResult:
    """Output of one forward over new tokens.

    ``kv``: per layer ``(k [H_k, T, d_k], v [H_v, T, d_v])`` of the new tokens as cached (rotated);
    ``logits``: ``[T', vocab]`` fp32 for the kept positions (last only by default) or None.
    """

    kv: list[LayerKV]
    logits: torch.Tensor | None


@dataclass
class EncodeInputs:
    """Normalized inputs of one encode: ``token_ids [T]`` (or None for embeddings),
    ``rel_positions [n_axes, T]``, span, storage dtype, input digest and the chunk id."""

    token_ids: torch.Tensor | None
    rel_positions: torch.Tensor
    span: int
    dtype: torch.dtype
    input_digest: str
    chunk_id: str


FINGERPRINT_SCHEME = "3"
"""Version of :func:`model_fingerprint`'s definition (part of cached fingerprints' keys)."""

_FINGERPRINTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[tuple[int, int], ...], str]]" = (
    weakref.WeakKeyDictionary()
)


def _weights_state(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Identity and in-place-modification counter of every tensor: changes whenever a weight
    does (assignment or in-place edit), costs no hashing."""
    return tuple((id(t), t._version) for t in model.state_dict(keep_vars=True).values())


def hash_weights(model: torch.nn.Module) -> str:
    """sha256 of the config and every tensor of the state dict, every byte of it (names, shapes,
    dtypes, values): any weight that can change a K or V changes it."""
    h = hashlib.sha256()
    h.update(f"scheme:{FINGERPRINT_SCHEME}|".encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    seen: dict[tuple, str] = {}
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            t = p.detach()
            h.update(f"|{name}{tuple(t.shape)}{t.dtype}|".encode())
            ident = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if t.numel() and ident in seen:  # a tied weight (e.g. lm_head = embed_tokens): hashed once
                h.update(f"=alias:{seen[ident]}".encode())
                continue
            seen[ident] = name
            if t.numel():
                t = t.to("cpu").contiguous()
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()[:32]


def model_fingerprint(model: torch.nn.Module, *, known: str | None = None) -> str:
    """The model's fingerprint: :func:`hash_weights`, computed once per loaded model (recomputed
    only when a weight was replaced or edited in place since). ``known``: a fingerprint cached
    for exactly these weights (the default model's, keyed by its file digest), used as is."""
    state = _weights_state(model)
    hit = _FINGERPRINTS.get(model)
    if hit is not None and hit[0] == state:
        return hit[1]
    fp = known if known is not None else hash_weights(model)
    _FINGERPRINTS[model] = (state, fp)
    return fp


def default_root_ids(tokenizer: Any, system: str = DEFAULT_SYSTEM) -> list[int]:
    """The fixed header every window starts with: the chat template up to the user turn's content
    (BOS, system prompt, user header), or just BOS for a plain tokenizer."""
    if tokenizer is None:
        return [0]
    if chat.has_template(tokenizer):
        ids = tokenizer(chat.user_header(tokenizer, system), add_special_tokens=False)["input_ids"]
        if ids:
            return list(ids)
    bos = getattr(tokenizer, "bos_token_id", None)
    return [int(bos)] if bos is not None else [0]


class HFBackend:
    """A transformers causal LM (or VLM) wrapped for position-free KV work.

    Attributes: ``model``, ``tokenizer`` (may be None), ``layout`` (:class:`KVLayout`, read off the
    model's structure by :func:`contextdeque.model.detect.read_layout`), ``fingerprint`` (str),
    ``root_ids`` (the window root's token ids), ``proof`` (the relocation oracle's verdict at load,
    :class:`contextdeque.model.detect.Proof`; None with ``verify_at_load=False``).

    Raises:
        UnsupportedLayoutError: the model's cache cannot be relocated exactly (``reason`` says why),
            or its layout fails the proof at load.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        root_ids: Sequence[int] | None = None,
        name: str | None = None,
        fingerprint: str | None = None,
        verify_at_load: bool = True,
    ) -> None:
        from .detect import behavior_digest, cached_layout, prove_layout

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or model.config.model_type
        self.fingerprint = model_fingerprint(model, known=fingerprint)
        behavior = behavior_digest(model)
        probes: dict = {}  # the detection's forwards (when it ran), reused by the proof
        self.layout: KVLayout = cached_layout(model, self.fingerprint, keep=probes, behavior=behavior)
        self.root_ids: tuple[int, ...] = tuple(int(i) for i in (root_ids or default_root_ids(tokenizer)))
        if not self.root_ids:
            raise EmptyChunkError("the window root must hold at least one token")
        self.root_digest = digest(list(self.root_ids))[:16]
        self._root_kv: list[LayerKV] | None = None
        self.counters = Counters()  # every forward this backend ran (forwards, tokens prefilled)
        # the proof at load: relocation vs the model's own shifted forward (cached per fingerprint)
        self.proof = prove_layout(self, probes=probes, behavior=behavior) if verify_at_load else None
        self.counters = Counters()  # (the proof's forwards are not the caller's)
        register_layout(self.layout)

    def with_root(self, root_ids: Sequence[int]) -> "HFBackend":
        """A view of this backend (same model, tokenizer, layout, fingerprint) with another window
        root. Chunk ids include the root digest, so canonicals of different roots never mix."""
        ids = tuple(int(i) for i in root_ids)
        if not ids:
            raise EmptyChunkError("the window root must hold at least one token")
        if ids == self.root_ids:
            return self
        view = copy.copy(self)
        view.root_ids = ids
        view.root_digest = digest(list(ids))[:16]
        view._root_kv = None
        view.counters = dataclasses.replace(self.counters)  # the view counts its own forwards
        return view

    # ------------------------------------------------------------------ basics
    def count_forward(self, tokens: int) -> None:
        """Count one model forward over ``tokens`` new tokens (``forward`` does; so does a caller
        that runs the model itself: a partial pass, a decode step)."""
        self.counters.forwards += 1
        self.counters.tokens_prefilled += int(tokens)

    # what the window's receipts difference (read-only views of ``counters``)
    forwards_run = property(lambda self: self.counters.forwards, doc="Model forwards this backend has run.")
    tokens_prefilled = property(lambda self: self.counters.tokens_prefilled, doc="Tokens those forwards processed.")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def root_len(self) -> int:
        return len(self.root_ids)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding table: valid token ids are ``[0, vocab_size)``."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def embed_dim(self) -> int:
        """Width of the input embeddings (``embeds=`` must be ``[T, embed_dim]``)."""
        return int(self.model.get_input_embeddings().embedding_dim)

    @property
    def n_pos_axes(self) -> int:
        return self.layout.n_pos_axes

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ModelLoadError("this backend has no tokenizer; pass token_ids")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text_positions(self, start: int, n: int) -> torch.Tensor:
        """``[n_axes, n]`` positions of ``n`` text tokens starting at ``start``."""
        return (torch.arange(n, dtype=torch.long) + int(start)).unsqueeze(0).expand(self.n_pos_axes, -1).clone()

    def position_ids(self, positions: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The model's ``position_ids`` for ``positions`` (see :func:`.forward.position_ids`, the
        one preparation every forward uses: encode, conditioned forwards, recompute arms, decode)."""
        return position_ids(positions, self.n_pos_axes, self.device)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]`` input embeddings."""
        return self.model.get_input_embeddings()(token_ids.to(self.device)).detach()

    # ------------------------------------------------------------------ forwards
    @torch.no_grad()
    def forward(
        self,
        *,
        input_ids: torch.Tensor | Sequence[int] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        positions: torch.Tensor,
        past: list[LayerKV] | None = None,
        logits: str = "last",
    ) -> ForwardResult:
        """Prefill new tokens after ``past`` at explicit ``positions``.

        ``input_ids [T]`` or ``inputs_embeds [T, hidden]``; ``positions [n_axes, T]`` (or ``[T]``);
        ``past``: per layer ``(k [H,S,d], v [H,S,d])`` as cached (rotated). ``logits``: "last", "all"
        or "none". Returns the new tokens' cached KV and the requested logits.
        """
        kv, lg = run_forward(
            self.model, self.n_pos_axes, input_ids=input_ids, inputs_embeds=inputs_embeds, positions=positions,
            past=past, logits=logits,
        )
        self.count_forward(kv[0][0].shape[-2])
        return ForwardResult(kv=kv, logits=lg)

    def root_kv(self) -> list[LayerKV]:
        """The window root's cached KV at positions ``0..R-1`` (computed once)."""
        if self._root_kv is None:
            res = self.forward(
                input_ids=list(self.root_ids), positions=self.text_positions(0, self.root_len), logits="none"
            )
            self._root_kv = [(k.clone(), v.clone()) for k, v in res.kv]
        return self._root_kv

    def reprefill(self, chunks: Sequence[Chunk]) -> ForwardResult:
        """The re-prefill oracle: one forward over the root and ``chunks`` from scratch, nothing
        reused (what a cache miss costs). Each chunk starts at the next free position (window
        order). Returns the KV of all ``R + N`` tokens, per layer ``(k [H, R+N, d], v [H, R+N, d])``,
        and no logits. Text-only chunks go in as token ids, anything else as fp32 embeddings."""
        root_ids = torch.tensor(self.root_ids, dtype=torch.long)
        positions, start = [self.text_positions(0, self.root_len)], self.root_len
        for c in chunks:
            positions.append(c.positions(start))
            start += c.span
        if all(c.token_ids is not None for c in chunks):
            inputs = {"input_ids": torch.cat([root_ids, *(c.token_ids for c in chunks)])}
        else:
            parts = [self.embed_tokens(root_ids)]
            for c in chunks:
                inp = self.chunk_inputs(c)
                parts.append(self.embed_tokens(inp["input_ids"]) if "input_ids" in inp else inp["inputs_embeds"])
            inputs = {"inputs_embeds": torch.cat([p.to("cpu", torch.float32) for p in parts])}
        return self.forward(**inputs, positions=torch.cat(positions, dim=1), past=None, logits="none")

    def adopt_root_kv(self, layers: Sequence[LayerKV]) -> bool:
        """Use ``layers`` (the root's KV as this model cached it, e.g. from a saved session) instead
        of running the root's forward. Only when the root's KV is not computed yet (returns False
        otherwise: the one already here stays). Shapes are checked against the layout."""
        if self._root_kv is not None:
            return False
        if len(layers) != self.layout.num_layers or any(k.shape[-2] != self.root_len or v.shape[-2] != self.root_len for k, v in layers):
            raise FingerprintMismatchError(f"root KV of {len(layers)} layers does not match this root ({self.root_len} tokens, {self.layout.num_layers} layers)")
        self._root_kv = [(k, v) for k, v in layers]
        return True

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        rel_positions: torch.Tensor | None = None,
        span: int | None = None,
        storage: torch.dtype | str = torch.float32,
        modality: str | None = None,
        meta: dict[str, str] | None = None,
    ) -> Chunk:
        """Canonical chunk ``KV(B | root)`` in the content frame.

        Give exactly one of ``text``, ``token_ids [T]`` or ``embeds [T, hidden]`` (an image span's
        input embeddings). ``rel_positions [n_axes, T]`` and ``span`` describe a multimodal chunk's
        own position grid (from the model's rope-index logic); text defaults to ``arange(T)``.
        """
        inp = self._encode_inputs(text, token_ids, embeds, rel_positions, span, storage)
        ids_t, rel, span, dt = inp.token_ids, inp.rel_positions, inp.span, inp.dtype
        start = self.root_len
        pos = rel + start
        res = self.forward(
            input_ids=ids_t, inputs_embeds=embeds if ids_t is None else None, positions=pos, past=self.root_kv(),
            logits="none",
        )
        keys, values = to_content_frame(res.kv, self.layout, pos)
        check_representable(keys, dt, "keys")
        check_representable(values, dt, "values")
        input_digest = inp.input_digest
        return Chunk(
            id=inp.chunk_id,
            fingerprint=self.fingerprint,
            layout_signature=self.layout.signature,
            root_digest=self.root_digest,
            keys=keys.to(dt).contiguous(),
            values=values.to(dt).contiguous(),
            rel_positions=rel,
            span=span,
            canonical_start=start,
            token_ids=ids_t,
            embeds=None if embeds is None else embeds.detach().to("cpu").clone(),
            modality=modality or ("text" if ids_t is not None else "image"),
            meta={"input_digest": input_digest, **(meta or {})},
        )

    def chunk_id_for(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        rel_positions: torch.Tensor | None = None,
        span: int | None = None,
        storage: torch.dtype | str = torch.float32,
    ) -> str:
        """The id :meth:`encode` would give these inputs, without running the model (a store lookup
        before encoding means content seen once is never encoded again)."""
        return self._encode_inputs(text, token_ids, embeds, rel_positions, span, storage).chunk_id

    def _encode_inputs(self, text, token_ids, embeds, rel_positions, span, storage) -> "EncodeInputs":
        """Normalize encode's inputs: exactly one of text/token_ids/embeds, a position grid, a span,
        a storage dtype, and the resulting content address."""
        if sum(x is not None for x in (text, token_ids, embeds)) != 1:
            raise EmptyChunkError("encode needs exactly one of text, token_ids, embeds")
        dt = storage_dtype(storage)
        ids_t: torch.Tensor | None = None
        if text is not None:
            check_str("text", text)
            ids_t = torch.tensor(self.tokenize(text), dtype=torch.long)
        elif token_ids is not None:
            ids_t = check_token_ids("token_ids", token_ids, self.vocab_size, empty_error=EmptyChunkError)
        else:
            check_instance("embeds", embeds, torch.Tensor, "a [T, hidden] float tensor")
            if not embeds.is_floating_point() or embeds.dim() != 2 or embeds.shape[1] != self.embed_dim:
                raise ArgumentError(
                    f"embeds must be a float [T, {self.embed_dim}] tensor (the model's embedding width), "
                    f"got {embeds.dtype} {tuple(embeds.shape)}"
                )
        n = int(ids_t.numel()) if ids_t is not None else int(embeds.shape[0])
        if n == 0:
            raise EmptyChunkError("cannot encode an empty chunk")
        if rel_positions is None:
            rel = torch.arange(n, dtype=torch.long).unsqueeze(0).expand(self.n_pos_axes, -1).clone()
        else:
            rel = torch.as_tensor(rel_positions, dtype=torch.long)
            if rel.dim() == 1:
                rel = rel.unsqueeze(0).expand(self.n_pos_axes, -1).clone()
        span = int(span) if span is not None else int(rel.max()) + 1
        input_digest = digest(ids_t if ids_t is not None else embeds.to(torch.float32), rel, span)[:32]
        return EncodeInputs(
            ids_t, rel, span, dt, input_digest, chunk_id(self.fingerprint, self.root_digest, input_digest, dt)
        )

    def chunk_inputs(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The forward inputs that reproduce ``chunk`` (``input_ids`` or ``inputs_embeds``)."""
        if chunk.token_ids is not None:
            return {"input_ids": chunk.token_ids}
        if chunk.embeds is not None:
            return {"inputs_embeds": chunk.embeds}
        raise EmptyChunkError(f"chunk {chunk.id[:12]} carries neither token ids nor embeddings")

    def __repr__(self) -> str:
        return f"HFBackend({self.name!r}, {self.layout.describe()})"
