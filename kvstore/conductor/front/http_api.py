"""The conductor's OpenAI-compatible HTTP API (aiohttp): ``POST /v1/completions``,
``GET /health``, ``GET /metrics``.

``/v1/completions`` takes ``prompt`` (text, token ids, or a list of one of either),
``max_tokens`` (default 16), ``temperature`` (default 1, 0 is greedy, else at least 0.01),
``seed`` and ``stream``; ``n`` must be 1 and other fields are ignored. Headers
``x-slo-ttft-ms`` and ``x-slo-tbt-ms`` set the request's SLO (defaults: the conductor's
flags). The answer has OpenAI's completion shape, with
``usage.prompt_tokens_details.cached_tokens`` (prompt tokens the prefill loaded or reused,
not computed) and one extension, ``kvstore``: ``token_ids`` (the output ids; in a stream,
the chunk's), and on the last message ``prefill_engine``, ``decode_engine``, ``ttft_s``
(measured at the conductor), ``predicted_ttft_s`` and ``tbt_s``. With ``return_token_ids``
(vLLM's extension) the ids are also in ``choices[0].token_ids``, so the conductor can
front another. A stream is ``text/event-stream``: one ``data: {chunk}`` per output piece,
usage on the last, then ``data: [DONE]``.

A request the policy refuses gets 429 at once: ``error.reason``, ``error.predicted``,
``error.limit`` and ``error.retry_after_s`` in the body, ``Retry-After`` (whole seconds,
rounded up) unless it can never fit. Bad input is 400; an engine that fails before the
first token is 503 (400 if it refused the input); after it, the stream carries
``data: {"error": ...}`` and ends without ``[DONE]``. A client that hangs up, streaming or
not, ends its request on the engines.

A stream holds one of the conductor's stream slots (`StreamSlots`, shared with the gRPC
service) from before its admission until nothing of it is left here. Its client is the
tenant its bearer token names (the gRPC service counts a tenant's calls under the same
name), or, without tokens, its remote address. Past ``max_streams_per_client`` or
``max_streams`` a stream request gets 429 at once, ``error.code`` ``too_many_streams``, the
message naming the limit; no Retry-After, since when a slot frees depends on other
streams' readers. A stream whose reader takes nothing for ``stream_stall_timeout_s`` is
ended (`EventStream`): its engine calls are cancelled and its connection aborted.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvstore.auth import Authenticator
from kvstore.bounds import StreamLimits, StreamSlots
from kvstore.conductor.front.completion import (
    CompletionChunk,
    CompletionRequest,
    RejectedError,
    check,
)
from kvstore.conductor.front.conductor import Conductor, Ticket
from kvstore.conductor.front.event_stream import EventStream
from kvstore.conductor.front.metrics import ConductorMetrics
from kvstore.conductor.front.tokenizer import ByteTokenizer, Detokenizer
from kvstore.conductor.slo import SLO
from kvstore.errors import (
    InvalidArgumentError,
    KVStoreError,
    StreamStalledError,
    TooManyStreamsError,
    UnauthenticatedError,
    UnavailableError,
)

log = logging.getLogger("kvstore.conductor")
DEFAULT_MAX_TOKENS = 16


class HttpApi:
    """The routes over one conductor.

    Args:
        conductor: admits and runs the completions.
        metrics: what ``/metrics`` serves.
        slo: the SLO of a request without SLO headers.
        health: ``/health``'s check: engine addresses and whether each answered.
        engines: engine addresses, by the indexes outcomes carry.
        auth: who may ask for completions (an ``Authorization: Bearer`` header, as the
            OpenAI clients send their api key); ``/health`` and ``/metrics`` stay open.
        streams: the slots streamed answers take; default: slots of their own, with the
            default limits.
    """

    def __init__(
        self,
        conductor: Conductor,
        metrics: ConductorMetrics,
        slo: SLO,
        health: Callable[[], Awaitable[dict[str, bool]]],
        engines: list[str],
        auth: Authenticator | None = None,
        streams: StreamSlots | None = None,
    ) -> None:
        self.auth = auth or Authenticator(None)
        # Not `streams or ...`: slots with no stream open are falsy (they have a length).
        self.streams = streams if streams is not None else StreamSlots(StreamLimits(), "conductor")
        self.conductor = conductor
        self.metrics = metrics
        self.slo = slo
        self.health = health
        self.engines = engines
        self.tokenizer = ByteTokenizer()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health_check)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    async def health_check(self, _: web.Request) -> web.Response:
        engines = await self.health()
        ok = all(engines.values())
        body = {"status": "ok" if ok else "unavailable", "engines": engines}
        return web.json_response(body, status=200 if ok else 503)

    async def metrics_text(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, http: web.Request) -> web.StreamResponse:
        try:
            client = self._client(http)
        except UnauthenticatedError as exc:
            return _error(401, str(exc), "authentication_error")
        try:
            body = await _json_body(http)
            request = parse_request(body, http.headers, self.slo, self.tokenizer)
        except (ValueError, InvalidArgumentError) as exc:
            return _error(400, str(exc), "invalid_request_error")
        if not body.get("stream"):
            return await self._serve(request, lambda ticket: self._whole(ticket, body))
        try:
            slot = self.streams.take(client)
        except TooManyStreamsError as exc:
            return _too_many_streams(exc, self.streams.limits)
        stream = EventStream(http, self.streams, slot)
        try:
            return await self._serve(request, lambda ticket: self._stream(stream, ticket, body))
        finally:
            stream.close()

    def _client(self, http: web.Request) -> str:
        """Whom a request's stream counts against: its tenant, named as the gRPC service
        names it (`kvstore.grpc_service`), so that a tenant's streams over both count
        together; without tokens, its remote address. UnauthenticatedError without a
        known token."""
        tenant = self.auth.tenant(http.headers.items())
        return f"tenant:{tenant}" if self.auth.is_enabled else f"address:{http.remote}"

    async def _serve(
        self, request: CompletionRequest, answer: Callable[[Ticket], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """`answer` of `request` once admitted (429 if refused); its ticket ends after."""
        try:
            ticket = await self.conductor.admit(request)
        except RejectedError as exc:
            return _rejected(exc)
        try:
            return await answer(ticket)
        finally:
            self.conductor.release(ticket)

    async def _whole(self, ticket: Ticket, body: Mapping[str, Any]) -> web.Response:
        chunks = self.conductor.run(ticket)
        try:
            async for _ in chunks:
                pass
        except KVStoreError as exc:
            return _engine_error(exc)
        finally:
            await chunks.aclose()
        text = self.tokenizer.decode(ticket.tokens)
        msg = _envelope(ticket, body, text, ticket.finish_reason, list(ticket.tokens))
        msg["usage"] = _usage(ticket)
        msg["kvstore"] |= self._summary(ticket)
        return web.json_response(msg)

    async def _stream(
        self, stream: EventStream, ticket: Ticket, body: Mapping[str, Any]
    ) -> web.StreamResponse:
        """The stream of an admitted request; a 503 (400) where the engines fail before its
        first token."""
        chunks = self.conductor.run(ticket)
        try:
            first = await anext(chunks)
        except (KVStoreError, StopAsyncIteration) as exc:
            await chunks.aclose()
            return _engine_error(exc if isinstance(exc, KVStoreError) else UnavailableError(""))
        try:
            await self._events(stream, ticket, body, first, chunks)
        except StreamStalledError:  # its engine calls are cancelled; `close` aborts the rest
            log.warning("event=stream_stalled front=http request=%d", ticket.request_id)
        return stream.response

    async def _events(
        self,
        stream: EventStream,
        ticket: Ticket,
        body: Mapping[str, Any],
        first: CompletionChunk,
        chunks: AsyncGenerator[CompletionChunk, None],
    ) -> None:
        """Opens the stream and sends every chunk, from `first`, then the summary and
        ``[DONE]``; an engine's error instead ends the stream. StreamStalledError where the
        reader stalls."""
        detok = Detokenizer()
        try:
            await stream.open()
            ids = list(first.token_ids)
            await _send(stream, _envelope(ticket, body, detok.feed(ids), None, ids))
            async for chunk in chunks:
                ids = list(chunk.token_ids)
                await _send(stream, _envelope(ticket, body, detok.feed(ids), None, ids))
        except StreamStalledError:
            raise
        except KVStoreError as exc:
            await _send(stream, {"error": {"message": str(exc), "type": type(exc).__name__}})
            await stream.end()
            return
        finally:
            await chunks.aclose()  # a client gone mid-stream cancels the engine calls
        last = _envelope(ticket, body, detok.feed([], final=True), ticket.finish_reason, [])
        last["usage"] = _usage(ticket)
        last["kvstore"] |= self._summary(ticket)
        await _send(stream, last)
        await stream.send(b"data: [DONE]\n\n")
        await stream.end()

    def _summary(self, t: Ticket) -> dict[str, Any]:
        outcome = t.outcome
        assert outcome is not None, "a finished run sets the outcome"
        return {
            "prefill_engine": self.engines[outcome.prefill],
            "decode_engine": self.engines[outcome.decode],
            "ttft_s": outcome.ttft_s,
            "predicted_ttft_s": outcome.predicted_ttft_s,
            "tbt_s": outcome.tbt_s,
        }


def parse_request(
    body: object, headers: Mapping[str, str], slo: SLO, tokenizer: ByteTokenizer
) -> CompletionRequest:
    """A `CompletionRequest` from an OpenAI completions body and the SLO headers;
    InvalidArgumentError naming the bad field."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("the body must be a JSON object")
    if body.get("n", 1) != 1:
        raise InvalidArgumentError("n: only 1 completion per request")
    prompt = _prompt_ids(body.get("prompt"), tokenizer)
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    temperature = body.get("temperature", 1.0)
    seed = body.get("seed")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be an integer >= 1: {max_tokens!r}")
    # JSON has NaN, Infinity and integers too big for a float: only finite numbers pass.
    if not isinstance(temperature, int | float) or not 0 <= temperature <= sys.float_info.max:
        raise InvalidArgumentError(f"temperature must be a number >= 0: {temperature!r}")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise InvalidArgumentError(f"seed must be an integer >= 0: {seed!r}")
    return check(
        CompletionRequest(prompt, max_tokens, float(temperature), seed, _slo(headers, slo))
    )


