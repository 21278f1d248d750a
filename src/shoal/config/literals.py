"""Python values as the TOML literals of config overrides (`--set KEY=VALUE`): what shoal.train()'s
`overrides` and a Session's keyword sections turn into."""

from __future__ import annotations

import json
from collections.abc import Callable

from shoal.errors import UserError


def overrides_as_sets(overrides: dict | None) -> list[str]:
    """{"train.steps": 100, ...} as the "train.steps=100" strings load_config takes."""
    return [f"{key}={toml_value(key, value)}" for key, value in (overrides or {}).items()]


def toml_value(key: str, value: object) -> str:
    """`value` as the TOML literal an override takes; a callable as "module:qualname"."""
    if callable(value):
        value = importable_name(key, value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: quotes and escapes as JSON's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(key, v) for v in value) + "]"
    raise UserError(f"{key}: {type(value).__name__} values cannot be passed; give a number, string, bool or list")


def importable_name(key: str, fn: Callable) -> str:
    """The "module:qualname" workers import `fn` by, checked to lead back to `fn`."""
    import importlib

    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise UserError(f"{key}: {getattr(fn, '__name__', fn)!r} cannot be imported by the workers (defined in "
                        f"{module or 'no module'}{', inside a function' if '<locals>' in qualname else ''}); define "
                        f"it at the top level of an importable module and pass it, or its 'module:function' name")
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not fn:
        raise UserError(f"{key}: {module}:{qualname} does not lead back to the callable passed; pass its "
                        f"'module:function' name instead")
    return f"{module}:{qualname}"
