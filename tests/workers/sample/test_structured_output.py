"""Structured outputs: the bitmask arithmetic, the worker's grammars, and constrained
generation end to end, against HF generate with xgrammar's own logits processor."""

from __future__ import annotations

import json

import anyio
import pytest
import torch
from support.hf_reference import hf_greedy
from support.models import preempting_smollm2
from support.paths import REPO_ROOT

from loomllm import Engine
from loomllm.protocols.sampling import SamplingParams, StructuredOutputsParams
from loomllm.workers.sample.structured_output import (
    GrammarCompiler,
    RequestGrammar,
    allocate_bitmask,
    apply_bitmask,
    choice_grammar,
)

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 3]}
TINY_EOS = [2]


def test_bitmask_bits_are_tokens_32i_plus_j():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (3, 5), dtype=torch.int64, generator=gen)
    bitmask = words.to(torch.int32)  # [3, 5]: 160 bits for a vocabulary of 150
    logits = torch.randn(3, 150, generator=gen)
    out = apply_bitmask(logits, bitmask)
    for row in range(3):
        for token in range(150):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert out[row, token] == (logits[row, token] if allowed else float("-inf"))
    assert torch.equal(apply_bitmask(logits, allocate_bitmask(3, 150)), logits)
    only = apply_bitmask(logits, bitmask, rows=[1])  # the others are not looked at
    assert torch.equal(only[1], out[1]) and torch.equal(only[[0, 2]], logits[[0, 2]])


def test_specs_are_validated_where_they_are_made():
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    for kwargs, match in [
        ({}, "exactly one"),
        ({"regex": "a", "grammar": 'root ::= "a"'}, "exactly one"),
        ({"json": "{not json"}, "not JSON"),
        ({"json": "[1]"}, "a JSON schema"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
        ({"json_object": 1}, "exactly one"),
    ]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_grammars_compile_for_the_model_and_refusals_are_value_errors(tiny_model):
    import xgrammar

    compiler = GrammarCompiler(tiny_model, 256)
    choices = ('say "hi"', "a\\b", "new\nline", "ünï", "w7")
    grammar = compiler.compile(StructuredOutputsParams(choice=choices), TINY_EOS)
    for text in choices:
        assert xgrammar.GrammarMatcher(grammar).accept_string(text), text
    assert not xgrammar.GrammarMatcher(grammar).accept_string("say hi")
    assert choice_grammar(("a",)) == 'root ::= "a"'
    any_object = compiler.compile(StructuredOutputsParams(json_object=True), TINY_EOS)
    for text, ok in [
        ('{"a": [1, 2], "b": {"c": null}}', True),
        ("[1, 2]", False),
        ("{ }", False),
        ('{"a":1}', False),
    ]:  # an object, json.dumps' spacing
        matcher = xgrammar.GrammarMatcher(any_object)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text
    for spec, match in [
        (
            StructuredOutputsParams(regex="(?=a)b"),
            r"^structured_outputs\.regex does not "
            r"compile: Regex parsing error",
        ),
        (
            StructuredOutputsParams(grammar="root ::= "),
            r"^structured_outputs\.grammar does "
            r"not compile: EBNF parser error",
        ),
        (StructuredOutputsParams(json='{"type": "frob"}'), "Unsupported type"),
    ]:
        grammar = compiler.request_grammar(spec, TINY_EOS)  # compiled on its own thread
        with pytest.raises(ValueError, match=match):  # the first fill waits for it
            grammar.fill_bitmask([], allocate_bitmask(1, 256), 0)


def test_a_finished_grammar_allows_only_its_stop_tokens(tiny_model):
    compiler = GrammarCompiler(tiny_model, 256)
    grammar = compiler.request_grammar(StructuredOutputsParams(regex="w7"), [2, 63])
    bitmask = allocate_bitmask(2, 256)
    grammar.fill_bitmask([], bitmask, 1)
    assert apply_bitmask(torch.zeros(2, 256), bitmask)[1].isfinite().nonzero().tolist() == [[7]]
    grammar.fill_bitmask([7, 63], bitmask, 1)  # ignore_eos: the request goes on past it
    allowed = apply_bitmask(torch.zeros(2, 256), bitmask).isfinite()
    assert allowed[1].nonzero().flatten().tolist() == [2, 63] and allowed[0].all()
    refusing = RequestGrammar(compiler.compile(StructuredOutputsParams(regex="w7"), [2]))
    with pytest.raises(ValueError, match="the grammar refused token 9"):
        refusing.fill_bitmask([9], bitmask, 0)
    unspellable = compiler.request_grammar(StructuredOutputsParams(regex="[a-z]{3}"), [2])
    with pytest.raises(ValueError, match="no token of this model's vocabulary"):
        unspellable.fill_bitmask([], bitmask, 0)  # the tiny vocabulary is "w0" to "w255"


@pytest.mark.anyio
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_constrained_requests_beside_plain_and_failing_ones(
    tiny_model, shared_manager, async_scheduling
):
    """Grammars, batched with a plain request and one whose grammar does not compile: that
    one fails alone with a ValueError, the plain one's tokens are what they are alone."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results: dict[str, object] = {}

    async def run(engine, name, params):
        try:
            outs = [out async for out in engine.generate(PROMPT, params)]
            results[name] = [(c.text, c.finish_reason) for c in outs[-1].outputs]
        except ValueError as exc:
            results[name] = exc

    def constrained(**so):
        return SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=6,
            n=3,
            structured_outputs=StructuredOutputsParams(**so),
        )

    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        async_scheduling=async_scheduling,
    ) as engine:
        await run(engine, "alone", greedy)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, engine, "plain", greedy)
            tg.start_soon(run, engine, "choice", constrained(choice=["w7", "w9w8"]))
            # (No token may be a proper prefix of a match: no token continues "w1" with "5".)
            tg.start_soon(run, engine, "regex", constrained(regex="(w7|w9)+"))
            tg.start_soon(run, engine, "bad", constrained(regex="(?=a)"))
        assert results["plain"] == results["alone"]
        assert isinstance(results["bad"], ValueError)
        assert "structured_outputs.regex does not compile" in str(results["bad"])
        # The tiny tokenizer's words are its tokens, which a grammar reads concatenated (its
        # decoder puts spaces between them): "w9w8" is w9 then w8. (Not "w9w11": after w9,
        # w1 would continue it too, into a dead end, as no token is "1".)
        for text, reason in results["choice"]:
            assert text.split() in (["w7"], ["w9", "w8"]) and reason == "stop", results["choice"]
        assert {text for text, _ in results["choice"]} != {" w7"}  # the seed gives both
        for text, reason in results["regex"]:
            words = text.split()
            assert (len(words) == 6) == (reason == "length"), results["regex"]
            assert words and set(words) <= {"w7", "w9"}, results["regex"]
        await engine.wait_until_idle()
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.anyio
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_requests_left_nothing_to_sample_fail_alone(
    tiny_model, shared_manager, async_scheduling
):
    """Token 0 was drawn from an all -inf row and the grammar then silently let go."""
    from loomllm import RequestRefusedError

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cases = {
        # The grammar ends after w7 (eos only) while min_tokens bans eos.
        "min_tokens": (
            dict(min_tokens=4, structured_outputs=StructuredOutputsParams(choice=["w7"])),
            "nothing is left to sample",
        ),
        "disjoint": (
            dict(
                allowed_token_ids=[9, 10], structured_outputs=StructuredOutputsParams(choice=["w7"])
            ),
            "nothing is left to sample",
        ),
        "unspellable": (
            dict(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}")),
            "no token of this model's vocabulary",
        ),
    }
    results: dict[str, object] = {}

    async def run(engine, name, params):
        try:
            results[name] = [out async for out in engine.generate(PROMPT, params)][-1]
        except RequestRefusedError as exc:
            results[name] = exc

    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        async_scheduling=async_scheduling,
    ) as engine:
        await run(engine, "alone", greedy)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, engine, "plain", greedy)
            for name, (kwargs, _) in cases.items():
                tg.start_soon(
                    run, engine, name, SamplingParams(temperature=0, max_tokens=6, **kwargs)
                )
        for name, (_, match) in cases.items():
            assert isinstance(results[name], RequestRefusedError), (name, results[name])
            assert match in str(results[name]) and isinstance(results[name], ValueError)
        assert results["plain"].outputs[0].token_ids == results["alone"].outputs[0].token_ids
        await engine.wait_until_idle()
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def hf_constrained_greedy(
    model_dir: str, prompts: list[list[int]], schema: str, max_new_tokens: int
) -> list[list[int]]:
    """HF generate with xgrammar's own logits processor, one prompt at a time."""
    import xgrammar
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    info = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model_dir),
        vocab_size=AutoConfig.from_pretrained(model_dir).vocab_size,
        stop_token_ids=eos if isinstance(eos, list) else [eos],
    )
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
    # A processor holds one generation's matcher: a new one for each prompt.
    return [
        hf_greedy(
            model_dir,
            [prompt],
            max_new_tokens,
            ignore_eos=False,
            logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)],
        )[0]
        for prompt in prompts
    ]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "likes": {"type": "array", "items": {"enum": ["tea", "coffee", "rain"]}, "maxItems": 2},
    },
    "required": ["name", "age", "likes"],
}


