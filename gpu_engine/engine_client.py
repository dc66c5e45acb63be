"""`EngineClient`: calls an engine process's EngineService (Generate, Load) over gRPC."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import grpc
import numpy as np

from gpu_engine.outputs import Usage
from gpu_engine.runner import EngineLoad
from gpu_engine.sampling import SamplingParams
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth import open_channel
from kvstore.client.common import raise_rpc_error
from kvstore.errors import UnavailableError


class GenerateChunk(NamedTuple):
    """One message of a Generate stream, as the client saw it."""

    token_ids: tuple[int, ...]  # new since the previous chunk
    received_s: float  # client clock (time.perf_counter) on arrival
    finish_reason: str | None


class GenerateResult(NamedTuple):
    """A finished request, with latencies seen by the client and by the engine."""

    request_id: int
    output_token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    ttft_s: float  # client: call to first token
    tpot_s: float | None  # client: mean gap between tokens after the first
    engine_ttft_s: float  # engine: arrival to first token
    engine_tpot_s: float | None
    logits: np.ndarray | None  # (vocab,) fp32 of the last token, when asked for
    start_s: float = 0.0  # client: time.perf_counter() at the call
    end_s: float = 0.0  # client: time.perf_counter() at the last token
    num_published_tokens: int = 0  # prefill: leading prompt tokens committed in the store


class EngineClient:
    """Blocking, thread-safe client of one engine process.

    Args:
        address: "host:port" of `kvstore engine`.
        timeout_s: deadline of a whole Generate stream or a Load call.
        auth_token: bearer token, for an engine started with --auth-token-file.
        tls_ca: PEM CA of the engine's certificate: connect over TLS.
    """

    def __init__(
        self, address: str, timeout_s: float = 600.0, auth_token: str = "", tls_ca: str = ""
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, auth_token=auth_token, tls_ca=tls_ca)
        self._stub = pb_grpc.EngineServiceStub(self._channel)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Blocks until the engine answers; raises UnavailableError after the timeout."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"engine at {self.address} is not reachable") from None

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        return_logits: bool = False,
        num_published_tokens: int = 0,
    ) -> GenerateResult:
        """Runs one request to the end; TTFT and TPOT as this client saw the stream.

        Args:
            prompt: the prompt's token ids.
            params: how to sample; default `SamplingParams()`.
            return_logits: the last token's logits in the result.
            num_published_tokens: for a decode engine, the count a prefill engine returned
                for this prompt (`GenerateResult.num_published_tokens`).

        Raises:
            InvalidArgumentError: a request the engine refuses.
            UnavailableError: the engine is unreachable, or a prefill engine could not
                commit the prompt's blocks in the store in time.
        """
        start = time.perf_counter()
        tokens: list[int] = []
        arrivals: list[float] = []
        final = None
        stream = self._stream(
            prompt, params or SamplingParams(), return_logits, num_published_tokens
        )
        for msg in stream:
            now = time.perf_counter()
            tokens += msg.token_ids
            arrivals += [now] * len(msg.token_ids)
            final = msg
        assert final is not None and final.finish_reason, "stream ended without a final message"
        return _result(final, tuple(tokens), start, arrivals)

    def load(self) -> EngineLoad:
        try:
            msg = self._stub.Load(pb.LoadRequest(), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return EngineLoad(**{name: getattr(msg, name) for name in EngineLoad._fields})

    def _stream(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        return_logits: bool,
        num_published_tokens: int,
    ) -> Iterator[pb.GenerateResponse]:
        request = pb.GenerateRequest(
            prompt_token_ids=list(prompt),
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            return_logits=return_logits,
            num_published_tokens=num_published_tokens,
        )
        try:
            yield from self._stub.Generate(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise_rpc_error(err)


def _result(
    final: pb.GenerateResponse, tokens: tuple[int, ...], start: float, arrivals: list[float]
) -> GenerateResult:
    gaps = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
    usage = final.usage
    return GenerateResult(
        request_id=final.request_id,
        output_token_ids=tokens,
        finish_reason=final.finish_reason,
        usage=Usage(*(getattr(usage, name) for name in Usage._fields)),
        ttft_s=arrivals[0] - start,
        tpot_s=gaps / (len(arrivals) - 1) if gaps is not None else None,
        engine_ttft_s=final.metrics.ttft_s,
        engine_tpot_s=final.metrics.tpot_s or None,
        logits=np.frombuffer(final.logits, dtype="<f4").copy() if final.logits else None,
        start_s=start,
        end_s=arrivals[-1],
        num_published_tokens=final.num_published_tokens,
    )
