"""ClickHouse over HTTPS: CA file, client certificate, verification on/off.

Unit tests check how :meth:`ClickHouseConfig.client_kwargs` translates the settings for
clickhouse-connect and what is refused; the slow tests start throwaway ``clickhouse-server``
processes (the local 18.16 binary) with an ``https_port`` and a certificate signed by a CA made
here with the ``openssl`` CLI, and connect through :class:`ClickHouseStore` as TrainGuard does.
"""

from __future__ import annotations

import inspect
import shutil
import signal
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import certifi
import clickhouse_connect
import pytest
from clickhouse_connect.driver.httpclient import HttpClient

from tests.net import free_port
from tests.waiting import wait_until
from trainguard.infra.clickhouse.store import ClickHouseStore, StoreError
from trainguard.infra.config import ClickHouseConfig, load_settings
from trainguard.infra.stack.clickhouse import find_binary
from trainguard.schemas.config import ConfigError, load_config


def _accepted() -> set[str]:
    """Every keyword clickhouse-connect's get_client takes for an HTTP(S) client."""
    names = set(inspect.signature(clickhouse_connect.get_client).parameters)
    return (names | set(inspect.signature(HttpClient).parameters)) - {"kwargs", "self"}


@pytest.fixture
def pem_files(tmp_path: Path) -> dict[str, str]:
    """Three placeholder files: the kwargs builder checks they exist, not what they hold."""
    out = {}
    for name in ("ca_file", "cert_file", "key_file"):
        path = tmp_path / f"{name}.pem"
        path.write_text("placeholder\n")
        out[name] = str(path)
    return out


# -- kwargs and validation -------------------------------------------------------------------


def test_plain_http_has_no_tls_kwargs() -> None:
    kw = ClickHouseConfig(host="ch", port=8123, password="pw").client_kwargs()
    assert kw["secure"] is False  # explicit: clickhouse-connect would guess https from port 8443
    assert not {"verify", "ca_cert", "client_cert", "client_cert_key", "tls_mode"} & kw.keys()
    assert kw["host"] == "ch" and kw["password"] == "pw" and kw["database"] == "trainguard"
    assert set(kw) <= _accepted()


def test_tls_settings_map_to_clickhouse_connect_names(pem_files: dict[str, str]) -> None:
    cfg = load_config(ClickHouseConfig, {"secure": True, **pem_files})
    kw = cfg.client_kwargs(database="")
    assert kw["secure"] is True and kw["verify"] is True and kw["database"] == ""
    assert kw["ca_cert"] == pem_files["ca_file"]
    assert kw["client_cert"] == pem_files["cert_file"]
    assert kw["client_cert_key"] == pem_files["key_file"]
    # The certificate secures the connection; the user is still username/password (Basic auth).
    assert kw["tls_mode"] == "strict"
    assert set(kw) <= _accepted()  # a wrong name would be a TypeError only when connecting


def test_verify_off_drops_the_ca_and_certifi_needs_no_file() -> None:
    kw = ClickHouseConfig(secure=True, verify=False, ca_file="certifi").client_kwargs()
    assert kw["verify"] is False and "ca_cert" not in kw
    assert ClickHouseConfig(secure=True, ca_file="certifi").client_kwargs()["ca_cert"] == "certifi"
    assert (
        ClickHouseConfig(secure=True, ca_file=certifi.where()).client_kwargs()["ca_cert"] == certifi.where()
    )


def test_secure_without_files_uses_the_system_trust_store() -> None:
    kw = ClickHouseConfig(secure=True).client_kwargs()
    assert kw["secure"] is True and kw["verify"] is True
    assert not {"ca_cert", "client_cert", "client_cert_key", "tls_mode"} & kw.keys()


@pytest.mark.parametrize(
    ("given", "missing"), [("cert_file", "key_file"), ("key_file", "cert_file")], ids=["cert", "key"]
)
def test_client_certificate_and_key_come_together(
    pem_files: dict[str, str], given: str, missing: str
) -> None:
    data = {"secure": True, given: pem_files[given]}
    with pytest.raises(ConfigError, match=f"{given} is set but {missing} is not"):
        load_config(ClickHouseConfig, data)


