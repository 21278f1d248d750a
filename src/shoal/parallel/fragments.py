"""A model's parameters split into fragments for streaming DiLoCo (Douillard et al. 2025, "Streaming
DiLoCo with overlapping communication"): each fragment is a contiguous run of the model's repeated
blocks, synchronised at its own step so that one outer all-reduce at a time carries 1/P of the model.

The blocks are the children of the model's repeated container, found from the parameter names: the
prefix before an integer segment ("blocks.3.attn.weight" -> "blocks", "model.layers.11.mlp..." ->
"model.layers") with the most distinct indices. Parameters outside it (embeddings, final norm, head)
join fragment 0.
"""

from __future__ import annotations

import re
from collections import defaultdict

from shoal.errors import UserError

_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


def block_of(names: list[str]) -> tuple[str | None, dict[str, int]]:
    """(the repeated container's prefix, each parameter's block index in it) for the names given."""
    found: dict[str, set[int]] = defaultdict(set)
    for n in names:
        m = _INDEX.match(n)
        if m:
            found[m.group(1)].add(int(m.group(2)))
    if not found:
        return None, {}
    prefix = max(found, key=lambda p: (len(found[p]), p))
    out = {}
    for n in names:
        m = _INDEX.match(n)
        if m and m.group(1) == prefix:
            out[n] = int(m.group(2))
    return prefix, out


def split_fragments(names: list[str], fragments: int) -> list[list[int]]:
    """The parameter positions of each of `fragments` fragments: consecutive blocks, the same number in
    each; what lies outside the blocks goes with fragment 0."""
    if fragments == 1:
        return [list(range(len(names)))]
    prefix, blocks = block_of(names)
    order = sorted(set(blocks.values()))
    if not order or len(order) % fragments:
        have = f"{len(order)} blocks ({prefix}.0 ...)" if order else "no repeated blocks (no name like 'blocks.0.')"
        raise UserError(f"sync.fragments = {fragments} must divide the model's blocks, but this rank holds {have}; "
                        f"set sync.fragments to a divisor of {len(order) or 1}")
    per = len(order) // fragments
    which = {b: i // per for i, b in enumerate(order)}
    out: list[list[int]] = [[] for _ in range(fragments)]
    for i, n in enumerate(names):
        out[which[blocks[n]] if n in blocks else 0].append(i)
    return out


def sync_offset(fragment: int, fragments: int, every: int) -> int:
    """The step within each round of `every` at which `fragment` synchronises: staggered evenly, the last
    fragment at the round's end (so one fragment is today's DiLoCo: every `every`-th step)."""
    return (fragment + 1) * every // fragments % every
