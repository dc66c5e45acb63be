"""The one-way layers of the source tree, read from its imports.

    vocabulary (keys, errors, results, checksum, wire, config, limits, auth, ...)
      <- store core (kvstore.store) <- tenancy, the pool (kvstore.cluster)
      <- node (kvstore.node, the data-plane servers)
      <- client side (kvstore.client, the data-plane clients)

Two checks: the static one reads every import of every module (those under
`if TYPE_CHECKING:` too, since they name what a module is written against) and holds each
layer to what it may import, and the whole tree to no import circle; the live one imports
each client-side entry point in a fresh interpreter and lists what came with it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("kvstore", "gpu_engine")
# Layers, by module prefix; a module is in the first layer whose prefix it starts with.
CLIENT_SIDE = (
    "kvstore.client",
    "kvstore.dataplane.base",
    "kvstore.dataplane.buffers",
    "kvstore.dataplane.frames",
    "kvstore.dataplane.retry",
    "kvstore.dataplane.selection",
    "kvstore.dataplane.shm.client",
    "kvstore.dataplane.shm.connection",
    "kvstore.dataplane.shm.crew",
    "kvstore.dataplane.shm.in_place",
    "kvstore.dataplane.shm.placed_rows",
    "kvstore.dataplane.shm.regions",
    "kvstore.dataplane.sockets.connection",
    "kvstore.dataplane.sockets.in_order",
    "kvstore.dataplane.sockets.landing",
    "kvstore.dataplane.sockets.messages",
    "kvstore.dataplane.tcp.client",
    "kvstore.dataplane.tcp.streams",
    "kvstore.dataplane.ucx.client",
    "kvstore.dataplane.ucx.runtime",
    "kvstore.dataplane.ucx.transfers",
)
VOCABULARY = (
    "kvstore.keys",
    "kvstore.errors",
    "kvstore.results",
    "kvstore.checksum",
    "kvstore.wire",
    "kvstore.config",
    "kvstore.limits",
    "kvstore.auth",
    "kvstore.failpoints",
    "kvstore._proto",
)
STORE = ("kvstore.store",)
TENANCY = ("kvstore.tenancy",)  # beneath the node and the data-plane servers, which share it
POOL = ("kvstore.cluster",)  # beneath the node: only nodes talk to Redis
NODE_ONLY = (
    "kvstore.store",
    "kvstore.tenancy",
    "kvstore.cluster",
    "kvstore.node",
    "kvstore.dataplane.servers",
    "kvstore.dataplane.shm.server",
    "kvstore.dataplane.tcp.server",
    "kvstore.dataplane.ucx.server",
    "kvstore.dataplane.sockets.server",
    "lmdb",
)


def _is_in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Every module `path` imports (absolute names), wherever in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    files = [p for s in SOURCES for p in (REPO_ROOT / s).rglob("*.py") if "_proto" not in p.parts]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


GRAPH = _graph()


def test_the_graph_reads_every_module():
    assert "kvstore.store.store" in GRAPH["kvstore.store"]
    assert "kvstore.dataplane.frames" in GRAPH["kvstore.dataplane.tcp.client"]
    assert len(GRAPH) > 150


@pytest.mark.parametrize(
    ("layer", "may_not_import"),
    [
        (VOCABULARY, (*STORE, *NODE_ONLY, *CLIENT_SIDE, "kvstore.conductor", "gpu_engine")),
        (
            STORE,
            (
                "kvstore.tenancy",
                "kvstore.cluster",
                "kvstore.node",
                "kvstore.dataplane",
                "kvstore.client",
                "kvstore.conductor",
            ),
        ),
        (TENANCY, ("kvstore.node", "kvstore.dataplane", "kvstore.client", "kvstore.conductor")),
        (POOL, ("kvstore.node", "kvstore.dataplane", "kvstore.client", "kvstore.conductor")),
        (CLIENT_SIDE, (*NODE_ONLY, "kvstore.conductor", "gpu_engine")),
    ],
    ids=["vocabulary", "store", "tenancy", "pool", "client"],
)
def test_each_layer_imports_only_what_is_beneath_it(layer, may_not_import):
    wrong = sorted(
        f"{module} -> {imported}"
        for module, imports in GRAPH.items()
        if _is_in(module, layer)
        for imported in imports
        if _is_in(imported, may_not_import) and not _is_in(imported, layer)
    )
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_no_import_circle():
    """Modules only: a package's `__init__` that re-exports its own modules is not a circle
    with them (each of them imports its siblings, never the package)."""
    edges = {
        m: {i for i in imports if not (GRAPH.get(i) is not None and m.startswith(i + "."))}
        for m, imports in GRAPH.items()
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (circle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(circle))


def _loaded_by(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


ENTRY_POINTS = [
    "from kvstore.client import AsyncClient, Client",
    "import kvstore.client.publishing",
    "import gpu_engine.connector",
    "import kvstore.integrations.vllm.loader, kvstore.integrations.vllm.layer_load",
]


@pytest.mark.parametrize("statement", ENTRY_POINTS)
def test_client_side_entry_points_load_no_node(statement):
    loaded = _loaded_by(statement)
    assert "kvstore.client" in loaded or "gpu_engine" in loaded or "kvstore.integrations" in loaded
    wrong = [m for m in loaded if _is_in(m, NODE_ONLY)]
    assert not wrong, f"{statement!r} loads the node side: {wrong}"


@pytest.mark.vllm
def test_the_vllm_connector_loads_no_node():
    """In .venv-vllm (`make test-vllm`, where a missing vLLM fails): the module vLLM
    loads by name."""
    if not os.environ.get("KVSTORE_REQUIRE_VLLM"):
        pytest.importorskip("vllm")
    loaded = _loaded_by("import kvstore.integrations.vllm.connector")
    assert "vllm" in loaded
    wrong = [m for m in loaded if _is_in(m, NODE_ONLY)]
    assert not wrong, f"the vLLM connector loads the node side: {wrong}"
