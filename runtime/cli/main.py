"""The `loom` command: serve (the OpenAI-compatible HTTP API), generate, chat, models, bench.

Engine options are vLLM's names as dashed flags; SIGINT or SIGTERM stops the server gracefully.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import anyio

from loomllm.config import EngineConfig
from loomllm.errors import LoomError


def _default(name: str) -> Any:
    """EngineConfig's default for the option `name`, for help texts: the flags themselves
    default to None (not given), so that EngineConfig alone decides."""
    return next(field.default for field in fields(EngineConfig) if field.name == name)


def _on_off(name: str) -> str:
    return "on" if _default(name) else "off"


ENGINE_FLAGS: list[tuple[str, Any, str]] = [
    ("--dtype", str, "auto | float32 | bfloat16 | float16"),
    ("--load-format", str, "auto | dummy (random weights from the config, for benchmarks)"),
    (
        "--model-impl",
        str,
        "auto | loom | transformers (auto: loomllm's own Llama-family "
        "model where it runs the checkpoint, else transformers')",
    ),
    ("--weight-dtype", str, "bfloat16 | float16: a float32 model's linear weights in 16 bits"),
    (
        "--quantization",
        str,
        "none | gguf | int8 | int4: weight-only, on the CPU (default: a GGUF file runs "
        "as it is stored; none dequantizes it; int8 | int4 quantize a float checkpoint)",
    ),
    (
        "--cpu-linear-kernel",
        str,
        "auto | dense | int8 | int4: the CPU's linear kernel (auto: the fastest measured "
        "for each shape and batch size)",
    ),
    ("--device", str, "auto | cpu | cuda"),
    ("--attention-backend", str, "auto | torch | triton (auto: triton on CUDA, torch on CPU)"),
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
    (
        "--gpu-memory-utilization",
        float,
        "CUDA: share of the GPU's memory the worker may "
        f"fill, in (0, 1] (default {_default('gpu_memory_utilization')})",
    ),
    ("--manager-socket", Path, "engine-manager socket (default: the per-user one)"),
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
        "send step N+1 while step N runs (default: on with CUDA workers, off on the CPU)",
    ),
    (
        "--enforce-eager",
        f"CUDA: run every step eager, no decode CUDA graphs (default: {_on_off('enforce_eager')})",
    ),
]


# `loom bench NAME`: the module in benchmarks/ that runs it.
BENCHMARKS = {
    "cpu": "loomllm.benchmarks.cpu",
    "offline": "loomllm.benchmarks.offline_throughput",
    "overhead": "loomllm.benchmarks.engine_overhead",
    "serving": "loomllm.benchmarks.serving",
    "worker-start": "loomllm.benchmarks.worker_start",
    "gpu": "loomllm.benchmarks.gpu_bench",
    "gpu-check": "loomllm.benchmarks.gpu_checks",
    "start": "loomllm.benchmarks.start_times",
    "decode-profile": "loomllm.benchmarks.decode_profile",
    "eager-step": "loomllm.benchmarks.eager_step",
    "broadcast": "loomllm.benchmarks.step_broadcast",
    "compile": "loomllm.benchmarks.kernel_compile",
    "emulated": "loomllm.benchmarks.emulated_device",
    "gpu-session": "loomllm.benchmarks.gpu_session",
    "structured": "loomllm.benchmarks.structured_overhead",
}


def _parser() -> argparse.ArgumentParser:
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
    serve.add_argument("model", nargs="?", default="smollm2")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="0: any free port")
    # From the environment by default: a key on the command line shows in `ps`.
    serve.add_argument(
        "--api-key",
        default=os.environ.get("LOOM_API_KEY") or None,
        help="require Authorization: Bearer KEY on every route but /health, "
        "/metrics, /version and /openapi.json (default: $LOOM_API_KEY)",
    )
    serve.add_argument("--served-model-name", default=None, help="the name clients send")
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

    models = sub.add_parser("models", help="list the models the engine-manager keeps warm")
    models.add_argument(
        "--manager-socket",
        type=Path,
        default=None,
        help="engine-manager socket (default: the per-user one)",
    )
    models.set_defaults(loop="asyncio")

    bench = sub.add_parser(
        "bench",
        help="run a benchmark: loomllm and its peers in one run, a table of ratios",
        description="Benchmarks in one run, same prompts for every engine. Flags after the "
        "name go to the benchmark: `loom bench offline --help`.",
    )
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return parser


# -- argparse types: a bad value is exit 2 with "argument --FLAG: ...", before anything starts.


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


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as Engine keyword arguments."""
    flags = [flag for flag, _, _ in ENGINE_FLAGS] + [flag for flag, _ in ENGINE_SWITCHES]
    names = [flag[2:].replace("-", "_") for flag in flags] + ["manager"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


async def _watch_signals(stop: anyio.Event, scope: anyio.CancelScope, serving: list[bool]) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"loom: {signal.Signals(signum).name}, stopping", file=sys.stderr)
            if stop.is_set() or not serving:
                scope.cancel()  # a second signal, or still starting: stop now
            stop.set()


