"""`OpenAIBackend`: an OpenAI-compatible completions server (vLLM with the kvstore connector,
another conductor) as one of the conductor's engines, beside `EngineHandle`.

Such a server prefills and decodes itself, so it is an engine of role "both"; its KV block
size is not on its API, so the conductor is told it (`--backend-block-tokens`). Output ids
come from vLLM's `return_token_ids` extension (``choices[0].token_ids``, the delta in a
stream), which the conductor's own API serves too; usage arrives in a final chunk
(``stream_options.include_usage``), and `cached_tokens` from
``usage.prompt_tokens_details``, which vLLM fills when run with
``--enable-prompt-tokens-details``. Load is the server's ``GET /health`` (no queue figures).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp

from kvstore.conductor.front.engine_handle import EngineChunk, EngineStatus
from kvstore.errors import InvalidArgumentError, UnavailableError

SCHEME = "http://"


def is_backend_address(address: str) -> bool:
    """An engine address naming an OpenAI-compatible server (``http://host:port``)."""
    return address.startswith(SCHEME)


class OpenAIBackend:
    """One OpenAI-compatible server, by base URL; `close` when done.

    Args:
        address: ``http://host:port`` (the API is under ``/v1``).
        timeout_s: deadline of one completion stream.
        block_tokens: the server's KV block size, in tokens.
    """

    def __init__(self, address: str, timeout_s: float, block_tokens: int) -> None:
        self.address = address.rstrip("/")
        self.timeout_s = timeout_s
        self.block_tokens = block_tokens
        self.model = ""  # the served model's id, read at the first load
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._http

    async def prefetch(self, prompt: Sequence[int]) -> int | None:
        return None  # the OpenAI API has no way to ask for it

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def load(self, timeout_s: float | None = None) -> EngineStatus:
        """Whether the server answers ``/health`` (and its model id); UnavailableError if not."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._session().get(self.address + "/health", timeout=timeout) as r:
                if r.status != 200:
                    raise UnavailableError(f"{self.address}/health answered {r.status}")
            if not self.model:
                self.model = await self._model_id(timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UnavailableError(f"{self.address} is not reachable: {exc!r}") from None
        return EngineStatus("both", self.block_tokens, 0, 0, 0, True)

    async def _model_id(self, timeout: aiohttp.ClientTimeout) -> str:
        """The first model ``/v1/models`` lists ("" if none)."""
        async with self._session().get(self.address + "/v1/models", timeout=timeout) as r:
            models = (await r.json()).get("data") if r.status == 200 else None
        return str(models[0].get("id", "")) if models else ""

    async def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int | None,
        num_published_tokens: int = 0,
    ) -> AsyncGenerator[EngineChunk, None]:
        """Streams one completion as `EngineChunk`s, the last with the finish reason and
        the cached tokens; InvalidArgumentError on a 400, UnavailableError otherwise."""
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if seed is not None:
            body["seed"] = seed
        finish, cached = "", 0
        try:
            async with self._session().post(self.address + "/v1/completions", json=body) as r:
                if r.status != 200:
                    cls = InvalidArgumentError if r.status == 400 else UnavailableError
                    raise cls(f"{self.address} answered {r.status}: {(await r.text())[:200]}")
                async for msg in _events(r):
                    ids, reason, tokens_cached = _parse(msg)
                    finish, cached = reason or finish, tokens_cached or cached
                    if ids:
                        yield EngineChunk(ids, "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UnavailableError(f"{self.address} failed: {exc!r}") from None
        yield EngineChunk((), finish or "length", cached)


async def _events(response: aiohttp.ClientResponse) -> AsyncGenerator[dict[str, Any], None]:
    """The ``data:`` messages of a server-sent event stream, up to ``[DONE]``."""
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        msg = json.loads(data)
        if "error" in msg:
            raise UnavailableError(f"the backend's stream failed: {msg['error']}")
        yield msg


def _parse(msg: dict[str, Any]) -> tuple[tuple[int, ...], str, int]:
    """(new token ids, finish reason or "", cached prompt tokens or 0) of one chunk."""
    choice = (msg.get("choices") or [{}])[0]
    ids = choice.get("token_ids") or []
    details = (msg.get("usage") or {}).get("prompt_tokens_details") or {}
    return (
        tuple(int(t) for t in ids),
        choice.get("finish_reason") or "",
        details.get("cached_tokens") or 0,
    )
