"""Authentication and TLS on a real `kvstore serve`: tokens, TLS, mutual TLS, and where a
node may listen without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import require_extra

NS = Namespace("auth-model", KVLayout("float16", 2, 2, 16, 16))  # 2 KiB blocks
TOKEN_A, TOKEN_B = "token-of-team-a-0123456789", "token-of-team-b-9876543210"


def _keys(n: int) -> list[bytes]:
    return block_keys(NS, list(range(n * NS.block_tokens)))


def _blocks(n: int) -> list[np.ndarray]:
    return [np.full(NS.block_bytes, i + 1, np.uint8) for i in range(n)]


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"team-a {TOKEN_A}\nteam-b {TOKEN_B}\n")
    return path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
             "-subj", "/CN=kvstore-test-ca", "-days", "2")  # fmt: skip
    for name, san in (("server", "IP:127.0.0.1,DNS:localhost"), ("client", "DNS:client")):
        _openssl("req", *ec, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr",
                 "-subj", f"/CN={name}")  # fmt: skip
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem",
                 "-CAkey", f"{d}/ca.key", "-CAcreateserial", "-out", f"{d}/{name}.pem",
                 "-days", "2", "-extfile", f"{d}/{name}.ext")  # fmt: skip
    files = {"ca": "ca.pem", "server": "server.pem", "server_key": "server.key",
             "client": "client.pem", "client_key": "client.key"}  # fmt: skip
    return {name: str(d / file) for name, file in files.items()}


def _roundtrip(client: Client) -> None:
    client.register_namespace(NS)
    keys, blocks = _keys(4), _blocks(4)
    assert client.put_chain(NS.id, keys, blocks).num_stored in (0, 4)
    into = [np.empty(NS.block_bytes, np.uint8) for _ in keys]
    assert client.get_into(NS.id, keys, into) == (True,) * 4
    assert all(np.array_equal(a, b) for a, b in zip(into, blocks, strict=True))


def test_calls_need_a_known_token_and_health_does_not(store_factory, token_file):
    store = store_factory("--dram-bytes", "16MiB", "--auth-token-file", str(token_file))
    with Client(store.address, timeout_s=10.0, auth_token=TOKEN_A) as client:
        _roundtrip(client)  # over UCX when installed: its handshake is an authenticated call
    for token in ("", "token-nobody-was-ever-given-00"):
        with Client(store.address, timeout_s=10.0, auth_token=token) as client:
            assert client.health()
            with pytest.raises(errors.UnauthenticatedError):
                client.match(NS.id, _keys(1))
            with pytest.raises(errors.UnauthenticatedError):
                client.stats()
            with pytest.raises(errors.UnauthenticatedError):
                client.get(NS.id, _keys(1))
    assert "event=unauthenticated" in store.log()
    assert TOKEN_A not in store.log()


def test_the_data_plane_handshake_needs_a_token(store_factory, token_file):
    require_extra("ucxx")
    store = store_factory("--dram-bytes", "16MiB", "--auth-token-file", str(token_file))
    client = Client(store.address, timeout_s=10.0, transport="ucx")
    with client, pytest.raises(errors.UnauthenticatedError):
        client.data_plane()


def test_tls_serves_clients_that_trust_its_ca(store_factory, pki):
    tls = ("--tls-cert", pki["server"], "--tls-key", pki["server_key"])
    store = store_factory("--dram-bytes", "16MiB", *tls, client={"tls_ca": pki["ca"]})
    with Client(store.address, timeout_s=10.0, tls_ca=pki["ca"]) as client:
        _roundtrip(client)
    with Client(store.address, timeout_s=5.0) as plain, pytest.raises(errors.UnavailableError):
        plain.stats()  # a plaintext client cannot talk to a TLS port


def test_mutual_tls_refuses_a_client_without_a_certificate(store_factory, pki):
    tls = ("--tls-cert", pki["server"], "--tls-key", pki["server_key"])
    mutual = {"tls_ca": pki["ca"], "tls_cert": pki["client"], "tls_key": pki["client_key"]}
    store = store_factory(
        "--dram-bytes", "16MiB", *tls, "--tls-client-ca", pki["ca"], client=mutual
    )
    with Client(store.address, timeout_s=10.0, **mutual) as client:
        _roundtrip(client)
    anonymous = Client(store.address, timeout_s=5.0, tls_ca=pki["ca"])
    with anonymous, pytest.raises(errors.UnavailableError):
        anonymous.stats()


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--dram-bytes", "8MiB"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)


def test_a_non_loopback_host_without_auth_refuses_to_start():
    out = _serve("--host", "0.0.0.0")
    assert out.returncode == 2
    assert "--auth-token-file" in out.stderr and "--insecure" in out.stderr


def test_insecure_or_a_token_file_lets_it_listen_on_every_interface(store_factory, token_file):
    for flags in (("--insecure",), ("--auth-token-file", str(token_file))):
        store = store_factory("--host", "0.0.0.0", "--dram-bytes", "8MiB", *flags)
        with Client(store.address, timeout_s=10.0, auth_token=TOKEN_B) as client:
            assert client.stats().num_blocks == 0
        assert store.stop() == 0


def test_the_stats_command_takes_a_token_file(store_factory, token_file, tmp_path):
    store = store_factory("--dram-bytes", "8MiB", "--auth-token-file", str(token_file))
    mine = tmp_path / "my-token"
    mine.write_text(f"{TOKEN_B}\n")
    cmd = [sys.executable, "-m", "kvstore.cli", "stats", "--address", store.address]
    ok = subprocess.run([*cmd, "--auth-token-file", str(mine)], capture_output=True, text=True)
    assert ok.returncode == 0 and "num_blocks=0" in ok.stdout
    refused = subprocess.run(cmd, capture_output=True, text=True)
    assert refused.returncode == 2 and "UnauthenticatedError" in refused.stderr
