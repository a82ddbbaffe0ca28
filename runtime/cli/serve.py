"""`loom serve`: the OpenAI-compatible (and Ollama) server over one or more models, until a
signal (exit 0) or its only model is gone for good (exit 1); SIGINT or SIGTERM stops it
gracefully."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from loomllm.cli.flags import engine_options


async def _watch_signals(stop: anyio.Event, scope: anyio.CancelScope, serving: list[bool]) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"loom: {signal.Signals(signum).name}, stopping", file=sys.stderr)
            if stop.is_set() or not serving:
                scope.cancel()  # a second signal, or still starting: stop now
            stop.set()


async def serve_command(args: argparse.Namespace) -> int:
    """Serve until a signal (exit 0) or until its only model is gone for good (exit 1).

    After a signal, in-flight requests get --shutdown-grace seconds, then the engines close.
    """
    from loomllm.server.run import bind_socket

    # Bound before the engine starts: a port in use or an unknown host is one line, at
    # once, not a traceback after the model has loaded.
    with bind_socket(args.host, args.port) as listener:
        return await _serve_on(listener, args)


def served_models(args: argparse.Namespace) -> list[Any]:
    """The models named on the command line, then in --models-file (smollm2 if none)."""
    from loomllm.server.fleet.catalog import ModelEntry, parse_model_arg, read_models_file

    options = engine_options(args)
    served = []
    for index, arg in enumerate(args.models):
        name, model = parse_model_arg(arg)
        if index == 0 and args.served_model_name is not None:
            if name is not None:
                raise ValueError(f"{arg!r} names its model already: drop --served-model-name")
            name = args.served_model_name
        served.append(ModelEntry(name or model, model, options))
    if args.models_file is not None:
        served += read_models_file(args.models_file, options)
    if not served:
        served.append(ModelEntry(args.served_model_name or "smollm2", "smollm2", options))
    if args.lora_modules:
        loras = dict(_lora_module(arg) for arg in args.lora_modules)
        served[0] = dataclasses.replace(served[0], loras={**served[0].loras, **loras})
    return served


def _lora_module(arg: str) -> tuple[str, str]:
    name, sep, path = arg.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH, got {arg!r}")
    return name, path


async def _serve_on(listener: socket.socket, args: argparse.Namespace) -> int:
    from loomllm.server import build_app, serve
    from loomllm.server.fleet.fleet import ModelFleet

    options = engine_options(args)
    fleet = ModelFleet(
        served_models(args),
        max_loaded=args.max_loaded_models,
        keep_alive=args.model_keep_alive,
        cached=_cached_hub_models(options),
        cached_options=options,
        restart_on_failure=args.restart_on_failure,
        max_restarts=args.max_restarts,
    )
    stop = anyio.Event()
    serving: list[bool] = []
    app_options = {} if args.max_request_body is None else {"max_body_bytes": args.max_request_body}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_signals, stop, tg.cancel_scope, serving)
        await tg.start(fleet.run)
        auto_tools = args.tool_call_parser if args.enable_auto_tool_choice else None
        app = build_app(
            fleet,
            api_key=args.api_key,
            trust_request_chat_template=args.trust_request_chat_template,
            tool_call_parser=auto_tools,
            reasoning_parser=args.reasoning_parser,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            **app_options,
        )

        async def shutdown_trigger() -> None:
            async with anyio.create_task_group() as first:
                for event in (stop, fleet.failed):
                    first.start_soon(_set_then_cancel, event, first.cancel_scope)
            # Stop listening now; in-flight requests finish while hypercorn waits for them.
            tg.start_soon(fleet.drain, args.shutdown_grace)

        serving.append(True)
        # hypercorn owns the socket from here: it listens on it and closes it.
        await serve(
            app,
            f"fd://{listener.detach()}",
            shutdown_trigger,
            graceful_timeout=args.shutdown_grace + 5,
        )
        tg.cancel_scope.cancel()
    if fleet.failure is not None:
        print(f"loom: {fleet.failure}", file=sys.stderr)
        return 1
    return 0


def _cached_hub_models(options: dict[str, Any]) -> Callable[[], Awaitable[list[str]]] | None:
    """What lists the hub models in the shared engine-manager's cache, which a request may
    name to have loaded; None with a private manager (it lives only with an engine)."""
    if options.get("manager") == "private":
        return None
    from loomllm.clients.manager import list_cached_models
    from loomllm.protocols.rundir import default_socket_path

    socket_path = options.get("manager_socket") or default_socket_path()

    async def cached() -> list[str]:
        return [entry.model for entry in await list_cached_models(socket_path)]

    return cached


async def _set_then_cancel(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
