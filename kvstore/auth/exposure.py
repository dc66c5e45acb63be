"""Whether a node may listen where it was asked to: off loopback only with authentication,
or when the operator says `--insecure` in so many words."""

from __future__ import annotations

import ipaddress
import logging
import socket

from kvstore.errors import InvalidArgumentError

log = logging.getLogger("kvstore.auth")


def is_loopback(host: str) -> bool:
    """True when `host` resolves to a loopback address (a wildcard is not loopback)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_exposure(host: str, has_auth: bool, has_tls: bool, insecure: bool) -> None:
    """Raises InvalidArgumentError for a non-loopback `host` without authentication unless
    `insecure`; warns when tokens would cross the network in clear."""
    if is_loopback(host):
        return
    if not has_auth and not insecure:
        raise InvalidArgumentError(
            f"--host {host} is reachable from other machines and no --auth-token-file is "
            "given: anyone could read, overwrite and remove every namespace. Pass "
            "--auth-token-file (and --tls-cert/--tls-key), or --insecure to run open anyway."
        )
    if has_auth and not has_tls:
        log.warning("event=tokens_in_clear host=%s hint='add --tls-cert and --tls-key'", host)
    if not has_auth:
        log.warning("event=insecure host=%s hint='any client may call this node'", host)
