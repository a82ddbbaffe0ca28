"""kernels/skinny_matmul.py, the Triton matmul for a few rows (Triton's interpreter):
against a float64 reference and F.linear's own error, its refusals, the per-shape choice
between it and cuBLAS, and loomllm's own model running it."""

from __future__ import annotations

import functools

import pytest
import torch
from support.models import PROMPT, save_variant
from support.paged_forward import paged_logits

from loomllm.workers.kernels import fused_ops, skinny_matmul
from loomllm.workers.models.fused_layers import install_fused_ops
from loomllm.workers.models.llama.model import Linear
from loomllm.workers.models.loader import load_model

pytestmark = pytest.mark.compute


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, n_out, k_in, bias",
    [
        (1, 40, 512, False),  # whole loads of BLOCK_K; outputs past a block's end masked
        (3, 33, 300, True),  # a ragged last load along K
        (8, 64, 256, True),  # MAX_ROWS
    ],
)
def test_matches_float64_as_closely_as_f_linear(dtype, rows, n_out, k_in, bias):
    torch.manual_seed(rows)
    # x as a model hands it over: [1, T, K], a view of a wider tensor's rows.
    x = torch.randn(1, rows, 2 * k_in).to(dtype)[..., :k_in]
    weight = torch.randn(n_out, k_in).to(dtype)
    b = torch.randn(n_out).to(dtype) if bias else None
    out = skinny_matmul.skinny_linear(x, weight, b)
    ref = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (1, rows, n_out) and out.dtype == dtype
    ours, theirs = _rel(out, ref), _rel(torch.nn.functional.linear(x, weight, b), ref)
    assert ours <= 1.5 * theirs + 1e-7, (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, half, k_in, bias", [(1, 40, 512, False), (5, 24, 300, True)])
def test_the_gated_kernel_is_the_kernel_then_silu_mul_bit_for_bit(dtype, rows, half, k_in, bias):
    """A packed gate|up projection with silu(gate) * up in its epilogue: the bits of the
    plain kernel's [.., 2I] output through fused_ops.silu_mul, never written."""
    torch.manual_seed(rows)
    x = torch.randn(1, rows, k_in).to(dtype)
    weight = (torch.randn(2 * half, k_in) / k_in**0.5).to(dtype)
    b = torch.randn(2 * half).to(dtype) if bias else None
    out = skinny_matmul.skinny_silu_linear(x, weight, b)
    assert out.shape == (1, rows, half) and out.dtype == dtype
    assert torch.equal(out, fused_ops.silu_mul(skinny_matmul.skinny_linear(x, weight, b)))
    gate_up = torch.nn.functional.linear(
        x.double(), weight.double(), None if b is None else b.double()
    )
    ref = torch.nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:]
    torch_ops = fused_ops.silu_mul(torch.nn.functional.linear(x, weight, b))
    assert _rel(out, ref) <= 1.5 * _rel(torch_ops, ref) + 1e-7


@pytest.mark.parametrize("tiling", ["32x128x2x4", "64x64x3x8"])
def test_other_tilings_compute_the_same_function(tiling):
    """What `loom bench kernel decode-profile --tilings` times: any tiling, a ragged last load and
    a partial last program included, is the same matmul (bf16, so each sums in another
    order: as close to float64 as F.linear), and its gated form the same bits as its plain
    one through silu_mul."""
    tiling = skinny_matmul.MatmulTiling.parse(tiling)
    torch.manual_seed(tiling.block_n)
    x = torch.randn(1, 5, 200).to(torch.bfloat16)
    weight = (torch.randn(2 * 40, 200) / 200**0.5).to(torch.bfloat16)
    b = torch.randn(2 * 40).to(torch.bfloat16)
    out = skinny_matmul.skinny_linear(x, weight, b, tiling=tiling)
    ref = torch.nn.functional.linear(x.double(), weight.double(), b.double())
    assert _rel(out, ref) <= 1.5 * _rel(torch.nn.functional.linear(x, weight, b), ref) + 1e-7
    gated = skinny_matmul.skinny_silu_linear(x, weight, b, tiling=tiling)
    assert torch.equal(gated, fused_ops.silu_mul(out))


def test_a_tiling_reads_and_prints_as_its_four_numbers():
    tiling = skinny_matmul.MatmulTiling.parse("32x128x2")  # four warps unless said
    assert (tiling.block_n, tiling.block_k, tiling.num_stages, tiling.num_warps) == (32, 128, 2, 4)
    assert str(tiling) == "32x128x2x4" and skinny_matmul.MatmulTiling.parse(str(tiling)) == tiling


