"""The chat templates of real model families, as their tokenizers ship them: test data, one JSON
file a model in ``tests/support/chat_templates/`` (its model, where it was copied from, its
special tokens and its template), read into what the gateway reads from a model directory."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.text.model_template import OTHER_TOKENS, ModelTemplate

FOLDER = Path(__file__).parent / "chat_templates"


def real_templates() -> dict[str, ModelTemplate]:
    """Each family's template by the file's name (``llama-3.1``, ``qwen-2.5``...)."""
    templates = {}
    for path in sorted(FOLDER.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        others = tuple((name, data[name]) for name in OTHER_TOKENS if name in data)
        templates[path.stem] = ModelTemplate(
            data["chat_template"], data.get("bos_token", ""), data.get("eos_token", ""), others
        )
    return templates
