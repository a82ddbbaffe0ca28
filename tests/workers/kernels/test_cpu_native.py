"""The CPU's C++ ops (kernels/cpu_ops.cpp): norms, SiLU and the rotary embedding against the
torch ops they replace (bit for bit in bfloat16), decode attention against a float64
reference, clear errors for bad input, the loader's settings, and a build for an AVX2-only CPU
held to the same references."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.counting_ops import CountingOps
from support.haswell_build import run_built_for_haswell

from loomllm.workers.kernels import cpu_native
from loomllm.workers.models.llama.model import RMSNorm, _rotate
from loomllm.workers.models.sources import cache_root

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    built = cpu_native.load(cache_root())
    assert built is not None, "the C++ ops did not build: is a C++ compiler installed?"
    return built


def norm_module(size: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size))
    return norm.to(dtype)


def close_or_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """bf16: bit for bit. float32: within a few units of the last place (the norm's sum of
    squares and the exp of SiLU are not torch's, rounding for rounding)."""
    if ours.dtype == torch.bfloat16:
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, size", [(1, 576), (7, 100), (33, 64)])
def test_norms_round_as_the_torch_module(ops, dtype, rows, size):
    torch.manual_seed(rows)
    norm = norm_module(size, dtype)
    x, residual = (torch.randn(rows, size).to(dtype) for _ in range(2))
    close_or_equal(ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, total = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    expected_out, expected_total = norm.add_forward(x, residual)
    assert torch.equal(total, expected_total)
    close_or_equal(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1536), (5, 37), (64, 96)])
def test_silu_mul_rounds_as_transformers_mlp(ops, dtype, rows, width):
    torch.manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    close_or_equal(ops.silu_mul(gate_up), expected)
    # Far into both tails, where exp under- and overflows.
    tails = torch.tensor([[-200.0, -90.0, 90.0, 200.0, 0.0, -0.0] * 2], dtype=dtype)
    close_or_equal(ops.silu_mul(tails), F.silu(tails[:, :6]) * tails[:, 6:])


