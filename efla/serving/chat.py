"""Chat messages to a prompt's token ids through a chat template (the tokenizer's, or the one the server
was started with)."""

from __future__ import annotations

from jinja2 import TemplateError

from .protocol import APIError

__all__ = ["render_chat", "NO_TEMPLATE"]

NO_TEMPLATE = (
    "messages: this model's tokenizer has no chat template; start the server with --chat-template FILE "
    "(a Jinja chat template), or send a prompt to /v1/completions"
)


def render_chat(
    tokenizer, messages: list[dict], template: str | None, add_generation_prompt: bool, add_special_tokens: bool | None = None
) -> list[int]:
    """The token ids of ``messages`` rendered by ``template`` (``None``: the tokenizer's); the template
    writes the special tokens, so none are added unless ``add_special_tokens``."""
    template = template if template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, NO_TEMPLATE, param="messages", code="chat_template_missing")
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as error:
        raise APIError(400, f"messages: the chat template refused them: {error}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=bool(add_special_tokens))["input_ids"])
