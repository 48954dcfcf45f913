"""An API server outage for tests: a TCP gate in front of the test API server that
forwards while up and refuses connections while down, as a restarting kube-apiserver
did on the real node (clients get ``Connection refused``); the server behind it keeps
its state, as etcd does."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import yaml


class Gate:
    """A TCP port that forwards to ``target`` while up and refuses connections while
    down (its listener closed, open connections cut)."""

    def __init__(self, target: int) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = int(probe.getsockname()[1])
        probe.close()
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        if self._listener is not None:  # shutdown first: it wakes the accept() blocked on it
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        for conn in self._open:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                near, _ = listener.accept()
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.target))
            self._open += [near, far]
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def gated_kubeconfig(kubeconfig: Path, gate: Gate, out: Path) -> Path:
    """A copy of ``kubeconfig`` whose clusters are reached through ``gate``."""
    doc = yaml.safe_load(kubeconfig.read_text())
    for cluster in doc.get("clusters") or []:
        cluster["cluster"]["server"] = gate.url
    out.write_text(yaml.safe_dump(doc))
    return out
