"""Workers fork from the manager's zygote; without it (dead, or switched off) they still start.

Each test has its own manager: they kill its zygotes or start it with the zygote off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from support.gguf_models import make_tiny_gguf
from support.processes import wait_gone

from loomllm import LLM, EngineDeadError, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def generate_once(llm: LLM) -> list[int]:
    [output] = llm.generate(["w5 w6 w7"], GREEDY, use_tqdm=False)
    return output.outputs[0].token_ids


def test_a_dead_zygote_takes_its_workers_and_the_next_engine_gets_a_new_one(tiny_model, manager):
    """The manager's zygote (the lean one) dies: the full zygote it forked, and their
    workers, die with it."""
    manager.start()
    with pytest.raises(EngineDeadError), LLM(tiny_model, manager_socket=manager.socket) as llm:
        expected = generate_once(llm)
        [worker] = manager.worker_states()
        full = parent_of(worker)
        lean = parent_of(full)
        assert "loomllm.workers.worker.zygote" in command_line(lean)
        assert parent_of(lean) == manager.pid()
        os.kill(lean, signal.SIGKILL)
        assert wait_gone(worker, timeout=5) and wait_gone(full, timeout=5)
        generate_once(llm)
    with LLM(tiny_model, manager_socket=manager.socket) as llm:
        assert generate_once(llm) == expected
        [worker] = manager.worker_states()
        assert parent_of(worker) not in (full, lean, manager.pid())


def test_a_gguf_worker_is_forked_lean_and_others_from_the_full_zygote(
    tiny_model, manager, tmp_path
):
    """loomllm's own model on a GGUF file is forked from the lean zygote, which never
    imports transformers' modeling code; a checkpoint directory's worker from the full one,
    its fork. When the full zygote dies, its workers go, and the next is forked lean and
    still works."""
    gguf = str(make_tiny_gguf(tmp_path / "m.gguf", "Q8_0"))

    def heavy_imports(worker: object) -> list[str]:
        """The full zygote's imports a worker has: transformers' modeling code and what it
        brings."""
        heavy = ("transformers.modeling_utils", "torch._dynamo", "sympy")
        return [name for name in heavy if name in sys.modules]

    manager.start()
    # The file's first read writes its config and tokenizer to the cache, with transformers'
    # help; a load from the cache, in a new worker (keep_alive 0), reads only the file.
    with LLM(gguf, manager_socket=manager.socket, keep_alive=0) as llm:
        expected_gguf = generate_once(llm)
    with LLM(gguf, manager_socket=manager.socket, keep_alive=0) as llm:
        assert generate_once(llm) == expected_gguf
        [worker] = llm.engine.worker_pids
        lean = parent_of(worker)
        assert parent_of(lean) == manager.pid()
        assert llm.collective_rpc(heavy_imports) == [[]]
    with pytest.raises(EngineDeadError), LLM(tiny_model, manager_socket=manager.socket) as llm:
        expected = generate_once(llm)
        [worker] = llm.engine.worker_pids
        full = parent_of(worker)
        assert full != lean and parent_of(full) == lean
        os.kill(full, signal.SIGKILL)
        assert wait_gone(worker, timeout=5)
        generate_once(llm)
    with LLM(tiny_model, manager_socket=manager.socket) as llm:
        assert generate_once(llm) == expected
        [worker] = llm.engine.worker_pids
        assert parent_of(worker) == lean


def test_without_the_zygote_workers_start_as_fresh_interpreters(tiny_model, manager, monkeypatch):
    monkeypatch.setenv("LOOM_WORKER_ZYGOTE", "0")
    manager.start()
    with LLM(tiny_model, manager_socket=manager.socket) as llm:
        assert len(generate_once(llm)) == 4
        [worker] = manager.worker_states()
        assert parent_of(worker) == manager.pid()
        assert "loomllm.workers.worker.main" in command_line(worker)


LATER_SCRIPT = """
import logging, socket, sys, threading
from loomllm.workers.worker import zygote
logging.basicConfig(level=logging.INFO)
zygote.LATER_AFTER_S = float(sys.argv[2])
sys.path.insert(0, sys.argv[1])
ours, managers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
z = zygote.Zygote(ours, later=["broken_on_import", "colorsys"])
threading.Timer(2.0, managers.close).start()  # the manager goes: serve() returns
z.serve()
print("after:", "colorsys" in sys.modules, z.later)
"""


def test_a_later_import_that_fails_leaves_the_zygote_serving(tmp_path):
    """The later imports run while the zygote already serves: one that raises (not only
    ImportError) is logged and the next follows, the zygote, and its workers, live on."""
    (tmp_path / "broken_on_import.py").write_text("raise RuntimeError('a broken dependency')")
    done = subprocess.run(
        [sys.executable, "-c", LATER_SCRIPT, str(tmp_path), "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "after: True []" in done.stdout
    assert "not preloaded: broken_on_import (RuntimeError: a broken dependency)" in done.stderr


def test_later_imports_wait_for_a_first_fork_or_their_delay(tmp_path):
    """No fork, and the delay (30 s) not over when the manager goes after 2 s: none of them
    ran, and the zygote did not spin meanwhile (its CPU time stays far below the wait)."""
    script = LATER_SCRIPT + "import resource\nprint('cpu:', resource.getrusage(0).ru_utime)\n"
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "30"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "after: False ['broken_on_import', 'colorsys']" in done.stdout
    cpu = float(done.stdout.split("cpu:")[1])
    assert cpu < 1.0, done.stdout  # a spinning loop would have used the 2 s


FULL_DIES_SCRIPT = """
import json, os, signal, socket, threading
from loomllm.workers.worker import zygote
ours, managers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
full = zygote.fork_full_zygote(ours)
os.kill(full.pid, signal.SIGSTOP)  # a request passed on waits, as behind a later import
seen = []

def manager():
    def ask(wants_full):
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
        request = {"args": ["--no-such-flag"], "full": wants_full}
        socket.send_fds(managers, [json.dumps(request).encode()], fds)
        for fd in fds:
            os.close(fd)

    managers.settimeout(20)
    seen.append(json.loads(managers.recv(4096)))  # ready
    ask(True)
    # A lean worker (its bad flag ends it): the zygote reads requests in order, so once it
    # is spawned the first one has been passed on, unanswered.
    ask(False)
    while not any("spawned" in m for m in seen):
        seen.append(json.loads(managers.recv(4096)))
    os.kill(full.pid, signal.SIGKILL)
    while not (any("error" in m for m in seen) and any("exited" in m for m in seen)):
        seen.append(json.loads(managers.recv(4096)))
    managers.close()

threading.Thread(target=manager).start()
zygote.Zygote(ours, full=full).serve()
print("seen:", json.dumps(seen[1:]))
"""


def test_a_request_the_full_zygote_dies_with_is_answered():
    """The full zygote dies with a request passed on to it: the manager gets an error for it
    (it then starts that worker itself) rather than waiting for ever, the lean zygote goes
    on forking, and the full zygote's own exit is never reported as a worker's."""
    done = subprocess.run(
        [sys.executable, "-c", FULL_DIES_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    spawned, *rest = json.loads(done.stdout.split("seen:")[1])
    assert set(spawned) == {"spawned"}
    assert [m for m in rest if "error" in m] == [{"error": "the full zygote died"}]
    assert [m for m in rest if "exited" in m] == [{"exited": spawned["spawned"], "code": 2}]
