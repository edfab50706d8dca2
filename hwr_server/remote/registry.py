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
  * redirects for blob GETs (registries send them to object storage);
  * monolithic or chunked uploads, ``Range`` resume of a download (a
    registry that ignores the Range and answers 200 is read from the start).

Where credentials go (an origin is scheme, host and port): the
``Authorization`` header only to the registry's own origin, never after a
redirect elsewhere; a redirect from https to http is refused (it would send
the request, and its URL's signature, in clear); a Bearer challenge's realm
is asked for a token only when it is the registry's own origin or listed
in ``[remote] token_realms`` (Docker Hub's ``https://auth.docker.io``), so
a registry cannot make the daemon fetch an arbitrary URL (a loopback
service) and forward what it answers, nor collect the basic credentials
over plain HTTP somewhere else. The credentials file is read as
:mod:`hwr_server.remote.credentials` says, and read again after a refused
answer (a rotated password works without a restart).

What is read of an answer (:mod:`hwr_server.remote.httpio`): the head and
every small body within ``timeout_s`` each; a 401's or a redirect's body
never (the connection is closed); an error's first
:data:`~hwr_server.remote.httpio.DETAIL_BYTES`; a manifest, config or
token up to the caller's limit.

Errors are :mod:`hwr_client.core.errors` classes: a connection failure,
timeout or 5xx is ``Unavailable`` (retry is safe), 401/403 after the
challenge ``PermissionDenied``, 404 ``NotFound``, anything else
``FailedPrecondition`` naming the request and the status.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import ssl
import threading
import urllib.parse
from typing import BinaryIO, Callable, Mapping, Protocol, Sequence, Union

from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from hwr_server.logtext import untrusted
from hwr_server.remote.credentials import CredentialSource, Credentials, load_credentials
from hwr_server.remote.httpio import Deadline, Watchdog, connect_error, detail, read_capped, redirect, status_error
from hwr_server.remote.names import Origin, Reference, parse_challenge, parse_origin, parse_reference

log = logging.getLogger(__name__)

#: Bytes read from a response (or a file for an upload) at a time.
IO_BYTES = 1 << 20
#: The largest token-service answer read, bytes (a JWT is 1-8 KiB).
TOKEN_BYTES = 64 * 1024
_MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


class Readable(Protocol):
    """A request body read block by block (a file, or a slice of one)."""

    def read(self, n: int = -1, /) -> bytes: ...


Body = Union[bytes, Readable]


class Response:
    """A response whose body is read by the caller; close it (context manager).

    Until :meth:`read` or :meth:`stream`, the watchdog deadline armed for
    the head still runs; :meth:`read` reads a small body within it,
    :meth:`stream` hands a payload to the caller's own rate guard.
    """

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, deadline: Deadline,
                 watchdog: Watchdog, what: str):
        self.conn, self.resp = conn, resp
        self.status = resp.status
        self.headers = resp.headers
        self._deadline, self._watchdog, self._what = deadline, watchdog, what

    def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes, within the deadline.

        Raises:
            FailedPrecondition: the body is larger.
            Unavailable: it broke off, or did not arrive in time.
        """
        try:
            return read_capped(self.resp, limit, what=self._what)
        except Unavailable:
            if self._deadline.expired:
                raise Unavailable(f"{self._what}: the answer did not arrive within {self._deadline.seconds:g} s "
                                  "([remote] timeout_s); retry is safe") from None
            raise
        finally:
            self._watchdog.disarm(self._deadline)

    def stream(self) -> http.client.HTTPResponse:
        """The body for the caller to stream (a layer): the deadline ends
        here; each read is bounded by the socket timeout and the caller's
        minimum rate."""
        self._watchdog.disarm(self._deadline)
        return self.resp

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc: object) -> None:
        self._watchdog.disarm(self._deadline)
        self.conn.close()


class _Fixed:
    """Credentials given as a value (tests, tools): never re-read."""

    def __init__(self, credentials: Credentials | None):
        self._credentials = credentials

    def get(self) -> Credentials | None:
        return self._credentials

    def reload(self) -> bool:
        return False


class CredentialsOf(Protocol):
    """Where a client's credentials come from (:class:`CredentialSource`)."""

    def get(self) -> Credentials | None: ...

    def reload(self) -> bool: ...


class RegistryClient:
    """One registry host. Thread-safe: each request opens its own connection
    (layers download in parallel on several threads).

    Args:
        host: ``host[:port]``.
        insecure: plain HTTP (for a loopback registry); else HTTPS.
        ca_file: PEM bundle that verifies the registry's certificate ("" =
            the system store).
        credentials: (user, password) for basic auth or the token request;
            or a source that re-reads them (:class:`CredentialSource`).
        timeout: seconds a connect, one read, a response head or a small
            answer may take.
        token_realms: origins (``https://auth.example``) besides the
            registry's own that may issue its tokens.
    """

    def __init__(self, host: str, *, insecure: bool = False, ca_file: str = "",
                 credentials: Credentials | CredentialsOf | None = None, timeout: float = 30.0,
                 token_realms: Sequence[str] = ()):
        self.host = host
        self.insecure = insecure
        self.timeout = timeout
        self.origin: Origin = ("http" if insecure else "https", host.lower())
        self._source: CredentialsOf = (credentials if credentials is not None and not isinstance(credentials, tuple)
                                       else _Fixed(credentials))
        self._realms = frozenset(parse_origin(r, what="[remote] token_realms entry") for r in token_realms)
        self._ca_file = ca_file
        try:
            self._ssl = None if insecure else ssl.create_default_context(cafile=ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"[remote] ca_file {ca_file!r}: cannot load it as a PEM CA bundle ({exc}); "
                                  "give the CA certificate that signed the registry's certificate") from None
        self._lock = threading.Lock()
        self._auth: dict[str, str] = {}  # scope -> Authorization header value
        self._watchdog = Watchdog()

    # -- plumbing --------------------------------------------------------------

    def _connect(self, origin: Origin) -> http.client.HTTPConnection:
        scheme, host = origin
        if scheme == "https":
            # An https origin other than the registry (object storage, a token
            # realm) is verified against the same trust, never skipped.
            ctx = self._ssl or ssl.create_default_context(cafile=self._ca_file or None)
            return http.client.HTTPSConnection(host, timeout=self.timeout, context=ctx, blocksize=IO_BYTES)
        return http.client.HTTPConnection(host, timeout=self.timeout, blocksize=IO_BYTES)

    def _basic(self) -> str:
        creds = self._source.get()
        if creds is None:
            return ""
        user, password = creds
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def _send(self, method: str, origin: Origin, target: str, body: Body | None, headers: Mapping[str, str],
              what: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, Deadline]:
        """One request; the head must arrive within ``timeout`` (watchdog)."""
        conn = self._connect(origin)
        deadline = Deadline(None, self.timeout)
        try:
            conn.request(method, target, body=body, headers=dict(headers))
            # Armed after the body went out: an upload takes as long as its
            # bytes take; the answer's head must then come in time.
            deadline = self._watchdog.arm(conn, self.timeout)
            return conn, conn.getresponse(), deadline
        except (OSError, http.client.HTTPException) as exc:
            self._watchdog.disarm(deadline)
            conn.close()
            if deadline.expired:
                raise Unavailable(f"{what}: registry {origin[1]} sent no complete answer within {self.timeout:g} s "
                                  "([remote] timeout_s); retry is safe") from None
            raise connect_error(exc, what, origin[1], self._ca_file) from None

    def _close(self, conn: http.client.HTTPConnection, deadline: Deadline) -> None:
        """Ends a request without reading its body (a 401, a redirect, an
        error: their bodies are the sender's choice of size)."""
        self._watchdog.disarm(deadline)
        conn.close()

    def request(self, method: str, path: str, *, scope: str, headers: Mapping[str, str] | None = None,
                body: Body | None = None, length: int | None = None, redirects: bool = False,
                ok: tuple[int, ...] = (200,), what: str = "") -> Response:
        """Sends one request, answering an auth challenge once (again after
        the credentials file changed) and following redirects when asked;
        returns a response whose status is in ``ok``.

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
        origin = (url.scheme, url.netloc.lower()) if url.netloc else self.origin
        target = urllib.parse.urlunsplit(("", "", url.path, url.query, "")) if url.netloc else path
        hdrs = dict(headers or {})
        if body is not None:
            hdrs["Content-Length"] = str(len(body) if isinstance(body, bytes) else int(length or 0))
        answers = 0  # challenges answered: once, and once more after a rotation of the credentials
        for _ in range(_MAX_REDIRECTS + 3):
            hdrs.pop("Authorization", None)
            if origin == self.origin:  # credentials never go to another origin
                with self._lock:
                    auth = self._auth.get(scope, "")
                if auth:
                    hdrs["Authorization"] = auth
            conn, resp, deadline = self._send(method, origin, target, body, hdrs, what)
            if resp.status == 401 and origin == self.origin and answers < 2:
                challenge = resp.headers.get("WWW-Authenticate", "")
                self._close(conn, deadline)
                if body is not None and not isinstance(body, bytes):
                    raise PermissionDenied(f"{what}: 401 on an upload; authenticate first")
                if answers and not self._reloaded(what):
                    raise status_error(401, what, "the credentials were refused")
                self._answer(challenge, scope, what)
                answers += 1
                continue
            location = resp.headers.get("Location")
            if redirects and resp.status in _REDIRECTS and location:
                self._close(conn, deadline)
                origin, target = redirect(origin, target, location, what)
                continue
            if resp.status in ok:
                return Response(conn, resp, deadline, self._watchdog, what)
            text = detail(resp)
            self._close(conn, deadline)
            raise status_error(resp.status, what, text)
        raise FailedPrecondition(f"{what}: more than {_MAX_REDIRECTS} redirects")

    def _reloaded(self, what: str) -> bool:
        """After a refusal: True when the credentials file changed (rotated),
        so answering the challenge again can help; the cached tokens go."""
        if not self._source.reload():
            return False
        log.info("%s: the credentials were refused; the credentials file changed since, answering again", what)
        with self._lock:
            self._auth.clear()
        return True

    def _answer(self, challenge: str, scope: str, what: str) -> None:
        """Answers a 401 challenge: basic credentials, or a bearer token."""
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if self._source.get() is None:
                raise PermissionDenied(f"{what}: registry {self.host} wants credentials; set [remote] "
                                       "credentials_file (docker config.json)")
            value = self._basic()
        elif scheme == "bearer" and params.get("realm"):
            try:
                value = "Bearer " + self._token(params, scope, what)
            except PermissionDenied:
                if not self._reloaded(what):
                    raise
                value = "Bearer " + self._token(params, scope, what)
        else:
            raise PermissionDenied(f"{what}: unsupported authentication challenge {challenge[:200]!r}")
        with self._lock:
            self._auth[scope] = value

    def _realm(self, text: str, what: str) -> tuple[Origin, str]:
        """The token realm's origin and path, if the daemon may ask it.

        Raises:
            PermissionDenied: another origin not listed in token_realms, or
                a downgrade from https.
        """
        realm = urllib.parse.urlsplit(text)
        origin = (realm.scheme, realm.netloc.lower())
        if realm.scheme not in ("http", "https") or not realm.netloc or "@" in realm.netloc:
            raise PermissionDenied(f"{what}: registry {self.host} names the token realm {untrusted(text)!s:.200}, "
                                   "not an http(s) URL; refused")
        if self.origin[0] == "https" and realm.scheme != "https":
            raise PermissionDenied(f"{what}: registry {self.host} (https) names the plain-http token realm "
                                   f"{realm.scheme}://{realm.netloc}; refused (credentials would go in clear)")
        if origin != self.origin and origin not in self._realms:
            raise PermissionDenied(
                f"{what}: registry {self.host} sends the token request to {realm.scheme}://{realm.netloc}, "
                "which is neither the registry itself nor in [remote] token_realms; refused (add "
                f"\"{realm.scheme}://{realm.netloc}\" to token_realms if that service issues its tokens)")
        return origin, realm.path or "/"

    def _token(self, params: dict[str, str], scope: str, what: str) -> str:
        """The registry token flow: GET realm?service=…&scope=… (with basic
        credentials when configured), answer {"token"} or {"access_token"}."""
        origin, path = self._realm(params["realm"], what)
        query = {"scope": params.get("scope") or scope}
        if params.get("service"):
            query["service"] = params["service"]
        target = f"{path}?{urllib.parse.urlencode(query)}"
        headers = {"Authorization": self._basic()} if self._source.get() is not None else {}
        service = f"{what}: token service {origin[1]}"
        conn, resp, deadline = self._send("GET", origin, target, None, headers, service)
        with Response(conn, resp, deadline, self._watchdog, service) as r:
            if r.status in (401, 403):
                raise PermissionDenied(f"{service} refused the credentials ({r.status})")
            if r.status != 200:
                raise status_error(r.status, f"{what}: token request", detail(resp))
            body = r.read(TOKEN_BYTES)
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise PermissionDenied(f"{service} answered no token")
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
        caller streams the body. For a range the answer is 206 from
        ``offset``, or 200 with the whole blob from a registry that ignores
        ``Range`` (RFC 9110 lets it): the caller starts over then.

        Raises:
            FailedPrecondition: a 206 whose Content-Range does not start at
                ``offset``. Others: as :meth:`request`.
        """
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        r = self.request("GET", f"/v2/{repository}/blobs/{digest}", scope=self._scope(repository),
                         headers=headers, redirects=True, ok=(200, 206) if offset else (200,))
        if r.status == 206 and not r.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
            got = r.headers.get("Content-Range", "")
            r.__exit__()
            raise FailedPrecondition(f"blob {digest[:19]} from {self.host}: asked for bytes {offset}-, the registry "
                                     f"answered the range {untrusted(got)!s:.100}")
        return r

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


def client_for(host: str, *, insecure: bool, ca_file: str, credentials_file: str, timeout: float = 30.0,
               token_realms: Sequence[str] = ()) -> RegistryClient:
    """A client for ``host`` with the credentials the file holds for it
    (re-read when it changes).

    Raises:
        FailedPrecondition / InvalidArgument: the credentials file
            (:mod:`hwr_server.remote.credentials`), the CA file, a realm.
    """
    source = CredentialSource(credentials_file, host) if credentials_file else None
    return RegistryClient(host, insecure=insecure, ca_file=ca_file, credentials=source, timeout=timeout,
                          token_realms=token_realms)


__all__ = ["Reference", "RegistryClient", "Response", "client_for", "load_credentials", "parse_origin",
           "parse_reference"]
