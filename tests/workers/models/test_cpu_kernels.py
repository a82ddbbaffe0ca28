"""loomllm's own model on the CPU's C++ ops (kernels/cpu_native.py, models/cpu_kernels.py):
logits against transformers' own model, bit for bit in bf16 against transformers' model
on our paged attention, and the one-call decoder stack bit for bit the layer-by-layer path
(prompt steps, decode steps and steps of both), with dense, int4, int8 and a8 linears."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.counting_ops import CountingOps
from support.hf_reference import hf_logits
from support.models import COMMON, PROMPT, VARIANTS, make_tiny_model, save_variant
from support.paged_forward import paged_logits
from support.runner_driver import drive

from loomllm.core.request import Request
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.attention import paged as attention
from loomllm.workers.kernels import cpu_native
from loomllm.workers.models.cpu_kernels import install_cpu_kernels
from loomllm.workers.models.llama import cpu_stack
from loomllm.workers.models.loader import load_model
from loomllm.workers.runner.model_runner import ModelRunner

pytestmark = pytest.mark.compute
LAYERS = COMMON["num_hidden_layers"]
QUANTIZED = [("int4", "int4"), ("int8", "int8"), ("int4", "a8")]


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    """The C++ ops loaded for each test only: `cpu_native.loaded()` is what it was after it
    (while loaded, the torch backend's decode attention takes them in every model)."""
    monkeypatch.setattr(cpu_native, "_ops", None)
    yield
    assert cpu_native.loaded() is not None, "the C++ ops did not build"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, tmp_path, monkeypatch):
    """Every variant (qwen3's norms of q and k, biases, tied embeddings, RoPE scalings): the
    prompt's step and the decode step each in one call of the C++ stack."""
    model_dir = save_variant(tmp_path, variant)
    loaded = load_model(str(model_dir), dtype="float32", model_impl="loom")
    assert install_cpu_kernels(loaded.model, torch.float32)
    counting = CountingOps(cpu_native.loaded())
    loaded.model.use_cpu_kernels(counting)
    monkeypatch.setattr(cpu_native, "_ops", counting)
    ours = paged_logits(loaded.model, loaded.config, PROMPT, "torch")
    torch.testing.assert_close(ours, hf_logits(model_dir, PROMPT), rtol=1e-4, atol=1e-5)
    assert counting.calls["decode_layers"] == 2
    assert counting.calls["rotary_into_cache"] == 0


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_bfloat16_logits_are_transformers_bit_for_bit(variant, tmp_path):
    """bf16, against transformers' model running our paged attention, whose decode rows
    then take the C++ kernel too: the norms, SiLU and rotary round as transformers' ops."""
    model_dir = save_variant(tmp_path, variant)
    ours = load_model(str(model_dir), dtype="bfloat16", model_impl="loom")
    theirs = load_model(str(model_dir), dtype="bfloat16", model_impl="transformers").model
    assert install_cpu_kernels(ours.model, torch.bfloat16)
    attention.route_transformers_model(theirs)
    expected = paged_logits(theirs, ours.config, PROMPT, "torch", torch.bfloat16)
    got = paged_logits(ours.model, ours.config, PROMPT, "torch", torch.bfloat16)
    assert torch.equal(got, expected)


def decode_tokens(model, config, dtype, on_schedule=None) -> dict[str, list[tuple]]:
    """Five requests of different lengths through a real scheduler and ModelRunner: each
    one's (tokens, logprobs) per step. 16 tokens a step: prompts come in chunks, in steps
    beside other requests' decode rows, then steps of 1 to 5 decode rows alone."""
    runner = ModelRunner(
        model, config, device=torch.device("cpu"), dtype=dtype, block_size=16, num_blocks=40
    )
    scheduler = Scheduler(SchedulerConfig(8, 16, 128, 16, runner.num_blocks))
    for i in range(5):
        # logprobs=0: each token's logprob, which the paths must agree on too.
        params = SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=0)
        prompt = PROMPT[: 4 + 3 * i]
        scheduler.add_request(Request(f"r{i}", prompt, params, frozenset(), 128, 0.0))
    outputs = drive(scheduler, runner, ahead=False, on_schedule=on_schedule)
    return {r: [(o.new_token_ids, o.new_logprobs) for o in outs] for r, outs in outputs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch, quantization, kernel",
    [
        ("llama", "none", "auto"),
        ("llama", "int4", "int4"),
        ("llama", "int8", "int8"),
        ("llama", "int4", "a8"),
        ("llama", "int8", "a8"),
        ("qwen3", "none", "auto"),
    ],
)
def test_the_one_call_stack_is_the_layer_by_layer_path(arch, quantization, kernel, dtype, tmp_path):
    """The same ops in the same order: identical tokens and logprobs, in prompt steps,
    decode steps and steps of both, the quantized kernels included (each forced, so every
    step runs it), and Qwen3's norms of q and k."""
    model_dir = make_tiny_model(tmp_path / "model", arch, seed=5)
    name = str(dtype).removeprefix("torch.")
    loaded = load_model(model_dir, dtype=name, quantization=quantization, cpu_linear_kernel=kernel)
    assert install_cpu_kernels(loaded.model, dtype)
    stack = loaded.model.cpu_stack
    assert stack is not None
    _, modes = stack.plan(1)
    expected_mode = {
        "auto": cpu_stack.DENSE,
        "int4": cpu_stack.INT4,
        "int8": cpu_stack.INT8,
        "a8": cpu_stack.A8,
    }
    assert set(modes) == {expected_mode[kernel]}
    counting = CountingOps(stack.ops)
    stack.ops = counting
    mixed = []  # per step: whether it has a prompt chunk and a decode row both

    def on_schedule(so) -> None:
        counts = so.num_scheduled_tokens.values()
        mixed.append(1 in counts and max(counts) > 1)

    stacked = decode_tokens(loaded.model, loaded.config, dtype, on_schedule=on_schedule)
    loaded.model.cpu_stack = None
    assert decode_tokens(loaded.model, loaded.config, dtype) == stacked
    assert all(len(steps) > 5 for steps in stacked.values())
    assert sum(mixed) >= 2 and counting.calls["decode_layers"] == len(mixed)


