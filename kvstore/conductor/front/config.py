"""`ConductorConfig`: one table for `kvstore conductor`'s flags, environment and file keys."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.auth import ListenerSecurity
from kvstore.bounds import StreamSettings
from kvstore.conductor.front.speed import MAX_AGE_S, WINDOW
from kvstore.conductor.registry import SCHEDULING_POLICIES
from kvstore.conductor.slo import SLO
from kvstore.config import option, table
from kvstore.errors import InvalidArgumentError


@dataclass(frozen=True)
class ConductorConfig:
    """What the conductor fronts, how it decides, and where it listens; `security`: who may
    call it (a token file guards `/v1/completions` and the gRPC service, TLS serves both);
    `streams`: how many response streams, HTTP and gRPC together, stay open per client and
    in all, and when a stalled one is ended.

    Engine roles are not configured: each engine's Load reports its own. The block size
    comes from the engines too; `model`, `model_id`, `dtype` and `tenant_salt` name the
    KV namespace they publish in (as `kvstore engine`'s flags of the same names).
    """

    security: ListenerSecurity = table(ListenerSecurity)
    streams: StreamSettings = table(StreamSettings)

    engines: str = option(
        "",
        "engines, comma-separated: HOST:PORT (kvstore engine) or http://HOST:PORT (an "
        "OpenAI-compatible server, e.g. vLLM with the kvstore connector)",
    )
    store: str = option("", "store node HOST:PORT the engines publish to; empty: no pool")
    policy: str = option("cache-aware-predictive", f"one of {list(SCHEDULING_POLICIES)}")
    profile: str = option(
        "datacenter", "cost profile: a built-in name or a JSON file (kvstore-bench calibrate)"
    )
    host: str = option("127.0.0.1", "address to listen on (HTTP and gRPC)")
    port: int = option(8000, "HTTP port: /v1/completions, /health, /metrics; 0 picks one")
    grpc_port: int = option(50071, "gRPC port of the Conductor service; 0 picks one, -1 none")
    ttft_slo_s: float = option(30.0, "default TTFT SLO, seconds (header x-slo-ttft-ms)")
    tbt_slo_ms: float = option(100.0, "default TBT SLO, milliseconds (header x-slo-tbt-ms)")
    model: str = option("tiny", "the engines' model preset (their --model)")
    model_id: str = option("", "the engines' --model-id (default gpu_engine/<model>)")
    dtype: str = option("float32", "the engines' --dtype")
    tenant_salt: str = option("", "the engines' --tenant-salt, hex")
    backend_block_tokens: int = option(16, "KV block size of the http:// engines, tokens")
    speed_window: int = option(
        WINDOW,
        "first tokens (and decode gaps) the engines' speed is measured over, to scale the "
        "profile's predictions by; 0: predict with the profile as it is",
    )
    speed_max_age_s: float = option(
        MAX_AGE_S, "seconds a measurement of the engines' speed counts for at most"
    )
    warmup_rounds: int = option(
        2,
        "rounds of probes timing every engine before the first admission (the first round's "
        "timings dropped as cold); 0: none, the first predictions are the profile's",
    )
    seed: int = option(0, "seeds the policy and the seeds drawn for unseeded sampling")
    engine_timeout_s: float = option(600.0, "deadline of one engine stream")
    ready_timeout_s: float = option(60.0, "how long to wait at start for every engine")
    engine_token_file: str = option("", "file holding the token the engines know us by")
    engine_tls_ca: str = option("", "PEM CA of the engines' certificates: reach them over TLS")
    store_token_file: str = option("", "file holding the token the store knows us by")
    store_tls_ca: str = option("", "PEM CA of the store's certificate: reach it over TLS")

    def __post_init__(self) -> None:
        if not self.engine_addresses:
            raise InvalidArgumentError("--engines: at least one engine HOST:PORT")
        if self.policy not in SCHEDULING_POLICIES:
            raise InvalidArgumentError(
                f"unknown policy {self.policy!r}; known: {list(SCHEDULING_POLICIES)}"
            )
        if not 0 <= self.port < 65536 or not -1 <= self.grpc_port < 65536:
            raise InvalidArgumentError(f"bad port: {self.port} / {self.grpc_port}")
        if self.backend_block_tokens < 1:
            raise InvalidArgumentError("backend_block_tokens must be >= 1")
        if self.speed_window < 0 or not self.speed_max_age_s > 0:
            raise InvalidArgumentError(
                f"speed_window must be >= 0 and speed_max_age_s > 0: {self.speed_window}, "
                f"{self.speed_max_age_s}"
            )
        if self.warmup_rounds < 0:
            raise InvalidArgumentError(f"warmup_rounds must be >= 0: {self.warmup_rounds}")
        if not self.engine_timeout_s > 0 or not self.ready_timeout_s > 0:
            raise InvalidArgumentError("engine_timeout_s and ready_timeout_s must be > 0")
        try:
            self.slo  # noqa: B018 - validates the SLO times
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None

    @property
    def engine_addresses(self) -> list[str]:
        return [a.strip() for a in self.engines.split(",") if a.strip()]

    @property
    def slo(self) -> SLO:
        """The objectives of a request that brings none."""
        return SLO(self.ttft_slo_s, self.tbt_slo_ms / 1000)
