"""A request's input checked against the model before anything is scheduled: ValueError
naming the field, so a bad request costs nothing but itself."""

from __future__ import annotations

from typing import Any

from loomllm.config import EngineConfig
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.messages import Pooling
from loomllm.protocols.sampling import SamplingParams, replace_checked
from loomllm.text.tokenizer import Tokenizer


def prompt_token_ids(
    prompt: str | dict[str, Any],
    tokenizer: Tokenizer,
    vocab: int,
    max_model_len: int,
    params: SamplingParams | None = None,
) -> tuple[str | None, list[int]]:
    """The prompt's text (None when given as ids) and token ids, truncated as
    `params.truncate_prompt_tokens` says (the text then being the kept tokens')."""
    text: str | None
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be a list of token ids in [0, {vocab})")
    else:
        raise ValueError('prompt must be a string or {"prompt_token_ids": [...]}')
    if not ids:
        raise ValueError("prompt must not be empty")
    if params is not None and params.truncate_prompt_tokens is not None:
        ids = truncated(
            ids, params, max_model_len, tokenizer.bos_token_id if isinstance(prompt, str) else None
        )
        text = None if text is None else tokenizer.decode(ids, skip_special_tokens=False)
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
            f"({max_model_len}) to leave room for output"
        )
    return text, list(ids)


def segments_of(
    prompt: str | dict[str, Any],
    token_ids: list[int],
    pooling: Pooling | None,
    params: SamplingParams,
) -> list[int] | None:
    """A prompt dict's `token_type_ids` (an encoder's segments of a pair of texts), checked:
    one 0 or 1 per token, on an encoder, untruncated; None when it has none."""
    if not isinstance(prompt, dict) or prompt.get("token_type_ids") is None:
        return None
    types = prompt["token_type_ids"]
    if pooling is None or pooling.causal:
        raise ValueError("token_type_ids are for an encoder's pair of texts (BERT and its kin)")
    if params.truncate_prompt_tokens is not None:
        raise ValueError("token_type_ids and truncate_prompt_tokens do not go together")
    if not isinstance(types, list) or len(types) != len(token_ids):
        raise ValueError("token_type_ids must be a list with one entry per prompt token")
    if not all(type(t) is int and t in (0, 1) for t in types):
        raise ValueError("token_type_ids must each be 0 or 1 (first or second text)")
    return list(types)


def check_room(prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """ValueError, worded as vLLM's server words it, when the prompt and max_tokens do not
    fit in max_model_len (max_tokens None: the rest of the context, which always fits)."""
    wanted = params.max_tokens
    if wanted is not None and prompt_tokens + wanted > max_model_len:
        raise ValueError(
            f"max_tokens is too large: {wanted}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({wanted} > {max_model_len} - {prompt_tokens})"
        )


def truncated(
    ids: list[int], params: SamplingParams, max_model_len: int, bos: int | None
) -> list[int]:
    """The last truncate_prompt_tokens of `ids` (-1: all that leave room for max_tokens), a
    leading `bos` kept first: the tokenizer put it there, and models need it."""
    k = params.truncate_prompt_tokens
    assert k is not None
    if k == -1:
        k = max(max_model_len - (params.max_tokens or 1), 1)
    elif k >= max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({k}) must be below max_model_len "
            f"({max_model_len}), to leave room for output"
        )
    if len(ids) <= k:
        return list(ids)
    if bos is not None and ids[0] == bos and k > 1:
        return [bos, *ids[len(ids) - k + 1 :]]
    return list(ids[len(ids) - k :])


def check_lora(lora: LoRARequest | None, config: EngineConfig) -> None:
    """ValueError unless `lora` is None or a LoRARequest for an engine with enable_lora."""
    if lora is None:
        return
    if not isinstance(lora, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {lora!r}")
    if not config.enable_lora:
        raise ValueError(
            f"lora_request {lora.lora_name!r}: this engine runs without LoRA; start it with "
            "enable_lora=True"
        )


def check_speculable(params: SamplingParams) -> None:
    """ValueError naming what a request asks that speculative decoding cannot give: a
    grammar's matcher and top logprobs would have to follow each draft token."""
    if params.structured_outputs is not None:
        raise ValueError(
            "structured_outputs do not work with speculative decoding (this engine has a "
            "speculative_config)"
        )
    if params.logprobs is not None:
        raise ValueError(
            "logprobs do not work with speculative decoding (this engine has a speculative_config)"
        )


def check_token_ids(params: SamplingParams, vocab: int, eos_token_ids: frozenset[int]) -> None:
    """The params' token ids against the vocabulary (>= 0: SamplingParams checks that)."""
    bad_ids = [t for seq in params.bad_words_token_ids for t in seq]
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_token_ids", bad_ids),
    ):
        if any(t >= vocab for t in ids):
            raise ValueError(f"{name} must be token ids in [0, {vocab})")
    # Before min_tokens the workers ban eos and the stop ids: something must be left.
    if params.min_tokens:
        banned = eos_token_ids | set(params.stop_token_ids)
        allowed = params.allowed_token_ids
        if allowed is not None and banned.issuperset(allowed):
            raise ValueError(
                "allowed_token_ids holds only eos and stop ids, which min_tokens "
                "bans: nothing is left to sample"
            )
        if len(banned) >= vocab and sum(t < vocab for t in banned) >= vocab:
            raise ValueError(
                "stop_token_ids and eos cover the vocabulary, and min_tokens "
                "bans them: nothing is left to sample"
            )


def check_request_id(request_id: object) -> str:
    """A request id that can cross the wire: a str of whole UTF-8 characters."""
    if type(request_id) is str:
        try:
            request_id.encode()
            return request_id
        except UnicodeEncodeError:  # a lone surrogate
            pass
    raise ValueError(f"request_id must be a string (of whole UTF-8 characters), got {request_id!r}")


def check_priority(priority: object, policy: str) -> None:
    """A request's priority: an integer, other than 0 only under the "priority" policy (as
    vLLM refuses it: under FCFS it would silently do nothing)."""
    if type(priority) is not int:
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority and policy != "priority":
        raise ValueError(
            f"priority {priority} needs scheduling_policy='priority' (this engine "
            f"schedules {policy})"
        )


def with_bad_words_encoded(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """`params` with each of its bad_words' encodings added to bad_words_token_ids: the word
    as it starts a text, and after a space when that spells it in as many tokens but
    another first one (a word-start token: "▁word", "Ġword"), as vLLM encodes them."""
    if not params.bad_words:
        return params
    sequences = dict.fromkeys(params.bad_words_token_ids)  # ordered, once each
    for word in params.bad_words:  # the server bounds their length: this runs in the loop
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.update(
            dict.fromkeys(
                [alone] if len(spaced) != len(alone) or spaced[:1] == alone[:1] else [alone, spaced]
            )
        )
    sequences.pop((), None)  # a word that encodes to nothing bans nothing
    return replace_checked(params, bad_words_token_ids=tuple(sequences))
