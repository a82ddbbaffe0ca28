"""GPU checks beyond the llama path, at the released models' layer shapes: experts, latent
attention, sinks and softcap end to end, pooling, LoRA and speculative decoding, each against
transformers or float64. Part of `loom bench gpu-check`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomllm.benchmarks import save_word_tokenizer, wait_for_no_workers

Check = Callable[[], tuple[bool | None, str]]

MAX_TOKENS = 24
# A divergence from transformers' greedy token is a near-tie when the two tokens' logits
# differ by less than this fraction of the largest logit: float32 kernels in another order.
NEAR_TIE = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EMBED_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the checks build: random models of these configs (two layers each), prompts of
    these lengths, and the LoRA kernel's [in, out] projections."""

    vocab: int
    archs: dict[str, tuple[str, dict[str, Any]]]
    llama: dict[str, Any]  # LoRA's and speculative decoding's base model
    pooling: dict[str, tuple[str, dict[str, Any], str]]  # with sentence-transformers pooling
    prompt_lengths: tuple[int, ...]
    lora_kernel: tuple[tuple[int, int], ...]

    def config(self, name: str, fields: dict[str, Any]) -> Any:
        import transformers

        common = dict(
            vocab_size=self.vocab,
            num_hidden_layers=2,  # a second layer's cache, DeepSeek's dense first layer
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        return getattr(transformers, name)(**{**common, **fields})

    def prompts(self, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, self.vocab) for _ in range(n)] for n in lengths]


