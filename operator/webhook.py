"""The validating webhook's server: its certificate, and how the API server reaches it.

kopf serves the webhook (HTTPS) and, with ``--webhook-managed``, keeps a
ValidatingWebhookConfiguration pointing at it. Two things here make that work in a
real cluster without extra packages or tunnels:

- **Certificate.** Without ``--webhook-cert``/``--webhook-key`` the operator makes a
  self-signed certificate for the webhook's host at start (:func:`self_signed`, with
  the ``cryptography`` package the Kubernetes client already needs); the managed
  configuration carries it as its CA bundle. It is valid for 90 days and made again
  after 60 (:class:`ReviewServer`); the new CA bundle reaches the configuration at
  once. Or mount a cert-manager certificate, which kopf rereads when it is renewed.
- **Address.** kube-apiserver does not resolve cluster DNS names in a webhook *URL*.
  A host of the form ``<service>.<namespace>.svc`` is therefore registered as a
  *Service reference* (:class:`ServiceWebhookServer`), which the API server resolves
  itself; any other host is registered as a URL.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf


def _subject_names(host: str) -> list[Any]:
    """The certificate's subject alternative names for ``host``: an IP address SAN for
    an IP (a client checks an IP against those only, never against DNS names), else the
    DNS name and, for ``<name>.<namespace>.svc``, its shorter Service names."""
    import ipaddress

    from cryptography import x509

    try:
        return [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        pass
    parts = host.split(".")
    names = [host] + [".".join(parts[:k]) for k in range(1, len(parts)) if host.endswith(".svc")]
    return [x509.DNSName(n) for n in dict.fromkeys(names)]


#: How long a self-signed serving certificate is valid; it is made again after two
#: thirds of that (:class:`ReviewServer`), long before it expires.
CERTIFICATE_LIFETIME = datetime.timedelta(days=90)


def self_signed(host: str, folder: Path,
                lifetime: datetime.timedelta = CERTIFICATE_LIFETIME) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) and key for ``host`` (:func:`_subject_names`),
    valid for ``lifetime``, written as ``tls.crt`` and ``tls.key`` into ``folder``
    (replacing the files at once: a reader never sees half of one)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + lifetime)
            .add_extension(x509.SubjectAlternativeName(_subject_names(host)), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = folder / "tls.crt", folder / "tls.key"
    for path, data in ((keyfile, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption())),
                       (certfile, cert.public_bytes(serialization.Encoding.PEM))):
        fresh = path.with_suffix(".new")
        fresh.write_bytes(data)
        fresh.chmod(0o600)
        fresh.replace(path)
    return certfile, keyfile


def service_of(host: str | None) -> tuple[str, str] | None:
    """``(namespace, name)`` when ``host`` is ``<name>.<namespace>.svc``, else None."""
    if not host:
        return None
    parts = host.split(".")
    if len(parts) == 3 and parts[2] == "svc" and all(parts[:2]):
        return parts[1], parts[0]
    return None


#: The largest AdmissionReview the webhook reads. aiohttp's default (1 MiB) refused
#: the review of an update of any AlpaJob above about 0.5 MiB (the review carries the
#: object twice, new and old), so such a job could never be changed, nor deleted (its
#: finalizer's removal is an update). etcd stores objects up to 1.5 MiB, so a review
#: stays under 3.5 MiB; 8 MiB leaves room.
REVIEW_LIMIT = 8 << 20


class ReviewServer(kopf.WebhookServer):
    """kopf's server, reading reviews up to :data:`REVIEW_LIMIT` bytes, and renewing
    its self-signed certificate (``renew``: the host and folder of :func:`self_signed`,
    and the lifetime) after two thirds of its lifetime. kopf rereads the certificate
    files every ``file_check_interval`` seconds and, when they changed, serves the new
    one and yields a new client configuration, whose CA bundle the managed
    ValidatingWebhookConfiguration then gets: the API server trusts the new certificate
    before the old one expires. (A mounted certificate, cert-manager's, is reread the
    same way when its Secret is renewed.)"""

    def __init__(self, *, renew: tuple[str, Path, datetime.timedelta] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.renew = renew

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        renewing = asyncio.create_task(self._renewing()) if self.renew is not None else None
        try:
            async for config in super().__call__(fn):
                yield config
        finally:
            if renewing is not None:
                renewing.cancel()

    async def _renewing(self) -> None:
        assert self.renew is not None
        host, folder, lifetime = self.renew
        while True:
            await asyncio.sleep(lifetime.total_seconds() * 2 / 3)
            await asyncio.to_thread(self_signed, host, folder, lifetime)

    @staticmethod
    async def _serve(fn: Any, request: Any) -> Any:
        return await kopf.WebhookServer._serve(fn, request.clone(client_max_size=REVIEW_LIMIT))


class ServiceWebhookServer(ReviewServer):
    """kopf's server, registered as a reference to the Service in front of it."""

    def __init__(self, *, namespace: str, name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service_namespace, self.service_name = namespace, name

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async for config in super().__call__(fn):
            reference: dict[str, Any] = {"service": {"namespace": self.service_namespace,
                                                      "name": self.service_name,
                                                      "port": self.port, "path": self.path or ""}}
            if config.get("caBundle"):
                reference["caBundle"] = config["caBundle"]
            yield reference


def webhook_server(port: int, host: str | None, cert: str | None, key: str | None, insecure: bool,
                   folder: Path, bind_address: str = "0.0.0.0",
                   lifetime: datetime.timedelta = CERTIFICATE_LIFETIME,
                   file_check_interval: float = 60.0) -> kopf.WebhookServer:
    """The server for ``alpajob operator``'s webhook flags (see the module docstring),
    listening on ``bind_address``; a self-signed certificate lives ``lifetime``."""
    options: dict[str, Any] = {"addr": bind_address, "port": port, "host": host, "insecure": insecure,
                               "file_check_interval": file_check_interval}
    if not insecure and not (cert and key):
        certfile, keyfile = self_signed(host or "localhost", folder, lifetime)
        cert, key = str(certfile), str(keyfile)
        options["renew"] = (host or "localhost", folder, lifetime)
    if not insecure:
        options.update(certfile=cert, pkeyfile=key, cafile=cert)
    service = service_of(host)
    if service is not None:
        return ServiceWebhookServer(namespace=service[0], name=service[1], **options)
    return ReviewServer(**options)
