"""Model and configs: presets, seeded weights, safetensors round trip, validation."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gpu_engine.config import MODEL_PRESETS, EngineConfig, ModelConfig
from gpu_engine.model import build_model, load_weights, save_weights
from kvstore.errors import InvalidArgumentError
from tests.conftest import require_extra

HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_random_weights_depend_only_on_the_seed() -> None:
    tiny = MODEL_PRESETS["tiny"]
    assert _weights_equal(build_model(tiny, seed=3), build_model(tiny, seed=3))
    assert not _weights_equal(build_model(tiny, seed=3), build_model(tiny, seed=4))


def test_parameter_names_follow_hugging_face_llama() -> None:
    names = set(build_model(MODEL_PRESETS["tiny"]).state_dict())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.self_attn.k_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_presets_give_a_store_layout(name: str) -> None:
    m = MODEL_PRESETS[name]
    layout = EngineConfig(model=name, block_tokens=32, page_tokens=8).kv_layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        m.num_layers,
        m.num_kv_heads,
        m.head_dim,
    )
    assert layout.block_bytes == 2 * m.num_layers * m.num_kv_heads * m.head_dim * 32 * 4


def test_safetensors_round_trip(tmp_path) -> None:
    require_extra("safetensors")
    tiny = MODEL_PRESETS["tiny"]
    model = build_model(tiny, seed=5)
    save_weights(model, tmp_path / "w.safetensors")
    loaded = build_model(tiny, weights_path=tmp_path / "w.safetensors")
    assert _weights_equal(model, loaded)


@pytest.mark.skipif(HAS_SAFETENSORS, reason="safetensors is installed")
def test_loading_without_safetensors_says_what_to_install(tmp_path) -> None:
    with pytest.raises(ImportError, match="safetensors"):
        load_weights(build_model(MODEL_PRESETS["tiny"]), tmp_path / "w.safetensors")


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": "huge"},
        {"dtype": "int8"},
        {"block_tokens": 16, "page_tokens": 6},
        {"num_pages": 0},
        {"max_prefill_tokens": -1},
        {"tenant_salt": "xyz"},
    ],
)
def test_bad_engine_configs_are_refused(overrides: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        EngineConfig(**overrides)


def test_bad_model_configs_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        ModelConfig(512, 64, 128, 2, num_heads=4, num_kv_heads=3)
    with pytest.raises(InvalidArgumentError):
        ModelConfig(512, 60, 128, 2, num_heads=8, num_kv_heads=2)


def test_tenant_salt_changes_the_namespace() -> None:
    assert EngineConfig().namespace.id != EngineConfig(tenant_salt="ab").namespace.id
