"""The GGUF kernels (kernels/cpu_gguf_linear.cpp): every quant type's random blocks read as
gguf's own dequantizer reads them, and x @ w.T against a float64 reference of the same
arithmetic (x quantized per 256 for K-quants, per 32 for legacy blocks), on the AVX512-VNNI
path, the portable one, and as built for an AVX2-only CPU; bad input refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from support.haswell_build import run_built_for_haswell

from loomllm.workers.kernels import cpu_native
from loomllm.workers.kernels.gguf_linear import in_transformers_order
from loomllm.workers.kernels.gguf_types import KERNEL_TYPES
from loomllm.workers.models.sources import cache_root

pytestmark = pytest.mark.compute
TYPES = [name for name, _, _ in KERNEL_TYPES.values()]
# gguf_linear's kernel: the fastest for the rows, one at every number of rows, portable.
PATHS = [pytest.param(0, id="native"), pytest.param(1, id="rows"), pytest.param(2, id="portable")]
# Where each type's float16 scales lie in its block: random bytes there could be NaN.
HALF_AT = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "IQ4_NL": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_XS": [0],
}


@pytest.fixture(scope="module")
def ops():
    built = cpu_native.load(cache_root())
    assert built is not None, "the C++ ops did not build: is a C++ compiler installed?"
    return built


def random_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """[rows, bytes a row] of random blocks: every code and scale bit pattern, with finite
    float16 scales."""
    kind = GGMLQuantizationType[name]
    weights, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // weights, block_bytes), dtype=np.uint8)
    for at in HALF_AT[name]:
        scales = rng.uniform(0.001, 0.02, size=(rows, k // weights)).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, k // weights, 2)
    return raw.reshape(rows, -1)


def width(name: str) -> int:
    """A row width that is whole blocks of the type, and for legacy blocks not whole groups
    of 256 (the kernels' padding is then used)."""
    return 512 if GGML_QUANT_SIZES[GGMLQuantizationType[name]][0] == 256 else 544


def dequantized(name: str, raw: np.ndarray) -> np.ndarray:
    values = dequantize(raw, GGMLQuantizationType[name]).astype(np.float64)
    return values.reshape(raw.shape[0], -1)


def quantized_x(x: torch.Tensor, block: int) -> np.ndarray:
    """x as the kernels quantize it, in float64: int8 codes per `block` inputs with scale
    max |x| / 127, rounded to the nearest, ties to even (numpy's float32 arithmetic)."""
    rows, k = x.shape
    padded = np.zeros((rows, -(-k // 256) * 256), np.float32)
    padded[:, :k] = x.float().numpy()
    blocks = padded.reshape(rows, -1, block)
    scale = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0)
    codes = np.round(blocks * inverse.astype(np.float32))
    return (codes * scale).reshape(rows, -1)[:, :k].astype(np.float64)


def reference(name: str, x: torch.Tensor, raw: np.ndarray) -> torch.Tensor:
    block = 256 if GGML_QUANT_SIZES[GGMLQuantizationType[name]][0] == 256 else 32
    return torch.from_numpy(quantized_x(x, block) @ dequantized(name, raw).T)


def close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, raw_values: np.ndarray):
    """Equal up to float32 sums: the bound is a few ulps of the largest term sum."""
    bound = 1e-6 * x.abs().max().item() * np.abs(raw_values).sum(1).max()
    assert (got.double() - want).abs().max().item() <= bound


@pytest.mark.parametrize("name", TYPES)
def test_blocks_dequantize_as_gguf_reads_them(ops, name):
    k = width(name)
    raw = random_blocks(name, 24, k, seed=1)
    type_id = GGMLQuantizationType[name].value
    got = ops.gguf_dequantize(torch.from_numpy(raw), type_id, k, None, torch.float32)
    assert torch.equal(got.double(), torch.from_numpy(dequantized(name, raw)))
    rows = torch.tensor([5, 0, 5, 23])
    picked = ops.gguf_dequantize(torch.from_numpy(raw), type_id, k, rows, torch.bfloat16)
    assert picked.dtype == torch.bfloat16
    assert torch.equal(picked, got[rows].bfloat16())


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("name", TYPES)
def test_linear_equals_the_float64_reference(ops, name, portable):
    k = width(name)
    raw = random_blocks(name, 40, k, seed=2)
    type_id = GGMLQuantizationType[name].value
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, k)
        out = ops.gguf_linear(x, [torch.from_numpy(raw)], [type_id], [0], None, portable)
        assert out.shape == (rows, 40) and out.dtype == torch.float32
        close(out, reference(name, x, raw), x, dequantized(name, raw))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_batch_invariant_kernel_gives_a_row_the_same_bits_in_any_batch(ops, name):
    """kernel 1 runs every row on the same kernel: a row's output is the same bits alone or
    with 8 or 31 others (kernel 0 switches to panels from 8 rows, which sum in another
    order, and stays within the reference's tolerance)."""
    k = width(name)
    raw = torch.from_numpy(random_blocks(name, 48, k, seed=11))
    type_id = GGMLQuantizationType[name].value
    x = torch.randn(32, k)
    alone = ops.gguf_linear(x[:1], [raw], [type_id], [0], None, 1)
    for rows in (9, 32):
        batch = ops.gguf_linear(x[:rows], [raw], [type_id], [0], None, 1)
        assert torch.equal(batch[:1], alone)
        fastest = ops.gguf_linear(x[:rows], [raw], [type_id], [0], None, 0)
        close(fastest, reference(name, x[:rows], raw.numpy()), x, dequantized(name, raw.numpy()))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_repacked_legacy_blocks_hold_the_same_weights(ops, name):
    """Q4_0, Q4_1 and Q8_0 blocks as the a8 kernel's codes: gguf's values exactly, rows in
    transformers' order where the part's heads say so; the repacked layer computes as the
    blocks as stored do (both quantize x per 32)."""
    from gguf.quants import quantize

    from loomllm.workers.kernels.gguf_linear import GgufPart, RepackedLinear, legacy_code_blocks

    kind = GGMLQuantizationType[name]
    raw = quantize(np.random.default_rng(12).standard_normal((64, 96)).astype(np.float32), kind)
    blocks = legacy_code_blocks(GgufPart(torch.from_numpy(raw), kind.value, 4))
    want = in_transformers_order(torch.from_numpy(dequantized(name, raw)), 4)
    assert torch.equal(blocks.dequantize().double(), want)
    if ops.block_linear_has_vnni():
        layer = RepackedLinear(96, [GgufPart(torch.from_numpy(raw), kind.value, 4)], None, ops)
        x = torch.randn(3, 96)
        stored = ops.gguf_linear(x, [torch.from_numpy(raw)], [kind.value], [4], None, 0)
        torch.testing.assert_close(layer(x), stored, rtol=1e-5, atol=1e-5)


def test_bfloat16_rows_compute_as_their_float_values(ops):
    raw = torch.from_numpy(random_blocks("Q4_K", 32, 256, seed=3))
    x = torch.randn(5, 256).bfloat16()
    out = ops.gguf_linear(x, [raw], [12], [0], None, 0)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ops.gguf_linear(x.float(), [raw], [12], [0], None, 0).bfloat16())


