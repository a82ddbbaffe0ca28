"""A body's chat-template fields: vLLM's extras to /v1/chat/completions, listed in FIELDS.

The chat route and /tokenize parse them alike, so /tokenize counts the very prompt chat sends.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from loomllm.server.openai.api_error import bad

FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "documents",
)
# A rendering error that names chat_template (one that does not compile) is a 400 naming it.
TEMPLATE_ERRORS = {"chat_template": "chat_template", "messages": "messages"}
# Names the template sees from the body's own fields: chat_template_kwargs cannot set them
# (chat_template there would pass a template past --trust-request-chat-template).
RESERVED_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
    }
)


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
    body: dict[str, Any], template_names: Collection[str], trust_templates: bool
) -> TemplateFields:
    """The fields of `body`; 400 naming the field for a bad one.

    `chat_template` may name one of the model's templates (`template_names`); a template's
    own text only with `trust_templates` (--trust-request-chat-template, as vLLM has it: a
    template is code, and a sandboxed one can still spin for as long as it likes).
    """
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(name)
        if value is not None and type(value) is not bool:
            raise bad(f"{name} must be true or false, got {value!r}"[:300], name)
        flags[name] = default if value is None else value
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise bad(
            "continue_final_message goes on with the final message, add_generation_prompt "
            "starts a new one: set add_generation_prompt to false",
            "continue_final_message",
        )
    template = body.get("chat_template")
    if template is not None:
        if not isinstance(template, str) or not template:
            raise bad("chat_template must be a template's name or text", "chat_template")
        if template not in template_names and not trust_templates:
            names = ", ".join(sorted(template_names)) or "none"
            raise bad(
                f"chat_template: this server takes the model's own templates only (its "
                f"names: {names}); start it with --trust-request-chat-template to send a "
                f"template's text"[:300],
                "chat_template",
            )
    variables = body.get("chat_template_kwargs")
    if variables is None:
        variables = {}
    if not isinstance(variables, dict):
        raise bad(
            "chat_template_kwargs must be an object of template variables", "chat_template_kwargs"
        )
    if reserved := sorted(RESERVED_VARIABLES.intersection(variables)):
        raise bad(
            f"chat_template_kwargs cannot set {', '.join(reserved)}: send the body's own field",
            "chat_template_kwargs",
        )
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise bad("documents must be a list of objects", "documents")
        variables = {**variables, "documents": documents}
    return TemplateFields(
        flags["add_generation_prompt"], flags["continue_final_message"], template, variables
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
