"""Chat templates rendered as Hugging Face renders them (transformers' ``chat_template_utils``),
so a model's own template gives the prompt it was trained on, byte for byte.

The environment is jinja2's immutable sandbox (a template is configuration, and may come with a
downloaded model) with what transformers adds to it: ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension (``{% break %}``), the ``{% generation %}`` tag (rendered as its
body), a ``tojson`` that does not escape HTML and takes ``indent``, ``separators`` and
``sort_keys``, ``strftime_now``, ``raise_exception``, and a ``dict`` and ``namespace`` that hold
no underscore-named attribute. :func:`render` continues a final message as
``continue_final_message`` does, or opens the next turn (``add_generation_prompt``)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.wire.api import InvalidRequest

Clock = Callable[[], datetime.datetime]
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own marker, so the cut is the same


class TemplateRefused(InvalidRequest):
    """The template refused the conversation (``raise_exception``), or cannot continue its last
    message: a 400 for the client."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks what the assistant wrote, for training
    masks; a prompt is its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads the class's set of tags

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _refuse(message: str) -> None:
    raise TemplateRefused(str(message))


class _Dict:
    """``dict(...)`` in a template: a plain dict, and nothing reachable through the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)``: jinja2's, refusing attributes named with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's own signature trick: any name
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")


def environment(now: Clock = datetime.datetime.now) -> ImmutableSandboxedEnvironment:
    """A Jinja environment as transformers makes one; ``now`` is ``strftime_now``'s clock."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: now().strftime(fmt), dict=_Dict(),
                       namespace=_Namespace)
    return env


def render(template: jinja2.Template, source: str, messages: list[dict[str, str]], continue_final: bool,
           **variables: Any) -> str:
    """The prompt for ``messages``: the next turn opened, or, with ``continue_final``, the last
    message left open for the model to continue (cut where transformers cuts it). ``variables``
    are the special tokens; ``tools`` and ``documents`` are None, as transformers passes them."""
    variables.update(tools=None, documents=None, add_generation_prompt=not continue_final)
    if not continue_final:
        return template.render(messages=messages, **variables)
    final = messages[-1]["content"]
    if "content" not in source:
        raise TemplateRefused("messages: this model's chat template cannot continue a final assistant turn")
    tagged = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
    rendered = template.render(messages=tagged, **variables)
    marker = CONTINUE_TAG.strip()
    if final.strip() not in rendered or marker not in rendered:
        raise TemplateRefused("messages: this model's chat template drops part of the final assistant turn")
    cut = rendered.rindex(marker)
    if rendered[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:cut]
    return rendered[:cut].rstrip()  # the template trimmed the message's end: trim the prompt's too
