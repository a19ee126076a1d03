"""The operator, step by step, below the window: encode -> relocate -> form patch -> apply -> generate.

1. encode: each chunk's KV is computed once, after the fixed root, and kept in the content frame
   (keys un-rotated): position-free;
2. relocate: the chunk's KV placed at any position by exact RoPE re-rotation (zero forwards) —
   equal to what the model caches for the same tokens at that position, *without* context;
3. form patch: the conditioning the chunk lost (its KV given what precedes it minus its KV given
   the root alone) as a rank-m factorization, one conditioned forward, formed once;
4. apply: relocate + patch in one fused call (zero forwards);
5. generate: greedy decoding on root + A + patched B, checked at each step against a full
   re-prefill of the same tokens (next-token KL).

Run:  .venv/bin/python examples/operator_walkthrough.py
"""

from __future__ import annotations

from typing import Any

import contextdeque as cd
from contextdeque.agents.base import query_ids
from contextdeque.core.kv import concat_kv
from contextdeque.core.metrics import kl_divergence

A = "The courier's name is Ilse Marrow. She works for the harbour office in Kestrel Bay."
B = "Every evening she carries one sealed parcel to the lighthouse keeper."
QUESTION = "Who carries the parcel, and where to?"


def main(backend: Any = None, rank: int = 8, max_new_tokens: int = 12) -> dict[str, float]:
    backend = backend or cd.load_model()
    root = backend.root_len
    # 1. encode: once each, after the root (KV(A | root), KV(B | root)), position-free
    a, b = backend.encode(A), backend.encode(B)
    print(f"encoded A ({a.n_tokens} tokens) and B ({b.n_tokens} tokens); root {root} tokens")

    # 2. relocate: exact placement, zero forwards (here B goes right after A)
    kv_a = cd.relocate(a, start=root)
    kv_b_blind = cd.relocate(b, start=root + a.span)
    far = cd.relocate(b, start=4100)  # anywhere: what the model would cache for B alone at 4100
    print(f"relocated B to {root + a.span} and to 4100 (layer 0 keys {tuple(far[0][0].shape)})")

    # 3. form patch: B's lost conditioning on A, rank-m, one conditioned forward
    patch = cd.form_patch(backend, b, antecedents=[a], rank=rank)
    full = cd.form_patch(backend, b, antecedents=[a], rank="full")
    print(f"patch: rank {rank}, {patch.nbytes:,} bytes (B's KV: {b.nbytes:,}); full-rank patch formed too")

    # 4. apply: relocate + patch, zero forwards
    kv_b = cd.apply(b, start=root + a.span, patch=patch)
    kv_b_full = cd.apply(b, start=root + a.span, patch=full)

    # the reference: a full re-prefill of root + A + B + question
    q = query_ids(backend, QUESTION)  # closes the user turn the root opened, opens the assistant's
    ids = list(backend.root_ids) + a.token_ids.tolist() + b.token_ids.tolist()
    start = len(ids)
    ref = backend.forward(input_ids=ids + q, positions=backend.text_positions(0, start + len(q))).logits[-1]

    def first_logits(kv_b_placed: Any) -> Any:
        past = concat_kv([backend.root_kv(), kv_a, kv_b_placed])
        return backend.forward(input_ids=q, positions=backend.text_positions(start, len(q)), past=past).logits[-1]

    kls = {name: kl_divergence(ref, first_logits(kv)) for name, kv in
           (("blind (relocated only)", kv_b_blind), (f"rank-{rank} patch", kv_b), ("full-rank patch", kv_b_full))}
    for name, value in kls.items():
        print(f"next-token KL vs re-prefill, {name:24s}: {value:.2e} nats")

    # 5. generate: greedy, on the patched cache; the re-prefill decodes beside it
    past = concat_kv([backend.root_kv(), kv_a, kv_b])
    step_ids, pos, out, ref_ids = list(q), start, [], ids + q
    for _ in range(max_new_tokens):
        res = backend.forward(input_ids=step_ids, positions=backend.text_positions(pos, len(step_ids)), past=past)
        past, pos = concat_kv([past, res.kv]), pos + len(step_ids)
        nxt = int(res.logits[-1].argmax())
        ref_next = int(backend.forward(input_ids=ref_ids, positions=backend.text_positions(0, len(ref_ids))).logits[-1].argmax())
        out.append(nxt)
        ref_ids = ref_ids + [ref_next]
        step_ids = [nxt]
        if backend.tokenizer is not None and nxt == backend.tokenizer.eos_token_id:
            break
    text = backend.tokenizer.decode(out) if backend.tokenizer is not None else str(out)
    same = out == ref_ids[len(ids) + len(q):]
    print(f"answer (patched cache): {text!r}; the same tokens as the re-prefill's greedy decode: {same}")
    return {**kls, "same_tokens": float(same)}


if __name__ == "__main__":
    main()
