"""contextdeque.agents: agents built on the context window (installed inside the contextdeque namespace)."""

if not __name__.startswith("contextdeque."):
    # imported as a top-level ``agents`` from a checkout on sys.path: stay an inert namespace shadow
    __file__ = None  # noqa: F811
