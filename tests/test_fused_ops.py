"""The fused RMSNorm and rotary kernels (workers.fused_ops) against a float64 reference and
transformers' own modules, under Triton's interpreter (TRITON_INTERPRET=1: conftest.py).

bfloat16: the kernels round each product and sum to nearest even, in integer arithmetic,
where torch's eager ops round (the interpreter's own float-to-bfloat16 conversion
truncates), so the rotary embedding is bit-identical to transformers' and RMSNorm is up to
its float32 sum's order; `loom bench gpu-check` checks the same on a GPU."""

from __future__ import annotations

import pytest
import torch
import transformers
import triton
import triton.language as tl
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from workers import fused_ops

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
    return torch.randn(batch, tokens, heads * dim).to(dtype).view(
        batch, tokens, heads, dim).transpose(1, 2)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 6, 32), (3, 1, 8)])
def test_rotary_matches_transformers(dtype, heads, kv_heads, dim):
    torch.manual_seed(2)
    q = _projected(2, heads, 5, dim, dtype)
    k = _projected(2, kv_heads, 5, dim, dtype)
    config = transformers.LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, head_dim=dim)  # fmt: skip
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rope(q, torch.tensor([[0, 1, 2, 7, 300], [3, 4, 5, 6, 9]]))
    out_q, out_k = fused_ops.rotary(q, k, cos, sin)
    ref_q, ref_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.dtype == dtype
    if dtype == torch.bfloat16:  # each product and sum rounded where torch rounds them
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    else:
        torch.testing.assert_close(out_q, ref_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out_k, ref_k, rtol=1e-6, atol=1e-6)
    x = torch.cat([q, k], 1).double()  # the float64 reference, from the formula
    c, s = cos.double()[:, None], sin.double()[:, None]
    rotated = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert _rel(torch.cat([out_q, out_k], 1), x * c + rotated * s) < tolerance


def _tiny(arch: str) -> torch.nn.Module:
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    config = config_cls(vocab_size=97, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch,modeling", [("llama", modeling_llama), ("qwen2", modeling_qwen2)])
def test_installed_model_keeps_its_logits(monkeypatch, arch, modeling):
    # Restore the modeling module's rotary function after the test: the swap is global.
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    original_rotary = modeling.apply_rotary_pos_emb
    kernel_calls = []
    monkeypatch.setattr(fused_ops, "rotary",
                        lambda *a: kernel_calls.append(1) or rotary(*a))  # fmt: skip
    model = _tiny(arch)
    ids = torch.tensor([[5, 9, 2, 40, 7, 7, 13]])
    with torch.no_grad():
        before = model(ids).logits
        assert fused_ops.install_fused_ops(model) == (2 * 2 + 1, 1)
        assert fused_ops.install_fused_ops(model) == (0, 1)  # idempotent: nothing left to swap
        after = model(ids).logits
    assert modeling.apply_rotary_pos_emb.__wrapped__ is original_rotary
    assert len(kernel_calls) == 2  # one a layer: the kernel ran, not the fallback
    assert sum(isinstance(m, fused_ops.FusedRMSNorm) for m in model.modules()) == 5
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_transformers_ops(monkeypatch):
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        modeling_llama.apply_rotary_pos_emb)  # fmt: skip
    assert fused_ops.install_fused_ops(_tiny("llama").half()) == (0, 0)
    with pytest.raises(ValueError, match="rms_norm takes"):
        fused_ops.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6)


def test_rms_norm_reads_strided_rows():
    torch.manual_seed(5)
    weight = torch.randn(32)
    for x in (torch.randn(6, 64)[:, ::2], torch.randn(32, 6).t()):  # column stride 2 and 6
        ref = weight * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), ref, rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, fused_ops._round_to(x, tl.bfloat16), mask=i < n)


def test_bfloat16_rounding_is_torchs():
    """Ties to even, either sign, overflow to inf, subnormals, and NaN kept NaN (adding the
    rounding carry to 0x7FFFFFFF, a GPU's NaN, would wrap it to -0.0)."""
    bits = [0x3F808000, 0x3F818000, 0xBF818000, 0x3F80C000, 0x7F7FFFFF, 0x00012345,
            0x80008000, 0x7F800000, 0xFF800000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000]
    x = torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits],
                     dtype=torch.int32).view(torch.float32)  # fmt: skip
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

    fused = fused_ops._fused_rotary(original)
    assert fused.__wrapped__ is original

    def qkcs(heads=2, kv_heads=2, tokens=3, dim=8, kv_tokens=3, cos_dtype=torch.float32):
        return (torch.randn(1, heads, tokens, dim), torch.randn(1, kv_heads, kv_tokens, dim),
                torch.randn(1, tokens, dim, dtype=cos_dtype),
                torch.randn(1, tokens, dim, dtype=cos_dtype))  # fmt: skip

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
