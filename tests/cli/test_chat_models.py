"""`loom chat` (the loop in-process over a real Engine, then the real command on a pipe) and
`loom models` (against the shared engine-manager, and with none at the socket).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import pytest

from loomllm import Engine
from loomllm.cli.chat import ChatSession
from loomllm.cli.main import main
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(
    max_tokens=4, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)


def lines(*texts: str):
    """A `read_line` that returns each text, then "" (end of input)."""
    pending = list(texts)

    async def read_line() -> str:
        await anyio.lowlevel.checkpoint()
        return pending.pop(0) if pending else ""

    return read_line


async def chat_once(engine: Engine, messages: list[dict]) -> str:
    """An independent greedy run over `messages`: what the chat loop must have printed."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    async with engine.chat(messages, params) as stream:
        async for out in stream:
            final = out
    return final.outputs[0].text


def loom_chat(model: str, manager, *args: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "loomllm.cli.main",
        "chat",
        model,
        "--dtype",
        "float32",
        "--manager-socket",
        str(manager.socket),
        *args,
    ]
    return cmd


async def test_chat_keeps_history_and_streams_each_reply(chat_model, shared_manager):
    async with Engine(chat_model, manager_socket=shared_manager.socket, dtype="float32") as engine:
        session = ChatSession(engine, GREEDY)
        session.check_chat_template()
        out: list[str] = []
        with anyio.fail_after(30):
            await session.run(lines("w5 w6\n", "\n", "w7\n", "/exit\n", "w8\n"), out.append)
        assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
        first, second = session.messages[1]["content"], session.messages[3]["content"]
        assert first and second
        assert "".join(out) == f"{first}\n{second}\n"  # streamed, one line per reply
        assert len([chunk for chunk in out if chunk not in ("", "\n")]) > 2  # in pieces
        # The second reply saw the whole history through the chat template.
        assert second == await chat_once(engine, session.messages[:3])
        assert first == await chat_once(engine, session.messages[:1])

        notices: list[str] = []
        await session.run(lines("/reset\n", "w7\n"), out.append, notify=notices.append)
        assert notices == ["(conversation cleared)\n"]
        assert [m["role"] for m in session.messages] == ["user", "assistant"]
        assert session.messages[1]["content"] == await chat_once(engine, session.messages[:1])


async def test_chat_system_prompt_survives_reset_and_bad_turns_leave_history(
    chat_model, shared_manager
):
    async with Engine(chat_model, manager_socket=shared_manager.socket, dtype="float32") as engine:
        session = ChatSession(engine, GREEDY, system="w3")
        out: list[str] = []
        notices: list[str] = []
        too_long = " ".join(["w5"] * (engine.max_model_len + 1)) + "\n"
        with anyio.fail_after(30):
            await session.run(
                lines("w5\n", too_long, "/nope\n", "/reset\n", "w6\n"),
                out.append,
                notify=notices.append,
            )
        assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
        assert session.messages[1]["content"] == "w6"
        assert "prompt has" in notices[0] and "/reset starts over" in notices[0], notices
        assert notices[1].startswith("unknown command /nope")
        assert notices[2:] == ["(conversation cleared)\n"]


async def test_interrupt_stops_the_reply_and_aborts_the_request(chat_model, shared_manager):
    async with Engine(chat_model, manager_socket=shared_manager.socket, dtype="float32") as engine:
        params = SamplingParams(
            max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        session = ChatSession(engine, params)
        assert not session.interrupt()  # no reply in progress
        chunks: list[str] = []

        def write(text: str) -> None:
            chunks.append(text)
            if len(chunks) == 2:
                assert session.interrupt()

        steps_before = engine.stats().num_steps
        with anyio.fail_after(30):
            answer = await session.reply("w5", write)
            await engine.wait_until_idle()
        assert answer == "".join(chunks) and len(chunks) == 2
        assert session.messages[-1] == {"role": "assistant", "content": answer}
        assert engine.stats().num_running == 0
        assert engine.stats().num_steps - steps_before < 100  # aborted, far from 400 tokens


def test_loom_chat_refuses_a_model_without_chat_template(tiny_model, shared_manager, capsys):
    code = main(
        ["chat", tiny_model, "--dtype", "float32", "--manager-socket", str(shared_manager.socket)]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("loom: cannot chat with") and "no chat template" in err
    assert err.count("\n") == 1


def test_loom_chat_on_a_pipe(chat_model, shared_manager):
    cmd = loom_chat(chat_model, shared_manager, "--temperature", "0", "--max-tokens", "3")
    result = subprocess.run(
        cmd, input="hello\nmore\n/exit\nnever read\n", capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    replies = result.stdout.split("\n")
    assert len(replies) == 3 and replies[2] == "", result.stdout  # two lines, no prompt
    assert all(replies[:2]), result.stdout


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_loom_chat_ctrl_c_stops_a_reply_then_quits_at_the_prompt(chat_model, shared_manager, loop):
    # Greedy: this model's reply to "w5" does not end (EOS) before max_tokens.
    cmd = loom_chat(
        chat_model, shared_manager, "--temperature", "0", "--max-tokens", "400", "--loop", loop
    )
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    try:
        proc.stdin.write("w5\n")
        proc.stdin.flush()
        first = proc.stdout.read(1)  # the reply has begun
        proc.send_signal(signal.SIGINT)
        reply = first + proc.stdout.readline()
        assert reply.endswith("\n") and len(reply.split()) < 200, reply  # cut short
        proc.stdin.write("/reset\n")  # back at the prompt: the loop reads on
        proc.stdin.flush()
        assert proc.stderr.readline() == "(conversation cleared)\n"
        proc.send_signal(signal.SIGINT)
        # stdin stays open: the blocked read must not keep the process alive.
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


def test_loom_models_lists_warm_workers(tiny_model, shared_manager):
    async def attach() -> list[int]:
        async with Engine(
            tiny_model, manager_socket=shared_manager.socket, dtype="float32", keep_alive=300
        ) as engine:
            return await engine.collective_rpc(lambda worker: os.getpid())

    [pid] = anyio.run(attach)
    result = subprocess.run(
        [sys.executable, "-m", "loomllm.cli.main", "models"],
        env=shared_manager.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "MODEL",
        "DTYPE",
        "TP",
        "PIDS",
        "STATE",
        "MEMORY",
        "KEEP_ALIVE",
        "EXPIRES",
    ]
    [row] = [r.split() for r in rows if str(pid) in r.split()]
    assert row[:5] == [tiny_model, "float32", "1", str(pid), "idle"], rows
    assert row[7] == "300s" and row[8].endswith("s"), row  # MEMORY is "<n> MiB": two words


def test_loom_models_without_a_manager(tmp_path, capsys):
    socket = tmp_path / "none.sock"
    assert main(["models", "--manager-socket", str(socket)]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"loom: no engine-manager is running on {socket}\n"
    assert captured.out == ""
    assert not socket.exists()  # and none was started for it
