"""The conductor's live front: `kvstore conductor` over real engine processes and the store.

Modules: `config` (`ConductorConfig`, the flag table), `tokenizer` (UTF-8 bytes as token
ids), `engine_handle` (asyncio gRPC client of one engine), `live_view` (the `ClusterView`
built from the conductor's bookkeeping and the store's matches), `completion` (request,
chunk, outcome, `RejectedError`), `conductor` (admission and the prefill -> decode flow),
`metrics` (Prometheus, its own registry), `http_api` (OpenAI-compatible completions,
/health, /metrics), `event_stream` (one streamed HTTP answer, in a stream slot, under the
stall deadline), `grpc_api` (`Conductor.Complete`), `server` (all of it on one loop).
"""
