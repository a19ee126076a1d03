"""The side-by-side measurements every agent reports (the window against a full re-prefill, what a
prefix cache would prefill): their home is :mod:`contextdeque.session.measure`, the layer the server
and the agents share; the agents name them from here."""

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
