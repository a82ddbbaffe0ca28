"""What a worker process holds: its rank, the loaded model, and the attached engine's state.

`Worker` is the object that `Engine.collective_rpc(fn)` hands to `fn` on every rank.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loomllm.protocols.messages import ModelInfo, Pooling
from loomllm.protocols.worker_options import WorkerOptions
from loomllm.workers.device.cpu_threads import CpuThreadGovernor, adaptive_threads_enabled

if TYPE_CHECKING:  # for types only: both import torch, which this module leaves to the load
    from loomllm.workers.models.loader import LoadedModel
    from loomllm.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    """One rank's model, runner and per-engine session (what collective_rpc's `fn` gets)."""

    rank: int
    world_size: int
    device: str
    loaded: LoadedModel
    runner: ModelRunner
    model_info: ModelInfo
    loaded_at: float  # time.time() when the weights finished loading
    seed: int  # the engines' `seed`: each one's draws start from it
    # Per-engine state (requests, their KV blocks, user RPC scratch): dropped whenever
    # the attached engine goes away, so the next engine starts clean.
    session: dict[str, object] = field(default_factory=dict)
    # A CPU worker's OpenMP team, sized step by step to the cores it gets (None elsewhere).
    cpu_threads: CpuThreadGovernor | None = None

    @classmethod
    def start(
        cls,
        model: str,
        options: WorkerOptions,
        rank: int,
        world_size: int,
        dist_init_method: str,
    ) -> Worker:
        """Load the model (its shard, joining the torch.distributed group at
        `dist_init_method`, a file:// or tcp:// URL, when world_size > 1) and size the KV
        cache."""
        import torch

        from loomllm.workers.models.loader import load_model
        from loomllm.workers.models.sources import ModelLoadError

        device: str = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        local_rank = rank
        if device == "cuda":
            local_rank = cuda_device_index(options, rank, world_size, torch.cuda.device_count())
            torch.cuda.set_device(local_rank)
        else:
            _share_cores(options.data_parallel_size)
        started = time.monotonic()
        torch.manual_seed(options.seed)  # unseeded requests draw from this RNG
        if world_size > 1:
            # Before the load: transformers shards the weights over this group (tp_plan).
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size)
            )
            torch.distributed.init_process_group(
                backend="nccl" if device == "cuda" else "gloo",
                init_method=dist_init_method,
                rank=rank,
                world_size=world_size,
            )
        loaded = load_model(
            model,
            dtype=options.dtype,
            device=device,
            weight_dtype=options.weight_dtype,
            load_format=options.load_format,
            tensor_parallel_size=world_size,
            model_impl=options.model_impl,
            quantization=options.quantization,
            cpu_linear_kernel=options.cpu_linear_kernel,
            batch_invariant=options.batch_invariant,
            revision=options.revision,
        )
        pooling = None
        if options.runner == "pooling":
            from loomllm.workers.models.pooling import read_classifier, read_pooling

            text = getattr(loaded.config, "get_text_config", lambda: loaded.config)()
            if getattr(loaded.model, "is_classifier", False):
                pooling = read_classifier(loaded.model_dir, text)
            else:
                pooling = read_pooling(loaded.model_dir, text, loaded.encoder)
        elif loaded.encoder:
            raise ModelLoadError(
                f"{model} is an encoder ({type(loaded.model).__name__}): it embeds, it does "
                "not generate; serve it with runner='pooling'"
            )
        runner = _make_runner(loaded, options, pooling)
        info = ModelInfo(
            model=model,
            model_dir=str(loaded.model_dir),
            vocab_size=loaded.vocab_size,
            max_model_len=loaded.max_model_len,
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            dtype=loaded.dtype,
            device=loaded.device,
            load_seconds=time.monotonic() - started,
            num_kv_blocks=runner.num_blocks,
            block_size=runner.block_size,
            pooling=pooling,
            weights_path=loaded.source.path if loaded.source.kind == "gguf" else "",
        )
        logger.info(
            "loaded %s on %s in %.1fs; KV cache: %d blocks of %d tokens",
            model,
            device,
            info.load_seconds,
            runner.num_blocks,
            runner.block_size,
        )
        # The model, its runner and the imports live as long as the worker, so they are kept
        # out of gc's full collections, which would otherwise stall a step now and then.
        # Collected first, so that the loading's garbage cycles are not frozen with them.
        gc.collect()
        gc.freeze()
        worker = cls(rank, world_size, device, loaded, runner, info, time.time(), options.seed)
        if device == "cpu" and adaptive_threads_enabled():
            # After the load: its kernel choices were measured with the whole team.
            worker.cpu_threads = CpuThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
        worker.reseed()
        return worker

    def reset_session(self) -> None:
        """Drop the attached engine's state, so the next engine starts clean."""
        self.session.clear()
        self.runner.reset()
        self.reseed()

    def reseed(self) -> None:
        """Unseeded requests draw from torch's RNG: with a `seed`, every engine that
        attaches finds it as a new worker would (vLLM seeds once per engine), not where the
        last engine, or the load's random weights, left it."""
        import torch

        torch.manual_seed(self.seed)

    def shutdown(self) -> None:
        """Leave the torch.distributed group, if this rank joined one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def cuda_device_index(options: WorkerOptions, rank: int, world_size: int, device_count: int) -> int:
    """This rank's GPU: data-parallel replica r's ranks take the GPUs after those of
    replicas 0..r-1, one each (each sizes its KV cache as if the GPU were its own). A Ray
    rank sees only the GPU of its bundle: index 0."""
    if options.distributed_executor_backend == "ray":
        return 0
    num_replicas = options.data_parallel_size
    needed = num_replicas * world_size
    if needed > device_count:
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size = {num_replicas} x {world_size} ranks "
            f"need {needed} GPUs, one each; this machine has {device_count}"
        )
    return options.data_parallel_rank * world_size + rank


def _share_cores(num_replicas: int) -> None:
    """Give each data-parallel replica its share of the CPU cores: every replica at torch's
    default (all cores) oversubscribes them, and OpenMP's spinning threads then starve one
    replica of another.
    Tensor-parallel ranks keep the default: they run in lockstep, and their greedy tokens
    stay those of one rank."""
    if num_replicas > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // num_replicas))


def _make_runner(
    loaded: LoadedModel, options: WorkerOptions, pooling: Pooling | None = None
) -> ModelRunner:
    """Size the paged KV cache from the options and build the model runner (a pooling one
    where `pooling` is set)."""
    import torch

    from loomllm.workers.runner.kv_sizing import kv_cache_budget, largest_step_tokens
    from loomllm.workers.runner.model_runner import ModelRunner
    from loomllm.workers.sample.structured_output import GrammarCompiler

    block_size = options.block_size
    dtype = getattr(torch, loaded.dtype)  # the model's: weight_dtype leaves it as it is
    device = torch.device(loaded.device)
    backend = _attention_backend(options.attention_backend, device)
    # CUDA graphs and fused kernels: one rank only (HF's tensor-parallel collectives inside
    # a capture, and DTensor weights in the kernels, are untried), and not under
    # enforce_eager, which runs the model's plain torch ops eagerly (for debugging).
    fast_path = (
        device.type == "cuda"
        and backend == "triton"
        and loaded.tp_size == 1
        and not options.enforce_eager
    )
    if fast_path:
        from loomllm.workers.models.fused_layers import install_fused_ops

        install_fused_ops(loaded.model)  # before the profiling pass: the model as it runs
    elif device.type == "cpu" and backend == "torch" and not options.enforce_eager:
        from loomllm.workers.models.cpu_kernels import install_cpu_kernels

        install_cpu_kernels(loaded.model, dtype)

    lora = None
    if options.max_loras:
        from loomllm.workers.runner.lora import LoRAManager

        # Its layers wrap the model's linears: once, before any runner is made.
        lora = LoRAManager(loaded.model, options.max_loras, options.max_lora_rank)

    def make_runner(num_blocks: int) -> ModelRunner:
        return ModelRunner(
            loaded.model,
            loaded.config,
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            attention_backend=backend,
            tp_size=loaded.tp_size,
            pooling=pooling,
            lora=lora,
        )

    per_block = ModelRunner.bytes_per_block(loaded.config, block_size, dtype, loaded.tp_size)
    budget = kv_cache_budget(loaded, options, block_size, per_block, make_runner)
    # With the Triton backend the runner allocates one block more than this, scratch for
    # decode graphs (workers/runner/cuda_graphs.py): the budget's bytes plus one block at most.
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        where = (
            "kv_cache_memory"
            if options.kv_cache_memory is not None
            else (
                "the default KV cache budget (on CUDA: gpu_memory_utilization of the GPU, less "
                "what is in use and a step's activations)"
            )
        )
        raise ValueError(f"{where}, {budget:.0f} bytes, holds no KV block ({per_block} bytes each)")
    runner = make_runner(num_blocks)
    runner.grammars = GrammarCompiler(str(loaded.model_dir), loaded.vocab_size)
    if fast_path and pooling is None:  # a pooling step is prompts only: no decode graphs
        runner.enable_graphs(
            options.max_num_seqs,
            loaded.max_model_len,
            capture=True,
            max_step_tokens=largest_step_tokens(options, loaded.max_model_len),
        )
    return runner


def _attention_backend(asked: str, device: Any) -> str:
    """ "auto": Triton's kernels on CUDA, the torch reference on the CPU (faster there)."""
    if asked == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if asked == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' needs a CUDA device (on the CPU only "
            "Triton's interpreter runs it, with TRITON_INTERPRET=1: for tests)"
        )
    return asked
