"""Llama models with random weights and an offline-trained tokenizer, for vLLM on CPU.

Nothing is downloaded: `transformers` writes the weights, `tokenizers` trains a small BPE
on generated text. Greedy output of such a model is deterministic, which is all the tests
and benchmarks compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 2048


@dataclass(frozen=True)
class ModelSize:
    """Shape of a generated Llama model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_len: int


SIZES = {
    # Tests: starts fast, a prefill of a few hundred tokens takes milliseconds.
    "tiny": ModelSize(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, max_len=2048),
    # Bench: an 8k-token prefill takes seconds on a few CPU cores.
    "bench": ModelSize(
        hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, max_len=16384
    ),
}


def _train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i} t{i % 97} x{i % 13}" for i in range(4000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(words, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def build_model(path: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Writes a Llama model of `size` with random weights to `path` (once) and returns it."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[size]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_len,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _train_tokenizer(path)
    return path


if __name__ == "__main__":
    import sys

    build_model(Path(sys.argv[1]), sys.argv[2])
