"""A registry that has the OCI distribution 1.1 referrers API, for the one
branch Debian's docker-registry (2.8, no referrers API) cannot exercise:
a signature indexed by the registry itself (``OCI-Subject`` on its PUT) and
found through ``GET /v2/<name>/referrers/<digest>``. In memory, loopback,
only the endpoints push and the signature check use; every other path of
the signature code runs against the real registry
(tests/server/test_oci_signatures.py)."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import uuid


class ReferrersRegistry:
    """Blobs, manifests (by digest and tag) and the referrers of each digest."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, tuple[bytes, str]] = {}  # reference -> (body, media type)
        self.referrer_gets = 0
        reg = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_HEAD(self) -> None:
                m = re.match(r"/v2/(.+)/blobs/(sha256:[0-9a-f]{64})$", self.path)
                data = reg.blobs.get(m.group(2)) if m else None
                self._send(404) if data is None else self._send(200, headers={"Content-Length": str(len(data))})

            def do_POST(self) -> None:
                self._body()
                self._send(202, headers={"Location": f"/upload/{uuid.uuid4().hex}"})

            def do_PUT(self) -> None:
                data = self._body()
                if self.path.startswith("/upload/"):
                    digest = self.path.split("digest=")[1].replace("%3A", ":")
                    assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
                    reg.blobs[digest] = data
                    return self._send(201)
                ref = self.path.rsplit("/", 1)[1]
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                media = self.headers.get("Content-Type", "")
                reg.manifests[ref] = reg.manifests[digest] = (data, media)
                subject = json.loads(data).get("subject")
                self._send(201, headers={"Docker-Content-Digest": digest,
                                         **({"OCI-Subject": subject["digest"]} if subject else {})})

            def do_GET(self) -> None:
                if "/referrers/" in self.path:
                    reg.referrer_gets += 1
                    subject = self.path.split("/referrers/")[1].split("?")[0]
                    docs = {d: (json.loads(body), len(body), media) for d, (body, media) in reg.manifests.items()
                            if d.startswith("sha256:")}
                    found = [{"mediaType": media, "digest": d, "size": size,
                              "artifactType": doc.get("artifactType", ""),
                              # the spec: a referrer's annotations are in its descriptor
                              **({"annotations": doc["annotations"]} if doc.get("annotations") else {})}
                             for d, (doc, size, media) in docs.items()
                             if (doc.get("subject") or {}).get("digest") == subject]
                    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                             "manifests": found}
                    return self._send(200, json.dumps(index).encode(),
                                      {"Content-Type": "application/vnd.oci.image.index.v1+json"})
                m = re.match(r"/v2/(.+)/(blobs|manifests)/([^/]+)$", self.path)
                if m and m.group(2) == "blobs" and m.group(3) in reg.blobs:
                    return self._send(200, reg.blobs[m.group(3)])
                if m and m.group(2) == "manifests" and m.group(3) in reg.manifests:
                    body, media = reg.manifests[m.group(3)]
                    return self._send(200, body, {"Content-Type": media})
                self._send(404)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
