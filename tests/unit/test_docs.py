"""The docs that describe code are generated from it; fail when they drift apart."""

from pathlib import Path

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
