"""What a client can make a server hold without having been granted it, and the bounds on it.

Two classes of thing: response streams whose reader stops reading (each holds the message
in flight and whatever produced it), counted per client and in all (`StreamSlots`) and
ended when a send stalls (`StreamWriter`); and sockets that have not proven themselves yet
(no hello that claimed an admission), bounded on their own, away from admitted clients
(`UnprovenSockets`). `StreamSettings` is the config table of the first, `BoundsCollector`
their metrics.
"""

from kvstore.bounds.bounds_collector import BoundsCollector
from kvstore.bounds.stream_settings import StreamSettings
from kvstore.bounds.stream_slots import StreamLimits, StreamSlot, StreamSlots
from kvstore.bounds.stream_writer import StreamWriter
from kvstore.bounds.unproven_sockets import UnprovenSockets

__all__ = [
    "BoundsCollector",
    "StreamLimits",
    "StreamSettings",
    "StreamSlot",
    "StreamSlots",
    "StreamWriter",
    "UnprovenSockets",
]
