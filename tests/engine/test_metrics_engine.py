"""An engine's Prometheus metrics, scraped after requests it served."""

from __future__ import annotations

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnectorConfig
from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
from gpu_engine.service import EngineServer, EngineServiceConfig
from tests.conftest import free_port
from tests.node.test_metrics import _scrape, _value

GREEDY = SamplingParams(max_tokens=4)


def test_a_scrape_counts_the_requests_and_tokens_an_engine_served():
    config = EngineConfig(num_pages=256)
    prompt = list(range(1, 3 * config.block_tokens + 5))  # 3 full blocks
    service = EngineServiceConfig(port=0, metrics_port=free_port())
    with (
        EngineServer(config, StoreConnectorConfig(), service) as server,
        EngineClient(server.address) as client,
    ):
        client.generate(prompt, GREEDY)
        again = client.generate([*prompt[:-2], 7, 8], GREEDY)  # shares the 3 full blocks
        assert again.usage.local_cached_tokens == 3 * config.block_tokens
        m = _scrape(server.metrics_port)
    assert _value(m, "kvstore_engine_requests_total", finish_reason="length") == 2
    assert _value(m, "kvstore_engine_tokens_total", kind="prompt") == 2 * len(prompt)
    assert _value(m, "kvstore_engine_tokens_total", kind="completion") == 2 * 4
    assert _value(m, "kvstore_engine_tokens_total", kind="cached_local") == 3 * config.block_tokens
    assert _value(m, "kvstore_engine_tokens_total", kind="cached_store") == 0
    assert _value(m, "kvstore_engine_ttft_seconds_count") == 2
    assert _value(m, "kvstore_engine_tpot_seconds_count") == 2
    assert _value(m, "kvstore_engine_pages") == 256
    assert _value(m, "kvstore_engine_running_requests") == 0
    assert _value(m, "kvstore_engine_cached_blocks") >= 3
