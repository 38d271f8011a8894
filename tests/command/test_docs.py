"""The docs' code agrees with the code: every ```python block of README.md and docs/*.md
imports what it imports, and passes mypy --strict (the project's own settings).

A block that is a fragment (it uses a ``sema`` or a ``client`` made elsewhere) is preceded
by an HTML comment, invisible on the rendered page, that declares what it uses::

    <!-- doc-check prelude
    import conch
    sema: conch.Semaphore
    -->

A block with ``await`` or ``async with`` at its top level is checked as the body of an
``async def``, as a reader pastes it into one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(?:<!-- doc-check prelude\n(?P<prelude>.*?)-->\n)?(?P<indent>[ \t]*)```python\n"
    r"(?P<code>.*?)^[ \t]*```",
    re.S | re.M,
)


def blocks() -> list[tuple[str, str]]:
    """(where, module source) for every python block of the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start("code")].count("\n") + 1
            code = textwrap.dedent(match["code"])
            prelude = textwrap.dedent(match["prelude"] or "")
            found.append((f"{path.relative_to(ROOT)}:{line}", as_module(prelude, code)))
    return found


def as_module(prelude: str, code: str) -> str:
    try:
        compile(code, "<doc>", "exec", dont_inherit=True)
    except SyntaxError:
        # top-level await / async with: the body of a coroutine
        code = "async def _doc_block() -> None:\n" + textwrap.indent(code, "    ")
    return prelude + "\n" + code


BLOCKS = blocks()


def test_the_docs_have_code_blocks_to_check() -> None:
    assert len(BLOCKS) >= 8, [where for where, _ in BLOCKS]


@pytest.mark.parametrize(("where", "source"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_docs_block_imports(where: str, source: str) -> None:
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}"
                ), f"{where}: {node.module} has no {alias.name}"


def test_every_docs_block_passes_mypy_strict(tmp_path: Path) -> None:
    names = {}
    for i, (where, source) in enumerate(BLOCKS):
        path = tmp_path / f"doc_block_{i}.py"
        path.write_text(source)
        names[path.name] = where
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            *sorted(str(p) for p in tmp_path.glob("doc_block_*.py")),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        timeout=600,
    )
    report = run.stdout
    for file, where in names.items():
        report = report.replace(str(tmp_path / file), where).replace(file, where)
    assert run.returncode == 0, report
