"""Block keys: golden vectors, chaining, namespace isolation, input validation."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.keys import (
    CHAIN_GROUP_BLOCKS,
    KEY_BYTES,
    ChainPosition,
    KVLayout,
    Namespace,
    block_keys,
    chain_groups,
    tokens_to_bytes,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_ID = "llama-3-8b"

# Computed once with `_ref_namespace_id` / `_ref_block_keys` below and frozen here, so a change
# to the hashing (of the namespace encoding, the token encoding or the chaining) is caught.
GOLDEN_NS_ID = "0105097336bcce26c6d18a337ccf582f5e362800d15476192912dd883c981c6c"
GOLDEN_NS_ID_SALTED = "53315d7ca7155e4dd8f1e225db6273a26175146f18a558959ec2071bba81b280"
GOLDEN_KEYS = [
    "5114312085d68f26673aa15092ab21406a396c09a41cd044b348c81b5caf00f4",
    "a2e29ed630ff5028f1a67e5c36b1e261407ec1640dd48e1874e581a61b1dfda3",
]
GOLDEN_KEYS_SALTED = [
    "7eb0ce8c051b13f9bc07c3fa46db6449186004ccc94f3d825d3c6ae959625c73",
    "9caff4e5a98609ff741bcdfd65d47b57a4d075261ff57d7f44f6046b2dbe447c",
]
GOLDEN_PARENT = bytes(range(32))
GOLDEN_PARENT_TOKENS = [100_000 + i for i in range(32)] + [2**32 - 1] * 5
GOLDEN_KEYS_WITH_PARENT = [
    "7ef027d96c2bae354a175f0b8ea1fa4eab727371f25d4dc1205074f68c3195d0",
    "f1733f51fc4756f072e8977000b28765cd67d2ff750bcdfdba0876b02ceb2f56",
]


def _ref_namespace_id(
    model_id: str, dtype: str, layers: int, heads: int, head_dim: int, block: int, salt: bytes
) -> bytes:
    """Independent restatement of the canonical namespace encoding in DESIGN.md."""
    fields = [
        "kvstore-ns-v1",
        f"model_id={model_id}",
        f"dtype={dtype}",
        f"num_layers={layers}",
        f"num_kv_heads={heads}",
        f"head_dim={head_dim}",
        f"block_tokens={block}",
        f"tenant_salt={salt.hex()}",
    ]
    return hashlib.blake2b("\n".join(fields).encode(), digest_size=32).digest()


def _ref_block_keys(seed: bytes, tokens: list[int], block: int) -> list[bytes]:
    """Independent restatement of the key chain: one struct.pack per token, one hash per block."""
    keys, prev = [], seed
    for i in range(len(tokens) // block):
        data = b"".join(struct.pack("<I", t) for t in tokens[i * block : (i + 1) * block])
        prev = hashlib.blake2b(prev + data, digest_size=32).digest()
        keys.append(prev)
    return keys


def _make_layout(**overrides: object) -> KVLayout:
    fields: dict[str, object] = {
        "dtype": "float16",
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "block_tokens": 16,
    }
    fields.update(overrides)
    return KVLayout(**fields)  # type: ignore[arg-type]


def _make_ns(model_id: str = MODEL_ID, salt: bytes = b"", **layout: object) -> Namespace:
    return Namespace(model_id, _make_layout(**layout), tenant_salt=salt)


def _hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


# --- golden vectors ---------------------------------------------------------------------------


def test_namespace_id_golden() -> None:
    assert _make_ns().id.hex() == GOLDEN_NS_ID
    assert _make_ns(salt=b"tenant-a").id.hex() == GOLDEN_NS_ID_SALTED


def test_namespace_id_matches_reference() -> None:
    ref = _ref_namespace_id(MODEL_ID, "float16", 32, 8, 128, 16, b"tenant-a")
    assert _make_ns(salt=b"tenant-a").id == ref


def test_block_keys_golden() -> None:
    assert _hexes(block_keys(_make_ns(), list(range(40)))) == GOLDEN_KEYS


def test_block_keys_golden_salted() -> None:
    ns = _make_ns(salt=b"tenant-a")
    assert _hexes(block_keys(ns, list(range(40)))) == GOLDEN_KEYS_SALTED


def test_block_keys_golden_with_parent() -> None:
    keys = block_keys(_make_ns(), GOLDEN_PARENT_TOKENS, parent=GOLDEN_PARENT)
    assert _hexes(keys) == GOLDEN_KEYS_WITH_PARENT


def test_golden_vectors_match_reference() -> None:
    ns, salted = _make_ns(), _make_ns(salt=b"tenant-a")
    assert _hexes(_ref_block_keys(ns.id, list(range(40)), 16)) == GOLDEN_KEYS
    assert _hexes(_ref_block_keys(salted.id, list(range(40)), 16)) == GOLDEN_KEYS_SALTED
    ref = _ref_block_keys(GOLDEN_PARENT, GOLDEN_PARENT_TOKENS, 16)
    assert _hexes(ref) == GOLDEN_KEYS_WITH_PARENT


@pytest.mark.parametrize("block", [1, 3, 16, 64])
def test_block_keys_match_reference_on_random_tokens(block: int) -> None:
    tokens = np.random.default_rng(block).integers(0, 2**32, size=300, dtype=np.uint64).tolist()
    ns = _make_ns(block_tokens=block)
    assert block_keys(ns, tokens) == _ref_block_keys(ns.id, tokens, block)


# --- chaining and shape -----------------------------------------------------------------------


def test_chain_continuation_equals_one_call() -> None:
    ns, tokens = _make_ns(), list(range(1000, 1064))
    head = block_keys(ns, tokens[:32])
    tail = block_keys(ns, tokens[32:64], parent=head[-1])
    assert head + tail == block_keys(ns, tokens)
    assert len(head + tail) == 4


def test_partial_trailing_block_ignored() -> None:
    ns, tokens = _make_ns(), list(range(47))
    assert len(block_keys(ns, tokens)) == 2
    assert block_keys(ns, tokens) == block_keys(ns, tokens[:32])


def test_fewer_tokens_than_one_block_gives_no_keys() -> None:
    assert block_keys(_make_ns(), list(range(15))) == []
    assert block_keys(_make_ns(), []) == []
    assert block_keys(_make_ns(), np.array([], dtype=np.uint32)) == []


def test_keys_are_32_bytes_and_distinct() -> None:
    keys = block_keys(_make_ns(), [7] * 160)
    assert len(keys) == 10
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 10  # same tokens, different position in the chain


def test_changed_token_changes_its_block_and_all_later_keys() -> None:
    ns, tokens = _make_ns(), list(range(64))
    changed = [*tokens[:20], 999_999, *tokens[21:]]
    before, after = block_keys(ns, tokens), block_keys(ns, changed)
    assert before[0] == after[0]
    assert all(b != a for b, a in zip(before[1:], after[1:], strict=True))


# --- namespace isolation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "salt", "layout"),
    [
        (MODEL_ID, b"tenant-a", {}),
        (MODEL_ID, b"tenant-b", {}),
        ("llama-3-70b", b"", {}),
        (MODEL_ID, b"", {"dtype": "bfloat16"}),
        (MODEL_ID, b"", {"num_layers": 33}),
        (MODEL_ID, b"", {"num_kv_heads": 4}),
        (MODEL_ID, b"", {"head_dim": 64}),
    ],
)
def test_different_namespace_gives_disjoint_keys(
    model_id: str, salt: bytes, layout: dict[str, object]
) -> None:
    tokens = list(range(160))
    base = set(block_keys(_make_ns(), tokens))
    other = set(block_keys(_make_ns(model_id, salt, **layout), tokens))
    assert len(other) == 10
    assert base.isdisjoint(other)


def test_different_block_tokens_gives_disjoint_keys() -> None:
    tokens = list(range(256))
    keys16 = set(block_keys(_make_ns(block_tokens=16), tokens))
    keys32 = set(block_keys(_make_ns(block_tokens=32), tokens))
    assert (len(keys16), len(keys32)) == (16, 8)
    assert keys16.isdisjoint(keys32)


def test_salts_that_differ_only_in_encoding_stay_distinct() -> None:
    # The salt is hex-encoded, so no salt can forge another namespace's field lines.
    forged = _make_ns(salt=b"\nmodel_id=x")
    assert forged.id != _make_ns().id != _make_ns(salt=b"\x00").id


# --- input kinds ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.uint64, np.int32])
def test_numpy_input_equals_list_input(dtype: type) -> None:
    tokens = list(range(5, 5 + 70))
    ns = _make_ns()
    assert block_keys(ns, np.array(tokens, dtype=dtype)) == block_keys(ns, tokens)


def test_tuple_and_numpy_scalar_elements_equal_list_input() -> None:
    tokens = [0, 1, 2**31, 2**32 - 1] * 8
    ns = _make_ns()
    expected = block_keys(ns, tokens)
    assert block_keys(ns, tuple(tokens)) == expected
    assert block_keys(ns, [np.uint32(t) for t in tokens]) == expected
    assert block_keys(ns, np.array(tokens, dtype=np.uint64)) == expected


def test_tokens_to_bytes_is_little_endian_uint32() -> None:
    assert tokens_to_bytes([1, 0x01020304, 2**32 - 1]) == (
        b"\x01\x00\x00\x00" + b"\x04\x03\x02\x01" + b"\xff\xff\xff\xff"
    )
    big_endian = np.array([1, 0x01020304], dtype=">u4")
    assert tokens_to_bytes(big_endian) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert tokens_to_bytes([]) == b""


def test_keys_deterministic_across_processes() -> None:
    script = (
        "from kvstore.keys import KVLayout, Namespace, block_keys\n"
        "layout = KVLayout('float16', 32, 8, 128, 16)\n"
        "ns = Namespace('llama-3-8b', layout, tenant_salt=b'tenant-a')\n"
        "print(' '.join(k.hex() for k in block_keys(ns, list(range(40)))))\n"
    )
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == GOLDEN_KEYS_SALTED


# --- invalid input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, -1],
        [0, 2**32],
        [2**70],
        [1.0, 2.0],
        [1, 2.5],
        ["a", "b"],
        [True] * 16,
        np.array([1.0, 2.0]),
        np.array([-1, 3], dtype=np.int64),
        np.array([2**32], dtype=np.uint64),
        np.zeros((2, 16), dtype=np.uint32),
        [[1, 2], [3, 4]],
        np.array(5, dtype=np.uint32),
    ],
    ids=[
        "negative",
        "2**32",
        "huge",
        "float-list",
        "mixed-float-list",
        "str-list",
        "bool-list",
        "float-array",
        "negative-array",
        "2**32-array",
        "2d-array",
        "nested-list",
        "0d-array",
    ],
)
def test_invalid_tokens_raise(tokens: object) -> None:
    with pytest.raises(InvalidArgumentError):
        block_keys(_make_ns(), tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_parent_key_of_wrong_length_raises(length: int) -> None:
    with pytest.raises(InvalidArgumentError, match="parent key must be 32 bytes"):
        block_keys(_make_ns(), list(range(32)), parent=b"\x01" * length)


@pytest.mark.parametrize(
    "overrides",
    [
        {"dtype": "float64"},
        {"dtype": "fp16"},
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 0},
        {"block_tokens": 0},
        {"num_layers": 32.0},
    ],
)
def test_invalid_layout_raises(overrides: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        _make_layout(**overrides)


def test_invalid_namespace_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="model_id"):
        Namespace("", _make_layout())
    with pytest.raises(InvalidArgumentError, match="tenant_salt"):
        Namespace(MODEL_ID, _make_layout(), tenant_salt="tenant-a")  # type: ignore[arg-type]


def test_invalid_argument_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        block_keys(_make_ns(), [-1])


# --- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, 2 * 32 * 8 * 128 * 16 * 2),
        ({"dtype": "bfloat16"}, 2_097_152),
        ({"dtype": "float32"}, 4_194_304),
        ({"dtype": "float8_e4m3fn"}, 1_048_576),
        ({"dtype": "int8", "block_tokens": 64}, 4_194_304),
        ({"num_layers": 80, "num_kv_heads": 8, "head_dim": 128, "block_tokens": 16}, 5_242_880),
        (
            {
                "dtype": "float32",
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 1,
                "block_tokens": 1,
            },
            8,
        ),
    ],
)
def test_block_bytes(overrides: dict[str, object], expected: int) -> None:
    assert _make_layout(**overrides).block_bytes == expected
    assert Namespace(MODEL_ID, _make_layout(**overrides)).block_bytes == expected


def test_block_bytes_default_is_2_mib() -> None:
    assert _make_ns().block_bytes == 2_097_152
    assert _make_ns().block_tokens == 16


@pytest.mark.parametrize("first_depth", [0, 1, 31, 32, 45])
def test_a_chain_position_names_the_group_chain_groups_gives_each_block(first_depth):
    keys = [i.to_bytes(4, "big") * 8 for i in range(3 * CHAIN_GROUP_BLOCKS + 7)]
    first = ChainPosition(first_depth, b"g" * 32) if first_depth else None
    if first_depth % CHAIN_GROUP_BLOCKS == 0 and first is not None:
        first = ChainPosition(first_depth, keys[0])  # opens its group: named by itself
    groups = chain_groups(keys, first)
    for start in range(len(keys)):
        position = ChainPosition.of(keys, start, first)
        if start == 0 and first is None:
            assert position is None  # the root
            continue
        assert position == ChainPosition(start + first_depth, groups[start])
        position.check(keys[start])
