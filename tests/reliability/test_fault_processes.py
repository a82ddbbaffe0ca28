"""Faults of whole processes, 10 trials each: kill -9 of a worker under `loom serve`, of the
manager, of the user's process; SIGTERM to `loom serve` under load.

Sync tests (real processes; the user side runs in threads or subprocesses).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.models import make_tiny_model
from support.processes import is_alive, wait_gone
from support.servers import loom_serve

from loomllm import LLM, EngineDeadError, SamplingParams

# Processes that need both cores at once: `make test` runs these tests one at a time.
pytestmark = pytest.mark.serial

TRIALS = 10
DETECT_S = 1.0
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
LONG_STREAM = 16_000  # tokens: ten seconds and more of the tiny model's steps


class Stream:
    """One streaming /v1/completions in a thread: its SSE events, and when it ended."""

    def __init__(self, base_url: str, max_tokens: int, prompt: str = "w5 w6") -> None:
        self.events: list = []
        self.status: int | None = None
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        self._thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict) -> None:
        try:
            with httpx.stream(
                "POST", f"{base_url}/v1/completions", json=body, timeout=60
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
        except BaseException as exc:  # the test asserts on it
            self.error = exc
        finally:
            self.ended_at = time.monotonic()

    def join(self) -> None:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "stream did not end"

    @property
    def errors(self) -> list:
        return [e for e in self.events if e != "[DONE]" and "error" in e]

    @property
    def finish_reasons(self) -> list:
        return [
            c["finish_reason"]
            for e in self.events
            if e != "[DONE]" and "choices" in e
            for c in e["choices"]
            if c["finish_reason"] is not None
        ]


def wait_until(predicate, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def busy_worker(manager) -> int:
    [pid] = [pid for pid, state in manager.worker_states().items() if state == "busy"]
    return pid


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """The tiny model with a context no stream of a trial finishes in before its kill, however
    slowly a busy host gets the kill to it (400 tokens did finish first, at times)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("long"), max_position_embeddings=LONG_STREAM + 16
    )


def test_worker_killed_under_loom_serve(long_model, shared_manager, fault_report):
    """Streams end with an SSE error within 1 s, /health turns 503, the server restarts
    the engine (default restart_on_failure) and the next request succeeds."""
    # More restarts than the default crash-loop limit (5 in 10 minutes) allows.
    with loom_serve(
        long_model,
        shared_manager.socket,
        "tiny",
        "asyncio",
        "--max-num-seqs",
        "15",
        "--max-restarts",
        str(TRIALS),
    ) as server:
        base = server.base_url

        def trial(_: int) -> float:
            streams = [Stream(base, LONG_STREAM, f"w{5 + k} w6") for k in range(3)]
            wait_until(lambda: all(s.events for s in streams), what="every stream to begin")
            pid = busy_worker(shared_manager)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            saw_503 = False
            while True:  # /health turns 503 while the engine is dead or restarting
                health = httpx.get(f"{base}/health", timeout=10).status_code
                if health == 503:
                    saw_503 = True
                    # A request now is refused with 503 (or served, if the restart won).
                    body = {"model": "tiny", "prompt": "w5", "max_tokens": 2}
                    code = httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code
                    assert code in (503, 200), code
                elif saw_503:
                    break
                assert time.monotonic() - killed_at < 30, "no restart"
                time.sleep(0.005)
            for stream in streams:
                stream.join()
                assert stream.status == 200 and stream.error is None, stream.error
                # Reported failed, exactly once; never finished as if nothing happened.
                assert len(stream.errors) == 1 and stream.errors[0]["error"]["code"] == 503
                assert stream.finish_reasons == []
            assert not is_alive(pid)
            body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True}
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert reply.status_code == 200
            assert reply.json()["usage"]["completion_tokens"] == 4
            worst = max(s.ended_at for s in streams) - killed_at
            assert worst < DETECT_S, worst
            return worst

        fault_report.run("kill -9 worker under loom serve (SSE error, 503, restart)", TRIALS, trial)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_manager_killed(tiny_model, manager, other_manager, fault_report):
    """Workers (and the zygotes) exit within 5 s; the next engine replaces the stale socket
    with a new manager and works.

    Each trial starts a manager whose zygote imports torch and transformers (~6 s of one
    core), so the trials run in two lanes of five, each lane on a socket of its own.
    """
    lanes = [manager, other_manager]

    def trial(i: int) -> float:
        socket = lanes[i % 2].socket
        with pytest.raises(EngineDeadError), LLM(tiny_model, manager_socket=socket) as llm:
            [before] = llm.generate(["w5 w6 w7"], GREEDY, use_tqdm=False)
            assert len(before.outputs[0].token_ids) == 4
            [worker] = llm.engine.worker_pids
            zygotes = [_parent(worker)]  # the full zygote, forked by the lean one
            zygotes.append(_parent(zygotes[0]))
            daemon = _parent(zygotes[-1])
            assert "loomllm.workers.manager" in Path(f"/proc/{daemon}/cmdline").read_text()
            killed_at = time.monotonic()
            os.kill(daemon, signal.SIGKILL)
            assert wait_gone(worker, timeout=5)
            assert all(wait_gone(zygote, timeout=5) for zygote in zygotes)
            gone_after = time.monotonic() - killed_at
            assert socket.exists()  # stale: the next engine must not trust it
            llm.generate(["w5"], GREEDY, use_tqdm=False)  # this engine is dead
        return gone_after

    fault_report.run(
        "kill -9 manager (workers gone; next engine starts a new one)",
        TRIALS,
        trial,
        lanes=len(lanes),
    )
    for lane in lanes:  # the 11th engine of each lane: after its last kill
        with LLM(tiny_model, manager_socket=lane.socket) as llm:
            [after] = llm.generate(["w5 w6 w7"], GREEDY, use_tqdm=False)
        assert len(after.outputs[0].token_ids) == 4


