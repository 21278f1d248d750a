"""Loading a config: a TOML file (or the defaults), `--set section.key=value` overrides, validation into
a frozen Config, and every user mistake as one `UserError` line naming where the value came from (the
file or `--set`), the key, the value and what is allowed; unknown keys get the closest valid key.

[Note: moved keys] Keys that moved to another section (MOVED: the layout's [parallel] once held the
step synchronisation, the parameter server and the batch balancing) are refused in a file or a
`--set`, in one line naming the new key and how to write it. A config shoal itself stored (a run
dir's config.toml, a checkpoint's train_state.json) is read with `stored=True`: its old keys move to
their new place, so a run written before the move still resumes, exports and is checked by `plan`.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from shoal.config.auto import resolve_auto
from shoal.config.base import tomllib
from shoal.config.root import SECTIONS, Config
from shoal.errors import UserError
from shoal.models.registry import model_config_class

# old key -> new key ([Note: moved keys])
MOVED = {
    "parallel.sync": "sync.mode", "parallel.sync_every": "sync.every", "parallel.outer_lr": "sync.outer_lr",
    "parallel.outer_momentum": "sync.outer_momentum", "parallel.replicas": "sync.replicas",
    "parallel.servers": "ps.servers", "parallel.ps_mode": "ps.mode", "parallel.ps_aggregate": "ps.aggregate",
    "parallel.ps_sparse": "ps.sparse", "parallel.max_staleness": "ps.max_staleness",
    "parallel.balance": "balance.mode", "parallel.balance_interval": "balance.interval",
}


def load_config(path: str | Path | None = None, overrides: list[str] = (), stored: bool = False,
                resolve: bool = True) -> Config:
    """Read a TOML file (or defaults), apply `section.key=value` overrides, validate, freeze. `stored`: the
    file is one shoal wrote (a run dir's config.toml): keys that moved are moved, not refused. `resolve`: the
    values left to the machine chosen (auto.py; False: kept "auto", for the caller to say what it chose)."""
    raw, overridden = read_raw(path, overrides)
    return validate_config(raw, str(path) if path else "defaults", overridden, stored=stored, resolve=resolve)


def read_raw(path: str | Path | None = None, overrides: list[str] = ()) -> tuple[dict[str, Any], set[str]]:
    """The TOML file (or nothing) with the overrides applied, not validated, and the keys they set. Imports
    neither pydantic's models nor torch (validating does: ~1 s): what `shoal train` reads before its workers'
    server starts (cli/train.py's early_worker_env)."""
    origin = str(path) if path else "defaults"
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist; pass the path of a .toml file")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: not valid TOML: {e}") from None
    overridden = set()
    for item in overrides:
        key, value = _parse_override(item)
        section, *path = key.split(".")
        if not isinstance(raw.setdefault(section, {}), dict):
            raise UserError(f"{origin}: {section} must be a [section] table")
        table = raw[section]
        # a deeper key sets one entry of a table-valued key (model.config.hidden_size=64), keeping the file's
        # others: shrinking a Hugging Face model's config.json-style table for a smoke test by width and depth
        for i, part in enumerate(path[:-1]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                outer = ".".join([section, *path[:i + 1]])
                raise UserError(f"--set {item!r}: {outer} is not a table, so it has no key {path[i + 1]}; set "
                                f"{outer} itself")
        table[path[-1]] = value
        overridden.update(".".join([section, *path[:i]]) for i in range(1, len(path) + 1))
    return raw, overridden


def validate_config(raw: dict[str, Any], origin: str = "config", overridden: set[str] = frozenset(),
                    stored: bool = False, resolve: bool = True) -> Config:
    """`raw` (parsed TOML) validated into a Config; `stored`: see [Note: moved keys]; `resolve`: load_config's."""
    for section in raw:
        if not isinstance(raw[section], dict):
            raise UserError(f"{origin}: {section} must be a [{section}] table, got {raw[section]!r}")

    def where(key: str) -> str:
        return "--set" if key in overridden else origin

    raw = _move_keys(raw, where, stored)
    for section in raw:
        if section != "model" and section not in SECTIONS:
            raise UserError(f"{origin}: unknown section [{section}]{_suggest(section, ['model', *SECTIONS])}")
    model_raw = dict(raw.get("model", {}))
    model_raw.setdefault("name", "gpt")
    try:
        model_cls = model_config_class(model_raw["name"])
        model = model_cls.model_validate(model_raw)
    except UserError as e:
        raise UserError(f"{where('model.name')}: {e}") from None
    except ValidationError as e:
        raise UserError(_explain(e, model_cls, ("model",), where)) from None
    try:
        cfg = Config.model_validate({**{k: v for k, v in raw.items() if k != "model"}, "model": model})
    except ValidationError as e:
        raise UserError(_explain(e, Config, (), where)) from None
    return resolve_auto(cfg)[0] if resolve else cfg


def _move_keys(raw: dict[str, Any], where, stored: bool) -> dict[str, Any]:
    """`raw` with the keys of MOVED in their new place (stored), or the first one refused in one line."""
    raw = copy.deepcopy(raw)
    for old, new in MOVED.items():
        section, key = old.split(".")
        if key not in raw.get(section, {}):
            continue
        value = raw[section].pop(key)
        new_section, new_key = new.split(".")
        if not stored:
            literal = tomli_w.dumps({"v": value}).split("=", 1)[1].strip()
            how = (f"use --set {new}={literal}" if where(old) == "--set" else
                   f"write it as {new_key} = {literal} under [{new_section}]")
            raise UserError(f"{where(old)}: {old} is now {new}; {how}")
        raw.setdefault(new_section, {}).setdefault(new_key, value)
    return raw


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or "." not in key or not all(key.split(".")):
        raise UserError(f"--set {item!r}: expected section.key=value, for example --set train.steps=100 (a key of a "
                        f"table in a section: --set model.config.hidden_size=64)")
    try:  # a TOML value (number, bool, quoted string, array); a bare word is taken as a string
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key, value


def _explain(err: ValidationError, cls: type[BaseModel], prefix: tuple, where) -> str:
    """Turn pydantic's first error into one line: origin, key, value, what is allowed."""
    e = err.errors()[0]
    loc = prefix + tuple(str(p) for p in e["loc"] if not isinstance(p, int))
    # a failing union member adds the member type to loc (e.g. ('parallel', 'dp', 'int')): drop it
    loc = tuple(p for p in loc if p not in ("int", "str", "float", "bool", "literal['auto']"))
    key = ".".join(loc)
    if e["type"] == "extra_forbidden":
        known = _fields_at(cls, loc[len(prefix):-1]) if prefix == () else list(cls.model_fields)
        section = ".".join(loc[:-1])
        return f"{where(key)}: unknown key {key}{_suggest(loc[-1], known, section + '.')}"
    msg = e["msg"].replace("Input should be", "must be").replace("Value error, ", "")
    if e["type"] == "value_error" and msg.startswith(tuple(f"{s}." for s in ("model", *SECTIONS))):
        return f"{where(msg.split(' ')[0])}: {msg}"
    value = e.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    return f"{where(key)}: {key}{shown}: {msg}"


def _fields_at(cls: type[BaseModel], path: tuple) -> list[str]:
    for part in path:
        ann = cls.model_fields[part].annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        cls = ann
    return [f.alias or name for name, f in cls.model_fields.items()]


def _suggest(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(choices)}"


