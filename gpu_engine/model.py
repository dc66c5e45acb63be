"""Llama-architecture decoder over a paged KV cache: RMSNorm, RoPE, GQA, SwiGLU.

Module and parameter names follow Hugging Face's `LlamaForCausalLM`, so a safetensors file of
a checkpoint with the same sizes loads as is. One forward pass runs the new tokens of a batch
of sequences, flattened to N tokens: each sequence's new K/V are written to its pages, then
its new queries attend over all its cached K/V (prefix + new), causally.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpu_engine.config import ModelConfig
from gpu_engine.kv_cache import KVCache

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: each (N, 1, D)


class ForwardBatch(NamedTuple):
    """Model input for N new tokens of B sequences; per-sequence fields are lists of B."""

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    slot_pages: torch.Tensor  # (N,) page that receives each new token's K/V
    slot_offsets: torch.Tensor  # (N,) offset in that page
    query_lens: list[int]  # new tokens per sequence; sum N
    context_lens: list[int]  # cached + new tokens per sequence
    page_tables: list[torch.Tensor]  # (ceil(context_len / page_tokens),) per sequence
    masks: list[torch.Tensor | None]  # (q, c) additive; None: see `_causal_mask`
    last_indices: torch.Tensor  # (B,) index in N of each sequence's last new token
    decode_tables: torch.Tensor | None  # (B, max_pages) padded page tables, when N == B > 1
    decode_mask: torch.Tensor | None  # (B, 1, 1, max_pages * page_tokens) additive

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        starts: list[int],
        page_tables: list[list[int]],
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Sequence i computes tokens `chunks[i]` at positions ``starts[i]...`` in its pages."""
        query_lens = [len(c) for c in chunks]
        context_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
        positions = [p for s, c in zip(starts, context_lens, strict=True) for p in range(s, c)]
        slot_pages = [
            table[p // page_tokens]
            for table, s, c in zip(page_tables, starts, context_lens, strict=True)
            for p in range(s, c)
        ]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            input_ids=tensor([t for c in chunks for t in c]),
            positions=tensor(positions),
            slot_pages=tensor(slot_pages),
            slot_offsets=tensor([p % page_tokens for p in positions]),
            query_lens=query_lens,
            context_lens=context_lens,
            page_tables=[
                tensor(t[: -(-c // page_tokens)])
                for t, c in zip(page_tables, context_lens, strict=True)
            ],
            masks=[
                _causal_mask(q, c, dtype, device)
                for q, c in zip(query_lens, context_lens, strict=True)
            ],
            last_indices=tensor(list(itertools.accumulate(query_lens))) - 1,
            **_decode_fields(query_lens, context_lens, page_tables, page_tokens, dtype, device),
        )


def _decode_fields(
    query_lens: list[int],
    context_lens: list[int],
    page_tables: list[list[int]],
    page_tokens: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    """Padded page tables and mask for one batched attention call when every sequence decodes
    one token; a batch with any prefill attends sequence by sequence instead."""
    if len(query_lens) < 2 or max(query_lens) > 1:
        return {"decode_tables": None, "decode_mask": None}
    num_pages = [-(-c // page_tokens) for c in context_lens]
    width = max(num_pages)
    tables = [t[:n] + [0] * (width - n) for t, n in zip(page_tables, num_pages, strict=True)]
    lens = torch.tensor(context_lens, device=device)[:, None]  # (B, 1)
    hidden = torch.arange(width * page_tokens, device=device)[None, :] >= lens  # (B, C)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)
    return {
        "decode_tables": torch.tensor(tables, dtype=torch.long, device=device),
        "decode_mask": mask[:, None, None, :],  # (B, 1, 1, C)
    }


def _causal_mask(
    query_len: int, context_len: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    """(q, c) additive mask: new token i (position c - q + i) sees cached tokens 0..c - q + i.

    None where `_attend` needs no mask: one query sees everything, and a suffix at least as
    long as its cached prefix runs the causal kernel on front-padded queries instead (2-3x
    faster on CPU than a dense mask, and more so the longer the suffix).
    """
    past = context_len - query_len
    if query_len == 1 or past <= query_len:
        return None
    rows = torch.arange(query_len, device=device)[:, None] + past
    hidden = torch.arange(context_len, device=device)[None, :] > rows
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's rotary angles, computed in fp32 whatever the model dtype."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `model.to(dtype)` must not round it.
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (N, D/2)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # (N, 1, D)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, rope: Rope, batch: ForwardBatch, cache: KVCache
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # (N, Hq, D)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (N, Hkv, D)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        cache.write(self.layer, batch.slot_pages, batch.slot_offsets, k, v)
        if batch.decode_tables is not None:
            ctx_k, ctx_v = cache.gather_batch(self.layer, batch.decode_tables)
            return self.o_proj(_attend_decode(q, ctx_k, ctx_v, batch.decode_mask).view(n, -1))
        out = torch.empty_like(q)
        start = 0
        for i, query_len in enumerate(batch.query_lens):
            end = start + query_len
            ctx_k, ctx_v = cache.gather(self.layer, batch.page_tables[i], batch.context_lens[i])
            out[start:end] = _attend(q[start:end], ctx_k, ctx_v, batch.masks[i])
            start = end
        return self.o_proj(out.view(n, -1))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q (q, Hq, D) over k, v (c, Hkv, D), the last q of c positions being the queries'."""
    past = k.shape[0] - q.shape[0]
    is_causal = mask is None and q.shape[0] > 1
    if is_causal and past:  # pad queries to c rows, so the causal kernel aligns them
        q = torch.cat([q.new_zeros(past, *q.shape[1:]), q])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, Hq, q, D)
        k.transpose(0, 1).unsqueeze(0),  # (1, Hkv, c, D)
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=True,
    )
    return out[0, :, past:].transpose(0, 1) if is_causal else out[0].transpose(0, 1)


def _attend_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q (B, Hq, D), one token per sequence, over k, v (B, C, Hkv, D) -> (B, Hq, D)."""
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (B, Hq, 1, D)
        k.transpose(1, 2),  # (B, Hkv, C, D)
        v.transpose(1, 2),
        attn_mask=mask,  # (B, 1, 1, C): padding hidden
        enable_gqa=True,
    )
    return out.squeeze(2)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: torch.Tensor, rope: Rope, batch: ForwardBatch, cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # (N, hidden)
        rope = self.rotary(batch.positions)
        for layer in self.layers:
            x = layer(x, rope, batch, cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Writes the new tokens' K/V to `cache`; returns (B, vocab) fp32 logits of each
        sequence's last new token."""
        hidden = self.model(batch, cache)  # (N, hidden)
        return self.lm_head(hidden[batch.last_indices]).float()


def build_model(
    config: ModelConfig,
    seed: int = 0,
    weights_path: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """The model with random weights from `seed` (the same on every device), or loaded from a
    safetensors file when `weights_path` is given."""
    model = LlamaForCausalLM(config)
    if weights_path:
        load_weights(model, weights_path)
    else:
        init_random(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def init_random(model: nn.Module, seed: int) -> None:
    """Norms to one, embeddings N(0, 1), linears N(0, 1/fan_in): unit-scale activations."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0, generator=gen)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Writes the weights as a safetensors file (needs the `safetensors` package)."""
    st = _safetensors_torch()
    st.save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, path)


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Loads a safetensors file with exactly this model's parameter names and shapes."""
    st = _safetensors_torch()
    state = st.load_file(str(path))
    model.load_state_dict(state, strict=True)


def _safetensors_torch():  # the module, imported lazily
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "loading or saving weights needs the `safetensors` package: pip install safetensors"
        ) from exc
    return safetensors.torch
