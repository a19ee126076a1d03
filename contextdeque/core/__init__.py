"""The core layer: what a position-free chunk is and how it is placed, with no model attached.

``errors`` (typed errors), ``compat`` (transformers version seams), ``layout`` (a model's KV
layout and RoPE), ``rotation`` (rotation tables), ``chunk`` (the canonical content-frame chunk),
``kv`` (per-layer KV: concatenation, byte counts), ``operator`` (relocate + patch, zero
forwards, through ``contextdeque.kernels``), ``metrics`` (KL, ULP errors)."""
