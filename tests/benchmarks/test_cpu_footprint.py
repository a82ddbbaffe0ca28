"""`loom bench cpu`'s footprint part: which tensors a one-row step streams (a tied embedding
as the LM head), the plain read of them, the KV cache's bytes from READY's facts, and a
peer's peak memory read from the kernel's record of it (a failing one as PeerFailed)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from support.gguf_models import LAYERS, make_tiny_gguf

from loomllm.benchmarks import cpu_footprint
from loomllm.benchmarks.serving import PeerFailed
from loomllm.workers.models.gguf_file import GgufFile


def test_a_step_streams_every_linear_weight_and_the_lm_head(tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", "Q8_0")
    names = cpu_footprint.streamed_tensors(path)
    assert len(names) == LAYERS * 7 + 1 and "output.weight" in names
    assert not any("norm" in n or "token_embd" in n for n in names)


def test_a_tied_embedding_is_streamed_as_the_lm_head(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "tied.gguf"
    writer = GGUFWriter(str(path), "llama")
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"):
        writer.add_tensor(name, np.zeros((4, 32) if "norm" not in name else (32,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert cpu_footprint.streamed_tensors(path) == ["blk.0.attn_q.weight", "token_embd.weight"]


@pytest.mark.compute
def test_the_plain_read_covers_those_bytes(tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", "Q4_K_M")
    file = GgufFile(path)
    expected = sum(file.tensor(n).numel() for n in cpu_footprint.streamed_tensors(path))
    read, seconds = cpu_footprint.plain_read(path, rounds=2)
    assert read == expected and seconds > 0


def test_kv_cache_bytes_from_ready_s_facts():
    info = SimpleNamespace(
        dtype="bfloat16",
        num_layers=24,
        num_kv_heads=32,
        head_dim=64,
        num_kv_blocks=341,
        block_size=16,
    )
    assert cpu_footprint.kv_cache_bytes(info) == 341 * 16 * 2 * 24 * 32 * 64 * 2


def test_rollup_bytes_of_this_process_and_of_none():
    anonymous = cpu_footprint.rollup_bytes(os.getpid(), "Anonymous")
    assert anonymous > 0
    both = cpu_footprint.rollup_bytes(os.getpid(), "Anonymous", "Private_Dirty")
    assert both > anonymous
    assert cpu_footprint.rollup_bytes(2**22 + 12345, "Anonymous") == 0  # no such process


def test_a_peer_s_peak_memory_and_its_failure(tmp_path):
    ok = tmp_path / "llama-bench"
    ok.write_text("#!/bin/sh\nexit 0\n")
    ok.chmod(0o755)
    assert cpu_footprint.llama_bench_peak_rss(ok, tmp_path / "m.gguf") > 0
    bad = tmp_path / "crashing"
    bad.write_text("#!/bin/sh\necho 'broken model' >&2\nkill -SEGV $$\n")
    bad.chmod(0o755)
    with pytest.raises(PeerFailed, match="SIGSEGV"):
        cpu_footprint.llama_bench_peak_rss(bad, tmp_path / "m.gguf")
