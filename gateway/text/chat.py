"""Chat templates: how a model reads a conversation, as the one prompt string it is given.

A model names its template in the config (``chat_template``): ``labelled`` (the default: the
system prompt, then each turn labelled, ``User: hello``, separated by blank lines); ``model``,
the Jinja template that ships with the model's tokenizer (read by
:mod:`gateway.text.model_template`); or a path to a ``.jinja`` file of one's own. Jinja templates
render as Hugging Face renders them (:mod:`gateway.text.hf_template`): ``messages`` as ``{role,
content}``, the special tokens, ``raise_exception`` to refuse a conversation. A conversation
whose last turn is the assistant's (a prefill) is left open for the model to continue.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from gateway.text import hf_template
from gateway.text.hf_template import TemplateRefused as TemplateRefused  # what a refusal raises
from gateway.text.model_template import ModelTemplate, read_chat_template

Turn = tuple[str, str]  # (role, text)


class ChatTemplate(Protocol):
    name: str

    def render(self, system: str, turns: Sequence[Turn], prefill: bool = False) -> str:
        """The prompt for a conversation: the model's reply comes next, or (``prefill``) it
        continues the last turn, the assistant's."""


class Labelled:
    """``System: ...`` then ``User: ...`` / ``Assistant: ...``, separated by blank lines; a
    prefill is the last of them, which the model continues."""

    name = "labelled"

    def render(self, system: str, turns: Sequence[Turn], prefill: bool = False) -> str:
        parts = [f"System: {system}"] if system else []
        parts += [f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in turns]
        return "\n\n".join(parts)


class Jinja:
    """A Hugging Face chat template, rendered as transformers renders it."""

    def __init__(self, template: ModelTemplate, name: str) -> None:
        self.name = name
        self._source = template.source
        self._template = hf_template.environment().from_string(template.source)
        self._tokens = template.special_tokens

    def render(self, system: str, turns: Sequence[Turn], prefill: bool = False) -> str:
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": role, "content": text} for role, text in turns]
        return hf_template.render(self._template, self._source, messages, prefill, **self._tokens)


def make_template(spec: str, tokenizer_path: str | None = None) -> ChatTemplate:
    """The template a model's config names: ``labelled``, ``model`` or a ``.jinja`` file."""
    if spec == Labelled.name:
        return Labelled()
    if spec == "model":
        return _from_model(tokenizer_path)
    path = os.path.expanduser(spec)
    try:
        with open(path, encoding="utf-8") as file:
            return Jinja(ModelTemplate(file.read()), path)
    except OSError as exc:
        raise ValueError(
            f"chat_template: expected 'labelled', 'model' or a .jinja file, got {spec!r} ({exc})"
        ) from None


def _from_model(tokenizer_path: str | None) -> Jinja:
    """The template shipped beside a model's tokenizer."""
    directory = os.path.expanduser(tokenizer_path or "")
    if not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    found = read_chat_template(directory)
    if found is None:
        raise ValueError(
            f"chat_template: 'model', but no chat template ships with the tokenizer in {directory!r}"
        )
    return Jinja(found, f"{directory} (model)")
