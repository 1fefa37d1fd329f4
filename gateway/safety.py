"""The safety stage: a check on the input before admission and on the output before return.

Seed 000 §1.1 puts safety checks in scope as one stage of the request path. The stage is
pluggable (anything with ``screen_input`` and ``screen_output``); the default is a blocklist of
terms from the config, matched case-insensitively on word boundaries. A blocked input is refused
(400) before it costs a GPU anything; a blocked output is replaced by a refusal, so what the
client receives never contains a blocked term. The verdict names the rule, never the text, so
it can be counted and logged without leaking a prompt.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

REFUSAL = "I can't help with that."


class SafetyCheck(Protocol):
    def screen_input(self, text: str) -> str | None:
        """The name of the rule the input breaks, or None when it may go on."""

    def screen_output(self, text: str) -> tuple[str, str | None]:
        """The text to return (a refusal if blocked) and the rule it broke, if any."""


class Blocklist:
    """Refuse inputs and outputs that contain any of ``terms`` (whole words, any case)."""

    def __init__(self, terms: Iterable[str], refusal: str = REFUSAL) -> None:
        self.terms = sorted({term.strip().lower() for term in terms if term.strip()})
        self.refusal = refusal
        pattern = "|".join(re.escape(term) for term in self.terms)
        self._pattern = re.compile(rf"(?<!\w)(?:{pattern})(?!\w)", re.IGNORECASE) if self.terms else None

    def _rule(self, text: str) -> str | None:
        if self._pattern is None:
            return None
        match = self._pattern.search(text)
        return None if match is None else f"blocklist[{self.terms.index(match.group(0).lower())}]"

    def screen_input(self, text: str) -> str | None:
        return self._rule(text)

    def screen_output(self, text: str) -> tuple[str, str | None]:
        rule = self._rule(text)
        return (text, None) if rule is None else (self.refusal, rule)