@pytest.mark.slow
@pytest.mark.compute
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_smollm2_json_schema_matches_hf_with_xgrammar(shared_manager, async_scheduling):
    """SmolLM2's greedy tokens under a JSON schema, batched, chunked and preempted under a
    small KV cache, with async scheduling off and on: those of HF generate with xgrammar's
    logits processor; and every answer parses and fits the schema."""
    from loomllm.text.tokenizer import Tokenizer
    from loomllm.workers.models.sources import prepare_model_dir, resolve_model

    model_dir = str(prepare_model_dir(resolve_model("smollm2"), dense_weights=True))
    tok = Tokenizer.from_model_dir(model_dir)
    asks = [
        "Describe a pirate",
        "Who is your favourite author?",
        "Invent a person.",
        "A cat that likes rain",
    ]
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"{a} as JSON"}], add_generation_prompt=True
            )
        )
        for a in asks
    ]
    expected = hf_constrained_greedy(model_dir, prompts, json.dumps(SCHEMA), 48)
    params = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    with preempting_smollm2(shared_manager, 12, 32, async_scheduling) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert llm.engine.stats().num_preemptions > 0
    assert sum(out.outputs[0].finish_reason == "stop" for out in outputs) >= 2
    for out in outputs:
        if out.outputs[0].finish_reason == "stop":
            answer = json.loads(out.outputs[0].text)
            assert set(answer) == {"name", "age", "likes"} and type(answer["age"]) is int
            assert set(answer["likes"]) <= {"tea", "coffee", "rain"}


@pytest.mark.slow
def test_the_example_answers_parse(shared_manager):
    import re
    import subprocess
    import sys

    example = REPO_ROOT / "examples" / "json_output.py"
    out = subprocess.run(
        [sys.executable, str(example)],
        env=shared_manager.env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [
        line.removeprefix("  -> ") for line in out.stdout.splitlines() if line.startswith("  -> ")
    ]
    assert len(answers) == 3, out.stdout
    person = json.loads(answers[0])
    assert set(person) == {"name", "age"} and type(person["age"]) is int
    assert answers[1] in ("yes", "no") and re.fullmatch(r"\d{4}-\d{2}-\d{2}", answers[2])
