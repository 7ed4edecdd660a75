"""API keys -> tenants: who a request acts for.

The tenant decides everything a request can reach: its fingerprint key (derived server-side
from the master secret, so equal prompts of two tenants never share an entry) and its sessions.
A caller therefore never names a tenant; it presents an API key, and the worker looks the
tenant up here. There is deliberately no header, query parameter or body field for it.

Sources (both may be used; a key given twice must name the same tenant):

* a keys file (``--api-keys-file PATH`` or ``KVCLOUD_API_KEYS_FILE``): one ``<key> <tenant>``
  per line, separated by whitespace; blank lines and ``#`` comments are ignored::

      # key                              tenant
      sk-acme-4f9c2a7e1d0b8a6c5e3f      acme
      sk-globex-0a1b2c3d4e5f6a7b8c9d    globex

* ``KVCLOUD_API_KEYS``: ``key1=tenantA,key2=tenantB`` (split at each key's last ``=``, so a
  base64 key with ``=`` padding works).

Keys are 16-256 characters of RFC 6750's token alphabet (``A-Z a-z 0-9 . _ ~ + / = -``);
tenants 1-64 characters of ``A-Z a-z 0-9 . _ -``.

Only SHA-256 digests of the keys are held, and a presented key is compared with every one of
them using ``hmac.compare_digest``: the time taken does not depend on how much of a key
matched or on which key it is. No error message, log record or ``repr`` here contains a key
(errors name the line instead).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{16,256}")
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
KEY_RULE = "16-256 characters of A-Z a-z 0-9 . _ ~ + / = -"
TENANT_RULE = "1-64 characters of A-Z a-z 0-9 . _ -"
# Bigger than any sane keys file; reading a wrong path (a disk image, /dev/zero) must not hang.
MAX_KEYS_FILE_BYTES = 4 * 2**20


class ApiKeyError(ValueError):
    """A keys file or KVCLOUD_API_KEYS value is invalid. The message never holds a key."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The key -> tenant map, holding digests only (see the module docstring)."""

    entries: tuple[tuple[bytes, str], ...] = field(repr=False)
    sources: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_mapping(
        cls, keys: Mapping[str, str], sources: Iterable[str] = (), warnings: Iterable[str] = ()
    ) -> ApiKeys:
        entries = []
        for i, (key, tenant) in enumerate(keys.items(), 1):
            _check(key, tenant, f"key #{i}")
            entries.append((_digest(key), tenant))
        return cls(tuple(entries), tuple(sources), tuple(warnings))

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys, {len(self.tenants)} tenants)"

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(t for _, t in self.entries)

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant of ``key``, or None. Constant time in the key's content and position."""
        presented = _digest(key)
        found = None
        for digest, tenant in self.entries:  # no early exit: every entry costs the same
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found

    def tenant_for_authorization(self, header: str | None) -> str | None:
        """The tenant for an ``Authorization: Bearer <key>`` header value, or None."""
        key = bearer_token(header)
        return None if key is None else self.tenant_for_key(key)


def bearer_token(header: str | None) -> str | None:
    """The credential of ``Bearer <token>`` (scheme case-insensitive, RFC 6750), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _check(key: str, tenant: str, where: str) -> None:
    if not KEY_PATTERN.fullmatch(key):
        raise ApiKeyError(f"{where}: an API key must be {KEY_RULE}")
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ApiKeyError(f"{where}: a tenant must be {TENANT_RULE}")


def _add(keys: dict[str, str], key: str, tenant: str, where: str) -> None:
    _check(key, tenant, where)
    previous = keys.get(key)
    if previous is not None and previous != tenant:
        raise ApiKeyError(f"{where}: this API key is already mapped to another tenant")
    keys[key] = tenant


def parse_keys_file(text: str, source: str, into: dict[str, str] | None = None) -> dict[str, str]:
    """``<key> <tenant>`` lines; ``#`` starts a comment (``#`` is not a key character)."""
    keys = {} if into is None else into
    for lineno, line in enumerate(text.splitlines(), 1):
        fields_ = line.split("#", 1)[0].split()
        if not fields_:
            continue
        where = f"{source} line {lineno}"
        if len(fields_) != 2:
            # the line is not echoed: it may be a key with a typo in it
            raise ApiKeyError(f"{where}: expected '<key> <tenant>', got {len(fields_)} fields")
        _add(keys, fields_[0], fields_[1], where)
    return keys


