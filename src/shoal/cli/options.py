"""Options several commands share."""

from __future__ import annotations

import argparse

SET_HELP = "override one config value (repeatable), e.g. --set train.steps=50"


def add_set(parser: argparse.ArgumentParser, help: str = SET_HELP) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)
