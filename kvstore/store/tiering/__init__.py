"""Tiering: where blocks live (DRAM slots, SSD records, HBM copies) and the moves between them.

Invariants (`Tiering.check`, which `Store.check_integrity` calls):
- the DRAM policy tracks exactly the committed entries with a DRAM slot (but those being
  written out by a demotion pass);
- the SSD policy tracks exactly the committed entries with `on_ssd`, one record each;
- an entry in no tier is not in the index;
- a memory tier's slots are those its entries hold plus the stale ones, each held by a
  leased block that left it (`slots`);
- HBM holds copies of DRAM blocks only.

SSD is inclusive: a promoted block keeps its SSD record, so evicting a clean block from
DRAM is free, and only blocks that were never written out cost an SSD write. DRAM over
its high watermark is cleaned down to its low watermark by writing victims to SSD in one
transaction (by a background thread, or inline when `background_demotion` is off).

Each tier has its own policy instance. A block's reads follow it down: a block demoted after
a hit in DRAM is recorded as reused by the SSD policy too, so a policy that protects reused
blocks (prefix-2q) keeps protecting it there; so does what the DRAM policy knew of it (its
`hint`, passed through unread: opaque to the tiering; no registered policy gives one now).

Modules, each importing only those above it:
- `usage`: traffic and event counters, `TierUsage` rows;
- `slots`: a memory tier's stale slots, the one release path for DRAM and HBM;
- `hbm`: the HBM tier, device copies of DRAM blocks;
- `ssd_space`: blocks on SSD, the SSD policy, making room there;
- `ssd_writes`: SSD transactions, and memory brought back to the disk when one fails;
- `dram_space`: DRAM slots, the DRAM policy, eviction;
- `promotion`: SSD blocks read back into DRAM;
- `demotion`: one pass writing DRAM victims to SSD;
- `demoter`: the background thread running those passes, with its backoff;
- `recovery`: the index rebuilt from SSD records;
- `tiering`: the `Tiering` facade the store calls.
"""

from kvstore.store.tiering.tiering import Tiering
from kvstore.store.tiering.usage import TierCounters, TieringCounters

__all__ = ["TierCounters", "Tiering", "TieringCounters"]
