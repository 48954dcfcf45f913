"""The operator's listeners: the webhook's certificate verifies as the API server
checks it (by IP address or DNS name), and every listener binds where it is told."""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from pathlib import Path

import pytest

from alpajob.cli.main import main
from alpajob.operator.metrics import OperatorMetrics
from alpajob.operator.webhook import self_signed


def _handshake(certfile: Path, keyfile: Path, server_name: str) -> None:
    """A TLS handshake on 127.0.0.1 whose client trusts ``certfile`` as its CA and
    checks the server's name against ``server_name``, as the API server checks a
    webhook's (raises ssl.SSLCertVerificationError on a mismatch)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certfile, keyfile)
    client = ssl.create_default_context(cafile=str(certfile))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept() -> None:
            connection, _ = listener.accept()
            try:
                with server.wrap_socket(connection, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            with socket.create_connection(("127.0.0.1", port)) as raw, \
                    client.wrap_socket(raw, server_hostname=server_name) as tls:
                tls.sendall(b"x")
        finally:
            thread.join(timeout=10)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_self_signed_certificate_verifies_for_the_host_it_was_made_for(tmp_path: Path, host: str) -> None:
    certfile, keyfile = self_signed(host, tmp_path)
    _handshake(certfile, keyfile, host)


def test_a_certificate_for_a_name_does_not_verify_for_an_ip(tmp_path: Path) -> None:
    """The check above can fail: a DNS-only certificate is refused when the webhook
    is called by IP address (what the API server did before the IP SAN)."""
    certfile, keyfile = self_signed("localhost", tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(certfile, keyfile, "127.0.0.1")


def test_the_self_signed_certificate_is_renewed_and_served_before_it_expires(tmp_path: Path) -> None:
    """A 3-second certificate (90 days in the operator): after 2 s a new one is made,
    kopf's server serves it and yields a client configuration whose CA bundle is the
    new certificate, which the managed webhook configuration then carries; a client
    that trusts the new bundle verifies the server."""
    import asyncio
    import base64
    import datetime

    from cryptography import x509

    from alpajob.operator.webhook import webhook_server

    port = _free_port()
    server = webhook_server(port, "127.0.0.1", None, None, False, tmp_path / "tls", "127.0.0.1",
                            lifetime=datetime.timedelta(seconds=3), file_check_interval=0.2)

    async def bundles() -> list[bytes]:
        async def fn(*_: object, **__: object) -> dict[str, object]:
            return {}

        seen: list[bytes] = []
        stream = server(fn)
        async for config in stream:
            seen.append(base64.b64decode(config["caBundle"]))
            if len(seen) == 2:
                break
        await stream.aclose()
        return seen

    first, second = asyncio.run(asyncio.wait_for(bundles(), timeout=30))
    old, new = x509.load_pem_x509_certificate(first), x509.load_pem_x509_certificate(second)
    assert new.serial_number != old.serial_number
    assert new.not_valid_after_utc > old.not_valid_after_utc
    assert second == (tmp_path / "tls" / "tls.crt").read_bytes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_operator_metrics_bind_where_told() -> None:
    metrics = OperatorMetrics()
    port = _free_port()
    metrics.serve(port, "127.0.0.1")
    try:
        assert metrics._server.server_address[:2] == ("127.0.0.1", port)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/metrics")
        assert b"alpajob_operator_jobs" in connection.getresponse().read()
    finally:
        metrics.close()


@pytest.mark.parametrize(("flags", "field"), [
    (["--metrics-port", "99999"], "--metrics-port"),
    (["--webhook-port", "0"], "--webhook-port"),
    (["--metrics-bind-address", "everywhere"], "--metrics-bind-address"),
    (["--webhook-bind-address", "0.0.0"], "--webhook-bind-address"),
    (["--data-schemes", ""], "--data-schemes"),
    (["--data-schemes", "s3://,gs"], "--data-schemes"),
])
def test_bad_operator_listener_flags_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                             field: str) -> None:
    assert main(["operator", "-n", "ml", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1 and "Traceback" not in err