def test_refuses_what_it_does_not_compute():
    weight = torch.zeros(16, 32)
    with pytest.raises(ValueError, match="up to 8 dense rows"):
        skinny_matmul.skinny_linear(torch.zeros(9, 32), weight)
    with pytest.raises(ValueError, match="of the weight's width"):
        skinny_matmul.skinny_linear(torch.zeros(2, 31), weight)
    with pytest.raises(ValueError, match="gate and up rows stacked, got 15 rows"):
        skinny_matmul.skinny_silu_linear(torch.zeros(2, 32), torch.zeros(15, 32))


def test_pick_takes_the_kernel_where_it_wins_at_one_row_and_at_max_rows():
    """A fake clock: the kernel is faster for [48, 32] weights at both sizes, faster for
    [16, 32] only at one row (cuBLAS stays), slower for [32, 32] biased ones (not timed at
    8 rows then). A gate|up weight of the [48, 32] shape is timed apart, as its kernel with
    SiLU * up against cuBLAS then silu_mul: slower here."""
    kernel_times = {
        (48, 1): 1.0,
        (48, 8): 1.0,
        (16, 1): 1.0,
        (16, 8): 3.0,
        (32, 1): 3.0,
        (32, 8): 3.0,
    }
    timed = []

    def seconds(fn: functools.partial) -> float:
        matmul, x, (weight,), _ = fn.args  # one weight: no L2 cache to overflow on the CPU
        timed.append(matmul.__name__)
        if matmul is skinny_matmul.skinny_linear:
            return kernel_times[(weight.shape[0], x.shape[0])]
        return 5.0 if matmul is skinny_matmul.skinny_silu_linear else 2.0

    linears = [
        Linear(32, 48, bias=False),
        Linear(32, 48, bias=False),
        Linear(32, 16, bias=False),
        Linear(32, 32, bias=True),
        Linear(32, 48, bias=False),
        Linear(32, 48, bias=False),
    ]
    linears[5].gated = True
    for linear in linears:
        torch.nn.init.normal_(linear.weight)
        if linear.bias is not None:
            torch.nn.init.normal_(linear.bias)
    for i in (0, 1, 2, 3, 5):
        linears[i].bfloat16()  # linears[4] stays float32: cuBLAS, untimed
    speedups = skinny_matmul.pick(linears, seconds)
    assert speedups == {
        (48, 32, False, False): (2.0, 2.0),
        (16, 32, False, False): (2.0, 2 / 3),
        (32, 32, True, False): (2 / 3, 0.0),
        (48, 32, False, True): (0.4, 0.0),
    }
    assert [linear.skinny for linear in linears] == [True, True, False, False, False, False]
    assert timed[-2:] == ["linear_silu_mul", "skinny_silu_linear"], timed


def test_pick_keeps_cublas_where_the_kernel_fails(monkeypatch, caplog):
    """A kernel that cannot be built on this GPU (a compile error) costs nothing but a log."""

    def broken(*args):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(skinny_matmul, "skinny_linear", broken)
    linear = Linear(32, 16, bias=False)
    torch.nn.init.normal_(linear.weight)
    linear.bfloat16()
    assert skinny_matmul.pick([linear], lambda fn: fn() or 1.0) == {}
    assert not linear.skinny and "the skinny matmul failed on [16, 32]" in caplog.text
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_loomllms_model_runs_it_for_a_decode_step(dtype, tolerance, tmp_path, monkeypatch):
    """Every matmul of the decode step (q|k|v, o, down, lm_head; gate|up with its activation)
    through the kernel, none of the prompt's (more rows than MAX_ROWS); the logits as with
    cuBLAS's, to the rounding of another summation order."""
    loaded = load_model(
        str(save_variant(tmp_path, "llama-biases-tied")), dtype=str(dtype)[6:], model_impl="loom"
    )
    install_fused_ops(loaded.model)
    expected = paged_logits(loaded.model, loaded.config, PROMPT, "triton", dtype)
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    for linear in linears:
        linear.skinny = True
    calls = []
    for name in ("skinny_linear", "skinny_silu_linear"):
        kernel = getattr(skinny_matmul, name)
        monkeypatch.setattr(
            skinny_matmul,
            name,
            lambda x, *args, name=name, kernel=kernel: (
                calls.append((name, x.shape[:-1])) or kernel(x, *args)
            ),
        )
    logits = paged_logits(loaded.model, loaded.config, PROMPT, "triton", dtype)
    assert len(linears) == 4 * 2 + 1 and sorted(calls) == sorted(
        [("skinny_linear", (1, 1))] * (3 * 2 + 1) + [("skinny_silu_linear", (1, 1))] * 2
    )
    torch.testing.assert_close(logits.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
