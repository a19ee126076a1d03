"""contextdeque.agents: agents built on the context window (installed inside the contextdeque namespace).

- :class:`MessageWindow` (``agents/messages.py``): a window kept in step with an OpenAI-style
  chat-messages list.
"""

# imported as a top-level ``agents`` from a checkout on sys.path: stay an empty shadow
if __name__.startswith("contextdeque."):
    from .messages import MessageWindow, SyncReceipt, normalize_messages

    __all__ = ["MessageWindow", "SyncReceipt", "normalize_messages"]
