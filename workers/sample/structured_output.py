"""Structured outputs on the worker: each constrained request's grammar (xgrammar), its matcher,
and the token bitmask that keeps its next token inside the grammar.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from loomllm.protocols.sampling import StructuredOutputsParams
from loomllm.workers.device.transfer import device_tensor, to_device

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (xgrammar evicts the least recently used beyond it): a JSON
# schema's takes megabytes on a large vocabulary, and a server may see a new schema per request.
GRAMMAR_CACHE_BYTES = 256 * 2**20
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[14:50:05] /project/x.cc:83: "


class GrammarCompiler:
    """Compiles a request's StructuredOutputsParams for one model's vocabulary.

    xgrammar (and the tokenizer's vocabulary it preprocesses) load on the first constrained
    request, not at the worker's start. Compiled grammars are cached by xgrammar. The worker,
    not the engine, holds the grammars: it samples the tokens, so it advances each matcher
    itself, and the engine's process never imports xgrammar (nor torch).
    """

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width: may exceed the tokenizer's
        self._compilers: dict[tuple[int, ...], Any] = {}  # by stop token ids
        self._thread: ThreadPoolExecutor | None = None

    def request_grammar(
        self, spec: StructuredOutputsParams, stop_token_ids: list[int]
    ) -> RequestGrammar:
        """A new request's matcher, its grammar compiled on a thread of its own (xgrammar
        lets go of the GIL): the step's forward runs meanwhile, and the first fill waits
        for it. That fill raises ValueError for anything that kept the grammar from being
        built, so that the request fails alone."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        return RequestGrammar(self._thread.submit(self._build, spec, stop_token_ids))

    def _build(self, spec: StructuredOutputsParams, stop_token_ids: list[int]) -> Any:
        try:
            return self.compile(spec, stop_token_ids)
        except ValueError:
            raise
        except Exception as exc:
            logger.exception("building a grammar failed")
            raise ValueError(
                f"structured_outputs failed on the worker: {type(exc).__name__}: {exc}"
            ) from exc

    def compile(self, spec: StructuredOutputsParams, stop_token_ids: list[int]) -> Any:
        """An xgrammar CompiledGrammar; ValueError naming what is wrong with the spec."""
        compiler = self._compiler(tuple(sorted(stop_token_ids)))
        try:
            if spec.json is not None:
                # No free whitespace, because a model could loop on it: json.dumps' separators.
                return compiler.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:  # an object (not any JSON value), held to the same whitespace
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            assert spec.grammar is not None
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            kind = next(
                k
                for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(spec, k) not in (None, False)
            )
            reason = _CPP_PREFIX.sub("", str(exc).strip())
            raise ValueError(f"structured_outputs.{kind} does not compile: {reason}") from None

    def _compiler(self, stop_token_ids: tuple[int, ...]) -> Any:
        compiler = self._compilers.get(stop_token_ids)
        if compiler is None:
            try:
                import xgrammar
            except ImportError as exc:  # the request fails alone, clearly
                raise ValueError(
                    f"structured_outputs need xgrammar in the workers' "
                    f"environment: pip install xgrammar ({exc})"
                ) from None
            from transformers import PreTrainedTokenizerFast

            tokenizer_file = Path(self.model_dir) / "tokenizer.json"
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(stop_token_ids)
            )
            compiler = self._compilers[stop_token_ids] = xgrammar.GrammarCompiler(
                info, cache_limit_bytes=GRAMMAR_CACHE_BYTES
            )
        return compiler


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are `choices` (JSON string escapes, which
    xgrammar's EBNF literals read alike)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class RequestGrammar:
    """One request's matcher, advanced lazily by the output tokens its request holds when it
    next samples: a preempted request (rebuilt with its output so far) and async scheduling
    (whose steps wait for the output ids of the step before, as penalties do) need nothing more."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled  # an xgrammar CompiledGrammar, or a Future of one
        self._matcher: Any = None
        self.num_accepted = 0

    @property
    def matcher(self) -> Any:
        """The xgrammar GrammarMatcher, once its grammar is compiled (ValueError if it was not)."""
        if self._matcher is None:
            import xgrammar

            compiled = self._compiled
            if isinstance(compiled, Future):
                compiled = compiled.result()
            self._matcher = xgrammar.GrammarMatcher(compiled)
        return self._matcher

    def fill_bitmask(self, output_token_ids: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Accept the tokens sampled since the last call, then write the allowed next tokens
        into `bitmask[row]` (int32 words, bit j of word i: token 32 i + j). ValueError if
        the grammar did not compile, refuses a token (sampled under another mask: never,
        short of a bug) or allows no next token (the vocabulary cannot spell what it needs)."""
        for token_id in output_token_ids[self.num_accepted :]:
            if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
                raise ValueError(f"structured_outputs: the grammar refused token {token_id}")
            self.num_accepted += 1
        if self.matcher.is_terminated():  # past its stop token (ignore_eos): stop tokens only
            bitmask[row] = 0
            for token_id in self.matcher.stop_token_ids:
                bitmask[row, token_id // 32] |= _bit(token_id % 32)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            raise ValueError(
                "structured_outputs: no token of this model's vocabulary can continue the grammar"
            )


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores (bit 31 is negative)."""
    return (1 << j) - (1 << 32) * (j == 31)


def fill_bitmasks(
    samplers: list[Any], vocab_size: int
) -> tuple[torch.Tensor | None, list[int], list[tuple[str, str]]]:
    """The step's bitmask for the sampling rows whose request has a grammar (`.grammar`,
    advanced by its `.output_token_ids`), those rows, and (request id, why) for each
    grammar that failed: that request is to fail, and its row goes unconstrained."""
    if all(s.grammar is None for s in samplers):
        return None, [], []
    bitmask = allocate_bitmask(len(samplers), vocab_size)
    rows, failed = [], []
    for row, state in enumerate(samplers):
        if state.grammar is None:
            continue
        try:
            state.grammar.fill_bitmask(state.output_token_ids, bitmask, row)
            rows.append(row)
        except Exception as exc:  # its request fails alone, never the step
            if not isinstance(exc, ValueError):
                logger.exception("request %s's grammar failed", state.req_id)
                exc = ValueError(f"structured_outputs failed on the worker: {exc!r}")
            failed.append((state.req_id, str(exc)))
            state.grammar = None
    return bitmask, rows, failed


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, every token allowed (all bits set)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def apply_bitmask(
    x: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> torch.Tensor:
    """Logits `x` [B, V] with the tokens whose bit is clear in `bitmask` [B, W] (on the
    host) at -inf, out of place; only `rows` are looked at (None: all)."""
    rows = list(range(x.shape[0])) if rows is None else rows
    if not rows:
        return x
    vocab = x.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)  # [32]
    words = to_device(bitmask[rows], x.device)  # [R, W], through pinned memory on CUDA
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
    index = device_tensor(rows, torch.long, x.device)
    return x.index_put((index,), x[index].masked_fill(~allowed, float("-inf")))
