"""The one rule of every connector's load: only a fully received prefix counts.

Blocks form a chain, and the engine may use block ``i`` only if it holds blocks ``0..i``: a
block missing from a get (evicted since the match, or failed its checksum) makes every later
block of that get unusable, even those that arrived, and the engine recomputes from the gap.
"""

from __future__ import annotations

from collections.abc import Sequence


def loaded_prefix_len(found: Sequence[bool]) -> int:
    """How many blocks of a get, from the first, were received: the index of the first miss,
    or all of them."""
    return next((i for i, is_found in enumerate(found) if not is_found), len(found))
