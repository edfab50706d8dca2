"""A thin OCI distribution client (the registry HTTP API v2) for push and pull.

Why the standard library (``http.client``) and not ``requests``/``httpx``
or ``oras``: the daemon must stay light (it starts in ~0.5 s and never loads
torch), and a pull must stream each layer straight into our own hashing
writer with bounded memory and resume it with a ``Range`` request. The
protocol subset HWR needs is small (HEAD/GET blob, upload, GET/PUT
manifest, the token challenge), so a client of ~300 lines on
``http.client`` does it without a new dependency; ``oras`` writes layers
to files itself (a second pass to hash them) and pulls ``requests`` in.

What it does:
  * anonymous, basic and bearer-token auth: a 401's ``WWW-Authenticate``
    challenge says which; a Bearer challenge is answered by a token GET at
    its realm (with basic credentials when there are some), cached per scope;
  * TLS verified against the system store or a CA file (a certificate that
    does not verify is ``FailedPrecondition`` naming TLS verification: a
    retry cannot help); ``insecure`` is plain HTTP (a loopback registry);
  * redirects for blob GETs (registries send them to object storage; the
    Authorization header is dropped when the host changes);
  * monolithic or chunked uploads, ``Range`` resume of a download.

Errors are :mod:`hwr_client.core.errors` classes: a connection failure,
timeout or 5xx is ``Unavailable`` (retry is safe), 401/403 after the
challenge ``PermissionDenied``, 404 ``NotFound``, anything else
``FailedPrecondition`` naming the request and the status.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import http.client
import json
import logging
import re
import ssl
import threading
import urllib.parse
from typing import BinaryIO, Callable, Mapping, Protocol, Union

from hwr_client.core.errors import (
    FailedPrecondition, HwrError, InvalidArgument, NotFound, PermissionDenied, Unavailable,
)

log = logging.getLogger(__name__)

#: Bytes read from a response (or a file for an upload) at a time.
IO_BYTES = 1 << 20
_MAX_REDIRECTS = 5
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*\Z")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")


class Readable(Protocol):
    """A request body read block by block (a file, or a slice of one)."""

    def read(self, n: int = -1, /) -> bytes: ...


Body = Union[bytes, Readable]


@dataclasses.dataclass(frozen=True)
class Reference:
    """``host[:port]/repository[:tag|@sha256:…]``; ``tag`` and ``digest``
    may both be empty (the caller fills the tag with the key)."""

    host: str
    repository: str
    tag: str = ""
    digest: str = ""

    def __str__(self) -> str:
        tail = f"@{self.digest}" if self.digest else (f":{self.tag}" if self.tag else "")
        return f"{self.host}/{self.repository}{tail}"

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest, else the tag."""
        return self.digest or self.tag


def parse_reference(text: str) -> Reference:
    """Parses ``host[:port]/repository[:tag|@sha256:<hex>]``.

    Raises:
        InvalidArgument: naming the part that is wrong.
    """
    what = f"registry reference {text!r}"
    host, sep, rest = text.partition("/")
    if not sep or not host or not rest:
        raise InvalidArgument(f"{what}: expected host[:port]/repository[:tag]")
    digest = tag = ""
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidArgument(f"{what}: digest {digest!r}, expected sha256:<64 lowercase hex>")
    elif ":" in rest.rsplit("/", 1)[-1]:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG.match(tag):
            raise InvalidArgument(f"{what}: tag {tag!r}, expected [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}")
    if not _REPO.match(rest):
        raise InvalidArgument(f"{what}: repository {rest!r}, expected lowercase path components")
    return Reference(host, rest, tag, digest)


