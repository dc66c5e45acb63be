"""Typed errors. Each class names the one gRPC status code it travels as.

The server sends the class name in trailing metadata (`ERROR_METADATA_KEY`), so the client
raises the same class the store raised; a status without it (transport failures, limits
enforced by gRPC itself) maps to the base class of its code.
"""

from __future__ import annotations

ERROR_METADATA_KEY = "kvstore-error"


class KVStoreError(Exception):
    """Base of every error this package raises on purpose."""

    code = "INTERNAL"


class InvalidArgumentError(KVStoreError, ValueError):
    """The request is malformed; nothing was changed."""

    code = "INVALID_ARGUMENT"


class BadKeyError(InvalidArgumentError):
    """A key has the wrong length."""


class DuplicateKeyError(InvalidArgumentError):
    """The same key appears twice in one call."""


class EmptyRequestError(InvalidArgumentError):
    """A call that needs keys got none."""


class BatchTooLargeError(InvalidArgumentError):
    """More keys in one call than the server's `max_batch_keys`."""


class PayloadSizeError(InvalidArgumentError):
    """A payload does not match the namespace's block size."""


class IncompleteWriteError(InvalidArgumentError):
    """Commit of a reservation whose blocks were not all fully written."""


class ChecksumMismatchError(InvalidArgumentError):
    """A block arrived short or altered (its checksum differs from the sender's); nothing of
    that put was committed."""


class BadParentError(InvalidArgumentError):
    """A chain link that is not allowed (`kvstore.store.chains`); nothing was reserved."""


class UnknownParentError(BadParentError):
    """A parent neither committed in the namespace nor earlier in the same call (evicted,
    removed or never stored): the caller's chain is cut there."""


class ChainCycleError(BadParentError):
    """A key named as its own parent, or a parent chain that would lead back to the key."""


class FieldTooLargeError(InvalidArgumentError):
    """A field over the node's size limit (a namespace's model id, dtype, tenant salt or
    layout numbers); the message names the limit and its setting."""


class NotFoundError(KVStoreError, LookupError):
    """The named thing does not exist."""

    code = "NOT_FOUND"


class UnknownNamespaceError(NotFoundError):
    """The namespace id was never registered with this store."""


class UnknownReservationError(NotFoundError):
    """No open reservation has this id (never made, committed, aborted or expired)."""


class UnknownLeaseError(NotFoundError):
    """No live lease has this id."""


class LeaseExpiredError(KVStoreError):
    """A read outlived its lease (released, or its reader stalled past the lease timeout):
    nothing more of it is sent, since the blocks' slots may hold other blocks by then.
    Everything sent before was the right bytes; read again."""

    code = "ABORTED"


class ResourceExhaustedError(KVStoreError):
    """No space, a message over the size limit, or overload; the reason says which."""

    code = "RESOURCE_EXHAUSTED"


class StoreFullError(ResourceExhaustedError):
    """Not enough evictable space for a reservation: too much is leased or reserved."""


class TooManyNamespacesError(ResourceExhaustedError):
    """The node has as many namespaces as it allows (`max_namespaces`)."""


class TooManyReservationsError(ResourceExhaustedError):
    """The client, or the node, holds as many open reservations as it allows."""


class TooManyLeasesError(ResourceExhaustedError):
    """The client, or the node, holds as many open read leases as it allows."""


class TooManyConnectionsError(ResourceExhaustedError):
    """The node holds as many data-plane connections as it allows (in all, or per peer)."""


class TooManyStreamsError(ResourceExhaustedError):
    """The client, or the server, has as many response streams open as it allows
    (`max_streams_per_client`, `max_streams`): a stream a reader stalls on counts until the
    reader takes its last message or goes away."""


class UnauthenticatedError(KVStoreError, PermissionError):
    """The call carries no token, or one the node does not know."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(KVStoreError, PermissionError):
    """The caller's tenant may not act on what it named."""

    code = "PERMISSION_DENIED"


class UnavailableError(KVStoreError, ConnectionError):
    """The store cannot be reached."""

    code = "UNAVAILABLE"


class DeadlineExceededError(KVStoreError, TimeoutError):
    """The call did not finish within its timeout."""

    code = "DEADLINE_EXCEEDED"


class StreamStalledError(DeadlineExceededError):
    """A response stream's reader took nothing for `stream_stall_timeout_s`: the server ended
    the stream (what it held for it is released)."""


def _all_subclasses(cls: type[KVStoreError]) -> list[type[KVStoreError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_class(name: str | None, code: str) -> type[KVStoreError]:
    """The class to raise for an error named `name` sent with status `code`."""
    by_name = {c.__name__: c for c in _all_subclasses(KVStoreError)}
    if name in by_name and by_name[name].code == code:
        return by_name[name]
    by_code = {c.code: c for c in reversed(_all_subclasses(KVStoreError))}
    return by_code.get(code, KVStoreError)
