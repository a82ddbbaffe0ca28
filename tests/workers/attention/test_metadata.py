"""The torch backend's attention metadata: each decode row's context slots padded to the
longest, with their mask, additive bias and lengths; no decode rows at all."""

from __future__ import annotations

import torch

from loomllm.workers.attention.metadata import context_metadata


def caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(40, 2, 8), torch.zeros(40, 2, 8))]


def test_rows_of_different_lengths_are_padded_and_masked():
    contexts = [[7, 3, 9], [1], [4, 5, 6, 2, 8]]
    meta = context_metadata(caches(), torch.device("cpu"), [9, 1, 8], [0, 1, 2], contexts, [])
    assert meta.decode_slots.tolist() == [[7, 3, 9, 0, 0], [1, 0, 0, 0, 0], [4, 5, 6, 2, 8]]
    assert meta.decode_slots.dtype == torch.long
    assert meta.decode_valid.tolist() == [
        [True, True, True, False, False],
        [True, False, False, False, False],
        [True] * 5,
    ]
    assert meta.decode_lens.tolist() == [3, 1, 5]
    bias = meta.decode_bias[:, 0, 0]
    assert torch.equal(bias == 0, meta.decode_valid)
    assert torch.isneginf(bias[~meta.decode_valid]).all()


def test_a_step_without_decode_rows():
    meta = context_metadata(caches(), torch.device("cpu"), [0, 1], [], [], [])
    assert meta.decode_slots.shape == (0, 0) and meta.decode_valid.shape == (0, 0)
    assert meta.decode_lens.tolist() == []
