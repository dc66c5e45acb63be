"""`kvstore conductor` end to end: a real store, two prefill engines and a decode engine (tiny
preset), a "both" engine, and two conductor processes, driven by the official `openai`
client and over gRPC.

Greedy outputs through the conductor (prefill on one engine, decode on another, or one
"both" engine) are the token ids a single engine gives; a stream sends each token once; a
repeated prompt reports cached tokens; a request over its TBT SLO is refused at once with
429 and Retry-After, one over its TTFT SLO with RESOURCE_EXHAUSTED; /metrics counts both;
/health answers; a client that leaves mid-stream frees the engine. The conductors decide on
a fixed test profile that they do not scale by the engines' measured speed
(`--speed-window 0`), so their predictions, and with them their decisions, do not depend on
this machine's speed; the round-robin conductor of the "both" engine and one more conductor
over the split engines measure it.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.front.tokenizer import ByteTokenizer
from tests.conductor.test_view import BLOCK, PROFILE
from tests.conftest import free_port, start_store, wait_until

LONG_TOKENS = 400  # a request that keeps decoding while another one is decided


@dataclass
class Proc:
    proc: subprocess.Popen
    log_path: Path
    is_terminated: bool = False

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self) -> None:
        if self.proc.poll() is None and not self.is_terminated:  # once: a second one kills
            self.proc.send_signal(signal.SIGTERM)
            self.is_terminated = True

    def stop(self) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@dataclass
class Cluster:
    split_http: str  # base URL of the conductor over 2 prefill + 1 decode engines
    split_grpc: str
    both_http: str  # of the conductor over one "both" engine
    both_engine: str  # that engine, for reference outputs
    both_engine_log: Path
    front_http: str  # of a conductor whose engine is the "both" conductor's HTTP API
    split_engines: list[str]
    store: str


def _spawn(tmp: Path, name: str, *args: str) -> Proc:
    log_path = tmp / f"{name}.log"
    with open(log_path, "w") as log:
        cmd = [sys.executable, "-m", "kvstore.cli", *args]
        return Proc(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log_path)


def _engine(tmp: Path, name: str, role: str, store: str) -> tuple[Proc, str]:
    port = free_port()
    flags = ["--port", str(port), "--role", role, "--num-pages", "512"]
    return _spawn(tmp, name, "engine", *flags, *(["--store", store] if store else [])), (
        f"127.0.0.1:{port}"
    )


def _conductor(
    tmp: Path, name: str, engines: list[str], store: str, policy: str, speed_window: int = 0
) -> Proc:
    profile = tmp / "profile.json"
    PROFILE.save(profile)
    flags = ["--engines", ",".join(engines), "--policy", policy, "--profile", str(profile)]
    flags += ["--port", "0", "--grpc-port", "0", "--tbt-slo-ms", "1000"]
    flags += ["--speed-window", str(speed_window)]
    if not speed_window:  # it predicts with the profile alone: nothing to warm up for
        flags += ["--warmup-rounds", "0"]
    return _spawn(tmp, name, "conductor", *flags, *(["--store", store] if store else []))


def _ports(proc: Proc) -> tuple[int, int] | None:
    assert proc.proc.poll() is None, f"the conductor exited:\n{proc.log()}"
    found = re.search(r"event=conductor_serving http=\S+:(\d+) grpc_port=(\d+)", proc.log())
    return (int(found.group(1)), int(found.group(2))) if found else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("conductor")
    store = start_store(tmp, "--dram-bytes", "64MiB")
    procs: list[Proc] = []
    try:
        engines = {}
        for name, role, to in [("p0", "prefill", store.address), ("p1", "prefill", store.address),
                               ("d0", "decode", store.address), ("b0", "both", "")]:  # fmt: skip
            proc, engines[name] = _engine(tmp, name, role, to)
            procs.append(proc)
        both_log = procs[-1].log_path
        split = [engines["p0"], engines["p1"], engines["d0"]]
        split_c = _conductor(tmp, "split", split, store.address, "cache-aware-predictive")
        # Round-robin decides on no prediction: this one measures its engine's speed.
        both_c = _conductor(tmp, "both", [engines["b0"]], "", "round-robin", speed_window=8)
        procs += [split_c, both_c]
        s_http, s_grpc = wait_until(lambda: _ports(split_c), 90.0, "the conductor serves")
        b_http, _ = wait_until(lambda: _ports(both_c), 90.0, "the both conductor serves")
        backend = f"http://127.0.0.1:{b_http}"
        procs.append(front_c := _conductor(tmp, "front", [backend], "", "round-robin"))
        f_http, _ = wait_until(lambda: _ports(front_c), 90.0, "the front conductor serves")
        yield Cluster(
            f"http://127.0.0.1:{s_http}", f"127.0.0.1:{s_grpc}", backend, engines["b0"],
            both_log, f"http://127.0.0.1:{f_http}", split, store.address,
        )  # fmt: skip
    finally:
        for p in procs:  # all at once: each drains on its own
            p.terminate()
        codes = {p.log_path.name: p.stop() for p in reversed(procs)}
        store.stop()
    assert all(code == 0 for code in codes.values()), codes


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60.0)


def _reference(cluster: Cluster, prompt: list[int], max_tokens: int) -> list[int]:
    with EngineClient(cluster.both_engine, timeout_s=60.0) as engine:
        return list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens)).output_token_ids)


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 for i in range(length)]


def test_a_completion_through_prefill_and_decode_engines_equals_one_engines(cluster):
    prompt = _prompt(1, 3 * BLOCK + 5)
    out = _client(cluster.split_http).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0
    )
    ids = out.model_extra["kvstore"]["token_ids"]
    assert ids == _reference(cluster, prompt, 8)
    assert out.choices[0].text == ByteTokenizer().decode(ids)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 8)
    info = out.model_extra["kvstore"]
    assert info["decode_engine"] != info["prefill_engine"] and info["ttft_s"] > 0


def test_a_stream_sends_every_token_once_with_usage_last(cluster):
    prompt = _prompt(2, 2 * BLOCK + 3)
    stream = _client(cluster.split_http).completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    ids = [t for c in chunks for t in c.model_extra["kvstore"]["token_ids"]]
    assert ids == _reference(cluster, prompt, 10)
    assert "".join(c.choices[0].text for c in chunks) == ByteTokenizer().decode(ids)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_a_repeated_text_prompt_reports_its_cached_tokens(cluster):
    client = _client(cluster.split_http)
    text = "The conductor routes each request to the prefill engine that caches it. " * 2
    first = client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0)
    # Every full block but the one that holds the last token (recomputed for its logits).
    full = (len(text.encode()) - 1) // BLOCK * BLOCK
    assert first.usage.prompt_tokens == len(text.encode())
    assert again.usage.prompt_tokens_details.cached_tokens == full
    assert again.model_extra["kvstore"]["token_ids"] == first.model_extra["kvstore"]["token_ids"]


def test_a_request_over_its_tbt_slo_is_refused_at_once_with_retry_after(cluster):
    client = _client(cluster.split_http)
    long = client.completions.create(
        model="tiny", prompt=_prompt(3, 40), max_tokens=LONG_TOKENS, temperature=0, stream=True
    )
    chunks = iter(long)
    next(chunks), next(chunks)  # the second token comes from the decode engine: it decodes
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(
            model="tiny", prompt=_prompt(4, 20), max_tokens=4, temperature=0,
            extra_headers={"x-slo-tbt-ms": "25"},
        )  # fmt: skip
    long.close()
    response = refused.value.response
    error = response.json()["error"]
    assert response.status_code == 429
    assert error["reason"] == "tbt" and error["limit"] == 0.025
    # Two sequences, 10 + 2 x 10 ms a step; the handoff of its 20-token prompt (no engine
    # timed, so at the profile's transfer speed) spread over its 3 steps after the first.
    handoff_s = CostModel(PROFILE).kv_transfer_s(20)
    assert error["predicted"] == pytest.approx(0.03 + handoff_s / 3)
    assert int(response.headers["retry-after"]) == math.ceil(error["retry_after_s"])


def test_grpc_complete_streams_the_same_tokens_and_refuses_over_the_ttft_slo(cluster):
    prompt = _prompt(5, 2 * BLOCK + 1)
    with grpc.insecure_channel(cluster.split_grpc) as channel:
        stub = pb_grpc.ConductorStub(channel)
        request = pb.CompleteRequest(prompt_token_ids=prompt, max_tokens=6, temperature=0)
        msgs = list(stub.Complete(request, timeout=60))
        with pytest.raises(grpc.RpcError) as refused:
            tiny = pb.CompleteRequest(prompt_token_ids=prompt, max_tokens=6, ttft_slo_s=1e-6)
            list(stub.Complete(tiny, timeout=60))
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.Complete(pb.CompleteRequest(max_tokens=1), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == _reference(cluster, prompt, 6)
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 6
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    metadata = dict(refused.value.trailing_metadata())
    assert metadata["kvstore-reject-reason"] == "ttft"
    assert "retry-after" not in metadata  # its own prefill is over the SLO: it never fits
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_input_is_a_400(cluster):
    with pytest.raises(openai.BadRequestError):
        _client(cluster.split_http).completions.create(model="tiny", prompt=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # outside the tiny model's vocabulary
        _client(cluster.split_http).completions.create(model="tiny", prompt=[9999], max_tokens=2)


def test_one_both_engine_serves_a_whole_request(cluster):
    prompt = _prompt(6, BLOCK + 7)
    stream = _client(cluster.both_http).completions.create(
        model="tiny", prompt=prompt, max_tokens=7, temperature=0, stream=True
    )
    ids = [t for c in stream for t in c.model_extra["kvstore"]["token_ids"]]
    assert ids == _reference(cluster, prompt, 7)


def test_a_client_that_leaves_mid_stream_frees_the_engine(cluster):
    stream = _client(cluster.both_http).completions.create(
        model="tiny", prompt=_prompt(9, BLOCK + 3), max_tokens=3000, temperature=0, stream=True
    )
    assert next(iter(stream)).model_extra["kvstore"]["token_ids"]
    stream.close()  # the client goes away after its first token
    what = "the engine aborts the request"
    wait_until(lambda: "event=abort" in cluster.both_engine_log.read_text(), 30.0, what)
    with EngineClient(cluster.both_engine, timeout_s=60.0) as engine:
        load = engine.load()
    assert (load.num_running, load.num_free_pages) == (0, load.num_pages)


def test_a_client_that_hangs_up_on_a_whole_answer_frees_the_engine(cluster):
    aborts = cluster.both_engine_log.read_text().count("event=abort")
    client = openai.OpenAI(
        base_url=cluster.both_http + "/v1", api_key="none", max_retries=0, timeout=1.0
    )
    with pytest.raises(openai.APITimeoutError):  # 3,000 tokens take longer than 1 s here
        client.completions.create(
            model="tiny", prompt=_prompt(10, BLOCK + 3), max_tokens=3000, temperature=0
        )
    what = "the engine aborts the request"
    wait_until(
        lambda: cluster.both_engine_log.read_text().count("event=abort") > aborts, 30.0, what
    )
    with EngineClient(cluster.both_engine, timeout_s=60.0) as engine:
        load = engine.load()
    assert (load.num_running, load.num_free_pages) == (0, load.num_pages)


def test_a_conductor_fronts_an_openai_compatible_server(cluster):
    prompt = _prompt(9, 3 * BLOCK + 2)
    client = _client(cluster.front_http)
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    ids = [t for c in stream for t in c.model_extra["kvstore"]["token_ids"]]
    assert ids == _reference(cluster, prompt, 6)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert again.model_extra["kvstore"]["token_ids"] == ids
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # the backend's count
    assert again.model_extra["kvstore"]["prefill_engine"] == cluster.both_http


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read().decode()


def _value(text: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_health_and_metrics_count_routed_and_rejected_requests(cluster):
    status, body = _get(cluster.split_http + "/health")
    assert status == 200 and all(json.loads(body)["engines"].values())
    client = _client(cluster.split_http)
    _, before = _get(cluster.split_http + "/metrics")
    client.completions.create(model="tiny", prompt=_prompt(7, 20), max_tokens=2, temperature=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(
            model="tiny", prompt=_prompt(8, 20), max_tokens=2,
            extra_headers={"x-slo-ttft-ms": "0.001"},
        )  # fmt: skip
    _, after = _get(cluster.split_http + "/metrics")
    rejected = 'kvstore_conductor_rejected_requests_total{reason="ttft"}'
    assert _value(after, rejected) == _value(before, rejected) + 1
    assert _routed(after) >= 1
    assert _value(after, "kvstore_conductor_ttft_seconds_count") >= 1
    assert "kvstore_conductor_engine_queued_seconds" in after


def test_a_conductor_scales_its_profile_by_the_engines_measured_speed(cluster, tmp_path):
    proc = _conductor(tmp_path, "measuring", cluster.split_engines, cluster.store, "cache-aware", 8)
    try:
        http, _ = wait_until(lambda: _ports(proc), 90.0, "the measuring conductor serves")
        base = f"http://127.0.0.1:{http}"
        _, before = _get(base + "/metrics")
        client = _client(base)
        for seed in range(3):
            prompt = _prompt(40 + seed, 2 * BLOCK + 1)
            client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        _, after = _get(base + "/metrics")
    finally:
        assert proc.stop() == 0
    for phase in ("prefill", "decode", "handoff"):
        # Measured by its warm-up before it served anything: the probes are no requests.
        warmed = _speed(before, phase)
        assert warmed > 0 and warmed != 1.0, (phase, warmed)
        measured = _speed(after, phase)
        assert measured > 0 and measured != 1.0, (phase, measured)
    # The first tokens' lateness beyond their predictions: shown, and never below 0.
    latency = re.search(r"^kvstore_conductor_ttft_latency_seconds (\S+)$", after, re.MULTILINE)
    assert latency is not None and float(latency.group(1)) >= 0
    assert _routed(before) == 0 and _value(before, "kvstore_conductor_ttft_seconds_count") == 0
    assert _routed(after) == 3


def test_a_both_engines_conductor_measures_its_decode_steps_too(cluster):
    prompt = _prompt(50, BLOCK + 3)
    _client(cluster.both_http).completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0
    )
    _, text = _get(cluster.both_http + "/metrics")
    for phase in ("prefill", "decode"):  # a request served whole measures both
        measured = _speed(text, phase)
        assert measured > 0 and measured != 1.0, (phase, measured)


def _routed(metrics: str) -> float:
    """Requests routed, over every (prefill, decode) pair."""
    pattern = r"^kvstore_conductor_routed_requests_total\{.*\} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, metrics, re.MULTILINE))


def _speed(metrics: str, phase: str) -> float:
    return _value(metrics, f'kvstore_conductor_speed_factor{{phase="{phase}"}}')
