"""What the vLLM connector needs without vLLM: the paged layouts it writes (against a per-token
oracle) and the prompt's cut along the chat template (against ``MessageWindow``'s cut)."""

from __future__ import annotations

import pytest
import torch

from contextdeque.agents.messages import ChatTemplate, normalize_messages
from contextdeque.core.errors import ArgumentError, PositionError, UnsupportedLayoutError
from contextdeque.integrations.paged import CpuPagedLayout, FlashPagedLayout, PromptCutter, paged_layout_for
from contextdeque.integrations.vllm_bench import TURNS, conversation


def _kv(H: int, T: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, T, d, generator=g), torch.randn(H, T, d, generator=g)


def test_cpu_layout_puts_each_token_where_vllm_reads_it():
    """Token p of the sequence lives in block table[p // B] at offset p % B; per block and head K is
    stored transposed ([d, B]) in the first half, V ([B, d]) in the second: checked token by token."""
    H, B, d, start, T = 3, 8, 4, 5, 14
    cache = torch.full((6, H, B, 2 * d), float("nan"))
    table = [4, 0, 2]
    k, v = _kv(H, T, d)
    CpuPagedLayout(B, H, d).write(cache, table, start, k, v)
    for t in range(T):
        p = start + t
        block, off = table[p // B], p % B
        for h in range(H):
            flat = cache[block, h].reshape(-1)
            assert torch.equal(flat[: B * d].view(d, B)[:, off], k[h, t])
            assert torch.equal(flat[B * d :].view(B, d)[off], v[h, t])
    written = torch.isfinite(cache).sum().item()
    assert written == T * H * 2 * d  # nothing else touched
    k2, v2 = CpuPagedLayout(B, H, d).read(cache, table, start, T)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_flash_layout_is_written_by_the_fused_kernel():
    H, B, d, start, T = 2, 4, 8, 3, 9
    cache = torch.zeros(2, 5, B, H, d)
    table = [1, 3, 0]
    k, v = _kv(H, T, d, seed=1)
    FlashPagedLayout(B, H, d).write(cache, table, start, k, v)
    for t in range(T):
        p = start + t
        assert torch.equal(cache[0, table[p // B], p % B], k[:, t]) and torch.equal(cache[1, table[p // B], p % B], v[:, t])
    k2, v2 = FlashPagedLayout(B, H, d).read(cache, table, start, T)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_layouts_are_told_by_shape_and_unknown_ones_refused():
    assert isinstance(paged_layout_for(torch.zeros(4, 3, 128, 128), 128, 3, 64), CpuPagedLayout)
    assert isinstance(paged_layout_for(torch.zeros(2, 4, 16, 3, 64), 16, 3, 64), FlashPagedLayout)
    with pytest.raises(UnsupportedLayoutError) as e:
        paged_layout_for(torch.zeros(4, 128, 3, 64), 128, 3, 64)
    assert e.value.reason == "paged-layout"
    with pytest.raises(ArgumentError):
        CpuPagedLayout(8, 3, 4).write(torch.zeros(2, 3, 8, 8), [0], 0, *_kv(2, 3, 4))
    with pytest.raises(PositionError):  # positions past the block table
        CpuPagedLayout(8, 3, 4).write(torch.zeros(2, 3, 8, 8), [0], 6, *_kv(3, 4, 4))


@pytest.fixture(scope="module")
def tokenizer(default_backend):
    return default_backend.tokenizer


@pytest.mark.parametrize("system", [True, False], ids=["system", "template-default-system"])
def test_prompt_cut_equals_the_message_windows_cut(tokenizer, system):
    """Cut from token ids alone, a chat prompt gives the root and the per-message chunks that
    MessageWindow cuts from the messages list: the same content addresses in a shared store."""
    cutter = PromptCutter(tokenizer)
    order, q = TURNS[-1]
    messages = conversation(order, q)
    if not system:
        messages = messages[1:]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    cut = cutter.cut(ids)
    ref = ChatTemplate(tokenizer).cut(normalize_messages(messages))
    assert cut.root == tuple(ref.root_ids)
    assert [tuple(c) for c in cut.chunks] == [run[0] for run in ref.pieces] and all(len(r) == 1 for r in ref.pieces)
    assert cut.tail == tuple(ref.generation_ids)
    assert cut.prefix_len(len(cut.chunks)) + len(cut.tail) == len(ids)


def test_ids_that_are_no_chat_prompt_are_not_cut(tokenizer):
    cutter = PromptCutter(tokenizer)
    assert cutter.cut(tokenizer("The capital of France is")["input_ids"]) is None
    assert cutter.cut([]) is None
