"""Schemathesis hooks for server/openai/test_openapi.py, loaded through SCHEMATHESIS_HOOKS.

positive_data_acceptance wants every schema-valid body answered 2xx, but five of the
server's rules are beyond JSON Schema: a prompt (or the rendered messages) must encode to at
least one token and leave room in max_model_len for max_tokens (for one token without it),
min_tokens <= max_tokens, seed + n - 1 fits in 64 bits (choice i samples with seed + i),
with min_tokens, allowed_token_ids must hold more than eos and the stop ids (which
min_tokens bans), and continue_final_message needs text content in the final message (on
/tokenize too). A pooling route's every text must fit as a prompt does, and score's text_1
is one text or one for each text_2. A structured output's grammar must also compile and be
spelled by the model's vocabulary, which only the workers can tell. Positive cases breaking
them are dropped before they are sent; tokens are counted by the server's own /tokenize
route (with the body's chat-template fields, so the same prompt), so the route under test is
not its own judge. Negative cases are never dropped.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import schemathesis

from loomllm.server.openai.chat_template_fields import FIELDS as TEMPLATE_FIELDS

CLIENT = httpx.Client(  # one client: a new one per call costs a TLS context (~40 ms)
    base_url=os.environ["LOOM_TEST_BASE_URL"],
    timeout=30,
    headers={"Authorization": f"Bearer {os.environ['LOOM_TEST_API_KEY']}"},
)
EOS_IDS = {int(t) for t in os.environ["LOOM_TEST_EOS_IDS"].split(",")}
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": None}
# A pooling route's texts: each must encode to 1 to max_model_len - 1 tokens (an embedder's
# pair is two inputs).
POOLING_TEXTS = {
    "/v1/embeddings": ("input",),
    "/v1/score": ("text_1", "text_2"),
    "/score": ("text_1", "text_2"),
    "/v1/rerank": ("query", "documents"),
    "/rerank": ("query", "documents"),
}


MAX_MODEL_LEN = CLIENT.get("/v1/models").json()["data"][0]["max_model_len"]


def fits(body: dict[str, Any], max_tokens: int | None) -> bool:
    """True if `body`'s prompt (token ids, or a text or messages that /tokenize counts)
    leaves room for max_tokens (None: for one token)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        count = len(prompt)
    else:
        response = CLIENT.post("/tokenize", json=body)
        if response.status_code != 200:
            return False  # e.g. the chat template rejects these messages: so does the route
        count = response.json()["count"]
    return 0 < count and count + (max_tokens or 1) <= MAX_MODEL_LEN


@schemathesis.hook
def filter_case(ctx: Any, case: Any) -> bool:
    path, body = case.operation.path, case.body
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if not positive or not isinstance(body, dict):
        return True
    if body.get("continue_final_message") and not final_has_text(body.get("messages")):
        return False  # nothing to go on from
    if path in POOLING_TEXTS:
        first, second = body.get("text_1"), body.get("text_2")
        seconds = len(second) if isinstance(second, list) else 1
        if isinstance(first, list) and len(first) not in (1, seconds):
            return False  # pairs: one text_1, or one for each text_2
        return all(pooled_fits(body.get(name)) for name in POOLING_TEXTS[path])
    if path not in DEFAULT_MAX_TOKENS:
        return True
    if path == "/v1/completions":
        max_tokens = body.get("max_tokens")
        max_tokens = DEFAULT_MAX_TOKENS[path] if max_tokens is None else max_tokens
        prompt = body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) or not prompt else prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompts = [prompt]  # one prompt of token ids
        if not all(fits({"prompt": p}, max_tokens) for p in prompts):
            return False
    else:
        max_tokens = body.get("max_completion_tokens")
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        template = {name: body[name] for name in TEMPLATE_FIELDS if name in body}
        if not fits({"messages": body["messages"], **template}, max_tokens):
            return False
    seed = body.get("seed")
    if seed is not None and seed + (body.get("n") or 1) - 1 >= 2**63:
        return False
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[path]
    min_tokens = body.get("min_tokens") or 0
    if grammar_may_not_compile(body):
        return False
    allowed = body.get("allowed_token_ids")
    if allowed and min_tokens and set(allowed) <= EOS_IDS | set(body.get("stop_token_ids") or ()):
        return False
    return max_tokens is None or min_tokens <= max_tokens


def pooled_fits(value: Any) -> bool:
    """Whether each input in `value` (a text, token ids, or a list of either) fits."""
    if value is None:
        return True
    one = isinstance(value, str) or (value and isinstance(value[0], int))
    return all(fits({"prompt": item}, None) for item in ([value] if one else value))


def final_has_text(messages: Any) -> bool:
    """Whether the final message has text content (continue_final_message goes on from it;
    a message of tool calls alone has none)."""
    content = messages[-1].get("content") if isinstance(messages, list) and messages else None
    return isinstance(content, str | list)


def grammar_may_not_compile(body: dict[str, Any]) -> bool:
    """Any structured output: whether its grammar compiles, and whether this model's
    vocabulary can spell what it asks (the tiny model's words cannot spell JSON, nor most
    choices), only the workers can tell; a 400 then."""
    response_format = body.get("response_format") or {}
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        return True  # tools: "auto" is a 400, a demanded call is a grammar
    return response_format.get("type") not in (None, "text") or any(
        body.get(name) is not None
        for name in (
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        )
    )