# The released models' layers, with their features set so that they bind: windows shorter
# than the longest prompt, and Gemma 2's weights wide enough for its softcaps to cap.
FULL_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral (Mixtral-8x7B's layers)": (
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),
    "deepseek_v2 (DeepSeek-V2-Lite's latent attention and experts)": (
        "DeepseekV2Config",
        dict(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "gpt_oss (gpt-oss-20b's sinks, window and experts)": (
        "GptOssConfig",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma2 (Gemma-2-9B's softcaps, window and head size 256)": (
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=256,
            initializer_range=0.15,
        ),
    ),
}
FULL_POOLING: dict[str, tuple[str, dict[str, Any], str]] = {
    "decoder, last token": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
        "lasttoken",
    ),
    "encoder, mean": (
        "BertConfig",
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            max_position_embeddings=512,
            initializer_range=0.2,
        ),
        "mean_tokens",
    ),
}
# Llama-3-8B's layers, Qwen3-Embedding-0.6B's and BERT-base's.
FULL = Shapes(
    vocab=32000,
    archs=FULL_ARCHS,
    llama=dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
    pooling=FULL_POOLING,
    prompt_lengths=(7, 64, 300, 700, 1100),  # past every window
    lora_kernel=((4096, 6144), (4096, 28672), (14336, 4096)),  # q|k|v, gate|up, down
)
_SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
# The same features at a CPU's shapes (`--shape tiny`): the checks' own smoke test.
TINY = Shapes(
    vocab=256,
    archs={
        "mixtral": ("MixtralConfig", dict(_SMALL, num_local_experts=4, sliding_window=None)),
        "deepseek_v2": (
            "DeepseekV2Config",
            dict(
                _SMALL,
                num_key_value_heads=4,
                moe_intermediate_size=32,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
            ),
        ),
        "gpt_oss": (
            "GptOssConfig",
            dict(
                _SMALL,
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        "gemma2": (
            "Gemma2Config",
            dict(
                _SMALL,
                head_dim=16,
                query_pre_attn_scalar=16,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                sliding_window=8,
                initializer_range=0.2,
            ),
        ),
    },
    llama=_SMALL,
    pooling={
        "decoder, last token": ("Qwen3Config", dict(_SMALL, head_dim=16), "lasttoken"),
        "encoder, mean": (
            "BertConfig",
            dict(_SMALL, max_position_embeddings=130, initializer_range=0.2),
            "mean_tokens",
        ),
    },
    prompt_lengths=(7, 20, 40),
    lora_kernel=((64, 96), (100, 48)),
)


def _random_model(
    shapes: Shapes, config_name: str, fields: dict[str, Any], path: Path, device: str
) -> Any:
    """A random-weight causal LM saved in bf16 to `path` with a word-level tokenizer (built on
    `device`, which is quick); transformers' model of it, float32, eager attention."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = shapes.config(config_name, fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_word_tokenizer(path, shapes.vocab)
    del model
    _free(device)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return reference.to(device).eval()


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _greedy_with_scores(model: Any, prompts: list[list[int]]) -> list[tuple[list[int], Any]]:
    """transformers' greedy tokens for each prompt, with each step's logits [steps, V]."""
    import torch

    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    found = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logits = torch.cat(out.logits).float().cpu()
            found.append((out.sequences[0, len(prompt) :].tolist(), logits))
    return found


def _compare(ours: list[list[int]], reference: list[tuple[list[int], Any]]) -> tuple[bool, str]:
    """Every request's tokens against transformers': identical, or diverging first at a
    near-tie (NEAR_TIE); the words that say which."""
    identical, ties, wrong = 0, [], []
    for i, (tokens, (expected, logits)) in enumerate(zip(ours, reference, strict=True)):
        if tokens == expected:
            identical += 1
            continue
        at = next(
            (j for j, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
            min(len(tokens), len(expected)),
        )
        if at >= min(len(tokens), len(expected)):
            wrong.append(f"request {i}: {len(tokens)} tokens, expected {len(expected)}")
            continue
        row = logits[at]
        gap = (row[expected[at]] - row[tokens[at]]).item() / row.abs().max().item()
        (ties if gap < NEAR_TIE else wrong).append(f"request {i} at token {at} (gap {gap:.1e})")
    words = f"{identical} of {len(ours)} requests identical to transformers"
    if ties:
        words += f"; near-ties: {', '.join(ties)}"
    if wrong:
        words += f"; WRONG: {', '.join(wrong)}"
    return not wrong, words


def _engine_tokens(
    model_dir: str,
    device: str,
    socket: Path,
    prompts: list[list[int]],
    loras: list[Any] | None = None,
    **options: Any,
) -> tuple[list[list[int]], Any, str]:
    """Greedy tokens of an Engine for every prompt, all started together; its stats; which
    CUDA graphs its worker captured (a forward that cannot be captured runs eager)."""
    import anyio

    from loomllm import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = loras or [None] * len(prompts)

    async def run() -> tuple[list[list[int]], Any, str]:
        async with Engine(
            model_dir,
            dtype="float32",
            device=device,
            keep_alive=0,
            manager_socket=socket,
            **options,
        ) as engine:
            tokens: list[list[int]] = [[] for _ in prompts]

            async def one(i: int) -> None:
                request = {"prompt_token_ids": prompts[i]}
                async for out in engine.generate(request, params, lora_request=loras[i]):
                    tokens[i] = list(out.outputs[0].token_ids)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            (graphs,) = await engine.collective_rpc(_captured_graphs)
            return tokens, engine.stats(), graphs

    wait_for_no_workers(socket)  # the last engine's worker gone, its memory freed
    return anyio.run(run)


def _captured_graphs(worker: Any) -> str:
    runner = worker.runner
    kinds = [("decode", runner.decode_graphs), ("mixed", runner.mixed_graphs)]
    return " and ".join(f"{k} graphs" for k, g in kinds if g is not None and g.captured) or "none"


def check_architectures(
    device: str, work: Path, shapes: Shapes, socket: Path
) -> tuple[bool | None, str]:
    """Each architecture's greedy tokens through an Engine (decode graphs on) against
    transformers' eager attention, float32, prompts of every length at once."""
    results, ok = [], True
    for seed, (name, (config_name, fields)) in enumerate(shapes.archs.items()):
        path = work / f"arch-{seed}"
        reference = _random_model(shapes, config_name, fields, path, device)
        prompts = shapes.prompts(seed, shapes.prompt_lengths)
        expected = _greedy_with_scores(reference, prompts)
        del reference
        _free(device)
        tokens, _, graphs = _engine_tokens(str(path), device, socket, prompts)
        passed, words = _compare(tokens, expected)
        ok &= passed
        results.append(f"{name}: {words}, captured: {graphs}")
    return ok, "; ".join(results)


def _write_adapter(base: Any, path: Path, seed: int, rank: int, alpha: float) -> dict[str, Any]:
    """A PEFT LoRA adapter with random weights on every projection of `base`, saved to `path`;
    {module name: the update scaling * B @ A, float32}."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors, updates = {}, {}
    for name, module in base.named_modules():
        if name.rpartition(".")[2] not in LORA_TARGETS:
            continue
        out_f, in_f = module.weight.shape
        a = (torch.randn(rank, in_f, generator=gen) / in_f**0.5).to(torch.bfloat16)
        b = (torch.randn(out_f, rank, generator=gen) * 0.05).to(torch.bfloat16)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
        updates[name] = (alpha / rank) * (b.double() @ a.double()).float()
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return updates


def _merged_reference(
    model: Any, updates: dict[str, Any] | None, prompts: list[list[int]]
) -> list[tuple[list[int], Any]]:
    """transformers' greedy tokens with an adapter's updates merged into the weights (None:
    the base model), the weights restored after."""
    import torch

    modules = dict(model.named_modules())
    saved = {}
    with torch.no_grad():
        for name, update in (updates or {}).items():
            weight = modules[name].weight
            saved[name] = weight.clone()
            weight += update.to(weight.device)
    try:
        return _greedy_with_scores(model, prompts)
    finally:
        with torch.no_grad():
            for name, weight in saved.items():
                modules[name].weight.copy_(weight)


def check_lora(
    device: str, work: Path, shapes: Shapes, socket: Path, base: str, reference: Any
) -> tuple[bool | None, str]:
    """Three adapters (ranks 16, 32, 64 on every projection) and the base model in one batch,
    each request's tokens against transformers with its adapter merged."""
    from loomllm import LoRARequest

    ranks = (16, 32, 64)
    updates = [
        _write_adapter(reference, work / f"lora-{r}", seed, r, alpha=2.0 * r)
        for seed, r in enumerate(ranks)
    ]
    prompt = shapes.prompts(7, shapes.prompt_lengths[2:3])[0]
    expected = [_merged_reference(reference, u, [prompt])[0] for u in [None, *updates]]
    loras = [None] + [
        LoRARequest(f"lora-{r}", i + 1, str(work / f"lora-{r}")) for i, r in enumerate(ranks)
    ]
    tokens, _, graphs = _engine_tokens(
        base,
        device,
        socket,
        [prompt] * len(loras) * 2,  # each twice: its prefix cached within its adapter only
        loras * 2,
        enable_lora=True,
        max_loras=len(ranks),
        max_lora_rank=max(ranks),
    )
    ok, words = _compare(tokens, expected * 2)
    differ = len({tuple(t) for t, _ in expected}) == len(expected)
    return ok and differ, (
        f"{words}; every adapter changes the tokens: {differ}; captured: {graphs}"
    )


def check_speculation(
    device: str,
    socket: Path,
    base: str,
    expected: list[tuple[list[int], Any]],
    prompts: list[list[int]],
) -> tuple[bool | None, str]:
    """Greedy tokens with n-gram and draft-model speculation (the draft: the model itself,
    so every draft is taken) against transformers'."""
    methods = {
        "n-gram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "draft model": {"method": "draft_model", "model": base, "num_speculative_tokens": 3},
    }
    results, ok = [], True
    for name, spec in methods.items():
        tokens, stats, graphs = _engine_tokens(
            base, device, socket, prompts, speculative_config=spec
        )
        passed, words = _compare(tokens, expected)
        taken = f"{stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} drafts"
        passed &= stats.spec_num_draft_tokens > 0
        ok &= passed
        results.append(f"{name}: {words}, {taken} taken, captured: {graphs}")
    return ok, "; ".join(results)


def _write_pooling_files(path: Path, hidden: int, pooling: str) -> None:
    """sentence-transformers' modules beside a model: pooling by `pooling`, then Normalize."""
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (p, t) in enumerate(modules)
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": hidden, f"pooling_mode_{pooling}": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


def check_pooling(device: str, work: Path, shapes: Shapes, socket: Path) -> tuple[bool | None, str]:
    """Embeddings of a decoder (last token, as Qwen3-Embedding) and an encoder (mean, as
    BERT's), prompts of three lengths together, against transformers' base model pooled and
    normalized, float32."""
    import anyio
    import torch
    import transformers

    from loomllm import Engine

    results, ok = [], True
    for i, (name, (config_name, fields, pooling)) in enumerate(shapes.pooling.items()):
        path = work / f"pooling-{i}"
        torch.manual_seed(i)
        config = shapes.config(config_name, fields)
        # A decoder saved as its causal LM, as Qwen3-Embedding is; its base model pools.
        kind = (
            transformers.AutoModel
            if pooling == "mean_tokens"
            else transformers.AutoModelForCausalLM
        )
        kind.from_config(config).save_pretrained(path)
        save_word_tokenizer(path, shapes.vocab)
        _write_pooling_files(path, config.hidden_size, pooling)
        prompts = shapes.prompts(20 + i, shapes.prompt_lengths[:3])
        if pooling == "mean_tokens":  # an encoder's input: CLS ... SEP
            prompts = [[1, *p[1:-1], 2] for p in prompts]
        model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
        model = model.to(device).eval()
        expected = []
        with torch.inference_mode():
            for prompt in prompts:
                hidden = model(torch.tensor([prompt], device=device)).last_hidden_state[0]
                vector = hidden[-1] if pooling == "lasttoken" else hidden.mean(0)
                expected.append(torch.nn.functional.normalize(vector, dim=0).cpu())
        del model
        _free(device)

        async def run(path: Path = path, prompts: list[list[int]] = prompts) -> list[Any]:
            async with Engine(
                str(path),
                runner="pooling",
                dtype="float32",
                device=device,
                keep_alive=0,
                manager_socket=socket,
            ) as engine:
                found: list[Any] = [None] * len(prompts)

                async def one(j: int) -> None:
                    out = await engine.embed({"prompt_token_ids": prompts[j]})
                    found[j] = torch.tensor(out.outputs.embedding)

                async with anyio.create_task_group() as tg:
                    for j in range(len(prompts)):
                        tg.start_soon(one, j)
                return found

        wait_for_no_workers(socket)
        ours = anyio.run(run)
        worst = max((a - b).abs().max().item() for a, b in zip(ours, expected, strict=True))
        ok &= worst < EMBED_TOLERANCE
        results.append(f"{name}: worst difference {worst:.1e} (< {EMBED_TOLERANCE:g})")
    return ok, "; ".join(results)


def check_lora_kernel(device: str, shapes: Shapes) -> tuple[bool | None, str]:
    """The Triton LoRA kernel on the base model's projections, 256 tokens of four adapters
    and none, against float64."""
    import torch

    from loomllm.workers.kernels.lora import add_lora

    gen = torch.Generator().manual_seed(0)
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for dtype in worst:
        for k_in, n_out in shapes.lora_kernel:
            for rank in (16, 64):
                tokens, adapters = 256, 4
                x = torch.randn(tokens, k_in, generator=gen)
                a = torch.randn(adapters, rank, k_in, generator=gen) / k_in**0.5
                b = torch.randn(adapters, n_out, rank, generator=gen) / rank**0.5
                slots = torch.randint(-1, adapters, (tokens,), generator=gen, dtype=torch.int32)
                y = torch.randn(tokens, n_out, generator=gen)
                x, a, b, y = (t.to(dtype) for t in (x, a, b, y))
                expected = y.double().clone()
                for s in range(adapters):
                    rows = slots == s
                    expected[rows] += (x[rows].double() @ a[s].double().T) @ b[s].double().T
                out = y.to(device)
                add_lora(out, x.to(device), a.to(device), b.to(device), slots.to(device))
                error = (out.cpu().double() - expected).abs().max() / expected.abs().max()
                worst[dtype] = max(worst[dtype], error.item())
    ok = worst[torch.float32] < 1e-5 and worst[torch.bfloat16] < 3e-2
    return ok, (
        f"{len(shapes.lora_kernel)} shapes x ranks 16, 64: worst relative error fp32 "
        f"{worst[torch.float32]:.1e} (< 1e-5), bf16 {worst[torch.bfloat16]:.1e} (< 3e-2)"
    )


def model_checks(
    device: str, work: Path, socket: Path, shapes: Shapes = FULL
) -> list[tuple[str, str, Check]]:
    """The checks of this module as gpu-check runs them: (name, title, check); their engines
    start from the manager at `socket`, one after another."""
    base_path = work / "llama-8b-layers"
    shared: dict[str, Any] = {}

    def base() -> tuple[str, Any]:
        """The llama base model (Llama-3-8B's layers at full shapes), built once."""
        if "model" not in shared:
            shared["model"] = _random_model(shapes, "LlamaConfig", shapes.llama, base_path, device)
        return str(base_path), shared["model"]

    def lora() -> tuple[bool | None, str]:
        path, model = base()
        return check_lora(device, work, shapes, socket, path, model)

    def speculation() -> tuple[bool | None, str]:
        path, model = base()
        prompts = shapes.prompts(11, shapes.prompt_lengths[::2])
        expected = _greedy_with_scores(model, prompts)
        shared.pop("model")
        del model
        _free(device)
        return check_speculation(device, socket, path, expected, prompts)

    return [
        (
            "architectures",
            "architectures: experts, latent attention, sinks, softcap",
            lambda: check_architectures(device, work, shapes, socket),
        ),
        ("pooling", "pooling: embeddings", lambda: check_pooling(device, work, shapes, socket)),
        ("lora-kernel", "the Triton LoRA kernel", lambda: check_lora_kernel(device, shapes)),
        ("lora", "LoRA adapters in one batch", lora),
        ("speculation", "speculative decoding", speculation),
    ]
