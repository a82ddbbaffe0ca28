"""The `loom` command line's flags: vLLM's engine options as dashed flags, each command's own,
and the parser that holds them."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from loomllm.config import EngineConfig
from loomllm.protocols import choices


def _alts(values: tuple[str, ...]) -> str:
    """An option's allowed values, as the help shows them."""
    return " | ".join(values)


def _default(name: str) -> Any:
    """EngineConfig's default for the option `name`, for help texts: the flags themselves
    default to None (not given), so that EngineConfig alone decides."""
    return next(field.default for field in fields(EngineConfig) if field.name == name)


def _on_off(name: str) -> str:
    return "on" if _default(name) else "off"


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, for a dict-valued option."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


MANAGER_SOCKET_FLAG = (
    "--manager-socket",
    Path,
    "engine-manager socket (default: the per-user one)",
)
ENGINE_FLAGS: list[tuple[str, Any, str]] = [
    (
        "--runner",
        str,
        f"{_alts(choices.RUNNERS)} (embeddings: /v1/embeddings; default {_default('runner')})",
    ),
    ("--revision", str, "a hub model's branch, tag or commit (default: its default branch)"),
    ("--dtype", str, _alts(choices.DTYPES)),
    (
        "--load-format",
        str,
        f"{_alts(choices.LOAD_FORMATS)} (dummy: random weights from the config, for benchmarks)",
    ),
    (
        "--model-impl",
        str,
        f"{_alts(choices.MODEL_IMPLS)} (auto: loomllm's own Llama-family "
        "model where it runs the checkpoint, else transformers')",
    ),
    (
        "--weight-dtype",
        str,
        f"{_alts(choices.WEIGHT_DTYPES)}: a float32 model's linear weights in 16 bits",
    ),
    (
        "--quantization",
        str,
        f"{_alts(choices.QUANTIZATIONS)}: on the CPU (default: a GGUF file runs "
        "as it is stored; none dequantizes it; int8 | int4 quantize a float checkpoint)",
    ),
    (
        "--cpu-linear-kernel",
        str,
        f"{_alts(choices.CPU_LINEAR_KERNELS)}: the CPU's linear kernel (auto: the fastest "
        "measured for each shape and batch size; a8 quantizes the activations to int8 too)",
    ),
    ("--device", str, _alts(choices.DEVICES)),
    (
        "--attention-backend",
        str,
        f"{_alts(choices.ATTENTION_BACKENDS)} (auto: triton on CUDA, torch on CPU)",
    ),
    ("--max-model-len", int, "longest prompt + output, in tokens"),
    ("--max-num-seqs", int, "most requests in one batch"),
    ("--max-num-batched-tokens", int, "most tokens in one step"),
    ("--kv-cache-memory", int, "KV cache size in bytes"),
    ("--block-size", int, "tokens per KV block"),
    ("--seed", int, "engine seed"),
    (
        "--generation-config",
        str,
        "sampling defaults for fields a request leaves out: auto "
        "(the model's generation_config.json) | vllm (none) | a directory holding one",
    ),
    (
        "--scheduling-policy",
        str,
        "fcfs | priority (a request's priority: lower runs first; "
        f"default {_default('scheduling_policy')})",
    ),
    ("--tensor-parallel-size", int, "ranks each layer's weights and KV heads are split over"),
    ("--data-parallel-size", int, "independent replicas, each request to the least loaded"),
    (
        "--distributed-executor-backend",
        str,
        "local | ray (ranks as actors of a Ray cluster "
        "at $RAY_ADDRESS; pip install 'loomllm[ray]')",
    ),
    ("--keep-alive", float, "seconds the workers stay warm after exit (-1: pinned)"),
    ("--max-loras", int, "with --enable-lora: LoRA adapters in a step at most"),
    ("--max-lora-rank", int, "with --enable-lora: the largest adapter rank"),
    (
        "--speculative-config",
        json_object,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4}',
    ),
    (
        "--gpu-memory-utilization",
        float,
        "CUDA: share of the GPU's memory the worker may "
        f"fill, in (0, 1] (default {_default('gpu_memory_utilization')})",
    ),
    MANAGER_SOCKET_FLAG,
]


