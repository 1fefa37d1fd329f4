"""The commands the documentation shows: every line of a fenced code block and every inline code
span of README.md, docs/, experiments/README.md and experiments/docs/ that runs ``ferry``,
``python -m MODULE``, ``python SCRIPT.py``, ``pytest`` or ``make``, with where it was found, so
that a test can check each still parses as written."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/*.md", "experiments/README.md", "experiments/docs/*.md")

PYTHON = r"(?:[\w.\-/]*/)?python3?"
COMMAND = re.compile(
    rf"^(?:{PYTHON}\s+-m\s+\S|{PYTHON}\s+\S+\.py(?:\s|$)|ferry(?:\s|$)|make(?:\s|$)|pytest\s)"
)
FENCE = re.compile(r"^\s*```")
INLINE = re.compile(r"`([^`]+)`")


@dataclasses.dataclass(frozen=True)
class Command:
    page: str  # the page's path from the repository root
    line: int  # where the command starts on it
    text: str  # as written, whitespace folded, a trailing comment dropped

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text.replace("\\|", "|"))

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def pages() -> list[Path]:
    return sorted({path for pattern in PAGES for path in ROOT.glob(pattern)})


def _command(page: str, line: int, text: str) -> Command | None:
    text = " ".join(text.split())
    if not COMMAND.match(text):
        return None
    text = " ".join(shlex.split(text, comments=True, posix=False))
    words = text.split()
    if len(words) > 1 and words[1].endswith(":"):
        return None  # a message that quotes the program ("ferry reload: ..."), not a command
    return Command(page, line, text)


def commands_on(path: Path) -> list[Command]:
    """The commands of one page: code blocks' lines first, then inline spans, each in page order."""
    page, found = str(path.relative_to(ROOT)), []
    prose: list[tuple[int, str]] = []  # (line number, line) outside code blocks
    in_block, pending = False, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
        elif not in_block:
            prose.append((number, line))
        elif line.endswith("\\"):
            pending += line[:-1] + " "
        else:
            found.append(_command(page, number, pending + line))
            pending = ""
    text = "\n".join(line for _, line in prose)  # an inline span may wrap onto the next line
    for match in INLINE.finditer(text):
        found.append(_command(page, prose[text.count("\n", 0, match.start())][0], match.group(1)))
    return [command for command in found if command is not None]


def documented_commands() -> list[Command]:
    return [command for path in pages() for command in commands_on(path)]
