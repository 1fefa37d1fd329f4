"""Chat templates: how a model reads a conversation, as the one prompt string it is given.

A model names its template in the config (``chat_template``): ``labelled`` (the default: the
system prompt, then each turn labelled, ``User: hello``, separated by blank lines); ``model``,
the Jinja template that ships with the model's tokenizer (read by
:mod:`gateway.text.model_template`) and rendered as Hugging Face renders it; or a path to a ``.jinja``
file of one's own. Jinja templates run in jinja2's immutable sandbox (a template is
configuration, not code, and may come with a downloaded model), with Hugging Face's conventions:
``messages`` as ``{role, content}``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``,
and ``raise_exception`` to refuse a conversation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from gateway.text.model_template import read_chat_template
from gateway.wire.api import InvalidRequest

Turn = tuple[str, str]  # (role, text)


class ChatTemplate(Protocol):
    name: str

    def render(self, system: str, turns: Sequence[Turn]) -> str:
        """The prompt for a conversation (the model's reply comes next)."""


class Labelled:
    """``System: ...`` then ``User: ...`` / ``Assistant: ...``, separated by blank lines."""

    name = "labelled"

    def render(self, system: str, turns: Sequence[Turn]) -> str:
        parts = [f"System: {system}"] if system else []
        parts += [f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in turns]
        return "\n\n".join(parts)


class TemplateRefused(InvalidRequest):
    """The template's ``raise_exception`` refused the conversation (a 400 for the client)."""


class Jinja:
    """A Hugging Face style chat template, rendered in jinja2's sandbox."""

    def __init__(self, source: str, name: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # only Jinja-templated models load it

        def refuse(message: str) -> None:
            raise TemplateRefused(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = refuse
        self.name = name
        self._template = environment.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, system: str, turns: Sequence[Turn]) -> str:
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": role, "content": text} for role, text in turns]
        return self._template.render(messages=messages, add_generation_prompt=True, **self._tokens)


def make_template(spec: str, tokenizer_path: str | None = None) -> ChatTemplate:
    """The template a model's config names: ``labelled``, ``model`` or a ``.jinja`` file."""
    if spec == Labelled.name:
        return Labelled()
    if spec == "model":
        return _from_model(tokenizer_path)
    path = os.path.expanduser(spec)
    try:
        with open(path, encoding="utf-8") as file:
            return Jinja(file.read(), path)
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
    return Jinja(found.source, f"{directory} (model)", found.bos_token, found.eos_token)
