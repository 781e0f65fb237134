"""Every command the README and the docs show, for the tests that run them
(``tests/test_doc_commands.py`` without a gateway, ``tests/server/test_doc_commands_live.py``
against one): the lines of shell blocks, the ``$ `` lines and known programs of plain
blocks, Python blocks whole, and inline code that is a command line (``semcache …``,
``make …``, ``python -c``/``-m …``, ``python scripts/….py``, ``pip install …``, a script with
its arguments, ``kill -HUP <pid>``, ``redis-cli …``, ``podman …``, ``kubectl …``,
``helm …``, ``curl -…``, ``xdg-open …``)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from server.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
GATEWAY = "http://127.0.0.1:8080"
"""The address the docs give the gateway (`make serve`)."""

PROGRAMS = frozenset(
    {"semcache", "curl", "make", "sudo", "xdg-open", "export", "python", "pip", "kill"}
)
"""First words of command lines (besides ``.venv/bin/…`` and ``scripts/…``)."""

_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"`([^`\n]+)`")
_ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")
_INLINE_COMMAND = re.compile(
    r"^(?:semcache (?:--help|[a-z][\w-]*|COMMAND)\b|make \w|python -[cm] |pip install |"
    r"(?:sudo )?scripts/\S+\.sh \S|kill -\w+ <|redis-cli |"
    r"(?:\.venv/bin/)?python scripts/\S+\.py|podman(?:-compose)? [a-z]|kubectl [a-z]|"
    r"helm [a-z]|curl -|xdg-open \S)"
)
_SEMCACHE_WORDS = frozenset(
    {
        "serve",
        "backends",
        "config",
        "policy",
        "cache",
        "usage",
        "keys",
        "calibrate",
        "train-verifier",
        "train-classifier",
        "--help",
        "COMMAND",
    }
)


@dataclass(frozen=True)
class DocCommand:
    file: str
    """Relative to the repository root."""
    line: int
    text: str
    """The command (continued lines joined as written), or a Python block's code."""
    python: bool = False
    block: int | None = None
    """Which fenced block of the file holds it (its commands run in order); None inline."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text.splitlines()[0]}"

    @property
    def words(self) -> list[str]:
        """The shell words, comments and leading ``VAR=value`` assignments dropped."""
        return shlex.split(_ENV.sub("", self.text.replace("\\\n", " ")), comments=True)

    @property
    def program(self) -> str:
        """``python`` for a Python block; else the first word (after ``sudo``): a program,
        ``.venv/bin/X`` as ``X``, a script as its path."""
        if self.python:
            return "python"
        words = self.words
        first = words[1] if words[0] == "sudo" else words[0]
        return first.removeprefix(".venv/bin/")


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "policies" / "README.md", *sorted(REPO.glob("docs/*.md"))]


def _complete(text: str) -> bool:
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def _is_command(line: str) -> bool:
    first = _ENV.sub("", line).split(" ", 1)[0]
    return first in PROGRAMS or re.fullmatch(r"\.venv/bin/\S+|scripts/\S+\.sh", first) is not None


def _shell_lines(lines: list[str], start: int, lang: str) -> list[tuple[int, str]]:
    """The commands of one shell (``sh``) or plain block; ``start``: its first line's
    number."""
    out: list[tuple[int, str]] = []
    text, first = "", 0
    for number, raw in enumerate(lines, start):
        if text:
            text += "\n" + raw
        else:
            line = raw.strip()
            if line.startswith("$ "):
                line = line[2:]
            elif lang != "sh" and not _is_command(line):
                continue  # output, a diagram, a file's text
            if not line or line.startswith("#"):
                continue
            text, first = line, number
        if _complete(text):
            out.append((first, text))
            text = ""
    return out


def _inline(line: str) -> list[str]:
    found = []
    for span in _INLINE.findall(line):
        if not _INLINE_COMMAND.match(span):
            continue
        words = span.split()
        if words[0] == "semcache" and words[1] not in _SEMCACHE_WORDS:
            continue
        found.append(span)
    return found


def doc_commands() -> list[DocCommand]:
    """Every command of every doc file, in the order they come."""
    out: list[DocCommand] = []
    for path in doc_files():
        name = str(path.relative_to(REPO))
        lines = path.read_text().splitlines()
        block = -1
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if fence is None:
                out += [DocCommand(name, i + 1, span) for span in _inline(lines[i])]
                i += 1
                continue
            lang = fence.group(1)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = lines[i + 1 : end]
            block += 1
            if lang == "python":
                out.append(DocCommand(name, i + 2, "\n".join(body), python=True, block=block))
            elif lang in ("sh", "bash", ""):
                for number, text in _shell_lines(body, i + 2, lang or "plain"):
                    out.append(DocCommand(name, number, text, block=block))
            i = end + 1
    return out


# -- the `semcache` command lines -------------------------------------------------------------

DOC_TOKEN = "T"
"""The admin token the docs' examples give (``--token T``): the live test's gateway takes it."""

GATEWAY_COMMANDS = frozenset({("cache", "purge"), ("usage",), ("keys",)})
"""Commands that call a running gateway: the live test runs them against one."""

_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(?:[./,][A-Z0-9_]+)*(?:\.jsonl)?|.*[…|<>].*")


def semcache_args(cmd: DocCommand) -> list[str]:
    """The arguments after ``semcache``, an optional part's brackets dropped (``[--tenant
    acme]`` is ``--tenant acme``) and ``\\|`` read as ``|``."""
    out = []
    for word in cmd.words[1:]:
        word = word.replace("\\|", "|").strip("[]")
        if word:
            out.append(word)
    return out


def is_synopsis(args: list[str]) -> bool:
    """The command names a placeholder (``FILE``, ``KIND``, ``+1|-1``, ``…``) rather than a
    value, so it shows a form to fill in (``--token T`` is the docs' admin token)."""
    return any(
        _PLACEHOLDER.fullmatch(word) and not (word == DOC_TOKEN and i and args[i - 1] == "--token")
        for i, word in enumerate(args)
    )


def calls_gateway(args: list[str]) -> bool:
    return tuple(args[:2]) in GATEWAY_COMMANDS or tuple(args[:1]) in GATEWAY_COMMANDS


def parses(args: list[str]) -> bool:
    """``semcache`` takes these arguments (its own parser, as the command line runs it)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            return exc.code == 0  # --help
    return True


def live(cmd: DocCommand) -> bool:
    """Run by the live test against a gateway: Python blocks, curl and xdg-open on the docs'
    gateway address, and the whole `semcache` command lines that call a gateway."""
    if cmd.python:
        return True
    if cmd.program in ("curl", "xdg-open"):
        return GATEWAY in cmd.text
    if cmd.program == "semcache":
        args = semcache_args(cmd)
        return calls_gateway(args) and not is_synopsis(args) and parses(args)
    return False
