"""The engine's errors are its own (none is a store error), and a refused request reaches
its caller as the engine raised it: on the runner's stream, then over gRPC as the status
code of its class (INVALID_ARGUMENT for a bad request)."""

from __future__ import annotations

import pytest

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnectorConfig
from gpu_engine.engine import Engine
from gpu_engine.engine_client import EngineClient
from gpu_engine.errors import BlockSizeError, EngineError, InvalidRequestError, OutOfPagesError
from gpu_engine.runner import EngineRunner
from gpu_engine.sampling import SamplingParams
from gpu_engine.service import EngineServer, EngineServiceConfig
from kvstore.errors import InvalidArgumentError, KVStoreError


@pytest.mark.parametrize("cls", [EngineError, InvalidRequestError, BlockSizeError, OutOfPagesError])
def test_engine_errors_are_not_store_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, EngineError) and not issubclass(cls, KVStoreError)


def test_bad_sampling_params_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1.0)


def test_a_refused_request_arrives_on_its_stream_and_the_runner_goes_on() -> None:
    runner = EngineRunner(Engine(EngineConfig())).start()
    try:
        refused = runner.submit([], SamplingParams(max_tokens=2)).get(timeout=30)
        assert isinstance(refused, InvalidRequestError)
        stream = runner.submit([1, 2, 3], SamplingParams(max_tokens=2))
        outs = [stream.get(timeout=30) for _ in range(2)]
        assert [len(o.output_token_ids) for o in outs] == [1, 2] and outs[-1].finished
    finally:
        runner.stop()


def test_over_grpc_a_bad_request_is_invalid_argument() -> None:
    config = EngineConfig(num_pages=8)  # 128 tokens of pages
    with (
        EngineServer(config, StoreConnectorConfig(), EngineServiceConfig(port=0)) as server,
        EngineClient(server.address) as client,
    ):
        for prompt in ([1] * 200, [600]):  # more tokens than pages; outside the vocabulary
            with pytest.raises(InvalidArgumentError, match="INVALID_ARGUMENT"):
                client.generate(prompt)
        assert client.generate([1, 2, 3], SamplingParams(max_tokens=2)).finish_reason == "length"
