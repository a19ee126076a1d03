"""Re-prefill: the ceiling. One forward over the root and every chunk, nothing reused."""

from __future__ import annotations

import torch

from .base import ArmResult, ReuseArm, ReuseRequest


class ReprefillArm(ReuseArm):
    """Full prefill of ``[root, chunk_1 .. chunk_N]`` in one forward (what a cache miss costs)."""

    name = "reprefill"

    def run(self, request: ReuseRequest) -> ArmResult:
        be = request.backend
        R = request.root_len
        root_ids = torch.tensor(be.root_ids, dtype=torch.long)
        pos = torch.cat([be.text_positions(0, R), request.positions()], dim=1)
        if request.all_text:
            inputs = {"input_ids": torch.cat([root_ids, request.token_ids()])}
        else:
            root_emb = be.embed_tokens(root_ids).to("cpu", torch.float32)
            inputs = {"inputs_embeds": torch.cat([root_emb, request.inputs()["inputs_embeds"]])}
        res = be.forward(**inputs, positions=pos, past=None, logits="none")
        rep = self.new_report(request)
        n = R + request.n_chunk_tokens
        rep.forwards = 1
        rep.tokens_prefilled = n
        rep.token_layers = request.n_chunk_tokens * request.num_layers  # the root is counted apart
        rep.tokens_recomputed = request.n_chunk_tokens
        rep.extras["root_tokens_prefilled"] = R
        return ArmResult(kv=[(k.clone(), v.clone()) for k, v in res.kv], next_position=request.next_position, report=rep)
