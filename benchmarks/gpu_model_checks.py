"""GPU checks beyond the llama path, at the released models' layer shapes: experts, latent
attention, sinks and softcap end to end, pooling, LoRA and speculative decoding, each against
transformers or float64. Part of `loom bench gpu-check`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomllm.benchmarks import save_word_tokenizer, wait_for_no_workers
from loomllm.benchmarks.gpu_model_runs import (
    compare,
    engine_tokens,
    free,
    greedy_with_scores,
    random_model,
)
from loomllm.benchmarks.gpu_model_shapes import FULL, Shapes

Check = Callable[[], tuple[bool | None, str]]

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EMBED_TOLERANCE = 1e-4


def check_architectures(
    device: str, work: Path, shapes: Shapes, socket: Path
) -> tuple[bool | None, str]:
    """Each architecture's greedy tokens through an Engine (decode graphs on) against
    transformers' eager attention, float32, prompts of every length at once."""
    results, ok = [], True
    for seed, (name, (config_name, fields)) in enumerate(shapes.archs.items()):
        path = work / f"arch-{seed}"
        reference = random_model(shapes, config_name, fields, path, device)
        prompts = shapes.prompts(seed, shapes.prompt_lengths)
        expected = greedy_with_scores(reference, prompts)
        del reference
        free(device)
        tokens, _, graphs = engine_tokens(str(path), device, socket, prompts)
        passed, words = compare(tokens, expected)
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
        return greedy_with_scores(model, prompts)
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
    tokens, _, graphs = engine_tokens(
        base,
        device,
        socket,
        [prompt] * len(loras) * 2,  # each twice: its prefix cached within its adapter only
        loras * 2,
        enable_lora=True,
        max_loras=len(ranks),
        max_lora_rank=max(ranks),
    )
    ok, words = compare(tokens, expected * 2)
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
        try:
            tokens, stats, graphs = engine_tokens(
                base, device, socket, prompts, speculative_config=spec
            )
        except Exception as exc:  # one method's failure; the other still runs
            while isinstance(exc, ExceptionGroup):
                exc = exc.exceptions[0]
            ok = False
            results.append(f"{name}: FAILED, {type(exc).__name__}: {exc}")
            continue
        passed, words = compare(tokens, expected)
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
        free(device)

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
            shared["model"] = random_model(shapes, "LlamaConfig", shapes.llama, base_path, device)
        return str(base_path), shared["model"]

    def lora() -> tuple[bool | None, str]:
        path, model = base()
        return check_lora(device, work, shapes, socket, path, model)

    def speculation() -> tuple[bool | None, str]:
        path, model = base()
        prompts = shapes.prompts(11, shapes.prompt_lengths[::2])
        expected = greedy_with_scores(model, prompts)
        shared.pop("model")
        del model
        free(device)
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
