"""The conductor's gRPC method: `Conductor.Complete` (proto/kvstore.proto), over the same
`Conductor` as the HTTP API. Protobuf types stop here.

A refused request ends with RESOURCE_EXHAUSTED at once: the details say why, trailing
metadata "kvstore-reject-reason" names the reason and "retry-after" the whole seconds to
wait (absent when it can never fit). Malformed input is INVALID_ARGUMENT, and each call
holds one of the conductor's stream slots, ended when its reader stalls
(`kvstore.grpc_service.register`): a stalled call's generator is closed, which ends its
engine calls and its ticket.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.conductor.front.completion import CompletionRequest, RejectedError, check
from kvstore.conductor.front.conductor import Conductor, Ticket
from kvstore.conductor.front.http_api import DEFAULT_MAX_TOKENS
from kvstore.conductor.front.tokenizer import ByteTokenizer, Detokenizer
from kvstore.conductor.slo import SLO
from kvstore.errors import ERROR_METADATA_KEY, InvalidArgumentError, KVStoreError
from kvstore.grpc_service import abort

SERVICE = pb.DESCRIPTOR.services_by_name["Conductor"]
REASON_METADATA_KEY = "kvstore-reject-reason"
RETRY_METADATA_KEY = "retry-after"


class ConductorServicer:
    """`Complete` over one conductor; `slo` is the default of a request that sets none."""

    def __init__(self, conductor: Conductor, slo: SLO) -> None:
        self.conductor = conductor
        self.slo = slo
        self.tokenizer = ByteTokenizer()

    async def Complete(
        self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CompleteResponse]:
        try:
            completion = self._parse(request)
        except (InvalidArgumentError, ValueError) as exc:
            await abort(context, InvalidArgumentError(str(exc)))
        try:
            ticket = await self.conductor.admit(completion)
        except RejectedError as exc:
            await _refuse(context, exc)
        detok = Detokenizer()
        chunks = self.conductor.run(ticket)
        try:
            async for chunk in chunks:
                ids = list(chunk.token_ids)
                yield self._message(ticket, ids, detok.feed(ids))
        except KVStoreError as exc:
            await abort(context, exc)
        finally:
            await chunks.aclose()  # closed here (a stall, a cancel): the engine calls end now
            self.conductor.release(ticket)
        yield self._last(ticket, detok.feed([], final=True))

    def _parse(self, r: pb.CompleteRequest) -> CompletionRequest:
        if bool(r.prompt) == bool(r.prompt_token_ids):
            raise InvalidArgumentError("set exactly one of prompt and prompt_token_ids")
        ids = self.tokenizer.encode(r.prompt) if r.prompt else list(r.prompt_token_ids)
        ttft_s = r.ttft_slo_s if r.HasField("ttft_slo_s") else self.slo.ttft_s
        tbt_s = r.tbt_slo_ms / 1000 if r.HasField("tbt_slo_ms") else self.slo.tbt_s
        seed = r.seed if r.HasField("seed") else None
        max_tokens = r.max_tokens or DEFAULT_MAX_TOKENS
        slo = SLO(ttft_s, tbt_s)
        return check(CompletionRequest(tuple(ids), max_tokens, r.temperature, seed, slo))

    def _message(self, t: Ticket, ids: list[int], text: str) -> pb.CompleteResponse:
        p, d = self.conductor.roles.prefill, self.conductor.roles.decode
        return pb.CompleteResponse(
            token_ids=ids,
            text=text,
            prefill_engine=p[t.accept.prefill],
            decode_engine=d[t.accept.decode],
        )

    def _last(self, t: Ticket, text: str) -> pb.CompleteResponse:
        msg = self._message(t, [], text)
        msg.finish_reason = t.finish_reason
        n = len(t.tokens)
        msg.usage.CopyFrom(
            pb.CompleteUsage(
                prompt_tokens=t.input_len, completion_tokens=n, cached_tokens=t.cached_tokens
            )
        )
        msg.ttft_s = t.first_token_s - t.arrival_s
        msg.predicted_ttft_s = t.predicted_ttft_s
        return msg


async def _refuse(context: grpc.aio.ServicerContext, exc: RejectedError) -> None:
    metadata = [(ERROR_METADATA_KEY, "ResourceExhaustedError")]
    metadata.append((REASON_METADATA_KEY, exc.reject.reason.value))
    if exc.reject.retry_after_s is not None:
        metadata.append((RETRY_METADATA_KEY, str(math.ceil(exc.reject.retry_after_s))))
    context.set_trailing_metadata(tuple(metadata))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