# On/off engine options: --NAME and --no-NAME (None when neither: EngineConfig's default).
ENGINE_SWITCHES: list[tuple[str, str]] = [
    (
        "--enable-prefix-caching",
        "reuse the KV blocks of a shared prompt prefix "
        f"(default: {_on_off('enable_prefix_caching')})",
    ),
    (
        "--enable-chunked-prefill",
        "split long prompts over steps, with decodes alongside "
        f"(default: {_on_off('enable_chunked_prefill')})",
    ),
    (
        "--async-scheduling",
        "send step N+1 while step N runs (default: on with CUDA workers; on the CPU, for "
        "steps of one request or of whole outputs only)",
    ),
    ("--enable-lora", "LoRA adapters per request (--lora-modules, or a request's model)"),
    (
        "--batch-invariant",
        "a GGUF on the CPU: one linear kernel at every batch size, so that a request's "
        "tokens do not depend on its batch; slower prompts and batches "
        f"(default: {_on_off('batch_invariant')})",
    ),
    (
        "--enforce-eager",
        f"CUDA: run every step eager, no decode CUDA graphs (default: {_on_off('enforce_eager')})",
    ),
]


# `loom bench NAME`: the module in benchmarks/ that runs it.
BENCHMARKS = {
    "cpu": "loomllm.benchmarks.cpu",
    "accuracy": "loomllm.benchmarks.accuracy",
    "offline": "loomllm.benchmarks.offline_throughput",
    "overhead": "loomllm.benchmarks.engine_overhead",
    "serving": "loomllm.benchmarks.serving",
    "worker-start": "loomllm.benchmarks.worker_start",
    "gpu": "loomllm.benchmarks.gpu_bench",
    "gpu-check": "loomllm.benchmarks.gpu_checks",
    "start": "loomllm.benchmarks.start_times",
    "decode-profile": "loomllm.benchmarks.decode_profile",
    "decode-attention": "loomllm.benchmarks.decode_attention",
    "moe": "loomllm.benchmarks.moe",
    "embed": "loomllm.benchmarks.embed",
    "spec": "loomllm.benchmarks.spec_decode",
    "eager-step": "loomllm.benchmarks.eager_step",
    "cpu-step": "loomllm.benchmarks.cpu_step",
    "cpu-contention": "loomllm.benchmarks.cpu_contention",
    "cpu-prefill-attention": "loomllm.benchmarks.cpu_prefill_attention",
    "broadcast": "loomllm.benchmarks.step_broadcast",
    "compile": "loomllm.benchmarks.kernel_compile",
    "emulated": "loomllm.benchmarks.emulated_device",
    "gpu-session": "loomllm.benchmarks.gpu_session",
    "structured": "loomllm.benchmarks.structured_overhead",
    "models": "loomllm.benchmarks.bench_models",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="loomllm: serve or run a model")
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_args(p: argparse.ArgumentParser) -> None:
        for flag, kind, help_ in ENGINE_FLAGS:
            p.add_argument(flag, type=kind, default=None, help=help_)
        for flag, help_ in ENGINE_SWITCHES:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        p.add_argument(
            "--manager",
            choices=["auto", "private"],
            default=None,
            help="auto: the shared daemon; private: one that dies with us",
        )
        p.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="the models to serve, each MODEL or NAME=MODEL (a path, a GGUF file or a hub "
        "id); the first is the default (default: smollm2, unless --models-file names some)",
    )
    serve.add_argument(
        "--models-file",
        type=Path,
        default=None,
        help="a TOML file of [models.NAME] tables, each with model = ... and its own "
        "engine options, served after the MODEL arguments",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters of the first model (PEFT folders), each served under its NAME: a "
        "request's model picks one (with --enable-lora)",
    )
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    serve.add_argument(
        "--max-loaded-models",
        type=_positive_int,
        default=None,
        help="most models loaded at once: loading another unloads the least recently "
        "used idle one (default: no limit)",
    )
    serve.add_argument(
        "--model-keep-alive",
        type=_keep_alive,
        default=300.0,
        help="seconds a model loaded on demand stays loaded once idle (-1: until evicted; "
        "a request's Ollama keep_alive overrides it); the models named at start stay "
        "loaded until evicted",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="0: any free port")
    # From the environment by default: a key on the command line shows in `ps`.
    serve.add_argument(
        "--api-key",
        default=os.environ.get("LOOM_API_KEY") or None,
        help="require Authorization: Bearer KEY on every route but /health, "
        "/metrics, /version and /openapi.json (default: $LOOM_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the name clients send for the first model"
    )
    serve.add_argument(
        "--restart-on-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start a new engine when a worker dies (else exit 1)",
    )
    serve.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=5,
        help="exit 1 after more worker deaths than this within 10 minutes",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=10.0,
        help="seconds in-flight requests get on SIGTERM before they are aborted",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): calls are read out '
        "of the model's text with --tool-call-parser",
    )
    # The choices mirror loomllm.server.parsers.tool_parsers.PARSERS; importing that here
    # would load starlette.
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="the model family's tool-call syntax (hermes: Qwen2.5, Qwen3, Hermes)",
    )
    # The choices mirror loomllm.server.parsers.reasoning.PARSERS.
    serve.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        default=None,
        help="split a thinking model's <think>...</think> out of chat answers "
        "into the message's reasoning",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a chat body's chat_template be a template's text (code that "
        "runs here), not only the name of one of the model's templates",
    )
    serve.add_argument(
        "--max-request-body",
        type=_positive_int,
        default=None,
        help="largest request body in bytes (default 8 MiB; larger: 413)",
    )
    engine_args(serve)

    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("model")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    engine_args(gen)

    chat = sub.add_parser("chat", help="chat with a model in the terminal, streaming")
    chat.add_argument("model", nargs="?", default="smollm2")
    chat.add_argument("--system", default=None, metavar="PROMPT", help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--sampling-seed", type=int, default=None)
    engine_args(chat)

    pull = sub.add_parser(
        "pull", help="download a model from the Hugging Face Hub, where the workers load it"
    )
    pull.add_argument("model", help="a hub id, org/name")
    pull.add_argument("--revision", default=None, help="a branch, tag or commit")
    models = sub.add_parser("models", help="list the models the engine-manager keeps warm")
    for command in (pull, models):  # they talk to the daemon alone: no engine flags
        flag, kind, help_ = MANAGER_SOCKET_FLAG
        command.add_argument(flag, type=kind, default=None, help=help_)
        command.set_defaults(loop="asyncio")

    bench = sub.add_parser(
        "bench",
        help="run a benchmark: loomllm and its peers in one run, a table of ratios",
        description="Benchmarks in one run, same prompts for every engine. Flags after the "
        "name go to the benchmark: `loom bench offline --help`.",
    )
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return parser


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _port(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    """A finite duration >= 0: NaN would reach anyio's deadlines only at SIGTERM."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be seconds >= 0 (finite), got {text}")
    return value


def _keep_alive(text: str) -> float:
    """Seconds >= 0 (finite), or -1: forever."""
    if text.strip() == "-1":
        return -1.0
    try:
        return _seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be seconds >= 0 (finite), or -1 for ever, got {text}"
        ) from None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as Engine keyword arguments."""
    flags = [flag for flag, _, _ in ENGINE_FLAGS] + [flag for flag, _ in ENGINE_SWITCHES]
    names = [flag[2:].replace("-", "_") for flag in flags] + ["manager"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
