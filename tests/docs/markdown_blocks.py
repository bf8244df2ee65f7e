"""Read the fenced code blocks, their markers, the links and the anchors of a Markdown page.

The convention (docs/development.md, "Code blocks in the docs"): an HTML comment on the line
right before a fence says what the test does with the block.

    ```python             no marker: run (the page's python blocks, in order, in one process)
    <!-- file: NAME -->   written to NAME in the page's folder; a later `run` block runs it
    <!-- run -->          a bash/console block: run with bash in the page's folder
    <!-- run: cwd=repo timeout=60 -->   options: cwd=repo (the repository root), timeout=S
    <!-- run: cuda -->    run only where CUDA is present (skipped, and said, elsewhere)
    <!-- output -->       what a command prints; not run
    <!-- not-run: WHY --> not run, for the reason given (a reason is required)
    <!-- tested-by: tests/PATH.py::test_name -->  not run here; that test runs the same code

Any other block without a marker (bash, text, yaml, ...) fails the test, so a new block cannot
escape it unnoticed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("run", "file", "output", "not-run", "tested-by")
_MARKER = re.compile(r"^<!--\s*([a-z-]+)\s*(?::\s*(.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")


@dataclass
class Block:
    """One fenced code block and what its marker asks for."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str | None = None  # one of KINDS; None when unmarked
    arg: str = ""  # the text after "kind:"
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs_python(self) -> bool:
        return self.lang == "python" and self.kind in (None, "run")

    @property
    def runs_shell(self) -> bool:
        return self.lang != "python" and self.kind == "run"


def _parse_run_options(arg: str) -> dict[str, str]:
    opts: dict[str, str] = {}
    for word in arg.split():
        key, _, value = word.partition("=")
        opts[key] = value or "yes"
    return opts


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, each with the marker on the line before its fence."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        block = Block(path, i + 1, lang, "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k].strip()) if k >= 0 else None
        if marker:
            block.kind, block.arg = marker.group(1), (marker.group(2) or "").strip()
            if block.kind == "run":
                block.options = _parse_run_options(block.arg)
        found.append(block)
        i = j + 1
    return found


def problems(block: Block) -> list[str]:
    """Why ``block``'s marker is missing or wrong; empty when it is fine."""
    where = f"{block.where} ({block.lang or 'no language'})"
    if block.kind is None:
        if block.lang == "python":
            return []
        return [
            f"{where}: no marker; put <!-- run -->, <!-- output -->, <!-- not-run: WHY --> or "
            "<!-- tested-by: tests/...::test_... --> on the line before the fence"
        ]
    if block.kind not in KINDS:
        return [f"{where}: unknown marker {block.kind!r}; one of {', '.join(KINDS)}"]
    if block.kind == "not-run" and len(block.arg) < 8:
        return [f"{where}: <!-- not-run: WHY --> needs its reason, got {block.arg!r}"]
    if block.kind == "file" and not re.fullmatch(r"[\w./-]+", block.arg or ""):
        return [f"{where}: <!-- file: NAME --> needs a relative file name, got {block.arg!r}"]
    if block.kind == "run":
        unknown = set(block.options) - {"cwd", "timeout", "cuda"}
        if unknown:
            return [f"{where}: unknown run options {sorted(unknown)}; cwd=repo, timeout=S, cuda"]
        if block.options.get("cwd", "repo") != "repo":
            return [f"{where}: cwd= takes only 'repo', got {block.options['cwd']!r}"]
    if block.kind == "tested-by":
        target, _, name = block.arg.partition("::")
        test_file = ROOT / target
        if not test_file.is_file():
            return [f"{where}: tested-by names {target!r}, which does not exist"]
        if not name or not re.search(rf"^\s*def {re.escape(name)}\(", test_file.read_text(), re.M):
            return [f"{where}: tested-by names {name!r}, which {target} does not define"]
    return []


# --- links and anchors ---------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks, with inline code removed."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or line.strip() == fence):
            fence = m.group(2) if fence is None else None
            continue
        if fence is None:
            out.append((n, re.sub(r"`[^`]*`", "", line)))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code."""
    return [(n, m.group(1)) for n, text in prose(path) for m in _LINK.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for the headings of ``path`` (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in path.read_text().splitlines():
        m = _FENCE.match(line)
        if m and (fence is None or line.strip() == fence):
            fence = m.group(2) if fence is None else None
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fence is None and h:
            base = slug(h.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out