@pytest.mark.parametrize(
    "quantization, kernel, dtype",
    [
        *[(q, k, d) for q, k in QUANTIZED for d in (torch.float32, torch.bfloat16)],
        ("none", "auto", torch.bfloat16),
    ],
)
def test_a_thread_count_changed_between_steps_changes_no_token(
    quantization, kernel, dtype, tmp_path
):
    """What the CPU thread governor relies on (device/cpu_threads.py): with the quantized
    kernels or bfloat16 matmuls, the prompt steps, the one-call stack, attention and
    sampling give the same tokens and logprobs at 1, 2 or 3 threads, switched from step to
    step. (float32 matmuls do not: torch's round differently at another thread count.)"""
    model_dir = make_tiny_model(tmp_path / "model", seed=5)
    name = str(dtype).removeprefix("torch.")
    loaded = load_model(model_dir, dtype=name, quantization=quantization, cpu_linear_kernel=kernel)
    assert install_cpu_kernels(loaded.model, dtype)
    threads = torch.get_num_threads()
    steps = itertools.count()
    try:
        torch.set_num_threads(2)
        fixed = decode_tokens(loaded.model, loaded.config, dtype)
        switched = decode_tokens(
            loaded.model,
            loaded.config,
            dtype,
            on_schedule=lambda _: torch.set_num_threads(1 + next(steps) % 3),
        )
    finally:
        torch.set_num_threads(threads)
    assert next(steps) > 10
    assert switched == fixed


def test_sixteen_bit_weights_under_float32_run_layer_by_layer(tmp_path):
    """weight_dtype's layers compute in their own way: not in the stack, and the C++ ops
    around them give torch's ops' logits."""
    model_dir = make_tiny_model(tmp_path / "model", seed=6)
    loaded = load_model(model_dir, dtype="float32", weight_dtype="bfloat16")
    assert install_cpu_kernels(loaded.model, torch.float32)
    assert loaded.model.cpu_stack is None
    with_ops = paged_logits(loaded.model, loaded.config, PROMPT, "torch")
    ops = cpu_native.loaded()
    loaded.model.use_cpu_kernels(None)
    cpu_native.use(None)
    without = paged_logits(loaded.model, loaded.config, PROMPT, "torch")
    cpu_native.use(ops)
    torch.testing.assert_close(with_ops, without, rtol=1e-4, atol=1e-5)


def test_bad_stack_input_is_refused(tmp_path):
    loaded = load_model(make_tiny_model(tmp_path / "model"), dtype="float32")
    assert install_cpu_kernels(loaded.model, torch.float32)
    ops = cpu_native.loaded()
    weights, modes = loaded.model.cpu_stack.plan(1)
    shape = loaded.config
    hidden = torch.randn(1, shape.hidden_size)
    cache = torch.zeros(16, shape.num_key_value_heads, shape.head_dim)
    layers = shape.num_hidden_layers
    heads = [shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim]
    args = [[cache] * layers, [cache] * layers, 1e-5, *heads, torch.ones(1, shape.head_dim)]
    rest = [torch.zeros(1, shape.head_dim), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long)]
    lens = [torch.tensor([1]), 0.25, 0]
    gguf = dict(gguf_weights=[], gguf_types=[], gguf_heads=[], gguf_counts=[], gguf_kernel=0)
    with pytest.raises(RuntimeError, match="linear mode 7 is none of 0, 1, 2"):
        ops.decode_layers(hidden, weights, [7] + modes[1:], *args, *rest, *lens, **gguf)
    with pytest.raises(RuntimeError, match="weight 0 is missing"):
        ops.decode_layers(hidden, [None] + weights[1:], modes, *args, *rest, *lens, **gguf)
    with pytest.raises(RuntimeError, match="1 layers' caches"):
        ops.decode_layers(hidden, weights, modes, [cache], [cache], *args[2:], *rest, *lens, **gguf)
    with pytest.raises(RuntimeError, match="prefill_slots without decode_rows"):
        prompt = torch.zeros(1, 1, dtype=torch.long)
        ops.decode_layers(hidden, weights, modes, *args, *rest, *lens, None, prompt, **gguf)
    with pytest.raises(RuntimeError, match="too few gguf_counts"):  # a GGUF layer, no parts
        ops.decode_layers(hidden, weights, [4] + modes[1:], *args, *rest, *lens, **gguf)
