"""The blocking LLM facade: in a script, inside a running event loop (a notebook cell),
and from a thread; outputs in input order; bad input leaves it usable."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import pytest
from support.worker_hooks import fail_next_launch

from loomllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i] * (i + 1)} for i in range(5)]


@pytest.fixture(scope="module")
def llm(tiny_model, shared_manager):
    with LLM(tiny_model, manager_socket=shared_manager.socket, dtype="float32") as llm:
        yield llm


def test_outputs_come_back_in_input_order(llm):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in PROMPTS]
    assert all(o.finished and len(o.outputs[0].token_ids) == 6 for o in outputs)
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in singles]


def test_works_inside_a_running_event_loop(llm):
    async def notebook_cell():
        return llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)

    outputs = asyncio.run(notebook_cell())
    assert len(outputs) == 2 and all(o.finished for o in outputs)


def test_works_from_a_thread(llm):
    results = []
    thread = threading.Thread(target=lambda: results.append(llm.generate(PROMPTS, GREEDY)))
    thread.start()
    thread.join(timeout=60)
    assert len(results) == 1 and len(results[0]) == len(PROMPTS)


def test_bad_input_raises_and_the_llm_stays_usable(llm):
    with pytest.raises(ValueError, match="^prompt 1: prompt must not be empty"):
        llm.generate([PROMPTS[0], ""], GREEDY, use_tqdm=False)
    # vLLM-style token ids as the prompts: one clear error, not one per prompt in a group.
    with pytest.raises(ValueError, match=r"^prompt 0: prompt must be a string or \{"):
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    deadline = time.monotonic() + 10  # the aborts of the requests started apply at once
    while (stats := llm.engine.stats()).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    with pytest.raises(ValueError, match="2 sampling_params for 5 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 5


def test_a_step_failing_under_every_prompt_is_one_error(llm):
    """vLLM raises the engine's error once; the batch's requests all failing with it is one
    failure, not a group of as many copies. The LLM runs on."""
    from loomllm.errors import EngineStepError

    llm.collective_rpc(fail_next_launch)
    with pytest.raises(EngineStepError, match="injected fault in the forward pass") as err:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not isinstance(err.value, BaseExceptionGroup)
    assert "(5 prompts failed with this same error)" in err.value.__notes__
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 5


def test_get_tokenizer_encodes_decodes_and_renders_chats(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("w5 w6", add_special_tokens=False)
    assert ids == [5, 6] and tokenizer.decode(ids) == "w5 w6"
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w9"
    chat = [{"role": "user", "content": "w5 w6"}]
    text = tokenizer.apply_chat_template(chat, chat_template=template)
    assert text == "w5 w6 w9"
    assert tokenizer.apply_chat_template(chat, chat_template=template, tokenize=True) == [5, 6, 9]


def test_chat_takes_a_template_and_its_variables(llm):
    """This model has no chat template: the error says to pass one, and one passed works,
    with variables of its own (vLLM's chat_template and chat_template_kwargs)."""
    chat = [{"role": "user", "content": "w5"}]
    with pytest.raises(ValueError, match="pass chat_template="):
        llm.chat(chat, GREEDY, use_tqdm=False)
    (out,) = llm.chat(
        chat,
        GREEDY,
        use_tqdm=False,
        chat_template_kwargs={"more": "w6"},
        chat_template="{{ messages[0].content }} {{ more }}",
    )
    assert out.prompt == "w5 w6" and len(out.outputs[0].token_ids) == 6


def test_chat_continues_a_prefilled_answer(llm, tiny_model):
    """continue_final_message: the prompt ends inside the final message, where transformers
    ends it, and the model goes on from there; asking for a new message too is refused."""
    from transformers import AutoTokenizer

    template = (
        "{% for m in messages %}{{ m.content }} w3 {% endfor %}"
        "{% if add_generation_prompt %}w9{% endif %}"
    )
    chat = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    expected = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        chat,
        chat_template=template,
        add_generation_prompt=False,
        continue_final_message=True,
        tokenize=True,
        return_dict=False,
    )
    (out,) = llm.chat(
        chat,
        GREEDY,
        use_tqdm=False,
        chat_template=template,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert out.prompt == "w5 w3 w6 w7" and out.prompt_token_ids == list(expected)
    (same,) = llm.generate({"prompt_token_ids": list(expected)}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(ValueError, match="set one of them at most"):
        llm.chat(chat, GREEDY, use_tqdm=False, chat_template=template, continue_final_message=True)


def test_ctrl_c_during_generate_aborts_the_batch(llm):
    """Ctrl-C in a notebook cell: the KeyboardInterrupt reaches the caller and the batch's
    requests are aborted (not left running to max_tokens); the LLM stays usable."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Python delivers signals to the main thread only")
    # pytest-xdist's workers may ignore SIGINT: here it must raise, as in a notebook.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def slow_steps(w):
        import time

        w.runner.launch_before_slow_steps = launch = w.runner.launch
        w.runner.launch = lambda *a: (time.sleep(0.02), launch(*a))[1]

    def normal_steps(w):
        w.runner.launch = w.runner.launch_before_slow_steps

    def interrupt_once_all_run(main_thread: int) -> None:
        # The requests run, so the main thread waits inside generate: interrupt it there.
        deadline = time.monotonic() + 30
        while llm._portal.call(lambda: llm.engine.stats().num_running) < 4:
            if time.monotonic() > deadline:
                return  # generate failed early: its own error shows
            time.sleep(0.01)
        signal.pthread_kill(main_thread, signal.SIGINT)

    async def idle_within(seconds: float) -> int:
        with anyio.fail_after(seconds):
            await llm.engine.wait_until_idle()
        return llm.engine.stats().num_running

    interrupter = threading.Thread(target=interrupt_once_all_run, args=(threading.get_ident(),))
    llm.collective_rpc(slow_steps)
    try:
        interrupter.start()
        # ~10 s to finish at 20 ms a step: only an abort ends it within the wait below.
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [5, 6]}] * 4, long, use_tqdm=False)
        assert llm._portal.call(idle_within, 3) == 0
    finally:
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
        llm.collective_rpc(normal_steps)
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 5


def test_plain_script_without_main_guard(tiny_model, shared_manager, tmp_path):
    script = tmp_path / "batch.py"
    script.write_text(
        textwrap.dedent(f"""
        from loomllm import LLM, SamplingParams
        llm = LLM({tiny_model!r}, dtype="float32")
        outs = llm.generate([{{"prompt_token_ids": [7, 8, 9]}}] * 3,
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        print("tokens", [len(o.outputs[0].token_ids) for o in outs])
        # no close(): the program must still exit, and the worker go back warm
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        env=shared_manager.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "tokens [4, 4, 4]" in out.stdout


def test_after_its_worker_died_calls_say_so(tiny_model, shared_manager):
    """Not "the engine is not running: use `async with Engine(...)`": the death, with the
    manager's report."""
    import os

    from loomllm import EngineDeadError

    llm = LLM(
        tiny_model, manager_socket=shared_manager.socket, keep_alive=0, max_num_seqs=47
    )  # max_num_seqs: a worker of its own
    [pid] = llm.collective_rpc(lambda worker: os.getpid())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # until the engine has seen the death
        try:
            llm.collective_rpc(lambda worker: None)
        except EngineDeadError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for call in (
        lambda: llm.generate("w5", SamplingParams(max_tokens=2), use_tqdm=False),
        lambda: llm.collective_rpc(lambda worker: None),
    ):
        with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
            call()
    with pytest.raises(EngineDeadError):  # closing reports it too, once more
        llm.close()


def test_close_returns_once_the_loop_thread_is_gone(tiny_model, shared_manager):
    llm = LLM(tiny_model, manager_socket=shared_manager.socket, dtype="float32")
    thread = llm._thread
    llm.close()
    assert not thread.is_alive()
    llm.close()  # twice: nothing more to do
