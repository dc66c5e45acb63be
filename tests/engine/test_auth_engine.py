"""Tokens on the engine's side: its own service, and its connector's calls to a store that
authenticates."""

from __future__ import annotations

import pytest

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnectorConfig
from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
from gpu_engine.service import EngineServer, EngineServiceConfig
from kvstore import errors
from kvstore.auth import ListenerSecurity
from kvstore.client import Client
from tests.conftest import wait_until

ENGINE_TOKEN, STORE_TOKEN = "token-of-the-conductor-0001", "token-of-the-engine-000001"
GREEDY = SamplingParams(max_tokens=4)
PROMPT = list(range(1, 3 * 16 + 5))  # 3 full blocks of the tiny preset


@pytest.fixture
def tokens(tmp_path):
    engine_table, store_table, mine = (tmp_path / n for n in ("engine", "store", "mine"))
    engine_table.write_text(f"conductor {ENGINE_TOKEN}\n")
    store_table.write_text(f"engines {STORE_TOKEN}\n")
    mine.write_text(STORE_TOKEN)
    return engine_table, store_table, mine


def test_the_engine_service_needs_a_known_token(tokens):
    engine_table, _, _ = tokens
    service = EngineServiceConfig(
        port=0, security=ListenerSecurity(auth_token_file=str(engine_table))
    )
    with EngineServer(EngineConfig(), StoreConnectorConfig(), service) as server:
        with EngineClient(server.address, auth_token=ENGINE_TOKEN) as client:
            assert len(client.generate(PROMPT, GREEDY).output_token_ids) == 4
            assert client.load().role == "both"
        for token in ("", "token-nobody-was-ever-given-0"):
            with EngineClient(server.address, timeout_s=10, auth_token=token) as client:
                with pytest.raises(errors.UnauthenticatedError):
                    client.generate(PROMPT, GREEDY)
                with pytest.raises(errors.UnauthenticatedError):
                    client.load()


def test_an_engine_reaches_an_authenticating_store_with_its_token(store_factory, tokens):
    _, store_table, mine = tokens
    store = store_factory("--dram-bytes", "16MiB", "--auth-token-file", str(store_table))
    connector = StoreConnectorConfig(store=store.address, store_token_file=str(mine))
    with (
        EngineServer(EngineConfig(), connector, EngineServiceConfig(port=0)) as server,
        EngineClient(server.address) as client,
    ):
        client.generate(PROMPT, GREEDY)
        with Client(store.address, timeout_s=10.0, auth_token=STORE_TOKEN) as reader:
            committed = wait_until(lambda: reader.stats().blocks_committed, 30.0, "a publish")
            assert committed >= 3  # the prompt's 3 full blocks
    without = StoreConnectorConfig(store=store.address)  # no token: the store refuses it
    with (
        EngineServer(EngineConfig(), without, EngineServiceConfig(port=0)) as server,
        EngineClient(server.address) as client,
    ):
        assert len(client.generate(PROMPT, GREEDY).output_token_ids) == 4  # computes instead
        assert client.load().num_store_loaded_blocks == 0
