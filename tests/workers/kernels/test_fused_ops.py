"""The fused kernels (kernels/fused_ops.py: RMSNorm alone and after the residual add, the
rotary embedding, SiLU times up) against a float64 reference and transformers' own ops,
under Triton's interpreter (TRITON_INTERPRET=1: conftest.py).

bfloat16: the kernels round each product and sum to nearest even, in integer arithmetic,
where torch's eager ops round (the interpreter's own float-to-bfloat16 conversion
truncates), so the rotary embedding and SiLU times up are bit-identical to transformers'
and RMSNorm is up to its float32 sum's order; `loom bench gpu-check` checks the same on a
GPU. models/fused_layers.py swaps them into models: tests/workers/models/test_fused_layers.py."""

from __future__ import annotations

import pytest
import torch
import transformers
import triton
import triton.language as tl
from transformers.models.llama import modeling_llama

from loomllm.workers.kernels import fused_ops

pytestmark = pytest.mark.compute

rotary = fused_ops.rotary  # the kernel's wrapper, before a test counts its calls


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row shorter than the kernel's block
def test_rms_norm_matches_float64_and_transformers(hidden):
    torch.manual_seed(0)
    x = torch.randn(2, 5, hidden) * 3
    norm = modeling_llama.LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden)
    out = fused_ops.rms_norm(x, norm.weight, 1e-5)
    x64 = x.double()
    ref = norm.weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert out.shape == x.shape and out.dtype == torch.float32
    assert _rel(out, ref) < 1e-6
    torch.testing.assert_close(out, norm(x), rtol=1e-6, atol=1e-6)


def test_rms_norm_in_bfloat16():
    torch.manual_seed(1)
    x = (torch.randn(4, 64) * 2).bfloat16()
    norm = modeling_llama.LlamaRMSNorm(64, eps=1e-6).bfloat16()
    norm.weight.data = torch.randn(64).bfloat16()
    out = fused_ops.rms_norm(x, norm.weight, 1e-6)
    assert out.dtype == torch.bfloat16
    # Bit for bit but where the float32 sums' order moves a rounding: a unit in the last
    # place (2**-7 of the value at most) of a few elements.
    ref = norm(x)
    assert (out != ref).float().mean() < 0.02
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)


def _projected(batch: int, heads: int, tokens: int, dim: int, dtype: torch.dtype):
    """[B, heads, T, D] as transformers makes it: a transposed view of a projection."""
    return (
        torch.randn(batch, tokens, heads * dim)
        .to(dtype)
        .view(batch, tokens, heads, dim)
        .transpose(1, 2)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 6, 32), (3, 1, 8)])
def test_rotary_matches_transformers(dtype, heads, kv_heads, dim):
    torch.manual_seed(2)
    q = _projected(2, heads, 5, dim, dtype)
    k = _projected(2, kv_heads, 5, dim, dtype)
    config = transformers.LlamaConfig(
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=dim,
    )
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rope(q, torch.tensor([[0, 1, 2, 7, 300], [3, 4, 5, 6, 9]]))
    out_q, out_k = fused_ops.rotary(q, k, cos, sin)
    ref_q, ref_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.dtype == dtype
    # Token-major, as transformers' ops leave them: the attention's output reshapes freely.
    assert out_q.transpose(1, 2).is_contiguous() and out_k.transpose(1, 2).is_contiguous()
    if dtype == torch.bfloat16:  # each product and sum rounded where torch rounds them
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    else:
        torch.testing.assert_close(out_q, ref_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out_k, ref_k, rtol=1e-6, atol=1e-6)
    x = torch.cat([q, k], 1).double()  # the float64 reference, from the formula
    c, s = cos.double()[:, None], sin.double()[:, None]
    rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert _rel(torch.cat([out_q, out_k], 1), x * c + rotated * s) < tolerance


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="rms_norm takes"):
        fused_ops.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(ValueError, match="silu_mul takes"):
        fused_ops.silu_mul(torch.randn(2, 8).half())
    with pytest.raises(ValueError, match="gate and up side by side"):
        fused_ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_ops.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    torch.manual_seed(6)
    x, residual = (torch.randn(3, 4, 96) * 4).to(dtype), (torch.randn(3, 4, 96) * 4).to(dtype)
    norm = modeling_llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    out, total = fused_ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(total, residual + x)  # the sum rounded as torch rounds it
    assert out.shape == x.shape and out.dtype == dtype
    # Up to the float32 sum's order, as rms_norm: a unit in the last place at most.
    torch.testing.assert_close(
        out, norm(residual + x), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=0
    )
    # A residual read through strides (every other row of a larger tensor).
    wide = torch.randn(3, 8, 96).to(dtype)
    out, total = fused_ops.add_rms_norm(x, wide[:, ::2], norm.weight, 1e-5)
    assert torch.equal(total, wide[:, ::2] + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1500])  # 1500: two column blocks, the second partial
