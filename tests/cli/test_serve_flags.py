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
from pathlib import Path

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
        ("--max-loaded-models", "0", "must be an integer >= 1, got 0"),
        ("--model-keep-alive", "-2", "must be seconds >= 0 (finite), or -1 for ever, got -2"),
        ("--model-keep-alive", "5m", "must be seconds >= 0 (finite), or -1 for ever, got 5m"),
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


def served(*argv: str) -> list[tuple[str, str, dict]]:
    from loomllm.cli.serve import served_models

    args = build_parser().parse_args(["serve", *argv])
    return [(m.name, m.model, m.options) for m in served_models(args)]


def test_served_models_from_the_command_line_and_a_models_file(tmp_path):
    assert served() == [("smollm2", "smollm2", {})]
    assert served("--served-model-name", "smol") == [("smol", "smollm2", {})]
    assert served("./m", "--served-model-name", "x") == [("x", "./m", {})]
    models_file = tmp_path / "models.toml"
    models_file.write_text(
        '[models.qwen]\nmodel = "Qwen/Qwen3-0.6B"\ndtype = "bfloat16"\n'
        '[models.llama]\nmodel = "/m/llama.gguf"\n'
        '[models.llama.loras]\nsql = "/m/sql-lora"\n'
    )
    assert served("a=/m/a", "org/x=y", "--dtype", "float32", "--models-file", str(models_file)) == [
        ("a", "/m/a", {"dtype": "float32"}),
        ("org/x=y", "org/x=y", {"dtype": "float32"}),  # an "=" after a "/" is the model's
        ("qwen", "Qwen/Qwen3-0.6B", {"dtype": "bfloat16"}),  # its own option wins
        ("llama", "/m/llama.gguf", {"dtype": "float32"}),
    ]
    from loomllm.cli.serve import served_models

    argv = ["serve", "--models-file", str(models_file), "--lora-modules", "chat=/m/chat"]
    found = served_models(build_parser().parse_args(argv))
    assert [m.loras for m in found] == [{"chat": "/m/chat"}, {"sql": "/m/sql-lora"}]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[models.a]\ndtype = 'float32'\n", "[models.a] needs model ="),
        ("[models.a]\nmodel = 'm'\nwarp = 9\n", "unknown engine options ['warp']"),
        ("[model.a]\nmodel = 'm'\n", "expected [models.NAME] tables and nothing else"),
        ("models = 3\n", "expected [models.NAME] tables"),
        ("[models.a\n", "cannot read the models file"),
    ],
)
def test_a_bad_models_file_is_exit_2_naming_the_entry(text, words, tmp_path, manager, capsys):
    models_file = tmp_path / "models.toml"
    models_file.write_text(text)
    argv = ["serve", "--models-file", str(models_file), "--port", "0"]
    code = main([*argv, "--manager-socket", str(manager.socket)])
    [line] = capsys.readouterr().err.splitlines()
    assert code == 2 and words in line and str(models_file) in line, line
    assert not manager.socket.exists()  # refused before any engine started


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["a=m1", "a=m2"], "two served models are named 'a'"),
        (["a:latest=m1"], "may not end in ':latest'"),
        (["=m1"], "NAME=MODEL"),
        (["a=m1", "--served-model-name", "b"], "drop --served-model-name"),
        (["m1", "--lora-modules", "sql=/x"], "serve it with --enable-lora"),
        (["m1", "--enable-lora", "--lora-modules", "sql"], "--lora-modules takes NAME=PATH"),
        (["m1", "--enable-lora", "--lora-modules", "m1=/x"], "two served models are named 'm1'"),
    ],
)
def test_bad_served_model_names_are_exit_2(argv, words, manager, capsys):
    code = main(["serve", *argv, "--port", "0", "--manager-socket", str(manager.socket)])
    [line] = capsys.readouterr().err.splitlines()
    assert code == 2 and words in line, line
    assert not manager.socket.exists()


def test_the_docs_table_of_options_is_the_one_the_fields_give():
    from loomllm.cli.options_doc import rewritten

    page = Path(__file__).parents[2] / "docs" / "options.md"
    text = page.read_text()
    assert rewritten(text) == text, "docs/options.md's table is stale: run `make options-doc`"


def test_each_flag_takes_its_type_and_choices_from_the_option():
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "m", "--dtype", "float32", "--max-num-seqs", "8", "--keep-alive", "-1"]
    )
    assert engine_options(args) == {"dtype": "float32", "max_num_seqs": 8, "keep_alive": -1.0}
    for bad in (["--dtype", "float8"], ["--max-num-seqs", "many"], ["--quantization", "gptq"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", *bad])
