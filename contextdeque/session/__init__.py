"""Chat sessions on the context window: the layer that the server and the agents both stand on.

- :class:`MessageWindow` (``message_window``): a window kept in step with an OpenAI-style chat
  messages list (diff -> append / evict / recall / reorder);
- ``messages``: message lists normalized into :class:`ChatMessage` records;
- ``template``: :class:`ChatTemplate`, the model's chat template cut into root, one chunk run per
  message and the generation prompt;
- ``receipt``: :class:`SyncReceipt`, what one sync did and cost;
- ``measure``: the window against a full re-prefill (next-token logits, time to first token) and
  what a prefix cache would prefill.

It imports the window and the model, never the evaluation package (``contextdeque.eval``).
"""

from .measure import FirstToken, common_prefix, reprefill_first_token, window_first_token, window_stream
from .message_window import MessageWindow
from .messages import ROLES, ChatMessage, normalize_messages
from .receipt import MessageOp, SyncReceipt
from .template import ChatTemplate, TemplateCut

__all__ = [
    "ROLES",
    "ChatMessage",
    "ChatTemplate",
    "FirstToken",
    "MessageOp",
    "MessageWindow",
    "SyncReceipt",
    "TemplateCut",
    "common_prefix",
    "normalize_messages",
    "reprefill_first_token",
    "window_first_token",
    "window_stream",
]