def load_credentials(path: str, host: str) -> tuple[str, str] | None:
    """(user, password) for ``host`` from a docker-style ``config.json``
    (``{"auths": {"host:port": {"auth": base64("user:pass")}}}``, or
    ``username``/``password`` fields); None when it has no entry.

    Raises:
        InvalidArgument: unreadable or malformed file.
    """
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except OSError as exc:
        raise InvalidArgument(f"credentials file {path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise InvalidArgument(f"credentials file {path}: not JSON ({exc})") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise InvalidArgument(f"credentials file {path}: expected an object with an 'auths' object")
    for name in (host, f"https://{host}", f"http://{host}"):
        entry = auths.get(name)
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str):
            try:
                user, sep, password = base64.b64decode(entry["auth"], validate=True).decode("utf-8").partition(":")
            except (ValueError, UnicodeDecodeError):
                raise InvalidArgument(f"credentials file {path}: auths[{name!r}].auth is not base64 of "
                                      "user:password") from None
            if sep:
                return user, password
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return entry["username"], entry["password"]
        raise InvalidArgument(f"credentials file {path}: auths[{name!r}] has neither auth nor username/password")
    return None


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme, params) of a ``WWW-Authenticate`` header."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


class Response:
    """A response whose body is read by the caller; close it (context manager)."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self.conn, self.resp = conn, resp
        self.status = resp.status
        self.headers = resp.headers

    def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes.

        Raises:
            FailedPrecondition: the body is larger.
        """
        try:
            data = self.resp.read(limit + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise Unavailable(f"registry response broke off ({exc}); retry is safe") from None
        if len(data) > limit:
            raise FailedPrecondition(f"registry response of more than {limit} bytes")
        declared = self.headers.get("Content-Length")
        # http.client returns a short body without complaint when the
        # connection closes early: the declared length tells.
        if declared is not None and declared.isdigit() and int(declared) != len(data):
            raise Unavailable(f"registry response truncated: {len(data)} of {declared} bytes; retry is safe")
        return data

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


class RegistryClient:
    """One registry host. Thread-safe: each request opens its own connection
    (layers download in parallel on several threads).

    Args:
        host: ``host[:port]``.
        insecure: plain HTTP (for a loopback registry); else HTTPS.
        ca_file: PEM bundle that verifies the registry's certificate ("" =
            the system store).
        credentials: (user, password) for basic auth or the token request.
        timeout: seconds a connect or a read may take.
    """

    def __init__(self, host: str, *, insecure: bool = False, ca_file: str = "",
                 credentials: tuple[str, str] | None = None, timeout: float = 30.0):
        self.host = host
        self.insecure = insecure
        self.timeout = timeout
        self._credentials = credentials
        self._ca_file = ca_file
        try:
            self._ssl = None if insecure else ssl.create_default_context(cafile=ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"[remote] ca_file {ca_file!r}: cannot load it as a PEM CA bundle ({exc}); "
                                  "give the CA certificate that signed the registry's certificate") from None
        self._lock = threading.Lock()
        self._auth: dict[str, str] = {}  # scope -> Authorization header value

    # -- plumbing --------------------------------------------------------------

    def _connect(self, host: str, https: bool) -> http.client.HTTPConnection:
        if https:
            return http.client.HTTPSConnection(host, timeout=self.timeout, context=self._ssl, blocksize=IO_BYTES)
        return http.client.HTTPConnection(host, timeout=self.timeout, blocksize=IO_BYTES)

    def _basic(self) -> str:
        if self._credentials is None:
            return ""
        user, password = self._credentials
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def request(self, method: str, path: str, *, scope: str, headers: Mapping[str, str] | None = None,
                body: Body | None = None, length: int | None = None, redirects: bool = False,
                ok: tuple[int, ...] = (200,), what: str = "") -> Response:
        """Sends one request, answering an auth challenge once and following
        redirects when asked; returns a response whose status is in ``ok``.

        Args:
            path: absolute path (``/v2/...``) or, after a Location, a full URL.
            scope: the token scope (``repository:<name>:pull,push``).
            body: bytes or a file positioned at its start (sent in IO_BYTES
                blocks, so memory stays bounded); a file is not resent after
                a challenge (callers make a body-less request first).
            length: Content-Length of a file body.

        Raises:
            Unavailable / PermissionDenied / NotFound / FailedPrecondition:
                see the module docstring.
        """
        what = what or f"{method} {self.host}{path.split('?')[0]}"
        url = urllib.parse.urlsplit(path)
        host, https = (url.netloc, url.scheme == "https") if url.netloc else (self.host, not self.insecure)
        target = urllib.parse.urlunsplit(("", "", url.path, url.query, "")) if url.netloc else path
        hdrs = dict(headers or {})
        if body is not None:
            hdrs["Content-Length"] = str(len(body) if isinstance(body, bytes) else int(length or 0))
        challenged = False
        for _ in range(_MAX_REDIRECTS + 2):
            if host == self.host:
                with self._lock:
                    auth = self._auth.get(scope, "")
                if auth:
                    hdrs["Authorization"] = auth
            else:
                hdrs.pop("Authorization", None)  # never send our credentials to another host
            conn = self._connect(host, https)
            try:
                conn.request(method, target, body=body, headers=hdrs)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise _connect_error(exc, what, host, self._ca_file) from None
            if resp.status == 401 and not challenged and host == self.host:
                challenge = resp.headers.get("WWW-Authenticate", "")
                resp.read()
                conn.close()
                if body is not None and not isinstance(body, bytes):
                    raise PermissionDenied(f"{what}: 401 on an upload; authenticate first")
                self._answer(challenge, scope, what)
                challenged = True
                continue
            if redirects and resp.status in (301, 302, 303, 307, 308) and resp.headers.get("Location"):
                loc = urllib.parse.urljoin(f"{'https' if https else 'http'}://{host}{target}",
                                           resp.headers["Location"])
                resp.read()
                conn.close()
                nxt = urllib.parse.urlsplit(loc)
                host, https = nxt.netloc, nxt.scheme == "https"
                target = urllib.parse.urlunsplit(("", "", nxt.path, nxt.query, ""))
                continue
            if resp.status in ok:
                return Response(conn, resp)
            detail = resp.read(4096).decode("utf-8", "replace").strip()[:300]
            conn.close()
            raise _status_error(resp.status, what, detail)
        raise FailedPrecondition(f"{what}: more than {_MAX_REDIRECTS} redirects")

    def _answer(self, challenge: str, scope: str, what: str) -> None:
        """Answers a 401 challenge: basic credentials, or a bearer token."""
        scheme, params = _challenge(challenge)
        if scheme == "basic":
            if self._credentials is None:
                raise PermissionDenied(f"{what}: registry {self.host} wants credentials; set [remote] "
                                       "credentials_file (docker config.json)")
            value = self._basic()
        elif scheme == "bearer" and params.get("realm"):
            value = "Bearer " + self._token(params, scope, what)
        else:
            raise PermissionDenied(f"{what}: unsupported authentication challenge {challenge!r}")
        with self._lock:
            self._auth[scope] = value

    def _token(self, params: dict[str, str], scope: str, what: str) -> str:
        """The registry token flow: GET realm?service=…&scope=… (with basic
        credentials when configured), answer {"token"} or {"access_token"}."""
        query = {"scope": params.get("scope") or scope}
        if params.get("service"):
            query["service"] = params["service"]
        realm = urllib.parse.urlsplit(params["realm"])
        target = f"{realm.path or '/'}?{urllib.parse.urlencode(query)}"
        conn = self._connect(realm.netloc, realm.scheme == "https")
        headers = {"Authorization": self._basic()} if self._credentials else {}
        try:
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
            body = resp.read(1 << 20)
        except (OSError, http.client.HTTPException) as exc:
            raise _connect_error(exc, f"{what}: token service", realm.netloc, self._ca_file) from None
        finally:
            conn.close()
        if resp.status in (401, 403):
            raise PermissionDenied(f"{what}: token service {realm.netloc} refused the credentials ({resp.status})")
        if resp.status != 200:
            raise _status_error(resp.status, f"{what}: token request", body[:300].decode("utf-8", "replace"))
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise PermissionDenied(f"{what}: token service {realm.netloc} answered no token")
        return token

    # -- the API ----------------------------------------------------------------

    @staticmethod
    def _scope(repository: str, push: bool = False) -> str:
        return f"repository:{repository}:{'pull,push' if push else 'pull'}"

    def blob_size(self, repository: str, digest: str, *, push: bool = False) -> int | None:
        """HEAD of a blob: its size, or None when the registry lacks it."""
        try:
            with self.request("HEAD", f"/v2/{repository}/blobs/{digest}", scope=self._scope(repository, push),
                              redirects=True) as r:
                return int(r.headers.get("Content-Length") or -1)
        except NotFound:
            return None

    def open_blob(self, repository: str, digest: str, *, offset: int = 0) -> Response:
        """GET of a blob from ``offset`` (a Range request when > 0); the
        caller streams the body. The response is 206 for a range."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        return self.request("GET", f"/v2/{repository}/blobs/{digest}", scope=self._scope(repository),
                            headers=headers, redirects=True, ok=(206,) if offset else (200,))

    def get_manifest(self, repository: str, reference: str, *, limit: int) -> tuple[bytes, str]:
        """(body, Content-Type) of a manifest by tag or digest."""
        with self.request("GET", f"/v2/{repository}/manifests/{reference}", scope=self._scope(repository),
                          headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
                          what=f"manifest {self.host}/{repository}:{reference}") as r:
            return r.read(limit), r.headers.get("Content-Type", "")

    def upload_blob(self, repository: str, digest: str, source: BinaryIO, size: int, *, chunk_bytes: int = 0,
                    progress: Callable[[int], None] = lambda n: None) -> None:
        """Uploads one blob: POST an upload session, then one PUT with the
        whole body (monolithic) or PATCHes of ``chunk_bytes`` and a closing
        PUT (chunked). The registry checks the digest."""
        scope = self._scope(repository, push=True)
        what = f"upload of {digest[:19]} to {self.host}/{repository}"
        with self.request("POST", f"/v2/{repository}/blobs/uploads/", scope=scope, body=b"", ok=(202,),
                          what=what) as r:
            location = r.headers.get("Location", "")
        if not location:
            raise FailedPrecondition(f"{what}: the registry answered no upload Location")
        if chunk_bytes and size > chunk_bytes:
            sent = 0
            while sent < size:
                n = min(chunk_bytes, size - sent)
                part = _Slice(source, n)
                with self.request("PATCH", location, scope=scope, body=part, length=n, ok=(202,), what=what,
                                  headers={"Content-Type": "application/octet-stream",
                                           "Content-Range": f"{sent}-{sent + n - 1}"}) as r:
                    location = r.headers.get("Location", location)
                sent += n
                progress(n)
            body: Body = b""
            length = 0
        else:
            body, length = _Counting(source, progress), size
        sep = "&" if "?" in location else "?"
        with self.request("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", scope=scope, body=body,
                          length=length, ok=(201,), what=what,
                          headers={"Content-Type": "application/octet-stream"}):
            pass

    def put_bytes_blob(self, repository: str, digest: str, data: bytes) -> None:
        """Uploads a small blob (the config) monolithically."""
        import io

        self.upload_blob(repository, digest, io.BytesIO(data), len(data))

    def put_manifest(self, repository: str, tag: str, data: bytes, media_type: str) -> str:
        """PUT of a manifest under ``tag``; returns the digest the registry
        names it by (Docker-Content-Digest)."""
        with self.request("PUT", f"/v2/{repository}/manifests/{tag}", scope=self._scope(repository, push=True),
                          body=data, headers={"Content-Type": media_type}, ok=(201,),
                          what=f"manifest {self.host}/{repository}:{tag}") as r:
            return r.headers.get("Docker-Content-Digest", "")

    # -- referrers (OCI distribution spec 1.1; hwr_server.remote.signatures) -----

    def referrers(self, repository: str, digest: str, *, artifact_type: str, limit: int) -> bytes | None:
        """The image index of the manifests whose ``subject`` is ``digest``
        (``GET /v2/<name>/referrers/<digest>``, filtered by artifact type
        where the registry filters), at most ``limit`` bytes; None when the
        registry has no referrers API (404: the spec forbids a 404 from a
        registry that has it), so the caller reads the fallback tag."""
        query = urllib.parse.urlencode({"artifactType": artifact_type})
        try:
            with self.request("GET", f"/v2/{repository}/referrers/{digest}?{query}", scope=self._scope(repository),
                              headers={"Accept": "application/vnd.oci.image.index.v1+json"},
                              what=f"referrers of {self.host}/{repository}@{digest[:19]}") as r:
                return r.read(limit)
        except NotFound:
            return None

    def get_index(self, repository: str, tag: str, *, limit: int) -> bytes | None:
        """An image index by tag (the referrers tag schema), at most
        ``limit`` bytes; None when there is no such tag."""
        try:
            with self.request("GET", f"/v2/{repository}/manifests/{tag}", scope=self._scope(repository),
                              headers={"Accept": "application/vnd.oci.image.index.v1+json"},
                              what=f"index {self.host}/{repository}:{tag}") as r:
                return r.read(limit)
        except NotFound:
            return None

    def put_referrer(self, repository: str, data: bytes, media_type: str) -> bool:
        """PUT of a manifest with a ``subject`` by its own digest; True when
        the registry indexed it for the referrers API (it answers
        ``OCI-Subject``), False when the caller must update the fallback tag."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with self.request("PUT", f"/v2/{repository}/manifests/{digest}", scope=self._scope(repository, push=True),
                          body=data, headers={"Content-Type": media_type}, ok=(201,),
                          what=f"manifest {self.host}/{repository}@{digest[:19]}") as r:
            return bool(r.headers.get("OCI-Subject"))