async def _json_body(http: web.Request) -> Any:
    """The body's JSON value; InvalidArgumentError for bytes that are none (an unknown
    charset, and nesting deeper than the decoder recurses, included)."""
    try:
        return await http.json()
    except (ValueError, LookupError, RecursionError) as exc:
        raise InvalidArgumentError(f"the body is not JSON: {exc}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_ids(prompt: object, tokenizer: ByteTokenizer) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidArgumentError("prompt: text, token ids, or a list of one of either")
    if not ids:
        raise InvalidArgumentError("prompt: empty")
    return tuple(ids)


def _slo(headers: Mapping[str, str], default: SLO) -> SLO:
    try:
        ttft_ms = float(headers.get("x-slo-ttft-ms", default.ttft_s * 1000))
        tbt_ms = float(headers.get("x-slo-tbt-ms", default.tbt_s * 1000))
        return SLO(ttft_ms / 1000, tbt_ms / 1000)
    except ValueError as exc:
        raise InvalidArgumentError(f"x-slo-ttft-ms / x-slo-tbt-ms: {exc}") from None


def _envelope(
    t: Ticket, body: Mapping[str, Any], text: str, finish: str | None, ids: list[int]
) -> dict[str, Any]:
    choice: dict[str, Any] = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if body.get("return_token_ids"):  # vLLM's extension, as vLLM spells it
        choice["token_ids"] = ids
    return {
        "id": f"cmpl-{t.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": str(body.get("model") or "kvstore"),
        "choices": [choice],
        "kvstore": {"token_ids": ids},
    }


def _usage(t: Ticket) -> dict[str, Any]:
    n = len(t.tokens)
    return {
        "prompt_tokens": t.input_len,
        "completion_tokens": n,
        "total_tokens": t.input_len + n,
        "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
    }


async def _send(stream: EventStream, msg: Mapping[str, Any]) -> None:
    await stream.send(b"data: " + json.dumps(msg).encode() + b"\n\n")


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": None}}
    return web.json_response(body, status=status)


def _rejected(exc: RejectedError) -> web.Response:
    r = exc.reject
    headers = {} if r.retry_after_s is None else {"Retry-After": str(math.ceil(r.retry_after_s))}
    body = {
        "error": {
            "message": str(exc),
            "type": "rate_limit_exceeded",
            "code": "slo_rejected",
            "reason": r.reason.value,
            "predicted": r.predicted,
            "limit": r.limit,
            "retry_after_s": r.retry_after_s,
        }
    }
    return web.json_response(body, status=429, headers=headers)


def _too_many_streams(exc: TooManyStreamsError, limits: StreamLimits) -> web.Response:
    body = {
        "error": {
            "message": str(exc),
            "type": "rate_limit_exceeded",
            "code": "too_many_streams",
            "max_streams_per_client": limits.max_streams_per_client,
            "max_streams": limits.max_streams,
        }
    }
    return web.json_response(body, status=429)


def _engine_error(exc: KVStoreError) -> web.Response:
    status = 400 if isinstance(exc, InvalidArgumentError) else 503
    return _error(status, str(exc), type(exc).__name__)