@pytest.mark.parametrize(
    "tls",
    [{"ca_file": "/ca.pem"}, {"cert_file": "/c.pem", "key_file": "/k.pem"}, {"verify": False}],
    ids=["ca_file", "client_cert", "verify_off"],
)
def test_tls_options_without_secure_are_an_error(tls: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="set without secure: true"):
        load_config(ClickHouseConfig, tls)
    load_config(ClickHouseConfig, {**tls, "secure": True})  # accepted (files checked later)


def test_chdb_dsn_refuses_tls() -> None:
    with pytest.raises(ConfigError, match="chdb DSN"):
        load_config(ClickHouseConfig, {"dsn": "chdb:///tmp/x", "secure": True})


@pytest.mark.parametrize("field", ["ca_file", "cert_file", "key_file"])
def test_missing_file_is_an_error_naming_the_field_at_client_creation(
    pem_files: dict[str, str], tmp_path: Path, field: str
) -> None:
    files = {**pem_files, field: str(tmp_path / "nope.pem")}
    cfg = load_config(ClickHouseConfig, {"secure": True, **files})  # loading does not read files
    with pytest.raises(ConfigError, match=rf"clickhouse\.{field}: .*nope\.pem does not exist"):
        cfg.client_kwargs()
    with pytest.raises(ConfigError, match=rf"clickhouse\.{field}: "):  # before any connection attempt
        ClickHouseStore(cfg).ensure_database()
    files[field] = str(tmp_path)
    with pytest.raises(ConfigError, match=rf"clickhouse\.{field}: .* is not a file"):
        load_config(ClickHouseConfig, {"secure": True, **files}).client_kwargs()


def test_environment_variables_set_the_tls_options(pem_files: dict[str, str]) -> None:
    env = {
        "TRAINGUARD__CLICKHOUSE__SECURE": "true",
        "TRAINGUARD__CLICKHOUSE__VERIFY": "false",
        "TRAINGUARD__CLICKHOUSE__CA_FILE": pem_files["ca_file"],
        "TRAINGUARD__CLICKHOUSE__CERT_FILE": pem_files["cert_file"],
        "TRAINGUARD__CLICKHOUSE__KEY_FILE": pem_files["key_file"],
    }
    ch = load_settings(environ=env).clickhouse
    assert (ch.secure, ch.verify, ch.ca_file) == (True, False, pem_files["ca_file"])
    assert ch.url.startswith("https://")
    kw = ch.client_kwargs()
    assert kw["verify"] is False and kw["client_cert"] == pem_files["cert_file"]


# -- a real HTTPS server -----------------------------------------------------------------------


def _openssl(*args: str | Path, cwd: Path) -> None:
    res = subprocess.run(["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True)
    assert res.returncode == 0, f"openssl {' '.join(map(str, args))} failed:\n{res.stderr}"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throwaway CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    assert shutil.which("openssl"), "the openssl CLI is needed to make the test certificates"
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=TrainGuard test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    exts = {
        "server": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in exts.items():
        (d / f"{name}.ext").write_text(f"basicConstraints=CA:FALSE\n{ext}")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)  # fmt: skip
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


_SERVER_CONFIG = """<?xml version="1.0"?>
<yandex>
  <logger><level>information</level><log>{dir}/server.log</log><errorlog>{dir}/error.log</errorlog></logger>
  <listen_host>127.0.0.1</listen_host>
  <https_port>{port}</https_port>
  <openSSL>
    <server>
      <certificateFile>{cert}</certificateFile>
      <privateKeyFile>{key}</privateKeyFile>
      <verificationMode>{verification}</verificationMode>
      <caConfig>{ca}</caConfig>
      <loadDefaultCAFile>false</loadDefaultCAFile>
      <cacheSessions>true</cacheSessions>
      <disableProtocols>sslv2,sslv3</disableProtocols>
      <preferServerCiphers>true</preferServerCiphers>
    </server>
  </openSSL>
  <path>{dir}/data/</path>
  <tmp_path>{dir}/tmp/</tmp_path>
  <user_files_path>{dir}/user_files/</user_files_path>
  <format_schema_path>{dir}/format_schemas/</format_schema_path>
  <users_config>{dir}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <timezone>UTC</timezone>
  <mark_cache_size>268435456</mark_cache_size>
</yandex>
"""

_USERS = """<?xml version="1.0"?>
<yandex>
  <profiles><default></default></profiles>
  <users>
    <default>
      <password></password>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </default>
  </users>
  <quotas><default></default></quotas>
</yandex>
"""


@pytest.fixture(scope="module", params=["tls", "mutual_tls"])
def https_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int]]:
    """A clickhouse-server serving only HTTPS on a free port: ``tls`` asks nothing of clients,
    ``mutual_tls`` requires a client certificate signed by the test CA.  Yields (mode, port)."""
    argv = find_binary()
    if argv is None:  # scripts/setup.sh installs it: its absence is a broken setup, not a skip
        pytest.fail("no clickhouse-server / clickhouse binary on PATH (apt-get install clickhouse-server)")
    pki: Pki = request.getfixturevalue("pki")
    mode: str = request.param
    d = tmp_path_factory.mktemp(f"ch_{mode}")
    port = free_port()
    (d / "config.xml").write_text(
        _SERVER_CONFIG.format(
            dir=d,
            port=port,
            cert=pki.server_cert,
            key=pki.server_key,
            ca=pki.ca,
            verification="strict" if mode == "mutual_tls" else "none",
        )
    )
    (d / "users.xml").write_text(_USERS)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if mode == "mutual_tls":
        ctx.load_cert_chain(pki.client_cert, pki.client_key)
    log = (d / "stdout.log").open("wb")
    proc = subprocess.Popen(
        [*argv, f"--config-file={d / 'config.xml'}"],
        cwd=d,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"clickhouse-server exited with {proc.returncode}:\n{_tail(d)}")
        try:
            with urllib.request.urlopen(f"https://localhost:{port}/ping", timeout=2, context=ctx) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    try:
        wait_until(up, 60, lambda: f"clickhouse-server HTTPS on port {port}:\n{_tail(d)}", interval_s=0.2)
        yield mode, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


