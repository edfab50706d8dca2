"""Ed25519 keys and signatures of pushed artifacts (docs/trust.md).

The crypto is the ``cryptography`` package's (no hand-written crypto);
this module decides only the formats and how a key file is trusted:

* a private key is a PKCS#8 PEM file (unencrypted: the daemon reads it
  unattended at each push) of mode 0600 owned by the user that reads it,
  opened ``O_NOFOLLOW | O_NONBLOCK`` (a planted link or FIFO is refused,
  never followed or waited on) and read only up to :data:`MAX_KEY_FILE_BYTES`;
* a public key is an OpenSSH line (``ssh-ed25519 AAAA… comment``), what
  ``[remote] trusted_keys`` lists and ``hwr keys show`` prints;
* a key's id is its OpenSSH fingerprint, ``SHA256:<base64>``, the one
  ``ssh-keygen -l -f`` prints for the same line;
* what is signed is a small canonical JSON document, the signature
  payload, naming the OCI manifest digest and the identity key
  (:func:`payload`): the digest pins every byte of the artifact (config and
  layers are content-addressed), and the explicit type keeps a signature
  made for anything else from verifying as one of ours.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import json
import os
import stat
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hwr_client.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument

#: The largest private key file read (an Ed25519 PKCS#8 PEM is 119 bytes).
MAX_KEY_FILE_BYTES = 16 * 1024
#: The signature payload's ``type``.
PAYLOAD_TYPE = "org.hwr.signature.v1"
_SSH_TYPE = "ssh-ed25519"


@dataclasses.dataclass(frozen=True)
class PublicKey:
    """A public key with its id (``SHA256:…`` fingerprint) and OpenSSH line."""

    id: str
    line: str
    key: Ed25519PublicKey

    def verify(self, signature: bytes, data: bytes) -> bool:
        try:
            self.key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def public_of(key: Ed25519PublicKey, comment: str = "") -> PublicKey:
    """The :class:`PublicKey` of ``key``; ``comment`` ends its OpenSSH line."""
    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode("ascii")
    blob = base64.b64decode(line.split()[1])
    fingerprint = base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")
    return PublicKey(f"SHA256:{fingerprint}", f"{line} {comment}".strip(), key)


def parse_public_key(text: str, *, what: str) -> PublicKey:
    """An ``ssh-ed25519 AAAA… [comment]`` line.

    Raises:
        InvalidArgument: not an Ed25519 OpenSSH public key, naming ``what``.
    """
    parts = text.strip().split(None, 2)
    if len(parts) < 2 or parts[0] != _SSH_TYPE:
        raise InvalidArgument(f"{what}: expected an OpenSSH Ed25519 public key line ('{_SSH_TYPE} AAAA…', as "
                              f"`hwr keys show` prints), got {text[:40]!r}")
    try:
        key = serialization.load_ssh_public_key(f"{parts[0]} {parts[1]}".encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise InvalidArgument(f"{what}: not a valid {_SSH_TYPE} key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidArgument(f"{what}: not an Ed25519 key")
    return public_of(key, parts[2] if len(parts) > 2 else "")


def parse_trusted_keys(lines: Iterable[str]) -> dict[str, PublicKey]:
    """``[remote] trusted_keys`` by key id.

    Raises:
        InvalidArgument: an entry that is not a key (naming its position).
    """
    keys = [parse_public_key(line, what=f"config: [remote] trusted_keys[{i}]") for i, line in enumerate(lines)]
    return {k.id: k for k in keys}


def load_private_key(path: str, *, what: str = "signing key") -> Ed25519PrivateKey:
    """Reads a private key file, trusting it only as the module docstring says.

    Raises:
        FailedPrecondition: missing, a link, not a regular file, another
            user's, readable by group or others, too large, or not an
            unencrypted Ed25519 PKCS#8 PEM; each names the path and the fix.
    """
    what = f"{what} {path}"
    try:
        # O_NOFOLLOW: a link is ELOOP, never followed. O_NONBLOCK: a FIFO
        # does not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FailedPrecondition(f"{what}: no such file; create it with `hwr keys generate {path}`") from None
    except OSError as exc:
        why = "is a symbolic link; expected the key file itself" if exc.errno == errno.ELOOP else exc.strerror
        raise FailedPrecondition(f"{what}: {why}") from None
    try:
        st = os.fstat(fd)
        _check_key_file(st, what)
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise FailedPrecondition(f"{what}: grew past {MAX_KEY_FILE_BYTES} bytes while being read")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise FailedPrecondition(f"{what}: not an unencrypted PKCS#8 PEM private key ({exc}); "
                                 f"create one with `hwr keys generate`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise FailedPrecondition(f"{what}: a {type(key).__name__}, expected an Ed25519 key")
    return key


def _check_key_file(st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FailedPrecondition(f"{what}: {stat.filemode(st.st_mode)}, expected a regular file")
    if st.st_uid != os.geteuid():
        raise FailedPrecondition(f"{what}: owned by uid {st.st_uid}, expected uid {os.geteuid()} (the user that "
                                 "signs); chown it")
    if st.st_mode & 0o077:
        raise FailedPrecondition(f"{what}: mode {stat.S_IMODE(st.st_mode):04o} lets others read or change it; "
                                 f"expected 0600 (`chmod 600`)")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise FailedPrecondition(f"{what}: {st.st_size} bytes, over the {MAX_KEY_FILE_BYTES}-byte limit of a key")


def generate_key() -> Ed25519PrivateKey:
    """A new Ed25519 private key (the operating system's randomness)."""
    return Ed25519PrivateKey.generate()


def write_private_key(path: str, key: Ed25519PrivateKey) -> None:
    """Writes a new key file, mode 0600, never over an existing file or link
    (``O_EXCL``), fsynced with its directory (a key that a crash loses after
    its public half was handed out would leave artifacts nobody can re-sign).

    Raises:
        AlreadyExists: something is at ``path``.
        FailedPrecondition: it cannot be written.
    """
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise AlreadyExists(f"key file {path}: exists; `hwr keys rotate {path}` replaces a key") from None
    except OSError as exc:
        raise FailedPrecondition(f"key file {path}: cannot create it ({exc.strerror})") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def payload(manifest_digest: str, key: str, signed_unix: int) -> bytes:
    """The bytes that are signed for an artifact (canonical JSON)."""
    doc = {"type": PAYLOAD_TYPE, "manifest_digest": manifest_digest, "key": key, "signed_unix": signed_unix}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def check_payload(data: bytes, *, manifest_digest: str, key: str) -> str:
    """Why a signature payload does not vouch for ``manifest_digest`` of
    ``key``; "" when it does."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return "its payload is not JSON"
    if not isinstance(doc, dict) or doc.get("type") != PAYLOAD_TYPE:
        return f"its payload is not of type {PAYLOAD_TYPE}"
    if doc.get("manifest_digest") != manifest_digest or doc.get("key") != key:
        return "it signs another manifest"
    return ""


__all__ = ["MAX_KEY_FILE_BYTES", "PAYLOAD_TYPE", "PublicKey", "check_payload", "generate_key", "load_private_key",
           "parse_public_key", "parse_trusted_keys", "payload", "public_of", "write_private_key"]
