"""The chat template read as a deque of messages: :class:`ChatTemplate` cuts a message list along a
tokenizer's own template into the window root, one chunk run per message and the generation
prompt, and checks that the pieces concatenate to the template applied to the whole list (string
and tokens; ``TemplateError`` when a template does not render incrementally)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

from contextdeque.core.errors import TemplateError
from contextdeque.model.images import pixel_digest

from .messages import IMAGE_MARK, ChatMessage

# a system message no conversation holds: what the template renders around it is its header
_PROBE = {"role": "system", "content": "\x00cdq-probe\x00"}


# ---------------------------------------------------------------------------- the template cut


@dataclass(frozen=True)
class TemplateCut:
    """A conversation cut along the chat template.

    ``root_ids``: the window root. ``first``: index of the first message after the root (1 when
    the list opens with a system message, else 0). ``pieces``: per message after the root, its
    chunks in order, each a tuple of token ids or an int (the index of an image of that message).
    ``generation_ids``: the assistant header. ``stream``: root + every message, as a prefix cache
    sees it (token ids; each image token an opaque item).
    """

    root_ids: tuple[int, ...]
    first: int
    pieces: tuple[tuple[tuple[int, ...] | int, ...], ...]
    generation_ids: tuple[int, ...]

    def stream(self, messages: Sequence[ChatMessage], image_tokens: Mapping[str, int]) -> list[Hashable]:
        out: list[Hashable] = list(self.root_ids)
        for m, pcs in zip(messages[self.first :], self.pieces):
            for pc in pcs:
                if isinstance(pc, int):
                    d = pixel_digest(m.images[pc])
                    out.extend(("image", d, j) for j in range(image_tokens.get(d, 1)))
                else:
                    out.extend(pc)
        return out


class ChatTemplate:
    """Cuts message lists along a tokenizer's chat template, one chunk run per message."""

    def __init__(self, tokenizer: Any, *, image_wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise TemplateError("MessageWindow needs a tokenizer with a chat template")
        self.tok = tokenizer
        self.image_wrap = image_wrap
        self._alone: dict[tuple[str, str], str] = {}
        self._ids: dict[str, tuple[int, ...]] = {}
        self._probe_head = self.render([_PROBE])

    def render(self, msgs: Sequence[Mapping[str, str]], generation: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=generation)
        except Exception as exc:  # jinja raises its own errors (TemplateError, UndefinedError...)
            raise TemplateError(f"the chat template failed on this list: {type(exc).__name__}: {exc}") from exc

    def ids(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        got = self._ids.get(text)
        if got is None:
            got = tuple(int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"])
            if len(self._ids) > 50_000:
                self._ids.clear()
            self._ids[text] = got
        return got

    def _isolated(self, m: ChatMessage) -> str:
        """The message rendered after a probe system message (its rendering mid-conversation)."""
        k = (m.role, m.text)
        got = self._alone.get(k)
        if got is None:
            full = self.render([_PROBE, m.template_dict()])
            if not full.startswith(self._probe_head):
                raise TemplateError("the chat template does not render messages incrementally")
            got = full[len(self._probe_head) :]
            if len(self._alone) > 50_000:
                self._alone.clear()
            self._alone[k] = got
        return got

    def cut(self, messages: Sequence[ChatMessage]) -> TemplateCut:
        """Cut ``messages`` into root, one piece run per later message, and the generation prompt.

        Raises:
            TemplateError: the template does not render incrementally, or tokenizing message by
                message gives other tokens than tokenizing the whole rendering.
        """
        dicts = [m.template_dict() for m in messages]
        full = self.render(dicts)
        with_gen = self.render(dicts, generation=True)
        if not with_gen.startswith(full):
            raise TemplateError("the chat template's generation prompt does not extend the conversation")
        if messages[0].role == "system":
            root_text, first = self.render(dicts[:1]), 1
        else:
            alone = self._isolated(messages[0])
            head = self.render(dicts[:1])
            if not head.endswith(alone):
                raise TemplateError("the chat template does not render the first message incrementally")
            root_text, first = head[: len(head) - len(alone)], 0
        segs = [self._isolated(m) for m in messages[first:]]
        if root_text + "".join(segs) != full:
            segs = self._incremental(dicts, root_text, first)
        root = self.ids(root_text)
        if not root:
            bos = getattr(self.tok, "bos_token_id", None)
            if bos is None:
                raise TemplateError("the chat template renders no root and the tokenizer has no BOS token")
            root = (int(bos),)
        gen = self.ids(with_gen[len(full) :])
        pieces = []
        for seg in segs:
            parts = seg.split(IMAGE_MARK)
            run: list[tuple[int, ...] | int] = []
            for j, text in enumerate(parts):
                if j:
                    run.append(j - 1)
                ids = self.ids(text)
                if ids:
                    run.append(ids)
            pieces.append(tuple(run))
        self._check_tokens(root_text, root, pieces, with_gen, gen)
        if any(self.image_wrap):
            pieces = [self._wrap(run) for run in pieces]
        return TemplateCut(root_ids=root, first=first, pieces=tuple(pieces), generation_ids=gen)

    def _wrap(self, run: tuple) -> tuple:
        """Put the model's vision start / end tokens around every image of a run (what a VL chat
        template renders around an image part), merged into the text chunks beside it."""
        start, end = self.image_wrap
        out: list[Any] = []
        pending: tuple[int, ...] = ()
        for pc in run:
            if isinstance(pc, int):
                text = pending + start
                if out and not isinstance(out[-1], int):
                    out[-1] = out[-1] + text
                elif text:
                    out.append(text)
                out.append(pc)
                pending = end
            else:
                out.append(pending + pc)
                pending = ()
        if pending:
            out.append(pending)
        return tuple(out)

    def _incremental(self, dicts: list[dict[str, str]], root_text: str, first: int) -> list[str]:
        """Per-message segments by rendering growing prefixes (for templates whose rendering of a
        message depends on its place, e.g. the first turn)."""
        prev, segs = root_text, []
        for k in range(first, len(dicts)):
            cur = self.render(dicts[: k + 1])
            if not cur.startswith(prev):
                raise TemplateError(
                    f"the chat template does not render messages incrementally (message {k} rewrites "
                    "what comes before it); this template cannot be kept as a deque of messages"
                )
            segs.append(cur[len(prev) :])
            prev = cur
        return segs

    def _check_tokens(self, root_text: str, root: tuple[int, ...], pieces: list, with_gen: str, gen: tuple[int, ...]) -> None:
        """Message-by-message tokens must equal the tokens of the whole rendering (runs between images)."""
        runs: list[list[int]] = [list(root) if self.ids(root_text) else []]
        for run in pieces:
            for pc in run:
                if isinstance(pc, int):
                    runs.append([])
                else:
                    runs[-1].extend(pc)
        runs[-1].extend(gen)
        whole = [list(self.ids(t)) for t in with_gen.split(IMAGE_MARK)]
        if runs != whole:
            raise TemplateError(
                "tokenizing message by message gives other tokens than tokenizing the whole rendered "
                "conversation (a token spans a message boundary); this tokenizer/template pair cannot be "
                "kept as a deque of messages"
            )
