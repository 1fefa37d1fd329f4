"""A model directory's own chat template, read as Hugging Face reads it, for a model table's
``chat_template = "model"``.

Where the template lives, first found wins (``transformers``' ``from_pretrained`` order)::

    chat_template.jinja             a file of its own, beside the tokenizer
    tokenizer_config.json           "chat_template": a string, or a list of
                                    {"name": ..., "template": ...} whose "default" is the one used

``tokenizer_config.json`` also names the special tokens a template may print (transformers hands a
template every one the tokenizer has). Pure: a file that is missing or malformed reads as no
template, so the caller says what it needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"
OTHER_TOKENS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")  # transformers' others


@dataclasses.dataclass(frozen=True, slots=True)
class ModelTemplate:
    """A model's chat template (Jinja source) and the special tokens it may print."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    others: tuple[tuple[str, str], ...] = ()  # (name, token) of the other special tokens it names

    @property
    def special_tokens(self) -> dict[str, str]:
        """What a template is given, as transformers gives it: each special token the tokenizer has."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, **dict(self.others)}
        return {name: token for name, token in named.items() if token}


def read_chat_template(model_dir: str | os.PathLike[str]) -> ModelTemplate | None:
    """The template shipped in ``model_dir`` (see the module's docstring), or None."""
    directory = Path(model_dir)
    settings = _read_json(directory / TOKENIZER_CONFIG)
    standalone = directory / TEMPLATE_FILE
    if standalone.is_file():
        source: str | None = standalone.read_text(encoding="utf-8")
    else:
        source = _default(settings.get("chat_template"))
    if source is None:
        return None
    others = tuple((name, _token(settings.get(name))) for name in OTHER_TOKENS if _token(settings.get(name)))
    return ModelTemplate(source, _token(settings.get("bos_token")), _token(settings.get("eos_token")), others)


def _read_json(path: Path) -> dict:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _default(template: object) -> str | None:
    """A ``chat_template`` entry: a string, or the template named ``default`` in a list of them."""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
