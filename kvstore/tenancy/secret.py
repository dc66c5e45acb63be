"""The node's tenant secret: the key every tenant's namespace ids are derived with.

A client never sees it, so it can neither choose nor compute another tenant's internal ids.
It comes from `--tenant-secret-file`, else from a file the node creates once beside its SSD
tier (so a restarted node maps tenants to the same ids and serves what they stored), else it
is drawn at random at each start (a node without SSD keeps nothing across restarts anyway).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvstore.errors import InvalidArgumentError

SECRET_BYTES = 32
SSD_SECRET_NAME = "tenant-secret"  # beside the LMDB files of the SSD tier


def read_secret(path: str | Path) -> bytes:
    """The secret in `path`: hex text of at least `SECRET_BYTES` bytes, first line.

    Raises:
        InvalidArgumentError: a file that cannot be read or holds too short a secret
            (never its text).
    """
    try:
        text = Path(path).read_text().strip().split("\n", 1)[0].strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read a hex secret from {path}: {exc}") from None
    if len(secret) < SECRET_BYTES:
        raise InvalidArgumentError(f"the secret in {path} needs {SECRET_BYTES}+ bytes (hex)")
    return secret


def secret_beside_ssd(ssd_path: str) -> bytes:
    """The secret kept in `ssd_path`, created there (mode 0600) the first time."""
    path = Path(ssd_path) / SSD_SECRET_NAME
    if not path.exists():
        os.makedirs(ssd_path, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return read_secret(path)


def load_secret(secret_file: str, ssd_path: str) -> bytes:
    """The node's secret: from `secret_file`, else kept beside the SSD tier, else random."""
    if secret_file:
        return read_secret(secret_file)
    if ssd_path:
        return secret_beside_ssd(ssd_path)
    return secrets.token_bytes(SECRET_BYTES)
