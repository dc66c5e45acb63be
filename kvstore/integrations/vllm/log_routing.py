"""The connector's log lines in vLLM's log: its own records and the publisher's (whose
`publish_failed` lines an operator looks for beside vLLM's), through vLLM's handlers."""

from __future__ import annotations

import logging
import sys

CONNECTOR_LOG = "kvstore.integrations.vllm.connector"  # the connector's and its loader's
PUBLISHER_LOG = "kvstore.client.publishing"


def route_through_vllm(level: str) -> None:
    """Sends the connector's and the publisher's records to vLLM's handlers. A `level` of
    its own (e.g. DEBUG, below vLLM's) gets a handler of its own with vLLM's format, so
    vLLM's handlers keep their level."""
    vllm_log = logging.getLogger("vllm")
    handlers = list(vllm_log.handlers)
    if level:
        own = logging.StreamHandler(sys.stdout)
        own.setFormatter(handlers[0].formatter if handlers else None)
        handlers = [own]
    for logger in (logging.getLogger(CONNECTOR_LOG), logging.getLogger(PUBLISHER_LOG)):
        if not logger.handlers:
            for handler in handlers:
                logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(level.upper() or vllm_log.level or logging.INFO)
