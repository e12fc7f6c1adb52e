"""Every documentation block marked runnable works as written.

A block is marked by a line `<!-- runnable -->` immediately before its opening fence
(```bash, ```sh or ```python) in README.md or docs/*.md. Each marked block runs in a fresh
temporary directory as its working directory: bash blocks with `bash -euo pipefail -c`, the
virtualenv's bin directory first on PATH (so `serve-app` and `python` are this project's);
Python blocks with this interpreter. Both import this checkout (its root first on
PYTHONPATH). A block passes when it exits 0 within its time limit.

Mark only blocks that need no network, GPU, cluster or long-running server and finish in
seconds; docs/testing.md says how.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "README.md").is_file():
            return folder
    raise RuntimeError(f"no repository root (pyproject.toml + README.md) above {here}")


ROOT = _repo_root()
MARKER = "<!-- runnable -->"
# The languages a marked block may have, and what runs it.
LANGUAGES = {"bash": "bash", "sh": "bash", "python": "python"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\s`]*)")
# Without enough marked blocks the test would pass however wrong the docs are.
MIN_BLOCKS = 6
TIMEOUT_S = 240  # a hang, not a slow machine: blocks take seconds on two quiet cores


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def scan(path: Path) -> tuple[list[Block], list[str]]:
    """The marked blocks of one Markdown file, and what is wrong with its markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    where = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = FENCE.match(line)
        if line.strip() == MARKER:
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if nxt is None:
                problems.append(f"{where}:{i + 1}: {MARKER} is not immediately before a fence")
                i += 1
                continue
            language = nxt["info"].lower()
            if language not in LANGUAGES:
                problems.append(
                    f"{where}:{i + 2}: a runnable block must be one of "
                    f"{', '.join(sorted(LANGUAGES))}, not {language or 'a bare fence'!r}"
                )
            end = _closing(lines, i + 1, nxt)
            if end is None:
                problems.append(f"{where}:{i + 2}: the runnable block is never closed")
                break
            indent = len(nxt["indent"])
            body = [_dedent(text, indent) for text in lines[i + 2 : end]]
            if language in LANGUAGES:
                blocks.append(Block(path, i + 2, LANGUAGES[language], "\n".join(body) + "\n"))
            i = end + 1
        elif opening is not None:  # an unmarked block: skip it whole (markers in it are text)
            end = _closing(lines, i, opening)
            i = len(lines) if end is None else end + 1
        else:
            i += 1
    return blocks, problems


def _dedent(text: str, width: int) -> str:
    """`text` without up to `width` leading blanks (a block's indent inside a list)."""
    k = 0
    while k < width and k < len(text) and text[k] in " \t":
        k += 1
    return text[k:]


def _closing(lines: list[str], start: int, opening: re.Match[str]) -> int | None:
    fence = opening["fence"]
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
            return j
    return None


def collect() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for path in doc_files():
        found, wrong = scan(path)
        blocks += found
        problems += wrong
    return blocks, problems


BLOCKS, PROBLEMS = collect()


def test_markers_are_well_formed() -> None:
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_enough_blocks_are_marked() -> None:
    ids = [block.id for block in BLOCKS]
    assert len(BLOCKS) >= MIN_BLOCKS, f"only {len(BLOCKS)} runnable blocks: {ids}"
    assert any(block.path.name == "README.md" for block in BLOCKS), "none in README.md"
    assert {block.language for block in BLOCKS} == {"bash", "python"}, ids


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(block: Block, cwd: Path) -> tuple[int | None, str, str]:
    if block.language == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        argv = [sys.executable, "-c", block.code]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so a timeout ends its children too
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    status, out, err = _run(block, tmp_path)
    if status == 0:
        return
    what = f"timed out after {TIMEOUT_S}s" if status is None else f"exited {status}"
    pytest.fail(
        f"{block.id} ({block.language}) {what}\n"
        f"--- block ---\n{block.code}--- stdout ---\n{out}--- stderr ---\n{err}",
        pytrace=False,
    )


# Repository paths and modules the pages name (`serve_app/grammar/spec.py`, `tests/...`,
# `serve_app.grammar.spec`): each must exist, so a move or a rename cannot leave a page behind.
REPO_PATH = re.compile(
    r"\b((?:serve_app|actors|tests|benchmarks|deploy|notebooks)/[\w/.-]+?"
    r"\.(?:py|md|yaml|ipynb|jinja))\b"
)
MODULE = re.compile(r"\b((?:serve_app|actors)(?:\.[a-z_][a-z0-9_]*)+)")
# Made by a run, not kept in the repository.
GENERATED = {"notebooks/quickstart-run.ipynb"}


def _defines(source: Path, name: str) -> bool:
    """Whether a module's text defines or imports `name` at its top level."""
    pattern = rf"^(?:(?:async )?def |class ){name}\b|^{name}\s*[:=]|^from \S+ import .*\b{name}\b"
    text = source.read_text()
    return bool(re.search(pattern, text, re.M)) or f'"{name}"' in text  # or in __all__


def _module_exists(dotted: str) -> bool:
    """A module or package of this checkout, or a name one defines (`pkg.mod.Name`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        rest = parts[n:]
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                return not rest or _defines(source, rest[0])
    return False


def test_every_path_and_module_the_docs_name_exists() -> None:
    missing = []
    for path in [*doc_files(), *sorted((ROOT / "benchmarks").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT).as_posix()
        for match in REPO_PATH.finditer(text):
            name = match.group(1)
            if name not in GENERATED and not (ROOT / name).exists():
                missing.append(f"{where}: {name}")
        for match in MODULE.finditer(text):
            if not _module_exists(match.group(1)):
                missing.append(f"{where}: {match.group(1)}")
    assert not missing, "\n".join(missing)
