"""A hostile OCI registry for the tests and bench/hostile.py: a small HTTP
server on 127.0.0.1 that serves real HWR artifacts (their bytes taken from
a daemon's store) and misbehaves as told.

It speaks just enough of the distribution API (GET/HEAD of ``/v2/``,
manifests by tag or digest, blobs, a token endpoint at ``/token``), records
every request (:class:`Hit`: method, path, scheme, the headers that matter,
status, body bytes written), and each attribute below turns one attack on:

* ``auth``: ``("basic", user, password)`` or ``("bearer", realm, token,
  user, password)``; a request without them is answered 401 with the
  challenge, and ``unauthorized_body`` bytes of body (the 401 bomb);
* ``redirect_body``: a blob GET is answered 307 to itself (``?hop=1``) with
  that many bytes of body (the redirect bomb);
* ``redirect_to``: a blob GET is answered 307 to that origin
  (``http://127.0.0.1:<port>``), e.g. its own port in plain HTTP (a
  downgrade: the server answers TLS and plain HTTP on ONE port, told apart
  by the first byte, so an https->http redirect to the same host:port is
  seen and recorded);
* ``trickle_s``: blob bodies (of ``trickle_blob`` only, when set) are sent
  a byte every ``trickle_s`` seconds; ``head_trickle_s``: the response head
  of every request is;
* ``ignore_range``: a ``Range`` request is answered 200 with the whole blob;
* ``cut``: ``{hex: n}``: the next GET of that blob ends after n bytes (the
  connection closed), once; ``short``: ``{hex: n}``: every GET of that blob
  ends after n bytes, its Content-Length still the whole (lying sizes);
* ``hang``: an Event; every request waits on it before answering
  (``arrived`` is set when one does; ``waiting`` counts them).

Artifacts are added with :meth:`HostileRegistry.add` (a config and blobs:
any config, also a forged one), usually from a daemon's store with
:func:`stored_artifact`. The TLS pieces come from
:func:`tests.support.oci_registry.make_tls`.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse

from hwr_client.core.manifest import Manifest
from hwr_server.remote.oci import MANIFEST_MEDIA_TYPE, build_oci_manifest, digest_of

_ZEROS = bytes(64 * 1024)


@dataclasses.dataclass(frozen=True)
class Hit:
    method: str
    path: str
    scheme: str
    authorization: str
    range: str
    status: int
    body_bytes: int


def stored_artifact(root: str, key: str) -> tuple[bytes, dict[str, bytes]]:
    """(manifest.json bytes, {blob hex: bytes}) of an artifact in a daemon's
    store (the test runs as root and reads the files directly)."""
    with open(os.path.join(root, "artifacts", key, "manifest.json"), "rb") as f:
        config = f.read()
    blobs = {}
    for entry in json.loads(config)["files"]:
        with open(os.path.join(root, "blobs", "sha256", entry["blob"]), "rb") as f:
            blobs[entry["blob"]] = f.read()
    return config, blobs


class HostileRegistry:
    """The server (module docstring). ``tls``: (certificate, key, CA) paths:
    TLS is answered too, on the same port."""

    def __init__(self, *, tls: tuple[str, str, str] | None = None):
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.blobs: dict[str, bytes] = {}
        self.hits: list[Hit] = []
        self.auth: tuple = ()
        self.unauthorized_body = 0
        self.redirect_body = 0
        self.redirect_to = ""
        self.trickle_s = 0.0
        self.trickle_blob = ""
        self.head_trickle_s = 0.0
        self.ignore_range = False
        self.cut: dict[str, int] = {}
        self.short: dict[str, int] = {}
        self.hang: threading.Event | None = None
        self.arrived = threading.Event()
        self.waiting = 0
        #: Set when a blob body starts to trickle.
        self.trickling = threading.Event()
        self._lock = threading.Lock()
        self._ctx = None
        if tls is not None:
            self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ctx.load_cert_chain(tls[0], tls[1])
        self.server = _Server(("127.0.0.1", 0), _handler(self), self._ctx)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="hostile-registry", daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def add(self, repository: str, config: bytes, blobs: dict[str, bytes], *, tag: str = "",
            manifest: Manifest | None = None) -> str:
        """Serves an artifact: its OCI manifest under ``tag`` (default: the
        config's key) and its digest, the config and the blobs. Returns the
        manifest digest. ``manifest``: the config parsed (spares parsing a
        huge one again)."""
        doc = json.loads(config) if manifest is None else {"key": manifest.key}
        try:
            oci = build_oci_manifest(manifest or Manifest.from_json(config), config)
        except Exception:  # noqa: BLE001 - a forged config: describe its files as they claim
            oci = json.dumps({
                "schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "artifactType": "application/vnd.hwr.artifact.v1",
                "config": {"mediaType": "application/vnd.hwr.manifest.v1+json", "digest": digest_of(config),
                           "size": len(config)},
                "layers": [{"mediaType": "application/vnd.cncf.model.weight.v1.raw", "digest": "sha256:" + f["blob"],
                            "size": f["size"]} for f in doc["files"]]}).encode()
        digest = digest_of(oci)
        with self._lock:
            self.manifests[(repository, tag or doc["key"])] = oci
            self.manifests[(repository, digest)] = oci
            self.blobs[digest_of(config)[7:]] = config
            self.blobs.update(blobs)
        return digest

    def take(self) -> list[Hit]:
        """The requests seen since the last take."""
        with self._lock:
            out, self.hits = self.hits, []
        return out

    def log(self, hit: Hit) -> None:
        with self._lock:
            self.hits.append(hit)

    def close(self) -> None:
        if self.hang is not None:
            self.hang.set()
        self.server.shutdown()
        self.server.server_close()


class _Server(http.server.ThreadingHTTPServer):
    """Answers TLS and plain HTTP on one port: the first byte of a TLS
    connection is a handshake record (0x16)."""

    def __init__(self, addr, handler, ctx):
        self.ctx = ctx
        super().__init__(addr, handler)

    def finish_request(self, request, client_address):
        if self.ctx is not None:
            try:
                request.settimeout(30)
                first = request.recv(1, socket.MSG_PEEK)
                if first == b"\x16":
                    request = self.ctx.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
        super().finish_request(request, client_address)


def _handler(reg: HostileRegistry):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _hit(self, status: int, sent: int) -> None:
            reg.log(Hit(self.command, self.path, "https" if isinstance(self.connection, ssl.SSLSocket) else "http",
                        self.headers.get("Authorization", ""), self.headers.get("Range", ""), status, sent))

        def _head(self, status: int, headers: dict[str, str]) -> None:
            lines = [f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            if reg.head_trickle_s:
                for i in range(len(data)):
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    time.sleep(reg.head_trickle_s)
            else:
                self.wfile.write(data)

        def _zeros(self, n: int) -> int:
            sent = 0
            try:
                while sent < n:
                    part = _ZEROS[:min(len(_ZEROS), n - sent)]
                    self.wfile.write(part)
                    sent += len(part)
            except OSError:
                self.close_connection = True
            return sent

        def _refuse(self) -> None:
            kind = reg.auth[0]
            challenge = ('Basic realm="hostile"' if kind == "basic" else
                         f'Bearer realm="{reg.auth[1]}",service="hostile",scope="repository:hwr/x:pull"')
            self._head(401, {"WWW-Authenticate": challenge, "Content-Length": str(reg.unauthorized_body)})
            self._hit(401, self._zeros(reg.unauthorized_body))

        def _authorized(self) -> bool:
            if not reg.auth:
                return True
            got = self.headers.get("Authorization", "")
            if reg.auth[0] == "basic":
                return got == _basic(reg.auth[1], reg.auth[2])
            return got == f"Bearer {reg.auth[2]}"

        def _token(self) -> None:
            ok = (reg.auth and reg.auth[0] == "bearer"
                  and self.headers.get("Authorization", "") == _basic(reg.auth[3], reg.auth[4]))
            body = json.dumps({"token": reg.auth[2]}).encode() if ok else b""
            self._head(200 if ok else 401, {"Content-Type": "application/json", "Content-Length": str(len(body))})
            self.wfile.write(body)
            self._hit(200 if ok else 401, len(body))

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self._head(status, {"Content-Length": str(len(body)), **headers})
            if self.command != "HEAD":
                self.wfile.write(body)
            self._hit(status, 0 if self.command == "HEAD" else len(body))

        def _answer(self) -> None:
            if reg.hang is not None:
                with reg._lock:
                    reg.waiting += 1
                reg.arrived.set()
                reg.hang.wait(300)
            url = urllib.parse.urlsplit(self.path)
            if url.path.startswith("/token"):
                return self._token()
            if not self._authorized():
                return self._refuse()
            parts = url.path.split("/")
            if url.path in ("/v2", "/v2/"):
                return self._send(200, b"{}", {"Content-Type": "application/json"})
            if len(parts) >= 5 and parts[-2] == "manifests":
                repo = "/".join(parts[2:-2])
                body = reg.manifests.get((repo, parts[-1]))
                if body is None:
                    return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', {})
                return self._send(200, body, {"Content-Type": MANIFEST_MEDIA_TYPE,
                                              "Docker-Content-Digest": digest_of(body)})
            if len(parts) >= 5 and parts[-2] == "blobs" and parts[-1].startswith("sha256:"):
                return self._blob(parts[-1][7:], url.query)
            self._send(404, b"", {})

        def _blob(self, hexd: str, query: str) -> None:
            data = reg.blobs.get(hexd)
            if data is None:
                return self._send(404, b"", {})
            if self.command == "GET" and "hop=1" not in query and (reg.redirect_body or reg.redirect_to):
                base = reg.redirect_to or ""
                self._head(307, {"Location": f"{base}{urllib.parse.urlsplit(self.path).path}?hop=1",
                                 "Content-Length": str(reg.redirect_body)})
                return self._hit(307, self._zeros(reg.redirect_body))
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes=") and not reg.ignore_range:
                start = int(rng[6:].split("-")[0])
            body = data[start:]
            headers = {"Content-Length": str(len(body)), "Content-Type": "application/octet-stream"}
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            status = 206 if start else 200
            self._head(status, headers)
            if self.command == "HEAD":
                return self._hit(status, 0)
            limit = reg.cut.pop(hexd, None) if self.command == "GET" else None
            if hexd in reg.short:
                limit = reg.short[hexd] if limit is None else min(limit, reg.short[hexd])
            if limit is not None:
                body = body[:limit]
                self.close_connection = True
            self._hit(status, self._body(body, reg.trickle_s if reg.trickle_blob in ("", hexd) else 0.0))

        def _body(self, body: bytes, trickle_s: float) -> int:
            sent = 0
            try:
                if trickle_s:
                    reg.trickling.set()
                    for i in range(len(body)):
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        sent += 1
                        time.sleep(trickle_s)
                else:
                    self.wfile.write(body)
                    sent = len(body)
            except OSError:
                self.close_connection = True
            return sent

        def do_GET(self) -> None:
            try:
                self._answer()
            except OSError:
                self.close_connection = True

        do_HEAD = do_GET

    return Handler


def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def registry_config(path: str, registry: str, *, https: bool = False, ca_file: str = "", repository: str = "hwr/x",
                    pull_on_miss: bool = False, extra: dict | None = None, top: dict | None = None) -> str:
    """A daemon config for a hostile registry: ``[remote]`` with ``extra``
    keys, and ``top`` keys (``max_artifact_files``...) above it."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in (top or {}).items()]
    lines += ["[remote]", f'registry = "{registry}"', f'repository = "{repository}"', f"insecure = {str(not https).lower()}"]
    if ca_file:
        lines.append(f'ca_file = "{ca_file}"')
    if pull_on_miss:
        lines.append("pull_on_miss = true")
    lines += [f"{k} = {json.dumps(v)}" for k, v in (extra or {}).items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


__all__ = ["HostileRegistry", "Hit", "registry_config", "stored_artifact"]
