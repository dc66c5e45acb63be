"""The node's limits on what clients may ask of it: namespace field sizes, and counts of
what stays open between calls (reservations, leases), per client and in all.

A *client* is an owner string the caller passes: the gRPC peer (`context.peer()`) until
clients authenticate; in-process callers are one owner, `LOCAL_OWNER`. Past a size limit:
`FieldTooLargeError` (INVALID_ARGUMENT); past a count: a `ResourceExhaustedError`. Every
message names the limit and the setting that raises it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore import errors

LOCAL_OWNER = "local"  # the owner of in-process calls
LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_tokens")


@dataclass(frozen=True)
class NamespaceLimits:
    """Largest fields a namespace may have: UTF-8 bytes of its strings, layout numbers."""

    max_model_id_bytes: int
    max_dtype_bytes: int
    max_tenant_salt_bytes: int
    max_layout: Mapping[str, int]  # one of LAYOUT_FIELDS -> its largest value

    def check(
        self, model_id: str, dtype: str, tenant_salt: bytes, layout: Mapping[str, int]
    ) -> None:
        """Raises `FieldTooLargeError` for the first field over its limit."""
        sizes = (
            ("model_id", len(model_id.encode(errors="replace")), self.max_model_id_bytes),
            ("dtype", len(dtype.encode(errors="replace")), self.max_dtype_bytes),
            ("tenant_salt", len(tenant_salt), self.max_tenant_salt_bytes),
        )
        for name, nbytes, limit in sizes:
            if nbytes > limit:
                raise errors.FieldTooLargeError(
                    f"{name} has {nbytes} bytes; the limit is {limit} (max_{name}_bytes)"
                )
        for name in LAYOUT_FIELDS:
            if layout[name] > self.max_layout[name]:
                raise errors.FieldTooLargeError(
                    f"{name} is {layout[name]}; the limit is {self.max_layout[name]} (max_{name})"
                )


class OwnerCounts:
    """How many of one kind of thing (reservations, leases) each owner holds open, under a
    cap per owner and one in all. The store calls it under its lock."""

    def __init__(
        self,
        noun: str,
        per_owner: int,
        total: int,
        error: type[errors.ResourceExhaustedError],
    ) -> None:
        self.noun = noun
        self.per_owner = per_owner
        self.total = total
        self.error = error
        self._counts: Counter[str] = Counter()
        self._num_open = 0

    def check(self, owner: str) -> None:
        """Raises `error` if `owner` may not open one more."""
        if self._counts[owner] >= self.per_owner:
            raise self.error(
                f"this client holds {self._counts[owner]} open {self.noun}, the most allowed "
                f"(max_{self.noun}_per_client = {self.per_owner}); end some first"
            )
        if self._num_open >= self.total:
            raise self.error(
                f"the node holds {self._num_open} open {self.noun}, the most allowed "
                f"(max_{self.noun} = {self.total}); try again later"
            )

    def add(self, owner: str) -> None:
        self._counts[owner] += 1
        self._num_open += 1

    def remove(self, owner: str) -> None:
        assert self._counts[owner] > 0, f"{owner} holds no {self.noun}"
        self._counts[owner] -= 1
        if not self._counts[owner]:
            del self._counts[owner]
        self._num_open -= 1

    def __len__(self) -> int:
        return self._num_open
