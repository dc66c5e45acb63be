"""`EngineRunner`: an `Engine` driven by its own thread, fed from any thread.

The engine is not thread-safe, so exactly one thread (the runner's) calls it: it admits
submitted requests between steps, steps while anything is unfinished and hands each output
to the stream of its request. Callers `submit` from any thread and read a `queue.Queue` of
`RequestOutput` (or, with `submit_to`, give an `OutputSink` of their own: an event loop's,
say) until an output is finished, or the exception ending the request: refused
on submission, a prefill engine's publish that fell short (`PublishError`), or
`RequestAbortedError` after the caller `cancel`led it (its caller is gone: the engine stops
computing it between two steps). A step that raises stops the engine: every stream gets
`EngineFailedError`, and so does every later submission, instead of waiting forever.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from gpu_engine.connector import StoreConnector
from gpu_engine.engine import Engine
from gpu_engine.errors import EngineError, EngineFailedError, RequestAbortedError
from gpu_engine.outputs import RequestOutput
from gpu_engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

OutputStream = queue.Queue[RequestOutput | EngineError]


class OutputSink(Protocol):
    """Where the runner hands a request's outputs, one `put` each, from its engine thread
    (from the submitting thread where the runner refuses the request at once). The last is
    finished, or an `EngineError`; nothing follows it. `OutputStream` is one."""

    def put(self, item: RequestOutput | EngineError) -> None: ...


class EngineLoad(NamedTuple):
    """What a scheduler routes on."""

    num_waiting: int  # submitted, not yet admitted
    num_running: int  # holding pages: running, loading or (prefill) publishing
    num_free_pages: int  # free or evictable
    num_pages: int
    num_cached_blocks: int
    block_tokens: int
    store_connected: bool
    num_store_loaded_blocks: int
    bytes_loaded: int
    num_published_blocks: int
    num_dropped_blocks: int
    num_pending_blocks: int
    role: str = "both"  # the engine's `EngineConfig.role`


class _Submission(NamedTuple):
    prompt: list[int]
    params: SamplingParams
    num_published_tokens: int
    prefetch: bool
    stream: OutputSink


class _Cancel(NamedTuple):
    stream: OutputSink


class EngineRunner:
    """Runs `engine` on a background thread; see the module docstring.

    Args:
        engine: the engine this runner owns from `start` to `stop`.
        connector: the engine's store connector, for load reports; None without a store.
    """

    def __init__(self, engine: Engine, connector: StoreConnector | None = None) -> None:
        self.engine = engine
        self.connector = connector
        self._inbox: queue.SimpleQueue[_Submission | _Cancel | None] = queue.SimpleQueue()
        self._num_inbox = 0  # submitted, not yet taken by the engine thread
        self._lock = threading.Lock()
        self._streams: dict[int, OutputSink] = {}
        self._failure: EngineFailedError | None = None  # set when a step raised
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Finishes nothing more: stops after the current step."""
        self._inbox.put(None)
        self._thread.join()
        self.engine.close()

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        num_published_tokens: int = 0,
        prefetch: bool = False,
    ) -> OutputStream:
        """Queues a request (`Engine.add_request` says what the arguments mean); its outputs,
        or the error ending it, arrive on the stream."""
        stream: OutputStream = queue.Queue()
        self.submit_to(stream, prompt, params, num_published_tokens, prefetch)
        return stream

    def submit_to(
        self,
        sink: OutputSink,
        prompt: Sequence[int],
        params: SamplingParams,
        num_published_tokens: int = 0,
        prefetch: bool = False,
    ) -> None:
        """`submit`, with the outputs handed to `sink`; `cancel(sink)` aborts the request."""
        with self._lock:  # held while queueing: a failure drains what was queued before it
            if self._failure is not None:
                sink.put(self._failure)
                return
            self._num_inbox += 1
            sub = _Submission(list(prompt), params, num_published_tokens, prefetch, sink)
            self._inbox.put(sub)

    def cancel(self, stream: OutputSink) -> None:
        """Aborts the request of `stream` (`Engine.abort`) between two steps; `stream` then
        gets `RequestAbortedError`. A no-op once the request has finished or was refused."""
        self._inbox.put(_Cancel(stream))

    def load(self) -> EngineLoad:
        engine = self.engine
        stats = self.connector.stats() if self.connector is not None else None
        publish = stats.publish if stats is not None else None
        return EngineLoad(
            num_waiting=engine.num_waiting + self._num_inbox,
            num_running=engine.num_running,
            num_free_pages=engine.pool.num_available,
            num_pages=engine.config.num_pages,
            num_cached_blocks=engine.pool.num_cached_blocks,
            block_tokens=engine.config.block_tokens,
            store_connected=self.connector is not None and self.connector.is_connected,
            num_store_loaded_blocks=stats.num_loaded_blocks if stats else 0,
            bytes_loaded=stats.bytes_loaded if stats else 0,
            num_published_blocks=publish.num_published_blocks if publish else 0,
            num_dropped_blocks=publish.num_dropped_blocks if publish else 0,
            num_pending_blocks=publish.num_pending_blocks if publish else 0,
            role=engine.config.role,
        )

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            logger.exception("event=engine_failed error=%r", exc)
            self._fail_everything(EngineFailedError(f"the engine stopped: {exc!r}"))

    def _fail_everything(self, failure: EngineFailedError) -> None:
        with self._lock:  # from here on, submit answers with the failure itself
            self._failure = failure
        for stream in self._streams.values():
            stream.put(failure)
        self._streams.clear()
        while True:  # what was submitted before, and not taken yet
            try:
                sub = self._inbox.get(block=False)
            except queue.Empty:
                return
            if isinstance(sub, _Submission):
                sub.stream.put(failure)

    def _loop(self) -> None:
        while True:
            if not self._take_submissions(block=not self.engine.has_unfinished):
                return
            for out in self.engine.step():
                stream = self._streams.get(out.request_id)
                if stream is None:  # cancelled: its caller is gone
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                stream.put(out.error if out.finished and out.error is not None else out)

    def _take_submissions(self, block: bool) -> bool:
        """Admits everything submitted (waiting for one when `block`); False on stop."""
        while True:
            try:
                sub = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if sub is None:
                return False
            block = False
            if isinstance(sub, _Cancel):
                self._cancel(sub.stream)
                continue
            with self._lock:
                self._num_inbox -= 1
            try:
                request_id = self.engine.add_request(
                    sub.prompt, sub.params, sub.num_published_tokens, sub.prefetch
                )
            except EngineError as exc:
                sub.stream.put(exc)
                continue
            self._streams[request_id] = sub.stream

    def _cancel(self, stream: OutputSink) -> None:
        # The stream's submission came through the inbox before this cancel did.
        request_id = next((i for i, s in self._streams.items() if s is stream), None)
        if request_id is None:  # finished, or refused on submission
            return
        del self._streams[request_id]
        self.engine.abort(request_id)
        stream.put(RequestAbortedError(f"request {request_id} was cancelled by its caller"))
