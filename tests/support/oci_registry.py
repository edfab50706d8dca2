"""A real OCI registry for the tests: Debian's ``docker-registry`` (CNCF
distribution) on 127.0.0.1, a port the OS chose, a temp storage directory
and a config written here; plus a small counting HTTP proxy in front of it
that logs every request (method, path, Range, bytes of the body sent back)
and can cut a blob download after some bytes or hold it at a gate.

Outside CI (``CI`` unset) a missing binary skips with the reason; in CI it
fails: ``.ci/setup`` installs it.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest

BINARY = "docker-registry"


def registry_binary() -> str:
    path = shutil.which(BINARY) or ""
    if not path:
        msg = (f"{BINARY} (Debian package docker-registry, CNCF distribution) is not installed; "
               "`apt-get install docker-registry` (.ci/setup does)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Registry:
    """One registry process; ``host`` is ``127.0.0.1:<port>``."""

    storage: str
    config_path: str
    port: int
    log_path: str
    htpasswd: str = ""
    #: (certificate, key, CA) PEM paths: the registry serves HTTPS (see make_tls).
    tls: tuple[str, str, str] | None = None
    proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def write_config(self) -> None:
        tls = (f"  tls:\n    certificate: {self.tls[0]}\n    key: {self.tls[1]}\n" if self.tls else "")
        auth = (f"auth:\n  htpasswd:\n    realm: hwr-test\n    path: {self.htpasswd}\n" if self.htpasswd else "")
        with open(self.config_path, "w") as f:
            f.write(f"""version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {self.storage}
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: {self.host}
  secret: hwr-test-secret
{tls}{auth}""")

    def start(self) -> "Registry":
        self.write_config()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([registry_binary(), "serve", self.config_path], stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"registry exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                conn = (http.client.HTTPSConnection(self.host, timeout=2,
                                                    context=ssl.create_default_context(cafile=self.tls[2]))
                        if self.tls else http.client.HTTPConnection(self.host, timeout=2))
                conn.request("GET", "/v2/")
                status = conn.getresponse().status
                conn.close()
                if status in (200, 401):
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"registry on {self.host} not answering after 30 s: {self.log()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def blob_data(self, digest_hex: str) -> str:
        """The file the registry keeps a blob's bytes in (distribution's layout)."""
        return os.path.join(self.storage, "docker", "registry", "v2", "blobs", "sha256", digest_hex[:2],
                            digest_hex, "data")


def make_registry(tmp_dir: str, *, htpasswd: str = "", tls: tuple[str, str, str] | None = None) -> Registry:
    os.makedirs(tmp_dir, exist_ok=True)
    return Registry(storage=os.path.join(tmp_dir, "storage"), config_path=os.path.join(tmp_dir, "config.yml"),
                    port=free_port(), log_path=os.path.join(tmp_dir, "registry.log"), htpasswd=htpasswd,
                    tls=tls).start()


def make_tls(tmp_dir: str) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate it signed for 127.0.0.1 (an IP
    SAN: the client checks the address it dialled), written by the
    ``openssl`` binary; returns (certificate, key, CA) paths. Outside CI a
    missing binary skips; in CI it fails (.ci/setup installs it)."""
    binary = shutil.which("openssl") or ""
    if not binary:
        msg = "openssl is not installed (Debian package openssl; .ci/setup installs it)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    os.makedirs(tmp_dir, exist_ok=True)
    ca, ca_key, cert, key, csr, ext = (os.path.join(tmp_dir, n) for n in
                                       ("ca.pem", "ca.key", "server.pem", "server.key", "server.csr", "ext.cnf"))
    # P-256 keys: generated in milliseconds (RSA takes far longer on a busy CI core).
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *args: subprocess.run([binary, *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=hwr-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    with open(ext, "w") as f:
        # What a strict verifier (Python >= 3.13's default context sets
        # VERIFY_X509_STRICT) wants of a leaf: SAN, key usages, key ids.
        f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2",
        "-extfile", ext)
    return cert, key, ca


@dataclasses.dataclass
class Seen:
    method: str
    path: str
    range: str
    status: int
    body_bytes: int


class Proxy:
    """A loopback HTTP proxy in front of ``upstream`` that logs every request.

    ``cut``: (digest, n): the next GET of that blob is cut (connection
    closed) after n body bytes. ``gate``: when set to an Event, GETs of the
    blob ``gate_digest`` stop after ``gate_after`` bytes until it is set (a
    pull held mid-layer), then break off. ``redirect_blobs``: blob GETs are
    answered 307 to the registry itself (another host:port, as a registry
    sends clients to object storage). Upstream refused: 502.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.seen: list[Seen] = []
        self.cut: tuple[str, int] | None = None
        self.gate: threading.Event | None = None
        self.gate_after = 0
        self.gate_digest = ""
        self.redirect_blobs = False
        self.holding = threading.Event()  # a download reached the gate
        #: When an Event: GETs of the blob ``stall_digest`` (of every blob
        #: when "") wait on it before going upstream (a registry that stalls
        #: before the first byte), then go on whole; ``stalled`` is set when
        #: one waits there.
        self.stall: threading.Event | None = None
        self.stall_digest = ""
        self.stalled = threading.Event()
        #: (user, password, token): answer the registry token flow in front
        #: of the registry (Bearer challenges, a token endpoint at /token).
        self.bearer: tuple[str, str, str] | None = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _refuse(self, status: int, challenge: str = "") -> None:
                self.send_response(status)
                if challenge:
                    self.send_header("WWW-Authenticate", challenge)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _token_gate(self) -> bool:
                """Bearer mode: the registry token flow in front of the
                registry. True when the request may go on upstream."""
                user, password, token = proxy.bearer  # type: ignore[misc]
                basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
                if self.path.startswith("/token"):
                    proxy._log(Seen("TOKEN", self.path, "", 0, 0))
                    if self.headers.get("Authorization") != basic:
                        self._refuse(401)
                        return False
                    body = json.dumps({"token": token}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return False
                if self.headers.get("Authorization") != f"Bearer {token}":
                    length = int(self.headers.get("Content-Length") or 0)
                    if length:
                        self.rfile.read(length)
                    self._refuse(401, f'Bearer realm="http://{proxy.host}/token",service="hwr-test",'
                                      f'scope="repository:hwr/x:pull"')
                    return False
                return True

            def _forward(self) -> None:
                if proxy.bearer is not None and not self._token_gate():
                    return
                if proxy.redirect_blobs and self.command == "GET" and "/blobs/sha256:" in self.path:
                    self.send_response(307)
                    self.send_header("Location", f"http://{proxy.upstream}{self.path}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    proxy._log(Seen(self.command, self.path, self.headers.get("Range", ""), 307, 0))
                    return
                stall = proxy.stall
                if (stall is not None and self.command == "GET" and "/blobs/sha256:" in self.path
                        and self.path.endswith(proxy.stall_digest)):
                    proxy.stalled.set()
                    stall.wait(120)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                # The Host header passes through: the registry builds upload
                # Locations from it, so they point at the proxy again.
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    conn.putheader("Host", self.headers.get("Host", proxy.upstream))
                    for k, v in headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body)
                    resp = conn.getresponse()
                except OSError:
                    conn.close()
                    self.send_response(502)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    proxy._log(Seen(self.command, self.path, self.headers.get("Range", ""), 502, 0))
                    return
                is_blob_get = self.command == "GET" and "/blobs/sha256:" in self.path
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                if resp.getheader("Content-Length") is None:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                sent = 0
                cut = None
                if is_blob_get and proxy.cut is not None and self.path.endswith(proxy.cut[0]):
                    cut, proxy.cut = proxy.cut[1], None
                try:
                    while True:
                        chunk = resp.read(64 * 1024)
                        if not chunk:
                            break
                        if cut is not None and sent + len(chunk) > cut:
                            self.wfile.write(chunk[:cut - sent])
                            sent = cut
                            self.close_connection = True
                            break
                        gate = proxy.gate
                        if (is_blob_get and gate is not None and self.path.endswith(proxy.gate_digest)
                                and sent + len(chunk) > proxy.gate_after):
                            self.wfile.write(chunk[:max(0, proxy.gate_after - sent)])
                            self.wfile.flush()
                            sent = max(sent, proxy.gate_after)
                            proxy.holding.set()
                            gate.wait(60)
                            raise ConnectionError("gate: cut")
                        self.wfile.write(chunk)
                        sent += len(chunk)
                except (OSError, http.client.HTTPException):
                    self.close_connection = True
                finally:
                    conn.close()
                    proxy._log(Seen(self.command, self.path, self.headers.get("Range", ""), resp.status, sent))

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def _log(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def take(self) -> list[Seen]:
        """The requests seen since the last take."""
        with self._lock:
            out, self.seen = self.seen, []
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def remote_config(path: str, *, registry: str = "", repository: str = "", pull_on_miss: bool = False,
                  credentials_file: str = "", layer_attempts: int = 3, push_after_publish: bool = False,
                  upload_chunk_bytes: int = 0, verify_pull: str = "file", https: bool = False, ca_file: str = "",
                  timeout_s: float = 10.0, extra: str = "") -> str:
    """Writes a daemon config with a [remote] table: plain HTTP (loopback)
    unless ``https`` (verified against ``ca_file``, or the system store);
    ``extra``: more lines of the [remote] table."""
    with open(path, "w") as f:
        f.write("[remote]\n" + ("" if https else "insecure = true\n"))
        if ca_file:
            f.write(f'ca_file = "{ca_file}"\n')
        f.write(f"layer_attempts = {layer_attempts}\ntimeout_s = {timeout_s}\n")
        if registry:
            f.write(f'registry = "{registry}"\nrepository = "{repository}"\n')
        if pull_on_miss:
            f.write("pull_on_miss = true\n")
        f.write(f'verify_pull = "{verify_pull}"\n')
        if upload_chunk_bytes:
            f.write(f"upload_chunk_bytes = {upload_chunk_bytes}\n")
        if push_after_publish:
            f.write("push_after_publish = true\n")
        if credentials_file:
            f.write(f'credentials_file = "{credentials_file}"\n')
        f.write(extra)
    return path