def test_parts_stack_along_the_output_with_their_own_types_and_a_bias(ops):
    """q|k|v as three tensors of different types (a Q4_K_M file's attn_v is Q6_K in some
    layers; legacy and K-quant parts quantize x each their own way)."""
    k = 512
    names = ["Q4_K", "Q6_K", "Q8_0"]
    raws = [random_blocks(name, 16 * (i + 1), k, seed=4 + i) for i, name in enumerate(names)]
    types = [GGMLQuantizationType[n].value for n in names]
    x = torch.randn(3, k)
    bias = torch.randn(sum(r.shape[0] for r in raws))
    out = ops.gguf_linear(x, [torch.from_numpy(r) for r in raws], types, [0, 0, 0], bias, 0)
    alone = [
        ops.gguf_linear(x, [torch.from_numpy(r)], [t], [0], None, 0)
        for r, t in zip(raws, types, strict=True)
    ]
    torch.testing.assert_close(out, torch.cat(alone, dim=1) + bias, rtol=0, atol=1e-5)


def test_rotary_rows_come_back_in_transformers_order(ops):
    """llama.cpp's converter interleaves each q/k head's rotary halves; transformers' reverse
    permutation is what the kernel's `heads` undoes."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    raw = random_blocks("Q5_K", 64, 256, seed=7)
    x = torch.randn(2, 256)
    plain = ops.gguf_linear(x, [torch.from_numpy(raw)], [13], [0], None, 0)
    permuted = ops.gguf_linear(x, [torch.from_numpy(raw)], [13], [4], None, 0)
    order = TENSOR_PROCESSORS["llama"]()._reverse_permute_weights(np.arange(64)[:, None], 4, 4)
    assert torch.equal(permuted, plain[:, order[:, 0]])
    assert torch.equal(in_transformers_order(torch.arange(64), 4), torch.from_numpy(order[:, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_variant_equals_silu_mul_then_the_linear(ops, dtype):
    raw = torch.from_numpy(random_blocks("Q6_K", 48, 512, seed=8))
    gate_up = torch.randn(6, 1024).to(dtype)
    fused = ops.silu_gguf_linear(gate_up, [raw], [14], [0], None, 0)
    assert torch.equal(fused, ops.gguf_linear(ops.silu_mul(gate_up), [raw], [14], [0], None, 0))


def test_built_for_an_avx2_only_cpu_it_computes_the_same(ops, tmp_path):
    """Every type on the AVX2 path (and its portable one), rows in one pass and in several."""
    cases = []
    for name in TYPES:
        k = width(name)
        raw = torch.from_numpy(random_blocks(name, 32, k, seed=9))
        for rows in (1, 6):
            cases.append((name, raw, torch.randn(rows, k)))
    calls = [
        ("gguf_linear", (x, [raw], [GGMLQuantizationType[n].value], [0], None, portable))
        for n, raw, x in cases
        for portable in (0, 2)
    ]
    got = run_built_for_haswell(calls, tmp_path)
    for i, (name, raw, x) in enumerate(cases):
        for out in got[2 * i : 2 * i + 2]:
            close(out, reference(name, x, raw.numpy()), x, dequantized(name, raw.numpy()))


def test_bad_input_is_refused_by_name_and_the_op_keeps_working(ops):
    raw = torch.from_numpy(random_blocks("Q4_K", 32, 256, seed=10))
    x = torch.randn(2, 256)
    cases = [
        ((x.half(), [raw], [12], [0], None, 0), "takes float32 or bfloat16"),
        ((x, [raw], [16], [0], None, 0), "GGUF type 16 is not one loomllm's kernels read"),
        ((x[:, :128], [raw], [12], [0], None, 0), "are not whole blocks of 256"),
        ((x, [raw], [8], [0], None, 0), "is not contiguous uint8 rows of 272 bytes"),
        ((x, [raw[:, ::2]], [12], [0], None, 0), "is not contiguous uint8 rows"),
        ((x, [raw], [12], [3], None, 0), "are not 3 heads of pairs"),
        ((x, [raw], [12, 12], [0], None, 0), "1 weights, 2 types"),
        ((x, [raw], [12], [0], torch.zeros(5), 0), "bias of 5 values for 32 outputs"),
        ((x, [raw], [12], [0], None, 3), "kernel 3 is none of 0 .auto., 1 .rows. and 2"),
    ]
    for args, says in cases:
        with pytest.raises(RuntimeError, match=says):
            ops.gguf_linear(*args)
    with pytest.raises(RuntimeError, match="row 32 is not in"):
        ops.gguf_dequantize(raw, 12, 256, torch.tensor([32]), torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        ops.gguf_dequantize(raw, 12, 256, None, torch.float16)
    out = ops.gguf_linear(x, [raw], [12], [0], None, 0)
    close(out, reference("Q4_K", x, raw.numpy()), x, dequantized("Q4_K", raw.numpy()))
