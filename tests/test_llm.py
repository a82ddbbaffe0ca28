"""The blocking LLM facade: in a script, inside a running event loop (a notebook cell),
and from a thread; outputs in input order; bad input leaves it usable."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

from runtime import LLM, SamplingParams

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
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([PROMPTS[0], ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 5 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 5


def test_plain_script_without_main_guard(tiny_model, shared_manager, tmp_path):
    script = tmp_path / "batch.py"
    script.write_text(textwrap.dedent(f"""
        from runtime import LLM, SamplingParams
        llm = LLM({tiny_model!r}, dtype="float32")
        outs = llm.generate([{{"prompt_token_ids": [7, 8, 9]}}] * 3,
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        print("tokens", [len(o.outputs[0].token_ids) for o in outs])
        # no close(): the program must still exit, and the worker go back warm
    """))
    out = subprocess.run([sys.executable, str(script)], env=shared_manager.env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "tokens [4, 4, 4]" in out.stdout
