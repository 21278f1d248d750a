"""The config reference in Markdown (docs/config.md), generated from the field docstrings."""

from __future__ import annotations

from pydantic import BaseModel

from shoal.config.load import MOVED
from shoal.config.root import SECTIONS


def config_reference() -> str:
    """The config reference in Markdown, from the field docstrings above (docs/config.md is this)."""
    from shoal.models.registry import builtin_model_configs

    def table(cls: type[BaseModel], skip=("name",)) -> list[str]:
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, f in cls.model_fields.items():
            if name in skip:
                continue
            ann = str(f.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
            ann = ann.replace("|", "\\|")
            default = f.default_factory() if f.default_factory else f.default
            text = " ".join((f.description or "").split()).replace("|", "\\|")
            rows.append(f"| `{f.alias or name}` | `{ann}` | `{default!r}` | {text} |".replace("`None`", "unset"))
        return rows

    out = ["# Config reference", "",
           "Generated from the field docstrings in `src/shoal/config/` and `src/shoal/models/`;",
           "`tests/unit/test_docs.py` fails when this page and the code disagree.", "",
           "## [model]", "", '`name` picks the model: a built-in name below, or `"package.module:function"` for '
           "your own (every other key in the section is passed to it).", ""]
    for name, cls in builtin_model_configs().items():
        out += [f'### name = "{name}"', "", (cls.__doc__ or "").strip(), "", *table(cls), ""]
    for name, cls in SECTIONS.items():
        out += [f"## [{name}]", "", *table(cls), ""]
    out += ["## Keys that moved", "",
            "A config file or `--set` with one of these is refused in one line naming the new key; a run dir or",
            "checkpoint written with them still resumes (they are moved on read).", "",
            "| was | now |", "|---|---|", *[f"| `{old}` | `{new}` |" for old, new in MOVED.items()], ""]
    return "\n".join(out)