USER_SCRIPT = """
import anyio
from loomllm import Engine, SamplingParams
async def main():
    async with Engine({model!r}, max_num_seqs=16) as engine:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            for k in range(3):
                async def stream(k=k):
                    async for out in engine.generate(f"w{{5 + k}} w6", params):
                        pass
                tg.start_soon(stream)
            while engine.stats().num_running < 3:
                await anyio.sleep(0.01)
            print(engine.worker_pids[0], flush=True)
anyio.run(main)
"""


def test_user_process_killed_mid_stream(tiny_model, shared_manager, fault_report):
    """The worker drops the dead engine's requests within 1 s and stays warm: the next
    engine attaches to the same worker and finds nothing of them."""

    def trial(_: int) -> float:
        user = subprocess.Popen(
            [sys.executable, "-c", USER_SCRIPT.format(model=tiny_model)],
            env=shared_manager.env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            worker = int(user.stdout.readline())  # three requests are streaming now
            killed_at = time.monotonic()
            user.kill()
            user.wait()
        finally:
            user.stdout.close()
        with LLM(tiny_model, manager_socket=shared_manager.socket, max_num_seqs=16) as llm:
            # Attaching waits until the worker has dropped the dead engine's state.
            held = llm.collective_rpc(lambda w: len(w.runner.requests))
            dropped_after = time.monotonic() - killed_at
            assert llm.engine.worker_pids == [worker]  # warm: the same worker
            assert held == [0]
            [out] = llm.generate(["w5 w6 w7"], GREEDY, use_tqdm=False)
            assert len(out.outputs[0].token_ids) == 4
            stats = llm.engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        assert dropped_after < DETECT_S, dropped_after
        return dropped_after

    fault_report.run("kill -9 user process mid-stream (worker drops, stays warm)", TRIALS, trial)


def test_sigterm_under_load(tiny_model, shared_manager, fault_report):
    """In-flight streams finish within the grace period (or end with finish_reason "abort"
    when it is short); exit code 0."""

    def trial(i: int) -> float:
        # Even trials: a long grace, every stream runs to its end; odd: a short one that
        # ends streams far longer than it.
        grace, max_tokens = ("60", 60) if i % 2 == 0 else ("0.3", 500)
        with loom_serve(
            tiny_model, shared_manager.socket, "tiny", "asyncio", "--shutdown-grace", grace
        ) as server:
            streams = [Stream(server.base_url, max_tokens, f"w{5 + k} w6") for k in range(4)]
            wait_until(lambda: all(s.events for s in streams), what="every stream to begin")
            signalled_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=30) == 0, server.output()[-2000:]
            exited_after = time.monotonic() - signalled_at
        for stream in streams:
            stream.join()
            assert stream.error is None and stream.events[-1] == "[DONE]", stream.events[-2:]
            expected = ["length"] if grace == "60" else ["abort"]
            assert stream.finish_reasons == expected, stream.finish_reasons
        return exited_after

    fault_report.run("SIGTERM to loom serve under load (drain, exit 0)", TRIALS, trial)
