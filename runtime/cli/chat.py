"""`loom chat`: a streaming conversation with one model, its history kept across turns.

Every turn sends the whole history through the model's chat template (`engine.chat`).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from loomllm.protocols.sampling import SamplingParams

if TYPE_CHECKING:
    from loomllm.engine.engine import Engine

HELP = "/reset forgets the conversation, /exit (or Ctrl-D) quits"
ReadLine = Callable[[], Awaitable[str]]
Write = Callable[[str], None]


class ChatSession:
    """One conversation: `messages` is what the model sees, system prompt first.

    Its input and output are functions passed in, so tests drive it in-process;
    `chat_in_terminal` wires it to stdin, stdout and Ctrl-C.
    """

    def __init__(self, engine: Engine, params: SamplingParams, *, system: str | None = None):
        self.engine = engine
        self.params = params
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self._reply_scope: anyio.CancelScope | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every turn; the system prompt stays."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def check_chat_template(self) -> None:
        """Raise ValueError (one line) when the model has no usable chat template."""
        assert self.engine.tokenizer is not None
        probe = [*self.messages, {"role": "user", "content": "hi"}]
        try:
            self.engine.tokenizer.apply_chat_template(probe, add_generation_prompt=True)
        except ValueError as exc:
            raise ValueError(f"cannot chat with {self.engine.config.model}: {exc}") from None

    def interrupt(self) -> bool:
        """Stop the reply being streamed, if any (Ctrl-C); False when there is none."""
        if self._reply_scope is None:
            return False
        self._reply_scope.cancel()
        return True

    async def reply(self, text: str, write: Write) -> str:
        """Add `text` as the user's turn and stream the model's answer through `write`.

        Returns the answer, which joins the history. Bad input (the template refuses the
        messages, the history outgrew the context) raises ValueError and leaves the
        history as it was. Cancellation: the request is aborted. interrupt() aborts it too,
        but then the partial answer, as shown, joins the history and is returned.
        """
        self.messages.append({"role": "user", "content": text})
        parts: list[str] = []
        try:
            with anyio.CancelScope() as self._reply_scope:
                # Leaving this block, by the end or by interrupt(), aborts the request.
                async with self.engine.chat(self.messages, self.params) as stream:
                    async for out in stream:
                        parts.append(out.outputs[0].text)
                        write(parts[-1])
        except ValueError:
            self.messages.pop()
            raise
        finally:
            self._reply_scope = None
        answer = "".join(parts)
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    async def run(
        self, read_line: ReadLine, write: Write, *, notify: Write | None = None, prompt: str = ""
    ) -> None:
        """Read lines until `/exit` or end of input (`read_line` returns ""), answer each.

        Replies go to `write`, notices and errors to `notify` (default: `write`).
        Cancellation: stops at once; a reply in progress is aborted.
        """
        notify = notify or write
        while True:
            write(prompt)
            line = await read_line()
            if not line:
                return
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                return
            if text == "/reset":
                self.reset()
                notify("(conversation cleared)\n")
                continue
            if text.startswith("/") and " " not in text:
                notify(f"unknown command {text}: {HELP}\n")
                continue
            try:
                await self.reply(text, write)
            except ValueError as exc:
                notify(f"loom: {exc} (/reset starts over)\n")
                continue
            write("\n")


async def chat_in_terminal(
    engine: Engine, params: SamplingParams, *, system: str | None = None
) -> None:
    """The `loom chat` loop on stdin/stdout. Ctrl-C stops a reply, or at the prompt quits.

    Raises ValueError before reading anything when the model cannot chat.
    Cancellation: ends the conversation; a reply in progress is aborted.
    """
    session = ChatSession(engine, params, system=system)
    session.check_chat_template()
    interactive = sys.stdin.isatty()
    if interactive:
        _write_stderr(f"chatting with {engine.config.model}: {HELP}\n")
    async with anyio.create_task_group() as tg:
        tg.start_soon(_route_interrupts, session, tg.cancel_scope)
        prompt = ">>> " if interactive else ""
        await session.run(read_stdin_line, _write_stdout, notify=_write_stderr, prompt=prompt)
        tg.cancel_scope.cancel()
    if interactive:
        _write_stdout("\n")


async def _route_interrupts(session: ChatSession, scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            if not session.interrupt():
                scope.cancel()  # at the prompt: Ctrl-C quits


async def read_stdin_line() -> str:
    """One line of stdin, "" at its end, read in a thread so the event loop runs on.

    A daemon thread of our own, not anyio.to_thread: anyio's asyncio worker threads are
    not daemons, so an abandoned readline would hold the process open until Enter.
    Cancellation: returns at once; the thread is abandoned and its line is lost.
    """
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    result: list[str | BaseException] = []

    def read() -> None:
        try:
            result.append(sys.stdin.readline())
        except BaseException as exc:  # handed to the caller below
            result.append(exc)
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except anyio.RunFinishedError:
            pass  # abandoned: nobody waits for this line any more

    threading.Thread(target=read, name="loom-chat-stdin", daemon=True).start()
    await done.wait()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _write_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
