"""The `loom` command line's flags: vLLM's engine options as dashed flags, each command's own,
and the parser that holds them."""

from __future__ import annotations

import argparse
import json
import math
import os
import types
import typing
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any

from loomllm.config import EngineConfig
from loomllm.server.parsers.reasoning import PARSERS as REASONING_PARSERS
from loomllm.server.parsers.tool_parsers import PARSERS as TOOL_CALL_PARSERS


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, for a dict-valued option."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# What argparse reads a flag's text into, by the option's type (a Literal is read as str).
_FLAG_TYPES: dict[Any, Any] = {int: int, float: float, str: str, Path: Path, dict: json_object}


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """One EngineConfig option as a `loom` flag: its type, choices and help come from the
    field, and it defaults to None (not given), so that EngineConfig alone decides."""

    name: str  # the option's name: the flag is --name-with-dashes
    kwargs: dict[str, Any]  # for argparse's add_argument

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def option_type(annotation: Any) -> Any:
    """An option's type without its `| None`."""
    kinds = [t for t in typing.get_args(annotation) if t is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(kinds) == 1:
        return kinds[0]
    return annotation


def default_text(option: Field[Any]) -> str:
    """An option's default in words: the field's own words, else its value."""
    if option.metadata["default_text"]:
        return str(option.metadata["default_text"])
    if option_type(option.type) is bool or type(option.default) is bool:
        return "on" if option.default else "off"
    return "" if option.default is None else str(option.default)


def engine_flags() -> list[EngineFlag]:
    hints = typing.get_type_hints(EngineConfig)
    flags = []
    for option in fields(EngineConfig):
        if not option.metadata["flag"]:
            continue
        kind = option_type(hints[option.name])
        default = default_text(option)
        help_ = option.metadata["help"] + (f" (default: {default})" if default else "")
        kwargs: dict[str, Any] = {"default": None, "help": help_.replace("%", "%%")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kwargs.update(type=str, choices=typing.get_args(kind))
        else:
            kwargs["type"] = _FLAG_TYPES[typing.get_origin(kind) or kind]
        flags.append(EngineFlag(option.name, kwargs))
    return flags


ENGINE_FLAGS = engine_flags()


# `loom bench NAME` or `loom bench GROUP NAME`: the module in benchmarks/ that runs it. The
# figures users compare (against peers, on real shapes) are verbs of their own; the engine's
# internals and the kernel micro-benchmarks are grouped.
BENCHMARKS: dict[str, str | dict[str, str]] = {
    "cpu": "loomllm.benchmarks.cpu",
    "gpu": "loomllm.benchmarks.gpu_bench",
    "serving": "loomllm.benchmarks.serving",
    "offline": "loomllm.benchmarks.offline_throughput",
    "accuracy": "loomllm.benchmarks.accuracy",
    "models": "loomllm.benchmarks.bench_models",
    "gpu-session": "loomllm.benchmarks.gpu_session",
    "gpu-check": "loomllm.benchmarks.gpu_checks",
    "engine": {
        "overhead": "loomllm.benchmarks.engine_overhead",
        "start": "loomllm.benchmarks.start_times",
        "worker-start": "loomllm.benchmarks.worker_start",
        "spec": "loomllm.benchmarks.spec_decode",
        "structured": "loomllm.benchmarks.structured_overhead",
        "embed": "loomllm.benchmarks.embed",
        "broadcast": "loomllm.benchmarks.step_broadcast",
        "emulated": "loomllm.benchmarks.emulated_device",
    },
    "kernel": {
        "cpu-step": "loomllm.benchmarks.cpu_step",
        "cpu-prefill-attention": "loomllm.benchmarks.cpu_prefill_attention",
        "cpu-contention": "loomllm.benchmarks.cpu_contention",
        "decode-attention": "loomllm.benchmarks.decode_attention",
        "decode-profile": "loomllm.benchmarks.decode_profile",
        "eager-step": "loomllm.benchmarks.eager_step",
        "moe": "loomllm.benchmarks.moe",
        "compile": "loomllm.benchmarks.kernel_compile",
    },
}
BENCHMARK_GROUPS = {
    "engine": "the engine's own costs: step overhead, starts, speculation, structured "
    "outputs, embeddings, the step broadcast, an emulated device",
    "kernel": "kernel micro-benchmarks: CPU steps and attention, GPU decode attention and "
    "profiles, MoE, compile times",
}


def benchmark_module(args: argparse.Namespace) -> str:
    """The module that runs the benchmark `loom bench` was given."""
    target = BENCHMARKS[args.benchmark]
    return target if isinstance(target, str) else target[args.member]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="loomllm: serve or run a model")
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_args(p: argparse.ArgumentParser) -> None:
        for option in ENGINE_FLAGS:
            p.add_argument(option.flag, **option.kwargs)
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
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model family's tool-call syntax (hermes: Qwen2.5, Qwen3, Hermes)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
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
    socket = next(option for option in ENGINE_FLAGS if option.name == "manager_socket")
    for command in (pull, models):  # they talk to the daemon alone: no engine flags
        command.add_argument(socket.flag, **socket.kwargs)
        command.set_defaults(loop="asyncio")

    bench = sub.add_parser(
        "bench",
        help="run a benchmark: loomllm and its peers in one run, a table of ratios",
        description="Benchmarks in one run, same prompts for every engine. Flags after the "
        "name go to the benchmark: `loom bench offline --help`, `loom bench kernel cpu-step "
        "--help`.",
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, target in BENCHMARKS.items():
        if isinstance(target, str):
            _benchmark_parser(benchmarks, name)
            continue
        group = benchmarks.add_parser(name, help=BENCHMARK_GROUPS[name])
        members = group.add_subparsers(dest="member", required=True, metavar="NAME")
        for member in target:
            _benchmark_parser(members, member)
    return parser


def _benchmark_parser(parent: Any, name: str) -> None:
    """A benchmark's entry: its own flags are split off before parsing (benchmark_flags)."""
    parent.add_parser(name, add_help=False)


def benchmark_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """`bench NAME [MEMBER] FLAGS...`: what `loom`'s parser reads, and the flags that go to
    the benchmark as they are, its own --help included."""
    target = BENCHMARKS.get(argv[1]) if len(argv) > 1 and argv[0] == "bench" else None
    if isinstance(target, str):
        return argv[:2], argv[2:]
    if target is not None and len(argv) > 2 and argv[2] in target:
        return argv[:3], argv[3:]
    return argv, []


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
    given = {option.name: getattr(args, option.name) for option in ENGINE_FLAGS}
    return {name: value for name, value in given.items() if value is not None}
