"""The safety stage: a check on the input before admission and on the output before return.

Safety checks are one stage of the request path, on the way in and on the way out. The stage is
pluggable (anything with ``screen_input`` and ``screen_output``); the default is a blocklist of
terms from the config, matched case-insensitively on word boundaries. A blocked input is refused
(400) before it costs a GPU anything; a blocked output is replaced by a refusal (or, in a stream
that has already shown text, ends with ``stop_reason`` ``refusal``: ``gateway/text/answer.py``), so
what the client receives never contains a blocked term. The verdict names the rule, never the text, so
it can be counted and logged without leaking a prompt.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

REFUSAL = "I can't help with that."


class SafetyCheck(Protocol):
    refusal: str
    lookback: int
    """Characters of context a verdict on new output needs: a stream holds back this many
    characters until the text after them can be judged (0: judge each piece alone)."""

    def screen_input(self, text: str) -> str | None:
        """The name of the rule the input breaks, or None when it may go on."""

    def screen_output(self, text: str) -> tuple[str, str | None]:
        """The text to return (a refusal if blocked) and the rule it broke, if any."""

    def screen_stream(self, text: str, final: bool) -> str | None:
        """The rule a stretch of output breaks. Unless ``final``, more text follows it, so a
        verdict that the next characters could still undo (a term at the very end, which may
        be the start of a longer word) waits for them."""


class Blocklist:
    """Refuse inputs and outputs that contain any of ``terms`` (whole words, any case)."""

    def __init__(self, terms: Iterable[str], refusal: str = REFUSAL) -> None:
        self.terms = sorted({term.strip().lower() for term in terms if term.strip()})
        self.refusal = refusal
        self.lookback = max(map(len, self.terms)) + 1 if self.terms else 0  # a term and the boundary after it
        pattern = "|".join(re.escape(term) for term in self.terms)
        self._pattern = re.compile(rf"(?<!\w)(?:{pattern})(?!\w)", re.IGNORECASE) if self.terms else None

    def _rule(self, text: str) -> str | None:
        return self.screen_stream(text, final=True)

    def screen_stream(self, text: str, final: bool) -> str | None:
        if self._pattern is None:
            return None
        for match in self._pattern.finditer(text):
            if final or match.end() < len(text):
                return f"blocklist[{self.terms.index(match.group(0).lower())}]"
        return None

    def screen_input(self, text: str) -> str | None:
        return self._rule(text)

    def screen_output(self, text: str) -> tuple[str, str | None]:
        rule = self._rule(text)
        return (text, None) if rule is None else (self.refusal, rule)