async def _serve(args: argparse.Namespace) -> int:
    """Serve until a signal (exit 0) or until the engine is gone for good (exit 1).

    After a signal, in-flight requests get --shutdown-grace seconds, then the engine closes.
    """
    from loomllm.server.run import bind_socket

    # Bound before the engine starts: a port in use or an unknown host is one line, at
    # once, not a traceback after the model has loaded.
    with bind_socket(args.host, args.port) as listener:
        return await _serve_on(listener, args)


async def _serve_on(listener: socket.socket, args: argparse.Namespace) -> int:
    from functools import partial

    from loomllm.engine.engine import Engine
    from loomllm.server import build_app, serve
    from loomllm.server.supervisor import EngineSlot, drain, supervise

    stop = anyio.Event()
    serving: list[bool] = []
    slot = EngineSlot()
    options = engine_options(args)
    app_options = {} if args.max_request_body is None else {"max_body_bytes": args.max_request_body}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_signals, stop, tg.cancel_scope, serving)
        await tg.start(
            partial(
                supervise,
                lambda: Engine(args.model, **options),
                slot,
                restart_on_failure=args.restart_on_failure,
                max_restarts=args.max_restarts,
            )
        )
        auto_tools = args.tool_call_parser if args.enable_auto_tool_choice else None
        app = build_app(
            slot,
            args.served_model_name or args.model,
            api_key=args.api_key,
            trust_request_chat_template=args.trust_request_chat_template,
            tool_call_parser=auto_tools,
            reasoning_parser=args.reasoning_parser,
            **app_options,
        )

        async def shutdown_trigger() -> None:
            async with anyio.create_task_group() as first:
                for event in (stop, slot.failed):
                    first.start_soon(_set_then_cancel, event, first.cancel_scope)
            # Stop listening now; in-flight requests finish while hypercorn waits for them.
            tg.start_soon(drain, slot, args.shutdown_grace)

        serving.append(True)
        # hypercorn owns the socket from here: it listens on it and closes it.
        await serve(
            app,
            f"fd://{listener.detach()}",
            shutdown_trigger,
            graceful_timeout=args.shutdown_grace + 5,
        )
        tg.cancel_scope.cancel()
    if slot.failure is not None:
        print(f"loom: {slot.failure}", file=sys.stderr)
        return 1
    return 0


async def _set_then_cancel(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _streaming_params(args: argparse.Namespace) -> Any:
    """SamplingParams from --max-tokens/--temperature/--sampling-seed, streamed as deltas."""
    from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.sampling_seed,
        output_kind=RequestOutputKind.DELTA,
    )


async def _generate(args: argparse.Namespace) -> None:
    from loomllm.engine.engine import Engine

    params = _streaming_params(args)
    async with Engine(args.model, **engine_options(args)) as engine:
        async with engine.generate(args.prompt, params) as stream:
            async for out in stream:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
    sys.stdout.write("\n")


async def _chat(args: argparse.Namespace) -> None:
    from loomllm.cli.chat import chat_in_terminal
    from loomllm.engine.engine import Engine

    params = _streaming_params(args)
    async with Engine(args.model, **engine_options(args)) as engine:
        await chat_in_terminal(engine, params, system=args.system)


async def _models(args: argparse.Namespace) -> None:
    from loomllm.clients.manager import list_workers
    from loomllm.protocols.rundir import default_socket_path
    from loomllm.protocols.worker_table import models_table

    print(models_table(await list_workers(args.manager_socket or default_socket_path())))


def _bench(args: argparse.Namespace) -> int:
    import importlib

    # Benchmarks run their own event loops and processes: not inside anyio.run.
    importlib.import_module(BENCHMARKS[args.benchmark]).main(args.bench_args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.command == "bench":
        return _bench(args)
    run = {"serve": _serve, "generate": _generate, "chat": _chat, "models": _models}[args.command]
    try:
        code = anyio.run(run, args, backend=args.loop)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as eg:
        leaf = _first_leaf(eg)
        if not isinstance(leaf, ValueError | LoomError | OSError):
            raise
        print(f"loom: {leaf}", file=sys.stderr)
        return 2 if isinstance(leaf, ValueError) else 1
    except (ValueError, LoomError, OSError) as exc:  # bad options name the option
        print(f"loom: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    return code if isinstance(code, int) else 0


def _first_leaf(eg: BaseExceptionGroup) -> BaseException:
    first = eg.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


if __name__ == "__main__":
    sys.exit(main())
