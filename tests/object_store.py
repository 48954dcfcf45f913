"""A real S3-compatible server for the tests, and a proxy in front of it that drops
connections mid-read.

:class:`S3Server` runs moto's server mode (what s3fs's own suite uses) in its own
process on 127.0.0.1 with authentication on: requests must be signed with an access
key of a user it knows (created through its IAM API in the first three unsigned
requests), so a wrong secret is refused as a real store refuses it.
:class:`FlakyProxy` forwards TCP connections to it and cuts each one after a random
number of response bytes (a few KiB to a few hundred), so requests die mid-body,
again and again, as on a congested network.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from alpajob.trainer_image.distributed.loopback import free_port


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@dataclass
class S3Server:
    """moto's S3 server in a subprocess, with one user allowed everything."""

    port: int
    process: subprocess.Popen
    key: str
    secret: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls) -> S3Server:
        import boto3

        port = free_port()
        # The first three requests (make a user, its key, its policy) need no signature.
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(port)
        iam = boto3.client("iam", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                           aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(policy))
        return cls(port, process, key["AccessKeyId"], key["SecretAccessKey"])

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret)

    def env(self, endpoint: str | None = None, secret: str | None = None) -> dict[str, str]:
        """What a pod's environment says to reach the store (``endpoint``: another
        address, such as a proxy's)."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": secret or self.secret,
                "AWS_ENDPOINT_URL": endpoint or self.url, "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


class FlakyProxy:
    """TCP to ``target`` on 127.0.0.1, each connection cut after a random number of bytes
    of response in ``[low, high)`` (``drops`` counts the cuts)."""

    def __init__(self, target: int, low: int = 4 * 1024, high: int = 256 * 1024, seed: int = 0) -> None:
        self.target, self.low, self.high = target, low, high
        self.random = random.Random(seed)
        self.drops = 0
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                budget = self.random.randrange(self.low, self.high)
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, budget), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, budget: int | None) -> None:
        try:
            while True:
                data = source.recv(16384)
                if not data:
                    break
                if budget is not None and len(data) >= budget:
                    sink.sendall(data[:budget])
                    with self._lock:
                        self.drops += 1
                    break
                sink.sendall(data)
                if budget is not None:
                    budget -= len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.listener.close()
