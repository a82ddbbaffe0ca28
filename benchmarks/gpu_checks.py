"""GPU correctness checks: what `make test` checks on the CPU at small shapes, at full ones.

Kernels, CUDA graphs and engines against references, then the models and features of
gpu_model_checks.py; exits 1 on a FAIL. Run: `loom bench gpu-check`.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loomllm.benchmarks import run_manager, wait_for_no_workers
from loomllm.benchmarks.attention_reference import TOLERANCE, mixed_errors
from loomllm.benchmarks.gpu_bench import SHAPES, write_model_dir
from loomllm.benchmarks.gpu_model_checks import model_checks
from loomllm.benchmarks.gpu_model_shapes import FULL, TINY

PROG = "loom bench gpu-check"


def check_kernels(device: str, num_batches: int, longest: int) -> tuple[bool | None, str]:
    """Random full-shape batches through both kernels; the worst error per dtype."""
    import torch

    rng = random.Random(0)
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    # One set of split counters for every batch, as a step's layers and a graph's replays
    # share one: each launch must leave them zero for the next.
    counts = torch.zeros(12 * 64, dtype=torch.int32, device=device)
    for seed in range(num_batches):
        group = rng.choice([1, 4, 8])
        requests = []
        for _ in range(rng.randint(1, 12)):
            seq_len = rng.choice([1, rng.randint(1, longest // 8), rng.randint(1, longest)])
            requests.append((seq_len, rng.choice([1, 1, 1, rng.randint(1, min(seq_len, 512))])))
        # Every other batch with Gemma 2's softcap and gpt-oss's sinks (one per query head).
        extras = seed % 2 == 0
        for dtype in worst:
            num_heads = group * rng.choice([2, 4, 8])
            sinks = torch.randn(num_heads, device=device) * 2 if extras else None
            errors = mixed_errors(
                requests,
                num_heads=num_heads,
                group=group,
                head_dim=rng.choice([64, 128]),
                block_size=rng.choice([16, 32]),
                dtype=dtype,
                window=rng.choice([None, None, 256]),
                seed=seed,
                device=device,
                one_kernel=seed % 2 == 1,  # every other batch as a mixed-step graph runs it
                num_splits=1 if seed % 3 == 0 else None,  # the decodes' output, unmerged
                split_counts=counts,
                softcap=rng.choice([20.0, 50.0]) if extras else None,
                sinks=sinks,
            )
            worst[dtype] = max(worst[dtype], *(err for *_, err in errors))
    zeroed = not counts.any().item()
    ok = zeroed and all(worst[dtype] < TOLERANCE[dtype] for dtype in worst)
    return ok, (
        f"{num_batches} random batches (half with a softcap and sinks): worst relative error fp32 "
        f"{worst[torch.float32]:.2e} (< 1e-4), bf16 {worst[torch.bfloat16]:.2e} "
        f"(< 1e-2); the decodes' split counters left zero: {zeroed}"
    )


def check_graphs(model: str, device: str, vocab: int) -> tuple[bool | None, str]:
    """The same schedule through a runner with captured graphs (decode-only and mixed
    steps) and one padding eagerly."""
    import torch

    if not device.startswith("cuda"):
        return None, "needs CUDA"

    from loomllm.core.request import Request
    from loomllm.core.scheduler import Scheduler, SchedulerConfig
    from loomllm.protocols.sampling import SamplingParams
    from loomllm.workers.models.fused_layers import install_fused_ops
    from loomllm.workers.models.loader import load_model
    from loomllm.workers.runner.model_runner import ModelRunner

    loaded = load_model(model, dtype="bfloat16", device=device, load_format="dummy")
    runs = []
    for capture in (True, False):
        runner = ModelRunner(
            loaded.model,
            loaded.config,
            device=torch.device(device),
            dtype=torch.bfloat16,
            block_size=16,
            num_blocks=1024,
            attention_backend="triton",
        )
        install_fused_ops(loaded.model)  # as a worker runs it
        runner.enable_graphs(max_num_seqs=64, max_model_len=4096, capture=capture)
        graphs = (runner.decode_graphs, runner.mixed_graphs)
        if any(g is None or g.captured != capture for g in graphs):
            return False, "the capture failed (see the log above)"
        runner.start_idle_probe()  # it counts the steps that replayed a graph
        scheduler = Scheduler(SchedulerConfig(64, 512, 4096, 16, 1024))
        rng = random.Random(1)
        for i in range(40):  # decode batches from 40 down to 1 as they finish
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 300))]
            params = SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True)
            scheduler.add_request(Request(f"r{i}", prompt, params, frozenset(), 4096, 0.0))
        outputs: list[tuple] = []
        for call_id in range(1000):
            if not scheduler.has_unfinished_requests():
                break
            so = scheduler.schedule()
            result = runner.execute(so, call_id)
            outputs.append((result.req_ids, result.sampled_token_ids, result.logprobs))
            scheduler.update_from_output(so, result)
        runs.append(outputs)
        if capture:
            device_time = runner.stop_idle_probe()
            # Every replay's decode attention must leave its split counters zero.
            zeroed = not runner.decode_graphs.split_counts.any().item()
        del runner
        torch.cuda.empty_cache()
    same = runs[0] == runs[1]
    steps = len(runs[0])
    replayed = device_time.steps - device_time.eager_steps
    return same and zeroed, (
        f"{steps} steps ({replayed} replayed decode or mixed-step "
        f"graphs), captured vs padded eager: "
        f"{'identical' if same else 'DIFFER'}; the decode graphs' split "
        f"counters left zero: {zeroed}"
    )


def check_fused(model: str, device: str, vocab: int, longest: int) -> tuple[bool | None, str]:
    """fused_ops against transformers' own ops in bf16: the rotary embedding bit for bit;
    RMSNorm (alone, and after the residual add) within a unit in the last place (its float32
    sum runs in another order), and SiLU times up (Triton's exp on a GPU is the approximate
    one); and the model's logits against the same weights in float32: no further off with
    fused_layers installed (the kernels and packed projections), or in loomllm's own model
    with the kernels (what a worker runs), than with transformers' ops. `longest`: the
    decode contexts' cap."""
    import copy

    import torch
    import transformers
    from transformers.models.llama import modeling_llama

    from loomllm.workers.kernels import fused_ops
    from loomllm.workers.models.fused_layers import install_fused_ops
    from loomllm.workers.models.llama import config as llama_config
    from loomllm.workers.models.llama import weights as llama_weights
    from loomllm.workers.models.llama.model import Linear

    def ulps(out: Any, ref: Any) -> tuple[float, float]:
        """(most units in bf16's last place between them, share of elements that differ);
        an element far smaller than the others (a near-cancellation) counts in units of
        a typical element's size/16."""
        out, ref = (torch.cat([t.flatten().float() for t in ts]) for ts in (out, ref))
        diff, size = (out - ref).abs(), ref.abs()
        units = diff / size.clamp_min(size.mean() / 16) * 2**7
        return units.max().item(), (diff > 0).float().mean().item()

    # Fewer tokens on the CPU: Triton's interpreter runs one program at a time.
    tokens = 512 if device.startswith("cuda") else 16
    torch.manual_seed(4)
    config = transformers.AutoConfig.from_pretrained(model)
    hidden, heads = config.hidden_size, config.num_attention_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = config.num_key_value_heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).bfloat16()

    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    norm = modeling_llama.LlamaRMSNorm(hidden, eps=1e-6).to(device).bfloat16()
    norm.weight.data.normal_()
    norm_ulps, norm_share = ulps([fused_ops.rms_norm(x, norm.weight, 1e-6)], [norm(x)])
    add_ulps, add_share = ulps(
        fused_ops.add_rms_norm(x, residual, norm.weight, 1e-6), [norm(residual + x), residual + x]
    )
    gate_up = randn(tokens, 2 * config.intermediate_size) * 4
    gate, up = gate_up.chunk(2, -1)
    silu_ulps, silu_share = ulps(
        [fused_ops.silu_mul(gate_up)], [torch.nn.functional.silu(gate) * up]
    )
    q = randn(1, tokens, heads, dim).transpose(1, 2)
    k = randn(1, tokens, kv_heads, dim).transpose(1, 2)
    rope = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    cos, sin = rope(q, torch.arange(tokens, device=device)[None] * 7)
    # transformers' own function, should an earlier check have swapped the kernel in.
    reference = getattr(
        modeling_llama.apply_rotary_pos_emb, "__wrapped__", modeling_llama.apply_rotary_pos_emb
    )
    rope_ulps, rope_share = ulps(fused_ops.rotary(q, k, cos, sin), reference(q, k, cos, sin))
    into_cache_same = _rotary_into_cache_is_the_pair(randn, cos[0], sin[0], heads, kv_heads, dim)
    rotating_same = _rotating_decode_is_the_pair(randn, heads, kv_heads, dim, longest)
    gated_same = _gated_is_the_pair(randn, config.intermediate_size, hidden)
    skinny = _skinny_error_ratio(
        randn,
        {
            "q|k|v": (heads * dim + 2 * kv_heads * dim, hidden),
            "o": (hidden, heads * dim),
            "gate|up": (2 * config.intermediate_size, hidden),
            "down": (hidden, config.intermediate_size),
            "lm_head": (config.vocab_size, hidden),
        },
    )
    with torch.device(device):
        exact = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    half = copy.deepcopy(exact).bfloat16()
    ids = torch.randint(3, vocab, (4, tokens // 2), device=device)
    few = ids[:, :2]  # 8 rows: what loomllm.workers.kernels.skinny_matmul takes

    def error(ids: Any = ids) -> float:
        # No transformers cache: the fused layers hand a cached forward to transformers'.
        out = half.eval()(ids, use_cache=False).logits.float()
        reference = references[ids.shape[1]]
        return ((out - reference).norm() / reference.norm()).item()

    with torch.no_grad():
        references = {
            x.shape[1]: exact.eval()(x, use_cache=False).logits.float() for x in (ids, few)
        }
        stock, stock_few = error(), error(few)
        fused_model = install_fused_ops(half)
        fused = error()
        del half  # room for loomllm's own model, built from the same weights
        shape, why_not = llama_config.read_shape(Path(model) / "config.json")
        if shape is None:
            return False, f"loomllm.workers.models.llama.model does not run {model}: {why_not}"
        half = llama_weights.build(
            shape, torch.bfloat16, torch.device(device), Path(model), "dummy"
        )
        llama_weights.copy_weights(half, exact.state_dict().items())
        own_fused = install_fused_ops(half)
        own = error()
        for module in half.modules():  # every matmul of a few rows through the kernel
            if isinstance(module, Linear):
                module.skinny = True
        own_few = error(few)
    if not all(fused_model):
        return False, f"not all fused in {type(exact).__name__}: {fused_model}"
    ok = (
        norm_ulps <= 1
        and add_ulps <= 1
        and rope_share == 0
        and silu_ulps <= 1
        and into_cache_same
        and rotating_same
        and skinny <= 1.5
        and gated_same
        and fused <= 1.5 * stock
        and all(own_fused)
        and own <= 1.5 * stock
        and own_few <= 1.5 * stock_few
    )
    return ok, (
        f"RMSNorm within {norm_ulps:.2f} units in the last place ({norm_share:.2%} of "
        f"elements differ), add + RMSNorm {add_ulps:.2f} ({add_share:.2%}), rotary "
        f"{rope_ulps:.2f} ({rope_share:.2%}), rotary into the KV cache against rotary "
        f"then write_kv: {'identical' if into_cache_same else 'DIFFER'}, the decode "
        f"kernel rotating q and writing K/V itself against it then the decode: "
        f"{'identical' if rotating_same else 'DIFFER'}, the skinny "
        f"matmul's error against float64 at most x{skinny:.2f} cuBLAS's, with SiLU * "
        f"up in its epilogue against it then silu_mul: "
        f"{'identical' if gated_same else 'DIFFER'}, "
        f"SiLU * up {silu_ulps:.2f} "
        f"({silu_share:.2%}); {fused_model.layers} layers packed; bf16 logits against "
        f"float32: relative error {fused:.2e} fused, {stock:.2e} with transformers' "
        f"ops, {own:.2e} in loomllm.workers.models.llama.model's model with the kernels "
        f"({own_fused.layers} layers); at 8 rows {own_few:.2e} in it with every matmul "
        f"through the skinny kernel, {stock_few:.2e} with transformers' ops"
    )


def _skinny_error_ratio(randn: Any, shapes: dict[str, tuple[int, int]]) -> float:
    """The largest ratio, over these weight shapes ([out, in], with a bias) at 1 and
    MAX_ROWS rows, of skinny_matmul's relative error against a float64 matmul to F.linear's
    (cuBLAS's)."""
    import torch

    from loomllm.workers.kernels.skinny_matmul import MAX_ROWS, skinny_linear

    worst = 0.0
    for out_features, in_features in shapes.values():
        weight, bias = randn(out_features, in_features), randn(out_features)
        for rows in (1, MAX_ROWS):
            x = randn(rows, in_features)
            ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
            errors = [
                ((out.double() - ref).norm() / ref.norm()).item()
                for out in (
                    skinny_linear(x, weight, bias),
                    torch.nn.functional.linear(x, weight, bias),
                )
            ]
            worst = max(worst, errors[0] / max(errors[1], 1e-12))
            del ref
    return worst


def _gated_is_the_pair(randn: Any, inter: int, hidden: int) -> bool:
    """Whether skinny_matmul's gate|up kernel with SiLU * up in its epilogue gives the bits
    of the plain kernel then fused_ops.silu_mul, at 1 and MAX_ROWS rows."""
    import torch

    from loomllm.workers.kernels.fused_ops import silu_mul
    from loomllm.workers.kernels.skinny_matmul import MAX_ROWS, skinny_linear, skinny_silu_linear

    weight = randn(2 * inter, hidden) * hidden**-0.5  # gate values around 1: SiLU's bend
    xs = [randn(rows, hidden) for rows in (1, MAX_ROWS)]
    return all(
        torch.equal(skinny_silu_linear(x, weight), silu_mul(skinny_linear(x, weight))) for x in xs
    )


def _rotating_decode_is_the_pair(
    randn: Any, heads: int, kv_heads: int, dim: int, longest: int
) -> bool:
    """Whether the decode kernel given q and the new K/V unrotated (it rotates them and
    writes K and V into their slots) leaves the output and both caches as
    fused_ops.rotary_into_cache then the decode kernel do: 8 requests of 1 to 2,047 tokens
    (none past `longest`)."""
    import torch

    from loomllm.workers.attention import triton_kernels as triton_attention
    from loomllm.workers.kernels import fused_ops

    lens = [min(n, longest) for n in (1, 17, 300, 1000, 2047, 64, 5, 129)]
    bs, device = 16, randn(1).device
    pages = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(pages) + 2).tolist()
    tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(lens))]
    width = max(pages)
    block_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )
    caches = [randn((sum(pages) + 2) * bs, kv_heads, dim) for _ in range(2)]
    qkv = randn(len(lens), (heads + 2 * kv_heads) * dim)
    q, k, v = (
        t.view(len(lens), -1, dim)
        for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    )
    pos = torch.tensor(lens, device=device) - 1
    angles = pos[:, None] * 500000.0 ** (-torch.arange(0, dim, 2, device=device) / dim)
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    slots = torch.tensor(
        [t[p // bs] * bs + p % bs for t, p in zip(tables, pos.tolist(), strict=True)], device=device
    )
    args = (
        block_tables,
        torch.tensor(lens, dtype=torch.int32, device=device),
        max(lens),
        bs,
        dim**-0.5,
    )
    pair = [c.clone() for c in caches]
    q_rot = fused_ops.rotary_into_cache(q, k, v, cos, sin, *pair, slots)
    expected = triton_attention.decode_attention(q_rot, *pair, *args)
    out = triton_attention.decode_attention(q, *caches, *args, new_kv=(k, v, cos, sin, slots))
    return torch.equal(out, expected) and all(
        torch.equal(c, p) for c, p in zip(caches, pair, strict=True)
    )


def _rotary_into_cache_is_the_pair(
    randn: Any, cos: Any, sin: Any, heads: int, kv_heads: int, dim: int
) -> bool:
    """Whether fused_ops.rotary_into_cache leaves q and a large cache (slots near its end
    too) exactly as the rotary kernel then triton_attention.write_kv do, on q, k, v views of
    one packed projection as loomllm's model makes them."""
    import torch

    from loomllm.workers.attention import triton_kernels as triton_attention
    from loomllm.workers.kernels import fused_ops

    tokens = cos.shape[0]
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
    q, k, v = (
        t.view(tokens, -1, dim)
        for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    )
    num_slots = 2**16 if qkv.is_cuda else 2 * tokens
    slots = torch.randperm(num_slots, device=qkv.device)[:tokens]
    slots[-1] = num_slots - 1
    caches = [randn(num_slots, kv_heads, dim) for _ in range(2)]
    caches += [c.clone() for c in caches]
    out_q = fused_ops.rotary_into_cache(q, k, v, cos, sin, caches[0], caches[1], slots)
    ref_q, ref_k = fused_ops.rotary(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    triton_attention.write_kv(ref_k[0].transpose(0, 1), v, caches[2], caches[3], slots)
    return (
        torch.equal(out_q, ref_q[0].transpose(0, 1))
        and torch.equal(caches[0], caches[2])
        and torch.equal(caches[1], caches[3])
    )


def check_engines(
    model: str, device: str, vocab: int, num_requests: int, socket: Path
) -> tuple[bool | None, str]:
    """Greedy tokens of engines with async scheduling and graphs on and off, float32; their
    workers forked from one manager's zygote."""
    import anyio

    from loomllm import Engine, SamplingParams

    rng = random.Random(2)
    work = [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(4, 400))], rng.randint(8, 96))
        for _ in range(num_requests)
    ]

    # float32: random weights have near-ties that bf16 rounding would flip between engines.
    async def run(**options: Any) -> list[list[int]]:
        async with Engine(
            model,
            load_format="dummy",
            dtype="float32",
            device=device,
            keep_alive=0,
            manager_socket=socket,
            **options,
        ) as engine:
            tokens: list[list[int]] = [[] for _ in work]

            async def one(i: int) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=work[i][1], ignore_eos=True)
                async for out in engine.generate({"prompt_token_ids": work[i][0]}, params):
                    tokens[i] = out.outputs[0].token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(work)):
                    tg.start_soon(one, i)
            return tokens

    variants = {
        "async on, graphs": dict(async_scheduling=True),
        "async off, graphs": dict(async_scheduling=False),
        "async on, eager": dict(async_scheduling=True, enforce_eager=True),
        "async off, eager": dict(async_scheduling=False, enforce_eager=True),
    }
    results = {}
    for name, options in variants.items():
        wait_for_no_workers(socket)  # the last engine's worker gone, its memory freed
        results[name] = anyio.run(lambda o=options: run(**o))
    reference = results["async off, eager"]
    differ = [name for name, tokens in results.items() if tokens != reference]
    return not differ, (
        f"{num_requests} requests, {len(variants)} engines: "
        + (
            f"{', '.join(differ)} differ from async off, eager"
            if differ
            else "identical greedy tokens"
        )
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen-0.5b")
    p.add_argument("--kernel-batches", type=int, default=24)
    p.add_argument("--longest", type=int, default=4096, help="longest context in the kernels")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument(
        "--skip",
        type=lambda text: text.split(","),
        default=[],
        help="comma-separated checks to leave out: kernels, fused, graphs, engines, "
        "architectures, pooling, lora-kernel, lora, speculation",
    )
    args = p.parse_args(argv)
    import torch

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{PROG} on {name}, model shape {args.shape}")
    failed = False
    # One manager for every engine: each waits for the last one's worker to be gone.
    with tempfile.TemporaryDirectory(prefix="loom-gpu-check-") as tmp, run_manager() as socket:
        model = write_model_dir(args.shape, Path(tmp))
        vocab = SHAPES[args.shape]["vocab_size"]
        checks = [
            (
                "kernels",
                "Triton kernels",
                lambda: check_kernels(args.device, args.kernel_batches, args.longest),
            ),
            (
                "fused",
                "fused kernels",
                lambda: check_fused(model, args.device, vocab, args.longest),
            ),
            ("graphs", "decode CUDA graphs", lambda: check_graphs(model, args.device, vocab)),
            (
                "engines",
                "engines, async scheduling and graphs on/off",
                lambda: check_engines(model, args.device, vocab, args.requests, socket),
            ),
            # The models at their layers' shapes, or at a CPU's with --shape tiny.
            *model_checks(args.device, Path(tmp), socket, TINY if args.shape == "tiny" else FULL),
        ]
        names = [name for name, *_ in checks]
        if unknown := sorted(set(args.skip) - set(names)):
            p.error(f"unknown checks {unknown} in --skip; the checks: {','.join(names)}")
        for name, title, check in checks:
            if name in args.skip:
                continue
            started = time.monotonic()
            try:
                ok, detail = check()
            except Exception as exc:  # a crash is a failed check; the others still run
                while isinstance(exc, ExceptionGroup):  # a task group's: its first error
                    exc = exc.exceptions[0]
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            failed |= ok is False
            word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
            print(f"{word}  {title}: {detail} ({time.monotonic() - started:.0f} s)", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
