"""The client side of suite `load`: one process running a mixed loop of match, get, put and
remove against a store node, every block it reads checked against the bytes its key implies.

A block's bytes are a PCG64 stream seeded by its key, so any process can put a block and any
other can verify it byte for byte, whoever wrote it and whether it was evicted in between.
A found block whose bytes differ counts its differing bytes as corrupted; a miss is expected
(the working set is larger than DRAM, and other clients remove keys) and is only counted.
Any exception an op raises is an error, tallied by class with its first message, except a
put refused because its parent was evicted meanwhile (counted as `refused_parent`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys

VERBS = ("match", "get-dp", "get-grpc", "put-dp", "put-grpc", "remove")
POISON = 0xA5  # fills get buffers first, so a block reported found but never written shows
_KV_BYTES_PER_TOKEN = 4096  # K and V, 2 layers x 8 heads x 64 dims, float16


@dataclass(frozen=True)
class LoadConfig:
    """Shape of one load run: clients, duration, working set against DRAM, op mix.

    Attributes:
        num_clients: client processes.
        seconds: how long the timed loop runs.
        warm_up_s: how long the same loop runs before it, untimed, so the server's memory
            reaches its level under this load before the first snapshot.
        block_bytes: bytes of one block (a multiple of 4 KiB).
        dram_bytes: the server's DRAM tier; below the working set, so blocks get evicted.
        num_prompts: chains of `prompt_blocks` keys; the first quarter is hot.
        op_weights: how often each of `VERBS` is picked.
        hot_share: share of ops on the hot quarter of prompts.
        max_get_blocks: most keys in one get.
    """

    num_clients: int
    seconds: float
    warm_up_s: float = 10.0
    block_bytes: int = 64 << 10
    dram_bytes: int = 64 << 20
    slab_bytes: int = 4 << 20
    num_prompts: int = 256
    prompt_blocks: int = 16
    op_weights: tuple[float, ...] = (0.15, 0.3, 0.1, 0.2, 0.1, 0.15)
    hot_share: float = 0.7
    max_get_blocks: int = 8
    timeout_s: float = 30.0
    seed: int = 0
    transport: str = "auto"  # the data plane of the "dp" client (`Client(transport=...)`)

    def __post_init__(self) -> None:
        if self.num_clients < 1 or self.seconds <= 0 or self.warm_up_s < 0:
            raise ValueError("a load run needs a client, a positive duration, warm_up_s >= 0")
        if self.block_bytes <= 0 or self.block_bytes % _KV_BYTES_PER_TOKEN:
            raise ValueError(f"block_bytes must be a multiple of {_KV_BYTES_PER_TOKEN}")
        if self.working_set_bytes <= self.dram_bytes:
            raise ValueError("the working set must exceed DRAM, or nothing is evicted")
        if len(self.op_weights) != len(VERBS) or min(self.op_weights) < 0:
            raise ValueError(f"op_weights needs one weight >= 0 per verb of {VERBS}")
        if self.num_prompts < 4 or not 0 < self.max_get_blocks <= self.prompt_blocks:
            raise ValueError("need 4 prompts or more and 0 < max_get_blocks <= prompt_blocks")

    @property
    def working_set_bytes(self) -> int:
        return self.num_prompts * self.prompt_blocks * self.block_bytes

    @property
    def namespace(self) -> Namespace:
        tokens = self.block_bytes // _KV_BYTES_PER_TOKEN
        return Namespace("bench-load", KVLayout("float16", 2, 8, 64, tokens))


class Channels(NamedTuple):
    """How the suite and its workers talk (multiprocessing objects of one spawn context).

    `counters` holds two slots per worker, ops then errors, each written by its worker only.
    """

    ready: Any  # Queue: a worker's index once its share is put
    results: Any  # Queue: a worker's WorkerResult
    go: Any  # Event: start the loop (the warm-up)
    timed: Any  # Event: the warm-up is over, time the ops from now on
    stop: Any  # Event: finish the op in hand and report
    release: Any  # Event: close the connections and exit
    counters: Any  # RawArray("q", 2 * num_clients)


class WorkerResult(NamedTuple):
    """What one worker saw: latencies of the timed loop; errors and integrity counts of all
    its ops (fill and warm-up too)."""

    worker: int  # its index
    latencies_s: dict[str, np.ndarray]  # op name -> seconds of each op
    errors: dict[str, int]  # exception class -> count
    error_samples: dict[str, str]  # exception class -> first message
    corrupted: int  # bytes of found blocks that differ from their key's bytes
    verified_bytes: int  # bytes of found blocks compared
    blocks_found: int
    blocks_missed: int
    blocks_present: int  # put blocks the store already held
    blocks_stored: int
    puts_refused_parent: int  # puts whose parent was evicted between match and put


def block_payload(key: bytes, block_bytes: int) -> np.ndarray:
    """The bytes stored under `key`: a PCG64 stream seeded by the key (read-only)."""
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))
    return np.frombuffer(rng.bytes(block_bytes), np.uint8)


def prompt_keys(config: LoadConfig) -> list[list[bytes]]:
    """Every prompt's chain of keys, the same in every process."""
    ns = config.namespace
    n = config.prompt_blocks * ns.block_tokens
    return [block_keys(ns, np.arange(p * n, (p + 1) * n)) for p in range(config.num_prompts)]


