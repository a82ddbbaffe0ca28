"""GGUF files run as stored: tiny models in each common mix of quant types (and one of the
rarer types) through a real Engine, against the same file dequantized to float32; the weights
are views of the file; unsupported types are refused by name; `quantization="none"`
dequantizes. asyncio and trio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.gguf_models import MIXES, make_tiny_gguf
from support.streams import final

from loomllm import Engine, SamplingParams
from loomllm.workers.kernels.gguf_linear import GgufEmbedding, GgufLinear
from loomllm.workers.models.gguf_file import GgufFile
from loomllm.workers.models.llama.model import Linear
from loomllm.workers.models.loader import load_model
from loomllm.workers.models.sources import ModelLoadError

PROMPT = list(range(1000, 2000, 25))
# Mean |difference| of the prompt's logprobs (nats), stored against dequantized: the kernels'
# int8 activations and a bfloat16 model stay within a few hundredths; the same mix of another
# seed is ~5 off, so a wiring error (a row order, a part, a bias) cannot hide under it.
TOLERANCE = 0.3


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def reference_logprobs(path: Path) -> np.ndarray:
    """The dequantized float32 model's logprob of each prompt token after the first."""
    model = load_model(str(path), dtype="float32", quantization="none").model
    with torch.no_grad():
        rows = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return np.array([rows[i, PROMPT[i + 1]].item() for i in range(len(PROMPT) - 1)])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mix", "architecture"), [*((mix, "llama") for mix in MIXES), ("Q4_K_M", "qwen2")]
)
async def test_each_mix_through_the_engine_matches_the_dequantized_model(
    mix, architecture, gguf_dir, shared_manager
):
    path = gguf_dir / f"{mix}-{architecture}.gguf"
    if not path.exists():
        make_tiny_gguf(path, mix, architecture=architecture)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    async with Engine(str(path), manager_socket=shared_manager.socket) as engine:
        out = await final(engine, {"prompt_token_ids": PROMPT}, params)
    got = np.array([next(iter(row.values())).logprob for row in out.prompt_logprobs[1:]])
    assert np.abs(got - reference_logprobs(path)).mean() < TOLERANCE
    assert len(out.outputs[0].token_ids) == 4


def test_another_seed_is_far_outside_the_tolerance(gguf_dir):
    """The test above can fail: the same mix drawn again differs by far more."""
    one, other = (make_tiny_gguf(gguf_dir / f"seed-{s}.gguf", "Q4_K_M", seed=s) for s in (0, 1))
    assert np.abs(reference_logprobs(one) - reference_logprobs(other)).mean() > 10 * TOLERANCE


def test_the_weights_are_the_file_s_pages(gguf_dir):
    """Every linear layer and the embedding compute from views of the mapped file: nothing
    the size of a weight is copied (the norms are)."""
    path = make_tiny_gguf(gguf_dir / "views.gguf", "Q4_K_M")
    model = load_model(str(path)).model
    linears = [m for m in model.modules() if isinstance(m, GgufLinear)]
    assert len(linears) == 2 * 4 + 1  # every layer's four, and the LM head
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, GgufEmbedding)
    views = [p.data for m in linears for p in m.parts] + [model.model.embed_tokens.part.data]
    assert all(mapped_from(v, path) for v in views)
    copied = sum(p.numel() * p.element_size() for p in model.parameters())
    assert copied < 0.01 * path.stat().st_size


def mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's bytes lie in a mapping of `path` (this process's /proc maps)."""
    start = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            low, high = (int(a, 16) for a in fields[0].split("-"))
            if low <= start and start + tensor.numel() <= high:
                return True
    return False


def test_a_type_the_kernels_do_not_read_is_refused_by_name(gguf_dir):
    """An IQ2_XXS tensor: refused at load, naming it; quantization="none" dequantizes it."""
    from gguf import GGMLQuantizationType

    path = make_tiny_gguf(gguf_dir / "iq2.gguf", ("Q4_K", "IQ2_XXS", "Q4_K", "Q6_K"))
    assert GgufFile(path).tensors["blk.0.attn_v.weight"].type_id == GGMLQuantizationType.IQ2_XXS
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_v\.weight is stored as IQ2_XXS"):
        load_model(str(path))
    dense = load_model(str(path), dtype="float32", quantization="none").model
    assert not any(isinstance(m, GgufLinear) for m in dense.modules())


@pytest.mark.parametrize("quantization", [None, "gguf", "none"])
def test_a_kernel_choice_for_a_gguf_is_refused_by_name(quantization, gguf_dir):
    """cpu_linear_kernel picks among kernels of weights quantized on load: a GGUF's blocks
    (or its dequantized weights) have none to pick, and the option is not silently dropped."""
    path = make_tiny_gguf(gguf_dir / "kernel.gguf", "Q4_0")
    with pytest.raises(ValueError, match=r"cpu_linear_kernel='int4' chooses the kernel"):
        load_model(str(path), quantization=quantization, cpu_linear_kernel="int4")


def test_llama3_rope_factors_divide_the_frequencies(gguf_dir):
    """llama.cpp's converter stores Llama 3's scaled RoPE as `rope_freqs.weight`, which
    transformers' config from a GGUF leaves out; the model divides its frequencies by them."""
    factors = np.linspace(1.0, 8.0, 32).astype(np.float32)
    plain = load_model(str(make_tiny_gguf(gguf_dir / "rope-1.gguf", "Q8_0"))).model
    scaled = make_tiny_gguf(gguf_dir / "rope-2.gguf", "Q8_0", rope_factors=factors)
    model = load_model(str(scaled)).model
    torch.testing.assert_close(model.inv_freq, plain.inv_freq / torch.from_numpy(factors))


@pytest.mark.anyio
async def test_batch_invariant_tokens_do_not_depend_on_the_batch(gguf_dir, shared_manager):
    """With batch_invariant, a request alone and the same request among 11 others (a step of
    12 rows: panels, without the option) give the same tokens and logprobs, bit for bit (in
    float32, where no rounding to bfloat16 hides the last bits' differences)."""
    import anyio

    path = gguf_dir / "invariant.gguf"
    if not path.exists():
        make_tiny_gguf(path, "Q4_K_M")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1000 + 37 * i + j for j in range(12)]} for i in range(12)]
    async with Engine(
        str(path), manager_socket=shared_manager.socket, dtype="float32", batch_invariant=True
    ) as engine:
        alone = await final(engine, prompts[0], params)
        outs: dict[int, object] = {}

        async def one(i: int) -> None:
            outs[i] = await final(engine, prompts[i], params)

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
    together = outs[0].outputs[0]
    assert together.token_ids == alone.outputs[0].token_ids
    assert [{k: v.logprob for k, v in row.items()} for row in together.logprobs] == [
        {k: v.logprob for k, v in row.items()} for row in alone.outputs[0].logprobs
    ]


def test_a_gguf_head_writes_float32_logits_in_a_bfloat16_model(gguf_dir):
    """The head computes from int8 activations whatever the model's dtype: its logits come
    out in float32, nearer a float64 product of the same activations and dequantized rows
    than the same logits rounded to bfloat16. A dense head keeps the model's dtype."""
    path = make_tiny_gguf(gguf_dir / "head.gguf", "Q4_K_M")
    model = load_model(str(path), dtype="bfloat16").model
    assert isinstance(model.lm_head, GgufLinear) and model.float32_logits
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0]
        hidden = model.last_hidden_states(ids)[0]
        weight = model.lm_head.dequantized(torch.float32).double()  # exact: 16-bit scales
    assert logits.dtype == torch.float32
    exact = hidden.double() @ weight.T
    error = (logits.double() - exact).abs().mean()
    rounded = (logits.bfloat16().double() - exact).abs().mean()
    assert error < rounded, (error, rounded)
    dense = load_model(str(path), dtype="bfloat16", quantization="none").model
    assert not dense.float32_logits
    with torch.no_grad():
        assert dense(ids).logits.dtype == torch.bfloat16
