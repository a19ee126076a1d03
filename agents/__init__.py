"""contextdeque.agents: agents built on the context window (installed inside the contextdeque namespace).

- :class:`MessageWindow`: a window kept in step with an OpenAI-style chat-messages list (its home
  is the session layer, :mod:`contextdeque.session`; re-exported here);
- ``DocAgent`` (``agents/doc.py``), ``WebAgent`` (``agents/web.py``), ``VideoAgent``
  (``agents/video.py``): agents on the public window API that record replay traces;
- ``agents/scenarios.py``: what ``contextdeque demo`` runs them on.
"""

# imported as a top-level ``agents`` from a checkout on sys.path: stay an empty shadow
if __name__.startswith("contextdeque."):
    from contextdeque.session import MessageWindow, SyncReceipt, normalize_messages

    __all__ = ["MessageWindow", "SyncReceipt", "normalize_messages"]
