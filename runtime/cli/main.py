"""The `loom` command: serve (the OpenAI-compatible HTTP API), generate, chat, pull, models, bench;
its flags are in flags.py, the server's run in serve.py."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from loomllm.cli.flags import benchmark_flags, benchmark_module, build_parser, engine_options
from loomllm.cli.serve import serve_command
from loomllm.errors import LoomError

# -- argparse types: a bad value is exit 2 with "argument --FLAG: ...", before anything starts.


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


async def _pull(args: argparse.Namespace) -> int:
    """`loom pull org/name`: the engine-manager downloads it (started if need be)."""
    from loomllm.clients import hub
    from loomllm.clients.manager import ManagerClient, connect_shared_manager
    from loomllm.protocols.rundir import default_socket_path

    if not hub.is_hub_id(args.model):
        raise ValueError(f"model {args.model!r} is not a hub id like 'org/name' (or is a path)")
    ms = await connect_shared_manager(args.manager_socket or default_socket_path())
    manager = ManagerClient(ms, on_worker_died=lambda died: None)
    async with anyio.create_task_group() as tg:
        await tg.start(manager.run)
        try:
            pulled = await hub.pull(manager, args.model, args.revision, check_hub=True)
        finally:
            await manager.aclose()
    print(pulled.path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    # Benchmarks run their own event loops and processes: not inside anyio.run.
    importlib.import_module(benchmark_module(args)).main(args.bench_args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, bench_args = benchmark_flags(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.bench_args = bench_args
    if args.command == "serve" and args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.command == "bench":
        return _bench(args)
    run = {
        "serve": serve_command,
        "generate": _generate,
        "chat": _chat,
        "models": _models,
        "pull": _pull,
    }[args.command]
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
