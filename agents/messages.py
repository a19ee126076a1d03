"""The chat-session layer moved to :mod:`contextdeque.session`; its names stay importable here."""

from contextdeque.session import (
    ROLES,
    ChatMessage,
    ChatTemplate,
    MessageOp,
    MessageWindow,
    SyncReceipt,
    TemplateCut,
    normalize_messages,
)

__all__ = ["ROLES", "ChatMessage", "ChatTemplate", "MessageOp", "MessageWindow", "SyncReceipt", "TemplateCut", "normalize_messages"]