class _Tally:
    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {}
        self.errors: Counter[str] = Counter()
        self.samples: dict[str, str] = {}
        self.blocks: Counter[str] = Counter()  # found, missed, present, stored, refused_parent
        self.corrupted = 0
        self.verified_bytes = 0

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] += 1
        self.samples.setdefault(name, str(exc)[:300])

    def result(self, index: int) -> WorkerResult:
        latencies = {k: np.asarray(v) for k, v in self.latencies.items()}
        b = self.blocks
        return WorkerResult(
            index, latencies, dict(self.errors), self.samples, self.corrupted,
            self.verified_bytes, b["found"], b["missed"], b["present"], b["stored"],
            b["refused_parent"],
        )  # fmt: skip


class Worker:
    """One client process's loop over two clients: `dp` (the data plane when both ends have
    UCX, else gRPC) and `grpc` (always the gRPC byte path)."""

    def __init__(self, config: LoadConfig, index: int, dp: Client, grpc: Client) -> None:
        self.config, self.index, self.dp, self.grpc = config, index, dp, grpc
        self.ns_id = config.namespace.id
        self.keys = prompt_keys(config)
        self.rng = np.random.default_rng((config.seed, index))
        self.tally = _Tally()
        self._buffers = [
            np.empty(config.block_bytes, np.uint8) for _ in range(config.max_get_blocks)
        ]
        self._weights = np.asarray(config.op_weights) / sum(config.op_weights)
        self._ops: dict[str, Callable[[int], None]] = {
            "match": self._match, "get-dp": self._get_into, "get-grpc": self._get,
            "put-dp": self._put_dp, "put-grpc": self._put_grpc, "remove": self._remove,
        }  # fmt: skip

    def fill(self) -> None:
        """Registers the namespace, puts this worker's share of prompts (so DRAM fills up and
        evicts), and opens both byte paths, so the server's memory and fds are settled."""
        self.dp.register_namespace(self.config.namespace)
        for p in range(self.index, self.config.num_prompts, self.config.num_clients):
            self._guarded(lambda p: self._put(self.dp, p, 0, self.keys[p]), p)
        self._guarded(self._get_into, self.index % self.config.num_prompts)
        self._guarded(self._get, self.index % self.config.num_prompts)

    def loop(self, channels: Channels) -> None:
        """Runs random ops until `stop`; times those after `timed`. Publishes the timed ops
        and all errors in `channels.counters`."""
        verbs = self.rng.choice(len(VERBS), size=1 << 16, p=self._weights)
        counters, i, is_timed = channels.counters, 0, False
        while not channels.stop.is_set():
            if not is_timed and channels.timed.is_set():
                i, is_timed = 0, True
                self.tally.latencies.clear()
            verb = VERBS[verbs[i % len(verbs)]]
            elapsed_s = self._guarded(self._ops[verb], self._prompt())
            self.tally.latencies.setdefault(self._name(verb), []).append(elapsed_s)
            i += 1
            counters[2 * self.index] = i
            counters[2 * self.index + 1] = self.tally.errors.total()

    def _guarded(self, op: Callable[[int], None], prompt: int) -> float:
        start = time.perf_counter()
        try:
            op(prompt)
        except Exception as exc:  # every failure is tallied by class, and the loop goes on
            self.tally.error(exc)
        return time.perf_counter() - start

    def _name(self, verb: str) -> str:
        """`get-dp` is `get-shm` or `get-ucx` over the data plane the client opened (shared
        memory on the node's host), `get-grpc` where it fell back to gRPC."""
        return verb.replace("-dp", "-" + self.dp.plane)

    def _prompt(self) -> int:
        n = self.config.num_prompts
        hot = self.rng.random() < self.config.hot_share
        return int(self.rng.integers(0, n // 4 if hot else n))

    def _span(self, prompt: int, most: int) -> tuple[int, list[bytes]]:
        """A random run of at most `most` consecutive keys of `prompt`: (start, keys)."""
        chain = self.keys[prompt]
        start = int(self.rng.integers(0, len(chain)))
        n = int(self.rng.integers(1, min(most, len(chain) - start) + 1))
        return start, chain[start : start + n]

    # -- ops --------------------------------------------------------------------------------

    def _match(self, prompt: int) -> None:
        self.dp.match(self.ns_id, self.keys[prompt])

    def _get_into(self, prompt: int) -> None:
        _, keys = self._span(prompt, self.config.max_get_blocks)
        buffers = self._buffers[: len(keys)]
        for buf in buffers:
            buf.fill(POISON)
        found = self.dp.get_into(self.ns_id, keys, buffers)
        for key, buf, hit in zip(keys, buffers, found, strict=True):
            self._check(key, buf if hit else None)

    def _get(self, prompt: int) -> None:
        _, keys = self._span(prompt, self.config.max_get_blocks)
        blocks = self.grpc.get(self.ns_id, keys).blocks
        for key, block in zip(keys, blocks, strict=True):
            self._check(key, None if block is None else np.frombuffer(block, np.uint8))

    def _put_dp(self, prompt: int) -> None:
        self._put(self.dp, prompt, *self._span(prompt, self.config.prompt_blocks))

    def _put_grpc(self, prompt: int) -> None:
        self._put(self.grpc, prompt, *self._span(prompt, self.config.prompt_blocks))

    def _put(self, client: Client, prompt: int, start: int, keys: list[bytes]) -> None:
        """Puts `keys` (from block `start` of the prompt) as an engine would: a chain whose
        stored prefix ends before `start` is continued from where it ends. A parent evicted
        between the match and the put is refused (UnknownParentError), an expected outcome
        under eviction like a miss, counted apart from errors."""
        chain, end = self.keys[prompt], start + len(keys)
        if start:
            start = min(start, client.match(self.ns_id, chain[:start]).num_matched)
        parent = chain[start - 1] if start else None
        keys = chain[start:end]
        blocks = [block_payload(k, self.config.block_bytes) for k in keys]
        try:
            result = client.put_chain(self.ns_id, keys, blocks, parent)
        except errors.UnknownParentError:
            self.tally.blocks["refused_parent"] += 1
            return
        self.tally.blocks.update(present=result.num_present, stored=result.num_stored)

    def _remove(self, prompt: int) -> None:
        _, keys = self._span(prompt, 4)
        self.grpc.remove(self.ns_id, keys)

    def _check(self, key: bytes, data: np.ndarray | None) -> None:
        if data is None:
            self.tally.blocks["missed"] += 1
            return
        expected = block_payload(key, self.config.block_bytes)
        common = min(data.size, expected.size)
        bad = np.count_nonzero(data[:common] != expected[:common]) + abs(data.size - expected.size)
        self.tally.blocks["found"] += 1
        self.tally.corrupted += int(bad)
        self.tally.verified_bytes += int(expected.size)


def run_worker(config: LoadConfig, index: int, address: str, channels: Channels) -> None:
    """A worker process: put its share, wait for `go`, loop until `stop`, report, wait for
    `release`, close."""
    timeout_s = config.timeout_s
    with (
        Client(address, timeout_s=timeout_s, transport=config.transport) as dp,
        Client(address, timeout_s=timeout_s, transport="grpc") as grpc,
    ):
        worker = Worker(config, index, dp, grpc)
        worker.fill()
        channels.ready.put(index)
        channels.go.wait()
        worker.loop(channels)
        channels.results.put(worker.tally.result(index))
        channels.release.wait()
