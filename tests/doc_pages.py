"""The project's Markdown pages and their fenced code blocks, for the tests that check the docs (tests/unit/test_docs.py)
and run their commands (tests/integration/test_docs_commands.py, tests/unit/test_docs_gpu_commands.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def code_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, info string, body) of every fenced block in a Markdown file."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info = i + 1, lines[i][3:].strip()
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            out.append((start, info, "\n".join(lines[start:i])))
        i += 1
    return out