class _Counting:
    """A file wrapper that reports each block read (upload progress)."""

    def __init__(self, f: BinaryIO, progress: Callable[[int], None]):
        self.f, self.progress = f, progress

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.progress(len(data))
        return data


class _Slice:
    """The next ``n`` bytes of a file, as a readable body."""

    def __init__(self, f: BinaryIO, n: int):
        self.f, self.left = f, n

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


def _connect_error(exc: BaseException, what: str, host: str, ca_file: str) -> HwrError:
    """A request that got no answer. A certificate the client cannot verify
    is FAILED_PRECONDITION (a retry fails the same way until the
    configuration changes); anything else is UNAVAILABLE (retry is safe)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        trust = f"the CA file {ca_file}" if ca_file else "the system's CA store (no [remote] ca_file)"
        return FailedPrecondition(
            f"{what}: TLS verification of registry {host} failed against {trust}: "
            f"{exc.verify_message or exc.reason or exc}; set [remote] ca_file to the CA that signed its "
            "certificate (insecure = true is plain HTTP, for a loopback registry only)")
    return Unavailable(f"{what}: registry {host} unreachable ({exc}); retry when it is up")


def _status_error(status: int, what: str, detail: str) -> HwrError:
    text = f"{what}: registry answered {status}" + (f" ({detail})" if detail else "")
    if status in (401, 403):
        return PermissionDenied(text + "; check [remote] credentials_file")
    if status == 404:
        return NotFound(text)
    if status in (408, 429) or status >= 500:
        return Unavailable(text + "; retry later")
    return FailedPrecondition(text)


def client_for(host: str, *, insecure: bool, ca_file: str, credentials_file: str,
               timeout: float = 30.0) -> RegistryClient:
    """A client for ``host`` with the credentials the file holds for it."""
    creds = load_credentials(credentials_file, host) if credentials_file else None
    return RegistryClient(host, insecure=insecure, ca_file=ca_file, credentials=creds, timeout=timeout)


__all__ = ["Reference", "RegistryClient", "Response", "client_for", "load_credentials",
           "parse_reference"]
