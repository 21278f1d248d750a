"""The docs that describe code are generated from it; fail when they drift apart."""

from pathlib import Path

from doc_pages import DOCS, code_blocks
from shoal.config import SECTIONS, config_reference

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_current():
    expected = config_reference()
    actual = (ROOT / "docs/config.md").read_text()
    assert actual == expected, (
        "docs/config.md is stale; regenerate it with\n"
        "  python -c 'from shoal.config import config_reference; print(config_reference(), end=\"\")' > docs/config.md"
    )


def test_every_config_key_is_documented():
    for name, cls in SECTIONS.items():
        for key, field in cls.model_fields.items():
            assert field.description, f"[{name}] {key} has no docstring"


FILE_CONTENTS = {"toml", "python", "yaml"}  # a file's text, shown; not run


def test_every_code_block_is_run_or_marked_as_an_illustration():
    """A block is one of: `sh` (commands tests/integration/test_docs_commands.py runs as written),
    `<language> illustration` (not run: it needs root, a cluster, a GPU or minutes, or shows output),
    or a file's contents (toml, python, yaml). A bare block, or a command in any other, is refused."""
    wrong = []
    for path in DOCS:
        for line, info, _ in code_blocks(path):
            words = info.split()
            if not (words == ["sh"] or (len(words) == 2 and words[1] == "illustration")
                    or (len(words) == 1 and words[0] in FILE_CONTENTS)):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ```{info}")
    assert not wrong, "blocks neither run nor marked as illustration:\n" + "\n".join(wrong)
