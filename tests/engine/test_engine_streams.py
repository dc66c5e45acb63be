"""What a reader that stops reading can make an engine's Generate streams hold: a stalling
client process gets no more streams than its bound, its stalled streams are ended after
`stream_stall_timeout_s` and their requests aborted (pages freed), while a well-behaved
client is served; once the staller goes away its slots are back."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnectorConfig
from gpu_engine.engine import Engine
from gpu_engine.engine_client import EngineClient
from gpu_engine.runner import EngineLoad
from gpu_engine.sampling import SamplingParams
from gpu_engine.service import EngineServer, EngineServiceConfig
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.bounds import StreamSettings
from kvstore.errors import TooManyStreamsError
from tests.conftest import free_port, wait_until
from tests.node.test_metrics import _scrape, _value

BLOCK = 8
GREEDY = SamplingParams(max_tokens=5)
PROMPT = list(range(30, 60))
STALL_S = 1.0
# Opens two Generate streams of 4,000 tokens (the engine needs seconds for them) and reads
# nothing; tries a third on the same connection (the same client) and says how it ended;
# holds the two until its stdin closes. A message is one token, ~12 bytes: the channel
# announces a 1 KiB window per stream and never grows it (no BDP probe), so the engine's
# sends wait on the reader after ~100 tokens. (With gRPC's default 64 KiB window the tiny
# model's 4,096 positions would all fit; its logits come with the last message only.)
STALLER = """
import sys
import grpc
from kvstore._proto import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
from kvstore.errors import ERROR_METADATA_KEY

options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
stub = pb_grpc.EngineServiceStub(grpc.insecure_channel(sys.argv[1], options=options))
request = pb.GenerateRequest(prompt_token_ids=list(range(1, 20)), max_tokens=4000)
stalled = [stub.Generate(request, timeout=120) for _ in range(2)]
for call in stalled:
    call.initial_metadata()  # the engine streams it: its slot is taken
try:
    next(stub.Generate(request, timeout=120))
    print("third served", flush=True)
except grpc.RpcError as err:
    error = dict(err.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
    print("third", err.code().name, error, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _staller(address: str, tmp_path: Path) -> Iterator[Path]:
    """The stalling client process; yields the file of what it says; killed on exit."""
    said = tmp_path / "staller.out"
    with open(said, "w") as out:
        cmd = [sys.executable, "-c", STALLER, address]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield said
    finally:
        proc.kill()  # the reader goes away: its last messages settle
        proc.wait(timeout=30)


def _said(path: Path, prefix: str) -> str | None:
    lines = path.read_text().splitlines()
    return next((line for line in lines if line.startswith(prefix)), None)


def _idle(server: EngineServer) -> EngineLoad | None:
    load = server.runner.load()
    return load if (load.num_running, load.num_waiting) == (0, 0) else None


def _service() -> EngineServiceConfig:
    streams = StreamSettings(
        max_streams_per_client=2, max_streams=3, stream_stall_timeout_s=STALL_S
    )
    return EngineServiceConfig(port=0, streams=streams, metrics_port=free_port())


def test_a_stalled_reader_is_bounded_and_ended_while_a_good_client_is_served(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpu_engine.scheduler")
    config = EngineConfig(block_tokens=BLOCK, page_tokens=BLOCK)
    [ref] = Engine(config).generate([PROMPT], GREEDY)
    with (
        EngineServer(config, StoreConnectorConfig(), _service()) as server,
        EngineClient(server.address, timeout_s=30.0) as client,
    ):
        with _staller(server.address, tmp_path) as said:
            third = wait_until(lambda: _said(said, "third"), 30.0, "the staller's third stream")
            assert third == "third RESOURCE_EXHAUSTED TooManyStreamsError"  # 2 per client
            assert (len(server.streams), server.streams.num_refused) == (2, 1)

            out = client.generate(PROMPT, GREEDY)  # the one slot left in all
            assert out.output_token_ids == ref.output_token_ids

            wait_until(lambda: server.streams.num_stalled == 2, 30.0, "both stalls are seen")
            load = wait_until(lambda: _idle(server), 30.0, "the stalled requests are dropped")
            assert caplog.text.count("event=abort") == 2  # aborted, not run to 4,000 tokens
            assert load.num_free_pages == load.num_pages
            # Their last messages still wait on the reader: their slots stay taken.
            assert len(server.streams) == 2
            _check_the_bound_in_all(server, client)
        wait_until(lambda: len(server.streams) == 0, 30.0, "the staller's slots are back")
        assert client.generate(PROMPT, GREEDY).output_token_ids == ref.output_token_ids
        m = _scrape(server.metrics_port)
    assert _value(m, "kvstore_stalled_streams_total", service="engine") == 2
    assert _value(m, "kvstore_refused_streams_total", service="engine") == 2
    assert _value(m, "kvstore_open_streams", service="engine") == 0


def _check_the_bound_in_all(server: EngineServer, client: EngineClient) -> None:
    """With the staller's 2 slots held, one open stream fills the engine's 3: another
    client is refused until it ends."""
    with grpc.insecure_channel(server.address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=2000)
        held = pb_grpc.EngineServiceStub(channel).Generate(request, timeout=30)
        assert next(held).token_ids
        with pytest.raises(TooManyStreamsError):
            client.generate(PROMPT, GREEDY)
        held.cancel()
    wait_until(lambda: len(server.streams) == 2, 30.0, "the cancelled stream's slot is back")
    wait_until(lambda: _idle(server), 30.0, "the cancelled request is dropped")
