"""`loom serve`: the OpenAI-compatible server over one Engine, until a signal (exit 0) or
the engine is gone for good (exit 1); SIGINT or SIGTERM stops it gracefully."""

from __future__ import annotations

import argparse
import signal
import socket
import sys

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
    from loomllm.server.fleet.supervisor import EngineSlot, drain, supervise

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
