"""Packaging for deployment: the wheel installs and serves in a fresh venv, the Dockerfile
passes hadolint, the Kubernetes manifests pass the Kubernetes schemas, and the flags both
hand to `kvstore serve` are ones it takes, with a setup it starts with."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import kubernetes_validate
import numpy as np
import pytest
import yaml

from kvstore import cli
from kvstore.auth import check_listener
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
MANIFESTS = ROOT / "deploy" / "kubernetes" / "kvstore.yaml"
NS = Namespace("deploy-test", KVLayout("float16", 2, 2, 16, 16))


def _manifests() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFESTS.read_text()) if doc]


def _named(kind: str, name: str) -> dict:
    [doc] = [d for d in _manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _kvstore_container() -> dict:
    workload = _named("StatefulSet", "kvstore")
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


def _serve_configs(args: list[str]):
    """What `kvstore serve ARGS` would run with; raises SystemExit on an unknown flag."""
    parsed = cli.build_parser().parse_args(["serve", *args])
    return cli._store_and_server(parsed)


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    done = subprocess.run([hadolint, DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_command_is_a_node_that_starts_exposed_with_tokens():
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    command = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entry and command
    assert yaml.safe_load(entry.group(1)) == ["kvstore", "serve"]
    store, server = _serve_configs(yaml.safe_load(command.group(1)))
    check_listener(server.security, server.host)  # every interface: allowed with tokens on
    assert server.security.auth_token_file and store.ssd_path.startswith("/data")
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    assert exposed == {server.port, server.dataplane_tcp_port, server.metrics_port}


@pytest.mark.parametrize("doc", _manifests(), ids=lambda d: d["kind"])
def test_manifests_pass_the_kubernetes_schemas(doc):
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_statefulset_runs_the_node_its_probes_service_and_scrape_expect():
    container = _kvstore_container()
    store, server = _serve_configs(container["args"])
    check_listener(server.security, server.host)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": server.port,
        "dataplane-tcp": server.dataplane_tcp_port,
        "metrics": server.metrics_port,
    }
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == server.port  # the node's health service
    workload = _named("StatefulSet", "kvstore")
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == server.metrics_port
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert store.ssd_path.startswith(mounts["ssd"] + "/")
    assert server.security.auth_token_file.startswith(mounts["tokens"] + "/")
    claims = [c["metadata"]["name"] for c in workload["spec"]["volumeClaimTemplates"]]
    assert claims == ["ssd"]
    service = _named("Service", "kvstore")
    assert service["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)


def test_the_nodes_form_one_pool_on_the_redis_beside_them():
    container = _kvstore_container()
    _, server = _serve_configs(container["args"])
    redis = _named("Service", "kvstore-redis")
    [port] = redis["spec"]["ports"]
    assert server.pool.cluster == f"redis://kvstore-redis:{port['port']}/0"
    assert server.tenancy.tenant_secret_file  # every node derives the same namespace ids
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert server.tenancy.tenant_secret_file.startswith(mounts["tokens"] + "/")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert server.pool.node_id == "$(POD_NAME)" and env["POD_NAME"] == "metadata.name"
    assert server.pool.advertise_host == "$(POD_NAME).kvstore"  # the headless Service's name
    [redis_pod] = _named("Deployment", "kvstore-redis")["spec"]["template"]["spec"]["containers"]
    assert redis_pod["ports"][0]["containerPort"] == port["port"]


@pytest.mark.timeout(900)
def test_wheel_installs_and_serves_in_a_fresh_venv(tmp_path):
    """`python -m build` makes a wheel; a venv with nothing else installs it (and what it
    depends on) and runs `kvstore serve`, which a client of this checkout uses."""
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp_path]
    subprocess.run([*build, ROOT], check=True, capture_output=True, timeout=600)
    [wheel] = tmp_path.glob("kvstore-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    # One package for the library (the benchmarks under it) and the engine: no tests, no
    # top-level `bench` or `tiers`.
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvstore", "gpu_engine"}
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    pip = [env_dir / "bin" / "python", "-m", "pip", "install", "-q"]
    subprocess.run([*pip, wheel], check=True, capture_output=True, timeout=600)
    port = free_port()
    serve = f"{env_dir / 'bin' / 'kvstore'} serve --port {port} --dram-bytes 32MiB"
    proc = subprocess.Popen(
        [*shlex.split(serve), "--slab-bytes", "1MiB", "--dataplane", "none"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=10.0, transport="grpc") as client:
            client.wait_ready(timeout_s=60)
            client.register_namespace(NS)
            keys = block_keys(NS, list(range(NS.block_tokens)))
            block = np.arange(NS.block_bytes, dtype=np.uint8)
            assert client.put(NS.id, keys, [block]).num_stored == 1
            assert bytes(client.get(NS.id, keys).blocks[0]) == block.tobytes()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
