"""The evaluation layer, above the window: reuse arms (``arms/``), the fidelity harness
(``fidelity/``), the per-model exactness gate (``verify``) and the cost benchmarks (``bench``,
``window_bench``). Nothing below imports it; the CLI (``contextdeque.cli``) runs it."""