def parse_keys_env(value: str, into: dict[str, str] | None = None) -> dict[str, str]:
    """``key1=tenantA,key2=tenantB``; empty items are ignored."""
    keys = {} if into is None else into
    for i, item in enumerate(value.split(","), 1):
        item = item.strip()
        if not item:
            continue
        key, sep, tenant = item.rpartition("=")
        where = f"KVCLOUD_API_KEYS item {i}"
        if not sep or not key:
            raise ApiKeyError(f"{where}: expected 'key=tenant'")
        _add(keys, key.strip(), tenant.strip(), where)
    return keys


def _read_keys_file(path: str) -> tuple[str, list[str]]:
    warnings = []
    try:
        # stat before open: opening a FIFO by mistake would block startup forever
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ApiKeyError(f"API keys file {path} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_KEYS_FILE_BYTES + 1)
    except OSError as exc:
        raise ApiKeyError(
            f"cannot read API keys file {path}: {exc.strerror or type(exc).__name__}"
        ) from None
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise ApiKeyError(f"API keys file {path} is larger than {MAX_KEYS_FILE_BYTES} bytes")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        # like ssh with a private key, but a warning: containers often mount secrets 0644
        warnings.append(
            f"API keys file {path} is accessible by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
        )
    try:
        return data.decode("utf-8"), warnings
    except UnicodeDecodeError:
        raise ApiKeyError(f"API keys file {path} is not UTF-8 text") from None


def load_api_keys(file: str | None, env_value: str | None) -> ApiKeys | None:
    """The configured keys, or None when neither source is set (no authentication)."""
    if not file and not (env_value and env_value.strip()):
        return None
    keys: dict[str, str] = {}
    sources: list[str] = []
    warnings: list[str] = []
    if file:
        text, warnings = _read_keys_file(file)
        parse_keys_file(text, f"API keys file {file}", into=keys)
        sources.append(file)
    if env_value and env_value.strip():
        parse_keys_env(env_value, into=keys)
        sources.append("KVCLOUD_API_KEYS")
    if not keys:
        # Configured but empty would otherwise lock every client out (or, worse, be read as
        # "auth off"); either way it is a mistake worth stopping for.
        raise ApiKeyError(f"no API keys found in {' and '.join(sources)}")
    return ApiKeys.from_mapping(keys, sources, warnings)


# -- credentials in third-party debug logs ----------------------------------------------------

# botocore at DEBUG prints every request's headers: the SigV4 Authorization header names the
# access key id and the signature, and a session token travels in its own header.
_CREDENTIAL_PATTERNS = (
    re.compile(r"(Credential=)[^/\s,'\"]+"),
    re.compile(r"(Signature=)[0-9a-fA-F]+"),
    re.compile(r"((?i:x-amz-security-token)['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,}]+"),
)
# the loggers that print request headers, canonical requests or strings to sign
CREDENTIAL_LOGGERS = ("botocore.endpoint", "botocore.auth", "botocore.awsrequest")


class CredentialRedactor(logging.Filter):
    """Masks AWS credentials in log records (``Credential=***``), whatever the level."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True  # a broken record is logging's problem to report, not ours
        redacted = message
        for pattern in _CREDENTIAL_PATTERNS:
            redacted = pattern.sub(r"\1***", redacted)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACTOR = CredentialRedactor()


def redact_credentials_in_logs() -> None:
    """Install the redactor on the loggers that print credentials; idempotent."""
    for name in CREDENTIAL_LOGGERS:
        logging.getLogger(name).addFilter(_REDACTOR)  # addFilter ignores a repeat
