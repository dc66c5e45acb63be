"""Scheduler-side planning of the vLLM connector and the load rule it shares with the
engine's connector, without vLLM."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.integrations.loaded_prefix import loaded_prefix_len
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.plan import RequestBlocks, loadable_prefix_len
from kvstore.keys import ChainPosition, KVLayout, Namespace, block_keys

NS = Namespace("vllm/cpu/tiny", KVLayout("float32", 2, 2, 16, 4))


@pytest.mark.parametrize(("n", "expected"), [(0, 0), (4, 0), (5, 4), (8, 4), (9, 8)])
def test_loadable_prefix_leaves_the_last_prompt_token(n, expected):
    assert loadable_prefix_len(n, 4) == expected


def test_saves_are_whole_computed_prompt_blocks_once():
    blocks = RequestBlocks.from_prompt("r", NS, list(range(14)))  # 3 full blocks
    blocks.block_ids = [7, 8, 9, 10]
    assert blocks.take_saves(3) is None
    first = blocks.take_saves(9)
    assert first is not None
    assert (first.block_ids, first.parent) == ((7, 8), None)
    assert first.keys == tuple(block_keys(NS, list(range(8))))
    second = blocks.take_saves(20)
    assert second is not None
    assert (second.block_ids, second.parent) == ((9,), first.keys[-1])
    assert blocks.take_saves(30) is None


def test_salt_changes_every_key():
    salted = Namespace(NS.model_id, NS.layout, b"tenant")
    assert not set(block_keys(NS, range(8))) & set(block_keys(salted, range(8)))


def test_config_reads_prefixed_extra_keys_and_rejects_unknown():
    config = ConnectorConfig.from_extra_config({"kvstore.address": "h:1", "other": 1})
    assert config.address == "h:1"
    with pytest.raises(InvalidArgumentError):
        ConnectorConfig.from_extra_config({"kvstore.adress": "h:1"})


def test_config_reads_publish_buffers_and_rejects_bad_numbers():
    config = ConnectorConfig.from_extra_config({"kvstore.publish_buffers": "3"})
    assert config.publish_buffers == 3
    assert ConnectorConfig().publish_buffers == 512
    for bad in ("0", "many"):
        with pytest.raises(InvalidArgumentError):
            ConnectorConfig.from_extra_config({"kvstore.publish_buffers": bad})
    with pytest.raises(InvalidArgumentError):
        ConnectorConfig.from_extra_config({"kvstore.timeout_s": "soon"})


@pytest.mark.parametrize(
    ("found", "expected"),
    [((), 0), ((True, True), 2), ((False, True), 0), ((True, False, True), 1)],
)
def test_only_a_fully_received_prefix_counts_as_loaded(found, expected):
    assert loaded_prefix_len(found) == expected


def test_config_reads_the_store_token_from_its_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("\n  token-of-the-vllm-server-01  \n")
    config = ConnectorConfig.from_extra_config({"kvstore.auth_token_file": str(path)})
    assert config.auth_token() == "token-of-the-vllm-server-01"
    assert ConnectorConfig().auth_token() == ""
    missing = ConnectorConfig.from_extra_config({"kvstore.auth_token_file": str(tmp_path / "x")})
    with pytest.raises(InvalidArgumentError, match="cannot read the token file"):
        missing.auth_token()


def test_transfers_state_their_chain_position_and_loads_say_when_blocks_are_elsewhere():
    blocks = RequestBlocks.from_prompt("r", NS, list(range(4 * 40)))  # 40 full blocks
    blocks.block_ids = list(range(40))
    blocks.num_home = 34  # the last match found blocks [0, 34) on the engine's own node
    head = blocks.load(0, 34)
    assert (head.position, head.remote) == (None, False)
    rest = blocks.load(33, 40)
    assert rest.remote
    assert rest.position == ChainPosition.of(blocks.keys, 33)
    assert rest.position == ChainPosition(33, blocks.keys[32])  # in the second chain group
    assert rest.namespace_id == NS.id
    save = blocks.take_saves(4 * 40)  # saves are never `remote`: only loads read
    assert save is not None and (save.position, save.remote) == (None, False)
    later = blocks.transfer(5, 6)
    assert later.position == ChainPosition(5, blocks.keys[0])


def test_config_reads_a_pool_of_seeds():
    config = ConnectorConfig.from_extra_config(
        {"kvstore.address": "a:1,b:2", "kvstore.pool": "true"}
    )
    assert (config.pool, config.seeds) == (True, ["a:1", "b:2"])
    assert ConnectorConfig(address="a:1").seeds == ["a:1"]
    for bad in ({"kvstore.address": "a:1,b:2"}, {"kvstore.address": "a:1,b", "kvstore.pool": 1}):
        with pytest.raises(InvalidArgumentError, match="address must be"):
            ConnectorConfig.from_extra_config(bad)
