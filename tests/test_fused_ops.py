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
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from workers import fused_ops


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
    x = torch.cat([q, q], 1).double()  # the float64 reference, from the formula
    c, s = cos.double()[:, None], sin.double()[:, None]
    rotated = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert _rel(torch.cat([out_q, out_q], 1), x * c + rotated * s) < tolerance


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
    model = _tiny(arch)
    ids = torch.tensor([[5, 9, 2, 40, 7, 7, 13]])
    with torch.no_grad():
        before = model(ids).logits
        assert fused_ops.install_fused_ops(model) == (2 * 2 + 1, 1)
        assert fused_ops.install_fused_ops(model) == (0, 1)  # idempotent: nothing left to swap
        after = model(ids).logits
    assert modeling.apply_rotary_pos_emb is not original_rotary
    assert sum(isinstance(m, fused_ops.FusedRMSNorm) for m in model.modules()) == 5
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_rotary_falls_back_for_other_layouts(monkeypatch):
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    fused = fused_ops._fused_rotary(original)
    q = torch.randn(1, 3, 2, 8)  # [B, T, H, D] with unsqueeze_dim=2: not the kernel's layout
    fused(q, q, torch.randn(1, 3, 8), torch.randn(1, 3, 8), unsqueeze_dim=2)
    fused(torch.randn(1, 2, 3, 6), torch.randn(1, 2, 3, 6), torch.randn(1, 3, 6),
          torch.randn(1, 3, 6))  # fmt: skip  # D=6: not a power of two
    assert calls == [2, 1]
