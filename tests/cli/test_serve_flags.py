"""`loom serve`'s flags: bad values are exit 2 naming the flag, before anything starts; a
port that cannot be bound is one line, exit 1, before the engine (and its manager) starts;
every EngineConfig option has a flag, defaulting to EngineConfig's own default.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from dataclasses import fields

import pytest

from loomllm.cli.flags import build_parser, engine_options
from loomllm.cli.main import main
from loomllm.config import EngineConfig


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--port", "70000", "must be a TCP port in [0, 65535], got 70000"),
        ("--port", "-1", "must be a TCP port in [0, 65535], got -1"),
        ("--port", "http", "must be an integer, got 'http'"),
        ("--max-request-body", "0", "must be an integer >= 1, got 0"),
        ("--max-request-body", "-1", "must be an integer >= 1, got -1"),
        ("--shutdown-grace", "nan", "must be seconds >= 0 (finite), got nan"),
        ("--shutdown-grace", "-1", "must be seconds >= 0 (finite), got -1"),
        ("--shutdown-grace", "inf", "must be seconds >= 0 (finite), got inf"),
        ("--max-restarts", "-1", "must be an integer >= 0, got -1"),
    ],
)
def test_serve_refuses_bad_values_naming_the_flag(flag, value, message, capsys):
    # The parser, not main(): were a value accepted, main() would go on to serve.
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "m", flag, value])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"loom serve: error: argument {flag}: {message}"
    )


def test_serve_accepts_the_bounds():
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--port",
            "0",
            "--max-restarts",
            "0",
            "--shutdown-grace",
            "0",
            "--max-request-body",
            "1",
        ]
    )
    assert (args.port, args.max_restarts, args.shutdown_grace, args.max_request_body) == (
        0,
        0,
        0.0,
        1,
    )
    assert build_parser().parse_args(["serve", "m", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_serve_on_a_port_in_use_fails_in_one_line_before_the_engine_starts(loop, manager, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(
            [
                "serve",
                "no-such-model",
                "--port",
                str(port),
                "--loop",
                loop,
                "--manager-socket",
                str(manager.socket),
            ]
        )
    captured = capsys.readouterr()
    in_use = f"[Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"
    assert (code, captured.err) == (1, f"loom: cannot listen on 127.0.0.1:{port}: {in_use}\n")
    assert not manager.socket.exists()  # no engine: its manager would be listening there


def test_serve_on_an_unknown_host_fails_in_one_line_before_the_engine_starts(manager, capsys):
    code = main(
        [
            "serve",
            "no-such-model",
            "--host",
            "nosuchhost.invalid",
            "--port",
            "0",
            "--manager-socket",
            str(manager.socket),
        ]
    )
    [line] = capsys.readouterr().err.splitlines()
    assert code == 1
    assert line.startswith("loom: cannot listen on nosuchhost.invalid:0: [Errno "), line
    assert not manager.socket.exists()


def test_every_engine_option_has_a_flag():
    args = build_parser().parse_args(["serve", "m"])
    assert engine_options(args) == {}  # none given: EngineConfig's defaults decide
    # Every flag "given": the ones engine_options passes on are exactly EngineConfig's.
    every_flag = argparse.Namespace(**{name: "given" for name in vars(args)})
    options = {field.name for field in fields(EngineConfig)} - {"model"}  # positional
    assert set(engine_options(every_flag)) == options


def test_engine_switches_and_gpu_memory_utilization_become_engine_options():
    def options(*flags: str) -> dict:
        return engine_options(build_parser().parse_args(["serve", "m", *flags]))

    assert options(
        "--gpu-memory-utilization",
        "0.5",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enforce-eager",
    ) == {
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        "enforce_eager": False,
    }
    assert options("--no-enable-chunked-prefill") == {"enable_chunked_prefill": False}
    for command in (["generate", "m", "p"], ["chat", "m"]):  # the same flags everywhere
        args = build_parser().parse_args([*command, "--no-enable-prefix-caching"])
        assert engine_options(args) == {"enable_prefix_caching": False}
