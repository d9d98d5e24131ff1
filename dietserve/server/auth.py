"""API keys (``--api-key-file``): read once, checked by each wire's own layer (the gRPC
interceptor in ``status.py``, the HTTP middleware in ``http_server.py``).

Clients send ``Authorization: Bearer KEY`` (HTTP) or ``authorization: Bearer KEY`` metadata
(gRPC). A presented key is compared with every key held, in constant time and without stopping
at a match, so neither timing nor which key matched says anything. Only SHA-256 digests are
kept, of equal length whatever a key's, and no message, repr or log line holds a key.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from ..runtime.errors import Unauthenticated
from .config import ConfigError

AUTHORIZATION = "authorization"  # the HTTP header, and the gRPC metadata key (lower case, as gRPC requires)
SCHEME = "Bearer"
CHALLENGE = {"WWW-Authenticate": SCHEME}  # what an HTTP 401 carries (RFC 6750)


class ApiKeyFileError(ConfigError):
    """The key file cannot be read or holds no usable key; the message never quotes a key."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def read_key_file(path: Path) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ApiKeyFileError(f"--api-key-file {path} cannot be read: {err.__class__.__name__}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(character.isspace() for character in key):
            raise ApiKeyFileError(f"--api-key-file {path}, line {number}: a key may not contain spaces "
                                  "(one key per line)")
        keys.append(key)
    if not keys:
        raise ApiKeyFileError(f"--api-key-file {path} holds no API key: write one key per line (blank lines and "
                              "lines starting with # are ignored)")
    return keys


class ApiKeys:
    """The keys a client may present."""

    def __init__(self, keys: list[str]):
        self._digests = [_digest(key) for key in keys]

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        return cls(read_key_file(path))

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def check(self, authorization: str | None) -> None:
        """Raises :class:`Unauthenticated` unless ``authorization`` (the header's or metadata's
        value) is ``Bearer KEY`` with a key held."""
        if not authorization:
            raise Unauthenticated(f"this server needs an API key: send the header 'Authorization: {SCHEME} KEY'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != SCHEME.lower():
            raise Unauthenticated(f"the authorization header must read '{SCHEME} KEY'")
        presented = _digest(token.strip())
        matched = False
        for digest in self._digests:  # every key, always: the time taken does not depend on which matched
            matched |= hmac.compare_digest(presented, digest)
        if not matched:
            raise Unauthenticated("invalid API key")


def load_api_keys(path: Path | None) -> ApiKeys | None:
    """The server's keys, or None where it needs none (no ``--api-key-file``)."""
    return None if path is None else ApiKeys.from_file(path)
