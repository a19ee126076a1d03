"""Reading a window out: the transformers cache of root + pages (``materialize``), answers
(``generate``) and the disposability test (``is_disposable``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..core.args import check_float, check_int
from ..core.errors import WindowError
from ..core.kv import LayerKV, kv_nbytes
from . import decode, ingest
from .disposable import Verdict, run_test
from .receipt import Meter, Receipt
from .ref import ChunkRef
from .slot import Slot
from .state import WindowState


@dataclass
class Answer:
    """What ``ContextWindow.generate`` returns: the answer's ids, its text (with a tokenizer),
    and the receipt. ``str(answer)`` is the text."""

    token_ids: list[int]
    text: str | None
    receipt: Receipt | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.text if self.text is not None else " ".join(map(str, self.token_ids))



class WindowReading:
    """The read-out operations of a :class:`~.window.ContextWindow` (a mixin over its ``_run``)."""

    # ------------------------------------------------------------------ reading it out
    def materialize(self) -> Any:
        """The KV the model sees, as a fresh transformers ``DynamicCache`` (batch 1): the root,
        then every chunk's page, ``S = root_len + sum(n_tokens)`` tokens per layer.

        Fresh every call: generating with it (which appends to it) never touches the window.
        Continue it with ``model.generate(input_ids=window.input_ids_for(q),
        past_key_values=cache, ...)``. Under the exact policy it equals the KV of one forward
        over the root and the chunks (to float rounding)."""
        return decode.to_cache(self._ctx, self.kv_layers())

    def kv_layers(self) -> list[LayerKV]:
        """What :meth:`materialize` holds, as plain tensors: per layer ``(k [H_k, S, d_k],
        v [H_v, S, d_v])`` at positions ``0..S-1`` (root, then every chunk), rotated as the model
        caches them. Fresh tensors (e.g. to copy into another engine's paged cache)."""
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], list[LayerKV]]:
            layers = decode.assemble(self._ctx, state.slots)
            meter.page_bytes += kv_nbytes(layers)
            return {"refs": state.refs}, layers

        return self._run("materialize", body, mutates=False)[1]

    def kv_layer_reader(self) -> Callable[[int], LayerKV]:
        """:meth:`kv_layers` one layer at a time: ``read(layer)`` is ``kv_layers()[layer]`` (the
        same values, ``(k [H_k, S, d_k], v [H_v, S, d_v])``, fresh tensors), each call relocating
        and patching that layer only — so a consumer can overlap the layers' loading with its own
        per-layer compute (vLLM's layer-wise load). It reads the window as it is now: later
        operations and ``close`` do not change what it returns; it may be called from another
        thread."""
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], tuple[Slot, ...]]:
            self._ctx.backend.root_kv()  # computed here (once per root), never by a reader's thread
            return {"refs": state.refs}, tuple(state.slots)

        slots = self._run("materialize", body, mutates=False)[1]
        ctx = self._ctx
        return lambda layer: decode.assemble_layer(ctx, slots, layer)

    def input_ids_for(self, query: str | Sequence[int] | torch.Tensor, *, chat: bool = True) -> torch.Tensor:
        """``[1, S + Q]`` ids for ``model.generate(input_ids=..., past_key_values=materialize())``:
        the cached prefix's ids (root, then each chunk's tokens) followed by the query's (text is
        tokenized and, with a chat template, closed as a user turn + assistant header).

        Raises:
            WindowError: the window holds a chunk whose span is not its token count (an image):
                ``generate`` would place the query at the wrong position; use
                ``ContextWindow.generate``, which passes positions explicitly.
        """
        self._check_open()
        if not decode.hf_compatible(self._state.slots):
            raise WindowError(
                "the window holds a chunk whose span differs from its token count (or M-RoPE "
                "positions); model.generate cannot continue it: use window.generate"
            )
        ids = decode.prefix_ids(self._ctx, self._state.slots) + decode.query_ids(self._ctx, query, chat=chat)
        return torch.tensor([ids], dtype=torch.long, device=self._ctx.backend.device)

    def generate(self, query: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 32, *, chat: bool = True, **kw: Any) -> Answer:
        """Materialize and decode ``query``. Text-only windows go through
        ``model.generate(input_ids=input_ids_for(query), past_key_values=materialize(), **kw)``
        (greedy unless ``kw`` says otherwise); windows with image spans through the window's own
        greedy decoder with explicit positions."""
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], Answer]:
            check_int("max_new_tokens", max_new_tokens, minimum=1, error=WindowError)
            q = decode.query_ids(self._ctx, query, chat=chat)
            new_ids = decode.answer(self._ctx, state.slots, q, max_new_tokens, meter, **kw)
            return {"refs": state.refs}, Answer(token_ids=new_ids, text=decode.decode_text(self._ctx, new_ids))

        receipt, answer = self._run("generate", body, mutates=False)
        answer.receipt = receipt
        return answer

    def is_disposable(
        self,
        ref: ChunkRef,
        query: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 8,
        *,
        drop: bool = False,
        kl_tol: float | None = None,
        chat: bool = True,
    ) -> Verdict:
        """Is ``ref``'s conditioning load-bearing for ``query``?

        Decodes ``query`` (greedy, ``max_new_tokens``) three ways: the window as is; with
        ``ref``'s conditioning toggled off (its page becomes the bare relocated canonical; every
        other chunk as is); and, with ``drop=True``, with ``ref`` dropped (later chunks shift
        back keeping their KV). Disposable when every variant gives the same answer (and,
        with ``kl_tol``, a first-token KL(as is || variant) at most ``kl_tol``). The window
        is not changed.
        """
        def body(state: WindowState, meter: Meter) -> tuple[dict[str, Any], dict[str, Any]]:
            state.check_known(ref)
            idx = state.index(ref)
            check_int("max_new_tokens", max_new_tokens, minimum=1, error=WindowError)
            check_float("kl_tol", kl_tol, minimum=0.0, none_ok=True, error=WindowError)
            q = decode.query_ids(self._ctx, query, chat=chat)
            slot = state.slots[idx]
            # a provisional slot (latency-first, not healed yet) is conditioned by its own forward:
            # its canonical (from the store, else encoded and stored for heal) is the variant without
            canonical = ingest.canonical_of(self._ctx, slot.chunk, meter) if slot.provisional else None
            found = run_test(self._ctx, state.slots, idx, q, max_new_tokens=max_new_tokens, drop=drop, kl_tol=kl_tol,
                             canonical=canonical)
            return {"refs": (ref,)}, found

        receipt, found = self._run("is_disposable", body, mutates=False)
        return Verdict(ref=ref, receipt=receipt, **found)
