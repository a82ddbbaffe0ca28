"""A body's chat-template fields: vLLM's extras to /v1/chat/completions, listed in FIELDS.

The chat route and /tokenize parse them alike, so /tokenize counts the very prompt chat sends.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from loomllm.server.bodies.chat_fields import TemplateBody
from loomllm.server.openai.api_error import bad

FIELDS = tuple(TemplateBody.model_fields)
# A rendering error that names chat_template (one that does not compile) is a 400 naming it.
TEMPLATE_ERRORS = {"chat_template": "chat_template", "messages": "messages"}


@dataclass(frozen=True, slots=True)
class TemplateFields:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a template's name, or (trusted) a template itself
    variables: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, documents

    def chat_kwargs(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Engine.chat's keyword arguments."""
        variables = dict(self.variables)
        if tools:
            variables["tools"] = tools
        return {
            "chat_template": self.chat_template,
            "chat_template_kwargs": variables,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def render_kwargs(self) -> dict[str, Any]:
        """Tokenizer.apply_chat_template's keyword arguments."""
        kwargs = dict(self.variables)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return {
            **kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


def parse_template_fields(
    body: TemplateBody, template_names: Collection[str], trust_templates: bool
) -> TemplateFields:
    """The fields of `body`; a 400 naming chat_template for a template the server does not take.

    `chat_template` may name one of the model's templates (`template_names`); a template's
    own text only with `trust_templates` (--trust-request-chat-template, as vLLM has it: a
    template is code, and a sandboxed one can still spin for as long as it likes).
    """
    template = body.chat_template
    if template is not None and template not in template_names and not trust_templates:
        names = ", ".join(sorted(template_names)) or "none"
        raise bad(
            f"chat_template: this server takes the model's own templates only (its "
            f"names: {names}); start it with --trust-request-chat-template to send a "
            f"template's text"[:300],
            "chat_template",
        )
    variables = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        variables["documents"] = body.documents
    return TemplateFields(
        body.add_generation_prompt is not False,
        bool(body.continue_final_message),
        template,
        variables,
    )


def echoed_text(messages: list[Any]) -> str:
    """What chat's `echo` puts before the answer: the final message's text when it is the
    assistant's own (continue_final_message goes on from it), else nothing. (vLLM echoes a
    final message of any role, and answers in that role; here the answer is the
    assistant's, so only its own text is echoed.)"""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):  # text parts, joined as the chat template sees them
        return "\n".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return content if isinstance(content, str) else ""