def test_bf16_silu_mul_is_torchs_for_every_gate_value(ops):
    """In bfloat16 SiLU is looked up by the gate's bits: every one of the 65,536 values, NaNs
    and infinities too, gives F.silu's bits, times an up value that rounds the product."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.full_like(gate, 1.3125)
    ours = ops.silu_mul(torch.cat([gate, up])[None])[0]
    theirs = F.silu(gate) * up
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan], theirs[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 16), (6, 2, 10)])
def test_rotary_into_cache_is_the_rotary_then_the_write(ops, dtype, heads, kv_heads, dim):
    """q, k, v as the model has them (views of one packed q|k|v output); every slot not
    written stays as it was."""
    torch.manual_seed(dim)
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split(sizes, -1))
    angles = torch.randn(tokens, dim // 2) * 10
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.randn(40, kv_heads, dim).to(dtype)
    v_cache = torch.randn(40, kv_heads, dim).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, 17, 5, 30, 39])
    q_out = ops.rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots)

    def rotated(x: torch.Tensor) -> torch.Tensor:  # as the model's torch path: [1, heads, T, D]
        return _rotate(x.transpose(0, 1)[None], cos[None, None], sin[None, None])[0].transpose(0, 1)

    assert torch.equal(q_out, rotated(q))
    assert torch.equal(k_cache[slots], rotated(k))
    assert torch.equal(v_cache[slots], v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


# Attention's head shapes (GQA groups of 1 to 8; head sizes the kernels know when compiled and
# one they do not) and options (a window; Gemma 2's softcap with gpt-oss' sinks).
HEAD_SHAPES = [(9, 3, 64), (12, 2, 64), (2, 2, 64), (8, 1, 128), (5, 1, 128), (4, 4, 80)]
OPTIONS = [(0, 0.0, False), (20, 0.0, False), (0, 5.0, True)]


def attention_reference(q, k_cache, v_cache, slots, lens, scale, window, softcap, sinks):
    """Each row's attention in float64, from the cache rows its slots name."""
    rows, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for b in range(rows):
        length = int(lens[b])
        first = max(0, length - window) if window else 0
        keys = slots[b, first:length]
        k, v = k_cache[keys].double(), v_cache[keys].double()
        for h in range(heads):
            scores = (k[:, h // group] @ q[b, h].double()) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].double().view(1)])
            probs = torch.softmax(scores, 0)[: keys.numel()]
            out[b, h] = probs @ v[:, h // group]
    return out


def attention_inputs(dtype, heads, kv_heads, dim, lens, with_sinks, seed):
    """q (a strided view), caches of 700 slots, each row's 260 slots scattered through them,
    lens and sinks: decode attention's arguments but its scale and options."""
    torch.manual_seed(seed)
    num_slots, width = 700, 260
    k_cache = torch.randn(num_slots, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim).to(dtype)
    slots = torch.stack([torch.randperm(num_slots)[:width] for _ in lens])
    q = torch.randn(heads, len(lens), dim).to(dtype).transpose(0, 1)  # [B, H, D], strided
    sinks = torch.randn(heads).to(dtype) if with_sinks else None
    return q, k_cache, v_cache, slots, torch.tensor(lens), sinks


@pytest.fixture
def one_thread():
    """torch at one thread, restored after: the kernel's items are whole rows where there are
    4 rows a thread, else a row's KV heads, so the number of rows picks the path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", HEAD_SHAPES)
@pytest.mark.parametrize("window, softcap, with_sinks", OPTIONS)
@pytest.mark.parametrize("lens", [[1, 260, 33], [1, 17, 100, 260, 33, 2, 64, 48]])
def test_decode_attention_matches_float64(
    ops, one_thread, dtype, heads, kv_heads, dim, window, softcap, with_sinks, lens
):
    """Rows of different lengths (one key, a window's worth, hundreds; not all whole chunks of
    16 keys) over slots scattered through the cache, q a strided view; head sizes the kernel
    knows when compiled and one it does not; GQA groups of 1 to 8, so that the query heads
    weighing values together come 1, 2, 3 and 4 at a time; a window, Gemma 2's softcap,
    gpt-oss' sinks; 3 rows (a row's KV head an item) and 8 (a whole row an item)."""
    q, k_cache, v_cache, slots, lens, sinks = attention_inputs(
        dtype, heads, kv_heads, dim, lens, with_sinks, seed=dim + heads
    )
    scale = dim**-0.5
    out = ops.decode_attention(q, k_cache, v_cache, slots, lens, scale, window, softcap, sinks)
    expected = attention_reference(q, k_cache, v_cache, slots, lens, scale, window, softcap, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 7])
def test_rows_sharing_one_slot_list_attend_each_up_to_its_own_key(ops, dtype, window):
    """A prompt's tokens (slots [1, L]): token j attends to the keys up to its position, as
    a causal prefill after a cached prefix of 5 keys; more tokens than one thread's share,
    so that the rows' interleaved order covers both ends."""
    torch.manual_seed(window)
    k_cache = torch.randn(90, 3, 64).to(dtype)
    v_cache = torch.randn(90, 3, 64).to(dtype)
    context = torch.randperm(90)[:41]
    lens = torch.arange(6, 42)  # tokens 5 .. 40 of the context
    q = torch.randn(len(lens), 9, 64).to(dtype)
    out = ops.decode_attention(q, k_cache, v_cache, context[None], lens, 0.125, window, 0.0, None)
    slots = context.expand(len(lens), -1)
    expected = attention_reference(q, k_cache, v_cache, slots, lens, 0.125, window, 0.0, None)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(RuntimeError, match="row 35 has 42 keys of 41"):
        ops.decode_attention(q, k_cache, v_cache, context[None], lens + 1, 0.125, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="slot 90 outside 90"):
        outside = context.clone()
        outside[-1] = 90
        ops.decode_attention(q, k_cache, v_cache, outside[None], lens, 0.125, 0, 0.0, None)


# Prompts as (context tokens, this step's queries): one whole, one after a cached prefix of 5
# keys, a one-token chunk, a one-token prompt, and one long enough for several items of query
# positions and blocks of keys.
PROMPTS = [(41, 36), (5, 5), (90, 17), (1, 1), (70, 70)]


def prefill_inputs(dtype, heads, kv_heads, dim, with_sinks, seed):
    """q (a strided view) with two rows before the prompts' queries and one after (rows in no
    prompt, which the kernel leaves zero), caches of 400 slots with each prompt's context
    scattered through them, and prefill_attention's other tensors: slots (padded), lens,
    q_starts, q_lens, sinks."""
    torch.manual_seed(seed)
    k_cache = torch.randn(400, kv_heads, dim).to(dtype)
    v_cache = torch.randn(400, kv_heads, dim).to(dtype)
    order = torch.randperm(400)
    slots = torch.zeros(len(PROMPTS), max(length for length, _ in PROMPTS), dtype=torch.long)
    q_starts, taken, token = [], 0, 2
    for p, (length, queries) in enumerate(PROMPTS):
        slots[p, :length] = order[taken : taken + length]
        taken += length
        q_starts.append(token)
        token += queries
    q = torch.randn(heads, token + 1, dim).to(dtype).transpose(0, 1)  # [T, H, D], strided
    sinks = torch.randn(heads).to(dtype) if with_sinks else None
    lens = torch.tensor([length for length, _ in PROMPTS])
    q_lens = torch.tensor([queries for _, queries in PROMPTS])
    return q, k_cache, v_cache, slots, lens, torch.tensor(q_starts), q_lens, sinks


def prefill_reference(q, k_cache, v_cache, slots, lens, q_starts, q_lens, *options):
    """Each prompt's queries as decode rows over its context up to their own positions, in
    float64 (attention_reference); zeros for rows in no prompt."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for p in range(len(lens)):
        length, queries, start = int(lens[p]), int(q_lens[p]), int(q_starts[p])
        rows = slice(start, start + queries)
        context = slots[p : p + 1, :length].expand(queries, -1)
        positions = torch.arange(length - queries + 1, length + 1)
        out[rows] = attention_reference(q[rows], k_cache, v_cache, context, positions, *options)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", HEAD_SHAPES)
@pytest.mark.parametrize("window, softcap, with_sinks", OPTIONS)
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_matches_float64(
    ops, dtype, heads, kv_heads, dim, window, softcap, with_sinks, threads
):
    """Prompts of 1 to 90 context tokens, some after a cached prefix, packed among rows of no
    prompt: each query over its prompt's context up to its own position. GQA groups of 1 to
    6 (tiles of query rows not whole), head sizes the kernel knows when compiled and one it
    does not, a window, Gemma 2's softcap, gpt-oss' sinks, at one thread and at two."""
    tensors = prefill_inputs(dtype, heads, kv_heads, dim, with_sinks, seed=heads + dim)
    *inputs, sinks = tensors
    options = (dim**-0.5, window, softcap)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.prefill_attention(*inputs, *options, sinks)
    finally:
        torch.set_num_threads(before)
    expected = prefill_reference(*inputs, *options, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert out.dtype == dtype and out.shape == inputs[0].shape
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_bad_prefill_input_is_refused_by_name_and_the_op_keeps_working(ops):
    q, k_cache, v_cache, slots, lens, q_starts, q_lens, _ = prefill_inputs(
        torch.float32, 4, 2, 64, False, seed=1
    )
    outside = slots.clone()
    outside[2, 89] = 400
    cases = [
        ((q, k_cache, v_cache, outside, lens, q_starts, q_lens), "slot 400 outside 400"),
        ((q, k_cache, v_cache, slots, lens, q_starts, q_lens + 1), "prompt 1 has 6 queries of 5"),
        ((q, k_cache, v_cache, slots, lens + 1, q_starts, q_lens), "prompt 2 has 17 queries of"),
        (
            (q, k_cache, v_cache, slots, lens, q_starts + 3, q_lens),
            "prompt 4's queries 64 to 134 are outside q's 132",
        ),
        ((q, k_cache, v_cache, slots, lens[:2], q_starts, q_lens), "not of one prompt count"),
        ((q.half(), k_cache, v_cache, slots, lens, q_starts, q_lens), "takes float32 or bf"),
        ((q, k_cache.bfloat16(), v_cache, slots, lens, q_starts, q_lens), "caches BFloat16"),
    ]
    for args, words in cases:
        with pytest.raises(RuntimeError, match=words):
            ops.prefill_attention(*args, 0.125, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="3 sinks for 4 heads"):
        ops.prefill_attention(
            q, k_cache, v_cache, slots, lens, q_starts, q_lens, 0.125, 0, 0.0, torch.zeros(3)
        )
    out = ops.prefill_attention(
        q, k_cache, v_cache, slots, lens, q_starts, q_lens, 0.125, 0, 0.0, None
    )
    expected = prefill_reference(
        q, k_cache, v_cache, slots, lens, q_starts, q_lens, 0.125, 0, 0.0, None
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_by_name_and_the_ops_keep_working(ops):
    k_cache = torch.randn(50, 2, 16)
    v_cache = torch.randn(50, 2, 16)
    q = torch.randn(2, 4, 16)
    slots = torch.arange(20).view(2, 10)
    lens = torch.tensor([10, 4])
    cases = [
        ((q, k_cache, v_cache, slots + 45, lens), "slot 50 outside 50"),
        ((q, k_cache, v_cache, slots, torch.tensor([11, 4])), "row 0 has 11 keys of 10"),
        ((q, k_cache, v_cache, slots, torch.tensor([0, 4])), "row 0 has 0 keys"),
        ((q.half(), k_cache, v_cache, slots, lens), "takes float32 or bfloat16"),
        ((q, k_cache.bfloat16(), v_cache, slots, lens), "caches BFloat16 for q Float"),
        ((torch.randn(2, 3, 16), k_cache, v_cache, slots, lens), "decode_attention: q"),
    ]
    for args, words in cases:
        with pytest.raises(RuntimeError, match=words):
            ops.decode_attention(*args, 0.25, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="slot 99 outside 50"):
        ops.rotary_into_cache(
            q,
            q[:, :2],
            q[:, :2],
            torch.ones(2, 16),
            torch.zeros(2, 16),
            k_cache,
            v_cache,
            torch.tensor([0, 99]),
        )
    with pytest.raises(RuntimeError, match="add_rms_norm: weight Float and input BFloat16"):
        ops.add_rms_norm(q.bfloat16(), q.bfloat16(), torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: an odd last dimension, 15"):
        ops.silu_mul(torch.randn(2, 15))
    # Nothing was written, and the next call computes as before.
    out = ops.decode_attention(q, k_cache, v_cache, slots, lens, 0.25, 0, 0.0, None)
    expected = attention_reference(q, k_cache, v_cache, slots, lens, 0.25, 0, 0.0, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_setting_turns_them_off_and_a_failed_build_is_logged(
    ops, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv(cpu_native.CPU_KERNELS_ENV, "0")
    assert cpu_native.load(tmp_path) is None
    monkeypatch.setenv(cpu_native.CPU_KERNELS_ENV, "yes")
    with pytest.raises(ValueError, match="LOOM_CPU_KERNELS must be 0 or 1"):
        cpu_native.load(tmp_path)
    monkeypatch.delenv(cpu_native.CPU_KERNELS_ENV)
    # As in a process that has not built them.
    monkeypatch.setattr(cpu_native, "_ops", None)
    monkeypatch.setattr(cpu_native, "_built", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.load(tmp_path) is None
    assert "no C++ compiler" in caplog.text
    monkeypatch.delenv("CXX")
    broken = tmp_path / "cpu_ops.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_native, "SOURCES", (broken,))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.load(tmp_path) is None
    assert "building them failed" in caplog.text
    assert cpu_native.loaded() is None


def test_a_build_cut_short_by_a_killed_worker_is_redone(ops, tmp_path):
    """torch's lock file left in the build dir (which would stall every later build) and a
    truncated library not marked complete (loading it would kill the process): the next
    start builds again. In a fresh process: one process holds one build of the ops."""
    key = cpu_native.build_key()
    copy = tmp_path / "cpu_ops" / key
    shutil.copytree(cache_root() / "cpu_ops" / key, copy)  # modification times kept
    (copy / "lock").write_text("")
    library = next(copy.glob("*.so"))
    library.write_bytes(library.read_bytes()[:4096])
    (copy / cpu_native.COMPLETE).unlink()
    code = (
        "import sys, torch; from pathlib import Path; "
        "from loomllm.workers.kernels import cpu_native; "
        "ops = cpu_native.load(Path(sys.argv[1])); "
        "print(ops.silu_mul(torch.zeros(1, 2)).tolist())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[[0.0]]"
    assert not (copy / "lock").exists()
    assert (copy / cpu_native.COMPLETE).read_text() == cpu_native._stamp(library)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_ids_are_torch_argmax(ops, dtype):
    """Ties go to the first id, a row of -inf to id 0, a NaN is the pick (the first of
    several, in the row's body or its tail past the last 16), as torch.argmax."""
    torch.manual_seed(1)
    logits = (torch.randn(9, 49157) * 3).to(dtype)
    logits[1, 7] = logits[1, 40000] = logits[1].max() + 1  # a tie
    logits[2] = float("-inf")
    logits[3, 11] = logits[3, 30] = float("nan")
    logits[4, -1] = logits[4].max() + 1  # the largest in the tail past the last 16
    logits[5, -2] = float("nan")  # a NaN in the tail alone
    logits[6, :16] = float("-inf")  # the first lanes' best found later
    logits[7, 20000] = float("inf")
    ids = ops.greedy_ids(logits)
    assert ids.dtype == torch.long
    assert ids.tolist() == logits.float().argmax(-1).tolist()
    assert ids[1] == 7 and ids[2] == 0 and ids[3] == 11 and ids[5] == 49155 and ids[7] == 20000
    short = logits[:, :5].contiguous()  # fewer ids than a vector's lanes
    assert ops.greedy_ids(short).tolist() == short.float().argmax(-1).tolist()
    strided = logits[:, ::2]
    assert ops.greedy_ids(strided).tolist() == strided.float().argmax(-1).tolist()


def test_bad_greedy_ids_input_is_refused_by_name_and_the_op_keeps_working(ops):
    logits = torch.randn(3, 100)
    with pytest.raises(RuntimeError, match=r"greedy_ids: logits \[100\] are not \[B, V\]"):
        ops.greedy_ids(logits[0])
    with pytest.raises(RuntimeError, match=r"greedy_ids: logits \[3, 0\] are not \[B, V\]"):
        ops.greedy_ids(logits[:, :0])
    with pytest.raises(RuntimeError, match="greedy_ids takes float32 or bfloat16, got Half"):
        ops.greedy_ids(logits.half())
    assert ops.greedy_ids(logits).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_sample_takes_the_first_id_whose_cumulative_probability_reaches_the_draw(ops, dtype):
    """Against softmax(logits / t) in float64: each id brackets 1 - u of its row's mass
    (within float32's rounding of the weights). Greedy rows (t = 0) take the argmax; ids of
    -inf are never drawn, at either end of the row or of [0, 1); a NaN is the pick."""
    torch.manual_seed(3)
    rows, vocab = 64, 49157
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    temperature = torch.rand(rows) * 2 + 0.05
    temperature[:4] = 0.0
    uniforms = torch.rand(rows, dtype=torch.float64)
    logits[4:8, :100] = float("-inf")  # banned ids at the head, drawn at u close to 1
    uniforms[4] = 1 - 2**-53
    logits[8:12, -100:] = float("-inf")  # and at the tail, reached at u = 0
    uniforms[8] = 0.0
    logits[12, 5] = float("nan")
    ids, logprobs = ops.random_sample(logits, temperature, uniforms)
    raw = logits.double()
    assert ids[:4].tolist() == raw[:4].argmax(-1).tolist()
    assert ids[12] == 5 and logprobs[12].isnan()
    assert not (ids[4:8] < 100).any() and not (ids[8:12] >= vocab - 100).any()
    for r in [r for r in range(4, rows) if r != 12]:
        probs = (raw[r] / temperature[r].double()).softmax(-1)
        cdf = probs.cumsum(-1)
        reach = 1 - uniforms[r].item()
        i = ids[r].item()
        assert probs[i] > 0
        assert (cdf[i - 1].item() if i else 0.0) <= reach + 1e-6 and cdf[i].item() >= reach - 1e-6
    expected = raw.log_softmax(-1).gather(1, ids[:, None])[:, 0]
    finite = torch.arange(rows) != 12
    torch.testing.assert_close(logprobs[finite].double(), expected[finite], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="random_sample: 3 temperatures and 64 uniforms"):
        ops.random_sample(logits, temperature[:3], uniforms)
    with pytest.raises(RuntimeError, match=r"random_sample: logits \[49157\] are not \[B, V\]"):
        ops.random_sample(logits[0], temperature, uniforms)
    again, _ = ops.random_sample(logits, temperature, uniforms)  # and it works after
    assert torch.equal(again, ids)


def test_the_sampler_takes_the_kernel_for_plain_greedy_rows_only(ops, monkeypatch):
    from loomllm.protocols.sampling import SamplingParams
    from loomllm.workers.sample import sampler

    torch.manual_seed(2)
    logits = torch.randn(3, 500).bfloat16()
    counting = CountingOps(ops)
    monkeypatch.setattr(cpu_native, "_ops", counting)

    def meta(**options):
        params = [SamplingParams(temperature=0.0, **options)] * 3
        return sampler.SamplingMetadata.from_params(params, [0] * 3, [[1]] * 3, [[2]] * 3, [[]] * 3)

    fast = sampler.sample(logits, meta())
    assert counting.calls["greedy_ids"] == 1
    monkeypatch.setattr(cpu_native, "_ops", None)
    slow = sampler.sample(logits, meta())
    assert torch.equal(fast.sampled_token_ids, slow.sampled_token_ids)
    assert fast.logprobs is None  # no row asked for them: the kernel skips them
    assert fast.top_token_ids == slow.top_token_ids == [None] * 3
    monkeypatch.setattr(cpu_native, "_ops", counting)
    for options in (
        {"logprobs": 2},
        {"logprobs": 0},
        {"repetition_penalty": 1.5},
        {"logit_bias": {3: 5.0}},
    ):
        asked = sampler.sample(logits, meta(**options))
        assert asked.logprobs is not None
    assert counting.calls["greedy_ids"] == 1


def test_the_sampler_takes_the_random_kernel_for_rows_at_a_temperature_alone(ops, monkeypatch):
    """Seeded rows draw as with torch's ops (the same uniforms, the same rule), greedy rows
    beside them take the argmax; top-k, top-p, min-p and logprobs rows take torch's path."""
    from loomllm.protocols.sampling import SamplingParams
    from loomllm.workers.sample import sampler

    torch.manual_seed(4)
    logits = torch.randn(8, 3000) * 2
    counting = CountingOps(ops)
    monkeypatch.setattr(cpu_native, "_ops", counting)

    def meta(**options):
        params = [SamplingParams(temperature=0.8, seed=s, **options) for s in range(7)]
        params.append(SamplingParams(temperature=0.0))
        return sampler.SamplingMetadata.from_params(params, [5] * 8, [[1]] * 8, [[]] * 8, [[]] * 8)

    fast = sampler.sample(logits, meta())
    assert counting.calls["random_sample"] == 1
    assert fast.sampled_token_ids[-1] == logits[-1].argmax()
    monkeypatch.setattr(cpu_native, "_ops", None)
    slow = sampler.sample(logits, meta())
    assert torch.equal(fast.sampled_token_ids, slow.sampled_token_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cpu_native, "_ops", counting)
    for options in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"logprobs": 1}):
        sampler.sample(logits, meta(**options))
    assert counting.calls["random_sample"] == 1


def test_the_ninja_package_is_found_without_the_venv_on_path(monkeypatch, tmp_path):
    import ninja

    monkeypatch.setenv("PATH", str(tmp_path))
    cpu_native.ninja_on_path()
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("c++") is None,
    reason="the library is built with the system's c++ on Linux",
)
def test_a_build_for_a_cpu_without_avx512_computes_as_the_native_one_must(tmp_path):
    """Each machine builds the library for its own CPU (-march=native), so the AVX-512 code
    sits behind target attributes or #ifdef, and an AVX2-only CPU runs the other paths: bf16
    attention without bf16 dot products, float vectors of two halves. Built here for Haswell,
    its attention, norms, SiLU and greedy ids meet the references the native build is held to."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the intrinsics are x86's")
    # Each call's expected output and tolerance (None: close_or_equal's rules).
    calls, expected = [], []
    for dtype in DTYPES:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
        for heads, kv_heads, dim, lens, window, softcap, with_sinks in [
            (9, 3, 64, [1, 260, 33], 0, 0.0, False),
            (9, 3, 64, [1, 17, 100, 260, 33, 2, 64, 48], 20, 0.0, False),
            (8, 1, 128, [1, 17, 100, 260, 33, 2, 64, 48], 0, 5.0, True),
            (4, 4, 80, [1, 260, 33], 0, 0.0, False),
        ]:
            *tensors, sinks = attention_inputs(
                dtype, heads, kv_heads, dim, lens, with_sinks, seed=dim + len(lens)
            )
            args = (*tensors, dim**-0.5, window, softcap)
            calls.append(("decode_attention", (*args, sinks)))
            expected.append((attention_reference(*args, sinks), tolerance))
        for heads, kv_heads, dim, window, softcap, with_sinks in [
            (9, 3, 64, 20, 0.0, False),
            (8, 1, 128, 0, 5.0, True),
        ]:
            *tensors, sinks = prefill_inputs(dtype, heads, kv_heads, dim, with_sinks, seed=dim)
            args = (*tensors, dim**-0.5, window, softcap)
            calls.append(("prefill_attention", (*args, sinks)))
            expected.append((prefill_reference(*args, sinks), tolerance))
        norm = norm_module(576, dtype)
        x = torch.randn(33, 576).to(dtype)
        calls.append(("rms_norm", (x, norm.weight, norm.eps)))
        expected.append((norm(x), None))
        gate_up = (torch.randn(64, 2 * 96) * 4).to(dtype)
        calls.append(("silu_mul", (gate_up,)))
        expected.append((F.silu(gate_up[:, :96]) * gate_up[:, 96:], None))
        logits = (torch.randn(5, 1003) * 3).to(dtype)
        logits[1, 7] = logits[1, 900] = logits[1].max() + 1  # a tie: the first id
        logits[2, 500] = float("nan")
        calls.append(("greedy_ids", (logits,)))
        expected.append((logits.float().argmax(-1), None))
    outs = run_built_for_haswell(calls, tmp_path)
    for (name, args), (theirs, tolerance), ours in zip(calls, expected, outs, strict=True):
        if name == "greedy_ids":
            assert ours.tolist() == theirs.tolist()
            continue
        assert ours.dtype == args[0].dtype, name
        if tolerance is None:
            close_or_equal(ours, theirs)
        else:
            torch.testing.assert_close(ours.double(), theirs, rtol=tolerance, atol=tolerance)