def _tail(d: Path) -> str:
    parts = [(d / name).read_text(errors="replace")[-1500:] for name in ("stdout.log", "error.log")]
    return "\n".join(p for p in parts if p)


def _store(port: int, mode: str, pki: Pki, *, host: str = "localhost", **tls: object) -> ClickHouseStore:
    if mode == "mutual_tls":
        tls = {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key), **tls}
    data = {"host": host, "port": port, "database": "default", "secure": True, "connect_timeout_s": 5}
    cfg = load_config(ClickHouseConfig, {**data, **tls})
    return ClickHouseStore(cfg)


def _version(store: ClickHouseStore) -> str:
    try:
        return str(store.query("SELECT version()")[0][0])
    finally:
        store.close()


@pytest.mark.slow
def test_verify_on_with_the_ca_file_connects(https_server: tuple[str, int], pki: Pki) -> None:
    mode, port = https_server
    for host in ("localhost", "127.0.0.1"):  # both are in the certificate's subjectAltName
        assert _version(_store(port, mode, pki, host=host, ca_file=str(pki.ca)))


@pytest.mark.slow
def test_verify_on_without_the_ca_fails_clearly(https_server: tuple[str, int], pki: Pki) -> None:
    mode, port = https_server
    with pytest.raises(StoreError) as err:
        _version(_store(port, mode, pki))  # the system trust store does not know the test CA
    msg = str(err.value)
    assert f"cannot connect to ClickHouse at https://localhost:{port}" in msg
    assert "CERTIFICATE_VERIFY_FAILED" in msg and "set clickhouse.ca_file" in msg


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_verify_off_connects_without_the_ca(https_server: tuple[str, int], pki: Pki) -> None:
    mode, port = https_server
    assert _version(_store(port, mode, pki, verify=False))


@pytest.mark.slow
@pytest.mark.parametrize("https_server", ["mutual_tls"], indirect=True)  # only it asks for one
def test_mutual_tls_needs_the_client_certificate(https_server: tuple[str, int], pki: Pki) -> None:
    mode, port = https_server
    assert mode == "mutual_tls"
    cfg = ClickHouseConfig(host="localhost", port=port, database="default", secure=True, ca_file=str(pki.ca))
    with pytest.raises(StoreError) as err:
        _version(ClickHouseStore(cfg))
    msg = str(err.value)
    assert f"cannot connect to ClickHouse at https://localhost:{port}" in msg and "SSLError" in msg
    if "CERTIFICATE_REQUIRED" in msg:  # TLS 1.3 names the cause; 1.2 says only "handshake failure"
        assert "set clickhouse.cert_file and key_file" in msg
    assert _version(_store(port, mode, pki, ca_file=str(pki.ca)))  # with it: in
