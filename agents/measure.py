"""The side-by-side measurements moved to :mod:`contextdeque.session.measure` (the layer the server
and the agents share); their names stay importable here."""

from contextdeque.session.measure import (
    FirstToken,
    common_prefix,
    query_logits,
    reprefill_first_token,
    window_first_token,
    window_layers,
    window_stream,
)

__all__ = ["FirstToken", "common_prefix", "query_logits", "reprefill_first_token", "window_first_token", "window_layers", "window_stream"]