def test_silu_mul_is_transformers_mlp_product(dtype, width):
    torch.manual_seed(7)
    gate_up = (torch.randn(2, 3, 2 * width) * 4).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    out = fused_ops.silu_mul(gate_up)
    ref = torch.nn.functional.silu(gate) * up
    assert out.shape == (2, 3, width) and out.dtype == dtype
    if dtype == torch.bfloat16:  # the activation and the product each rounded where torch does
        assert torch.equal(out, ref)
    else:  # exp's last bit differs between numpy's and torch's
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    g, u = gate.double(), up.double()
    assert _rel(out, g * torch.sigmoid(g) * u) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_rms_norm_reads_strided_rows():
    torch.manual_seed(5)
    weight = torch.randn(32)
    for x in (torch.randn(6, 64)[:, ::2], torch.randn(32, 6).t()):  # column stride 2 and 6
        ref = weight * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), ref, rtol=1e-5, atol=1e-6)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, fused_ops.round_to(x, tl.bfloat16), mask=i < n)


def test_bfloat16_rounding_is_torchs():
    """Ties to even, either sign, overflow to inf, subnormals, and NaN kept NaN (adding the
    rounding carry to 0x7FFFFFFF, a GPU's NaN, would wrap it to -0.0)."""
    bits = [
        0x3F808000,
        0x3F818000,
        0xBF818000,
        0x3F80C000,
        0x7F7FFFFF,
        0x00012345,
        0x80008000,
        0x7F800000,
        0xFF800000,
        0x7FFFFFFF,
        0xFFFFFFFF,
        0x7FC00000,
    ]
    x = torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32).view(
        torch.float32
    )
    x = torch.cat([x, torch.randn(500) * torch.logspace(-30, 30, 500)])
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    ref = x.bfloat16().float()  # torch rounds to nearest even
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan) and nan[9:12].all()
    assert torch.equal(out[~nan], ref[~nan])
    assert out[4] == float("inf")


def test_rotary_falls_back_where_the_kernel_does_not_fit(monkeypatch):
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    fused = fused_ops.fused_rotary(original)
    assert fused.__wrapped__ is original

    def qkcs(heads=2, kv_heads=2, tokens=3, dim=8, kv_tokens=3, cos_dtype=torch.float32):
        return (
            torch.randn(1, heads, tokens, dim),
            torch.randn(1, kv_heads, kv_tokens, dim),
            torch.randn(1, tokens, dim, dtype=cos_dtype),
            torch.randn(1, tokens, dim, dtype=cos_dtype),
        )

    fused(*qkcs(), unsqueeze_dim=2)  # [B, T, H, D] layout
    fused(*qkcs(dim=6))  # D not a power of two
    fused(*qkcs(kv_tokens=4))  # k of another length
    fused(*qkcs(cos_dtype=torch.bfloat16))  # cos of another dtype than q's
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors, and no interpreter to run them
    fused(*qkcs())
    assert calls == [2, 1, 1, 1, 1]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k = fused(*qkcs(kv_heads=1))  # fits: the kernel runs
    assert calls == [2, 1, 1, 1, 1] and q.shape == (1, 2, 3, 8)


def _packed_qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """q, k, v [T, heads, D] as loomllm's model makes them: views of one q|k|v projection."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 6, 32), (3, 1, 8)])
def test_rotary_into_cache_is_rotary_then_write_kv(dtype, heads, kv_heads, dim):
    """The fused kernel leaves q and both caches exactly as `rotary` then `write_kv` do,
    and touches no other slot."""
    from loomllm.workers.attention import triton_kernels as triton_attention

    torch.manual_seed(4)
    tokens = 5
    q, k, v = _packed_qkv(tokens, heads, kv_heads, dim, dtype)
    angles = torch.tensor([0, 1, 2, 7, 300])[:, None] * torch.rand(dim // 2).repeat(2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([9, 3, 4, 15, 0])
    caches = [torch.full((16, kv_heads, dim), 7.0, dtype=dtype) for _ in range(4)]
    assert fused_ops.rotary_into_cache_fits(q, k, v, cos, sin, caches[0], caches[1])
    out_q = fused_ops.rotary_into_cache(q, k, v, cos, sin, caches[0], caches[1], slots)
    ref_q, ref_k = fused_ops.rotary(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    triton_attention.write_kv(ref_k[0].transpose(0, 1), v, caches[2], caches[3], slots)
    assert torch.equal(out_q, ref_q[0].transpose(0, 1))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (caches[0][untouched] == 7).all() and (caches[1][untouched] == 7).all()


def test_rotary_into_cache_declines_what_it_would_cast_or_misread():
    q, k, v = _packed_qkv(3, 4, 2, 16, torch.bfloat16)
    cos = sin = torch.ones(3, 16, dtype=torch.bfloat16)
    cache = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    fits = fused_ops.rotary_into_cache_fits
    assert fits(q, k, v, cos, sin, cache, cache.clone())
    assert not fits(q, k, v, cos, sin, cache.float(), cache.float())  # a cast to the cache's
    assert not fits(q, k, v, cos.float(), sin.float(), cache, cache)
    assert not fits(q, k, v, cos, sin, torch.zeros(8, 1, 16, dtype=torch.bfloat16), cache)
    assert not fits(q, k, v[:2], cos, sin, cache, cache)
    assert not fits(q, k, v, cos[:, :8], sin[:, :8], cache, cache)
    q6, k6, v6 = _packed_qkv(3, 4, 2, 6, torch.bfloat16)  # D not a power of two
    cache6 = torch.zeros(8, 2, 6, dtype=torch.bfloat16)
    assert not fits(q6, k6, v6, cos[:, :6], sin[:, :6], cache6, cache6)
