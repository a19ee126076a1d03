"""Chat messages as a session reads them: OpenAI-style message lists (dicts or objects; text,
image and tool-call parts) normalized into :class:`ChatMessage` records, each with the content
digest a session matches messages by (role + text + tool calls + image pixels)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from contextdeque.core.errors import MessageFormatError, MessageTypeError
from contextdeque.model.images import load_image, pixel_digest

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a message may have (``developer`` is read as ``system``, as OpenAI's API does)."""

IMAGE_MARK = "\x00cdq-image\x00"
"""What stands for an image in a message's text as the template sees it (never in user text)."""


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True, eq=False)
class ChatMessage:
    """One normalized message: ``role``, ``text`` (the content as the template sees it: text parts
    joined, each image as a marker, tool calls appended as JSON), the image pixels in order, and
    ``key``, the content digest that ``sync`` matches messages by."""

    role: str
    text: str
    images: tuple[Any, ...] = ()
    key: str = ""

    def template_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text}


def _field(m: Any, name: str) -> Any:
    if isinstance(m, Mapping):
        return m.get(name)
    return getattr(m, name, None)


def _part_dict(part: Any, where: str) -> Mapping[str, Any]:
    if isinstance(part, Mapping):
        return part
    dump = getattr(part, "model_dump", None)  # pydantic objects from the openai client
    if callable(dump):
        return dump()
    raise MessageTypeError(f"{where} must be a dict, got {type(part).__name__}")


def normalize_messages(messages: Any) -> list[ChatMessage]:
    """Validate an OpenAI-style messages list and normalize it.

    Each message: a dict (or an object with attributes) with ``role`` in :data:`ROLES` and
    ``content`` a string, None (an assistant turn that only calls tools) or a list of parts:
    ``{"type": "text", "text": str}``, ``{"type": "image_url", "image_url": {"url": "data:..."}}``
    or ``{"type": "image", "image": pixels}`` (array, PIL image, bytes or path). An assistant's
    ``tool_calls`` are appended to its text as JSON (most chat templates drop them otherwise).

    Raises:
        MessageTypeError: not a list, a message or part of the wrong type.
        MessageFormatError: empty list, unknown role, missing/invalid content, unknown part type.
        MediaError: an image part cannot be read (``UnsupportedMediaError`` for its mode).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise MessageTypeError(f"messages must be a list of chat messages, got {type(messages).__name__}")
    if not messages:
        raise MessageFormatError("messages is empty: a conversation needs at least one message")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) and not hasattr(m, "role"):
            raise MessageTypeError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = _field(m, "role")
        if not isinstance(role, str):
            raise MessageTypeError(f"{where}.role must be a string, got {type(role).__name__}")
        if role not in ROLES:
            raise MessageFormatError(f"{where}.role {role!r} is not one of {ROLES}")
        role = "system" if role == "developer" else role
        content = _field(m, "content")
        tool_calls = _field(m, "tool_calls")
        texts: list[str] = []
        images: list[Any] = []
        if content is None:
            if not tool_calls:
                raise MessageFormatError(f"{where} has no content (only an assistant turn with tool_calls may)")
        elif isinstance(content, str):
            texts.append(content)
        elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                p = _part_dict(part, pw)
                kind = p.get("type")
                if kind == "text":
                    if not isinstance(p.get("text"), str):
                        raise MessageTypeError(f"{pw}.text must be a string")
                    texts.append(p["text"])
                elif kind in ("image_url", "image"):
                    src = p.get("image_url") if kind == "image_url" else p.get("image")
                    if kind == "image_url" and isinstance(src, Mapping):
                        src = src.get("url")
                    if src is None:
                        raise MessageFormatError(f"{pw} of type {kind!r} carries no image")
                    images.append(load_image(src, name=pw))
                    texts.append(IMAGE_MARK)
                else:
                    raise MessageFormatError(f"{pw}.type {kind!r} is not one of 'text', 'image_url', 'image'")
        else:
            raise MessageTypeError(f"{where}.content must be a string, a list of parts or None, got {type(content).__name__}")
        text = "".join(texts)
        if IMAGE_MARK in text and text.count(IMAGE_MARK) != len(images):
            raise MessageFormatError(f"{where}: its text contains contextdeque's reserved image marker")
        if tool_calls:
            try:
                text += json.dumps(tool_calls, sort_keys=True, default=str)
            except (TypeError, ValueError) as exc:
                raise MessageFormatError(f"{where}.tool_calls cannot be serialized: {exc}") from exc
        h = hashlib.sha256(b"cdq-message-v1\0")
        for piece in (role, text, *(pixel_digest(im) for im in images)):
            b = piece.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little") + b)
        out.append(ChatMessage(role=role, text=text, images=tuple(images), key=h.hexdigest()[:32]))
    return out
