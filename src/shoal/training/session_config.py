"""A Session's config: built from a file, overrides and sections, and refused in one line where it asks a
Session for what it does not do, or contradicts the optimizer the user prepares."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.config import Config, load_config
from shoal.config.literals import overrides_as_sets
from shoal.errors import UserError


def refuse_unhonoured(cfg: Config) -> None:
    """One line for a key that asks a Session for what it does not do. [model] and [data] (but
    data.prefetch) describe what your code builds and are left to it; the optimizer's keys are checked
    against the optimizer you prepare (refuse_conflicts)."""
    t, default = cfg.train, Config().train
    if t.on_bad_step == "rollback":
        raise UserError('train.on_bad_step = "rollback" reruns steps inside shoal\'s own loop; in a Session use '
                        '"skip" or "abort"')
    asks = {"balance.mode": (cfg.balance.mode != "uniform", "sess.data() splits every step's batch evenly; use "
                             "`shoal train` to balance by throughput"),
            "data.pack_documents": (cfg.data.pack_documents, "sess.data() gives your dataset's samples as they are; "
                                    "pack documents in your dataset and mask attention in your model, or use "
                                    "`shoal train`"),
            "train.eval_on_start": (t.eval_on_start, NO_VALIDATION),
            "train.val_interval": (t.val_interval not in (0, default.val_interval), NO_VALIDATION)}
    for key, (asked, fix) in asks.items():
        if asked:
            raise UserError(f"{key} asks a Session for what it does not do: {fix}")


NO_VALIDATION = "a Session runs no validation; evaluate in your loop and sess.log() the result"


def refuse_conflicts(cfg: Config, optimizer: torch.optim.Optimizer) -> None:
    """A train.* optimizer key set in the config and not what the prepared optimizer does: a Session keeps
    your optimizer, so say so rather than train with another value than the config shows."""
    t, default, d = cfg.train, Config().train, optimizer.defaults
    kinds = {torch.optim.SGD: "sgd", torch.optim.AdamW: "adamw"}
    kind = next((name for cls, name in kinds.items() if isinstance(optimizer, cls)), t.optimizer)
    checks = {"train.optimizer": (t.optimizer, default.optimizer, kind),
              "train.lr": (t.lr, default.lr, d.get("lr", t.lr)),
              "train.beta1": (t.beta1, default.beta1, d.get("betas", (t.beta1,))[0]),
              "train.beta2": (t.beta2, default.beta2, d.get("betas", (0, t.beta2))[1]),
              "train.momentum": (t.momentum, default.momentum, d.get("momentum", t.momentum)),
              "train.weight_decay": (t.weight_decay, default.weight_decay, d.get("weight_decay", t.weight_decay))}
    for key, (mine, unset, theirs) in checks.items():
        if mine != unset and mine != theirs:
            raise UserError(f"{key} = {mine}, but the optimizer you prepare has {theirs}: a Session keeps your "
                            f"optimizer; set it there, or leave {key} out")


def session_config(config: str | Path | Config | None, overrides: dict | None, sections: dict) -> Config:
    """The validated config of Session(config, overrides=..., **sections)."""
    sets = overrides_as_sets(overrides)
    for section, values in sections.items():
        if not isinstance(values, dict):
            raise UserError(f"Session({section}=...): give a section as a dict of its keys, e.g. "
                            f"Session(train={{'steps': 100}})")
        sets += overrides_as_sets({f"{section}.{k}": v for k, v in values.items()})
    if not isinstance(config, Config):
        return load_config(str(config) if config is not None else None, sets)
    if sets:
        raise UserError("Session(config): a loaded Config takes no overrides or sections; load it with them "
                        "(shoal.load_config(path, ['train.steps=100']))")
    return config
