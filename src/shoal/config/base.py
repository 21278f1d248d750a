"""What every config section is: a frozen, strict pydantic model whose field docstrings are its docs."""

from __future__ import annotations

import sys

from pydantic import BaseModel, ConfigDict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["Section", "tomllib"]


class Section(BaseModel):
    # strict: a TOML string "100" is not silently an int; extra keys are errors, not ignored.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)
