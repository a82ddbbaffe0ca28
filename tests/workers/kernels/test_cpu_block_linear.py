"""The a8 kernel (kernels/cpu_block_linear.cpp): a weight's blocks of codes against
activations quantized to int8 in blocks of 32, against a float64 reference of the same
arithmetic, on the AVX512-VNNI path and the portable one (also as built for an AVX2-only CPU);
bad input refused by name; and the measured choice's rule for it."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
import torch
from support.haswell_build import run_built_for_haswell

from loomllm.workers.kernels import cpu_kernel_choice, cpu_native
from loomllm.workers.kernels.cpu_linear import BlockLinear, CodeBlocks, GroupwiseInt4
from loomllm.workers.models.sources import cache_root

pytestmark = pytest.mark.compute
PATHS = [pytest.param(False, id="native"), pytest.param(True, id="portable")]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def ops():
    built = cpu_native.load(cache_root())
    assert built is not None, "the C++ ops did not build: is a C++ compiler installed?"
    return built


# How a weight's scales are held (see BlockLinear): each block's a and b in float32, or in
# float16 (GGUF's Q4_1), or a alone where b = -2^(bits - 1) * a, in float16 (Q4_0, Q8_0)
# or float32.
FORMS = {
    "float": (torch.float32, 2),
    "half": (torch.float16, 2),
    "symmetric": (torch.float16, 1),
    "symmetric float": (torch.float32, 1),
}


def random_blocks(bits: int, n: int, k: int, seed: int, form: str = "float") -> CodeBlocks:
    generator = torch.Generator().manual_seed(seed)
    groups = k // 32
    codes = torch.randint(0, 2**bits, (n, k), generator=generator).to(torch.uint8)
    a = torch.rand(n, groups, generator=generator) * 0.02 + 0.001
    b = torch.randn(n, groups, generator=generator) * 0.05
    if form in ("half", "symmetric"):  # values float16 holds exactly
        a, b = a.half().float(), b.half().float()
    if form.startswith("symmetric"):
        b = -(2 ** (bits - 1)) * a
    return CodeBlocks(codes, a, b, bits)


def reference(x: torch.Tensor, weight: CodeBlocks, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 of what the kernel says it computes: x's blocks of 32 rounded to int8 codes
    (scale d = amax / 127, codes x * (1 / d) to the nearest, ties to even), each block's dot
    product with the weight's codes, scaled by a * d, plus b times the block's sum of
    d * code."""
    rows, k = x.shape
    # In numpy's float32, whose divisions are IEEE's (torch may multiply by a reciprocal).
    blocks = x.float().view(rows, k // 32, 32).numpy()
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    codes = torch.from_numpy(np.rint(blocks * inverse)).double()
    d = torch.from_numpy(d).double()
    w_codes = weight.codes.double().view(weight.codes.shape[0], k // 32, 32)
    dots = torch.einsum("mgj,ngj->mng", codes, w_codes)
    sums = (codes.sum(-1, keepdim=True) * d).squeeze(-1)  # [M, G]
    out = (dots * (weight.a.double()[None] * d.squeeze(-1)[:, None])).sum(-1)
    out += sums @ weight.b.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_block_linear_is_its_float64_arithmetic(ops, bits, rows, portable, form):
    """80 outputs are five column blocks: one tile of three and two left over, which the
    weights' order interleaves by tile; 9 rows are two tiles of four and one row."""
    weight = random_blocks(bits, 80, 96, seed=rows + bits, form=form)
    layer = BlockLinear(weight, ops)
    assert (layer.scales.dtype, layer.scales.shape[2]) == FORMS[form]
    x = torch.randn(rows, 96) * 3
    x[0, :32] = 0  # a block of zeros quantizes to zeros
    bias = torch.randn(80)
    out = ops.block_linear(x, layer.packed, layer.scales, bias, bits, portable)
    torch.testing.assert_close(out.double(), reference(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"),
    reason="built with the system's c++ for an x86 CPU",
)
def test_the_portable_path_built_for_an_avx2_only_cpu_is_its_float64_arithmetic(ops, tmp_path):
    """A CPU without AVX512-VNNI runs the portable path, compiled for it: built for Haswell,
    every weight form and width, in float32 and bfloat16, at one row and at a tile and more."""
    calls, expected = [], []
    for bits in (4, 8):
        for form in FORMS:
            for rows, dtype in [(1, torch.float32), (9, torch.float32), (5, torch.bfloat16)]:
                weight = random_blocks(bits, 80, 96, seed=rows + bits, form=form)
                layer = BlockLinear(weight, ops)
                x = (torch.randn(rows, 96) * 3).to(dtype)
                bias = torch.randn(80)
                calls.append(("block_linear", (x, layer.packed, layer.scales, bias, bits, True)))
                expected.append(reference(x, weight, bias))
                gate_up = (torch.randn(rows, 192) * 3).to(dtype)
                calls.append(
                    ("silu_block_linear", (gate_up, layer.packed, layer.scales, bias, bits, True))
                )
                expected.append(reference(ops.silu_mul(gate_up), weight, bias))
    outs = run_built_for_haswell(calls, tmp_path)
    for (_, args), theirs, ours in zip(calls, expected, outs, strict=True):
        assert ours.dtype == args[0].dtype
        # bf16 rows: the output's rounding, once at the end.
        tolerance = 1e-5 if ours.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours.double(), theirs, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["half", "symmetric"])
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_silu_block_linear_is_block_linear_of_silu_mul_bit_for_bit(
    ops, bits, portable, form, dtype
):
    """The down projection's input quantized as silu_mul computes it: the same bits as
    silu_mul's output through block_linear, at one row, a tile and more, with a bias."""
    weight = random_blocks(bits, 80, 96, seed=bits, form=form)
    layer = BlockLinear(weight, ops)
    bias = torch.randn(80)
    for rows in (1, 4, 9):
        gate_up = (torch.randn(rows, 192) * 3).to(dtype)
        gate_up[0, 96:128] = 0  # a block of zeros quantizes to zeros
        fused = ops.silu_block_linear(gate_up, layer.packed, layer.scales, bias, bits, portable)
        apart = ops.block_linear(
            ops.silu_mul(gate_up), layer.packed, layer.scales, bias, bits, portable
        )
        assert fused.dtype == dtype and fused.shape == (rows, 80)
        assert torch.equal(fused.view(torch.uint8), apart.view(torch.uint8))


def test_bad_silu_block_linear_input_is_refused_by_name_and_the_op_keeps_working(ops):
    layer = BlockLinear(random_blocks(4, 32, 64, seed=12), ops)
    gate_up = torch.randn(2, 128)
    cases = [
        ((gate_up.half(), layer.packed, layer.scales, None, 4), "takes float32 or bfloat16"),
        ((gate_up[:, :127], layer.packed, layer.scales, None, 4), "is not \\[M, 2K\\]"),
        ((gate_up[0], layer.packed, layer.scales, None, 4), "is not \\[M, 2K\\]"),
        ((gate_up[:, :96], layer.packed, layer.scales, None, 4), "not a multiple of 32"),
        ((gate_up[:, :64], layer.packed, layer.scales, None, 4), "silu_block_linear: packed"),
        ((gate_up, layer.packed, layer.scales, torch.zeros(5), 4), "bias of 5 values for 32"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.silu_block_linear(*args, False)
    assert ops.silu_block_linear(gate_up, layer.packed, layer.scales, None, 4, False).shape == (
        2,
        32,
    )


@pytest.mark.parametrize("portable", PATHS)
def test_bfloat16_rows_round_once_at_the_end(ops, portable):
    """bf16 rows give the float32 rows' sums, rounded to bf16 once."""
    weight = random_blocks(4, 48, 64, seed=7)
    layer = BlockLinear(weight, ops)
    x = (torch.randn(6, 64) * 2).bfloat16()
    out = ops.block_linear(x, layer.packed, layer.scales, None, 4, portable)
    as_float = ops.block_linear(x.float(), layer.packed, layer.scales, None, 4, portable)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, as_float.bfloat16())
    torch.testing.assert_close(as_float.double(), reference(x, weight, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("form", "bits"), [("half", 4), ("symmetric", 4), ("symmetric", 8)])
def test_float16_scales_are_held_so_and_symmetric_blocks_without_offsets(ops, form, bits):
    """Scales float16 holds exactly (on-load int4's, as GGUF's Q4_1) are held in float16, and
    a symmetric block's offset (Q4_0's, Q8_0's) not at all; the layer computes what it
    computes with float32 scales."""
    weight = random_blocks(bits, 48, 128, seed=4, form=form)
    layer = BlockLinear(weight, ops)
    assert layer.scales.dtype == torch.float16
    assert layer.scales.shape == (3, 4, 2 if form == "half" else 1, 16)
    x = torch.randn(5, 128)
    torch.testing.assert_close(layer(x).double(), reference(x, weight, None), rtol=1e-5, atol=1e-5)


def test_the_layer_takes_any_leading_shape_and_strided_rows(ops):
    weight = random_blocks(8, 32, 64, seed=8)
    layer = BlockLinear(weight, ops)
    x = torch.randn(2, 3, 128)[..., ::2]  # strided rows
    out = layer(x)
    assert out.shape == (2, 3, 32)
    expected = reference(x.reshape(6, 64), weight, None).float().view(2, 3, 32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_activation_quantization_stays_close_to_the_float_product(ops):
    """Per 32 inputs, 8 bits: within a percent of the product with x unquantized."""
    weight = CodeBlocks.from_int4(GroupwiseInt4.from_dense(torch.randn(256, 512) * 0.02))
    x = torch.randn(8, 512)
    exact = x.double() @ weight.dequantize().double().T
    error = (BlockLinear(weight, ops)(x).double() - exact).abs().max()
    assert error < 0.01 * exact.abs().max()


def test_mixed_widths_stack_as_8_bits(ops):
    four, eight = random_blocks(4, 16, 64, seed=9), random_blocks(8, 32, 64, seed=10)
    both = CodeBlocks.cat([four, eight])
    assert both.bits == 8
    assert torch.equal(both.dequantize(), torch.cat([four.dequantize(), eight.dequantize()]))
    x = torch.randn(2, 64)
    got = BlockLinear(both, ops)(x)
    torch.testing.assert_close(got[:, :16], BlockLinear(four, ops)(x), rtol=1e-6, atol=1e-6)


def test_bad_input_is_refused_by_name_and_the_op_keeps_working(ops):
    layer = BlockLinear(random_blocks(4, 32, 64, seed=11), ops)
    x = torch.randn(2, 64)
    cases = [
        ((x.half(), layer.packed, layer.scales, None, 4), "takes float32 or bfloat16"),
        ((x, layer.packed, layer.scales, None, 5), "bits must be 4 or 8"),
        ((x[:, :48], layer.packed, layer.scales, None, 4), "not a multiple of 32"),
        ((x, layer.packed, layer.scales, None, 8), "is not contiguous uint8"),
        ((x, layer.packed, layer.scales.double(), None, 4), "are not contiguous float32"),
        ((x, layer.packed, layer.scales[:, :, [0, 1, 1]], None, 4), "1 or 2, 16\\]"),
        ((x, layer.packed, layer.scales, torch.zeros(5), 4), "bias of 5 values for 32"),
        ((x[0], layer.packed, layer.scales, None, 4), "is not \\[M, K\\]"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.block_linear(*args, False)
    assert ops.block_linear(x, layer.packed, layer.scales, None, 4, False).shape == (2, 32)


def timings(a8: list[float], others: dict[str, list[float]]) -> list[dict[str, float]]:
    return [
        {"a8": t, **{kind: times[i] for kind, times in others.items()}} for i, t in enumerate(a8)
    ]


def test_a8_runs_at_every_batch_size_or_none():
    """Far faster at small batches, a little slower at big ones: a8 everywhere. Much slower
    at the big ones: the weight-only kernels at each size, a8 at none."""
    others = {"dense": [10.0, 10.0, 12.0, 30.0], "int4": [3.0, 5.0, 20.0, 80.0]}
    assert cpu_kernel_choice._pick(timings([2.0, 4.0, 13.0, 33.0], others)) == ("a8",) * 4
    assert cpu_kernel_choice._pick(timings([2.0, 4.0, 40.0, 120.0], others)) == (
        "int4",
        "int4",
        "dense",
        "dense",
    )


def test_measuring_a8_needs_the_ops(monkeypatch):
    """Without the C++ ops loaded, a8 is not timed (and so never picked)."""
    monkeypatch.setattr(cpu_native, "_ops", None)
    monkeypatch.setattr(cpu_kernel_choice, "_seconds_per_call", lambda call: 1.0)
    choice = cpu_kernel_choice.measure((64, 32), ["dense", "a8"], torch.float32)
    assert choice == ("dense",) * len(cpu_kernel_choice.BATCH_SIZES)


def test_a8_far_slower_at_one_batch_size_is_not_timed_after_it_nor_picked(monkeypatch):
    def timed(fn):
        kernel, x = fn.__defaults__
        if isinstance(kernel, BlockLinear):
            return 1.0 if x.shape[0] == 1 else 100.0
        return 2.0

    monkeypatch.setattr(cpu_kernel_choice, "_seconds_per_call", timed)
    monkeypatch.setattr(cpu_native, "_ops", cpu_native.load(cache_root()))
    choice = cpu_kernel_choice.measure((64, 32), ["dense", "a8"], torch.float32)
    assert choice == ("dense",) * len(cpu_kernel_choice.BATCH_SIZES)
