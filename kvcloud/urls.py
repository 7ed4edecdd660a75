"""URL helpers every layer uses: parse a backend URL, and show one without its secrets.

They sit below the configuration and the backends (``config`` → ``stores``/``indexes`` →
``urls``), so a backend never imports the configuration that chooses it.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

from .errors import ConfigError

_SECRET_QUERY_KEYS = {"password", "secret", "token", "aws_secret_access_key", "secret_key", "key"}


def redact_url(url: str) -> str:
    """The URL as given, with a password and secret-looking query values replaced by
    ``***``. Nothing else is rewritten: ``sqlite:////tmp/x.db`` stays an absolute path."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    out = url
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        masked = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
        out = out.replace(parts.netloc, masked, 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode(
                [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs],
                safe="/:",
            )
            head = out.partition("?")[0]
            fragment = f"#{parts.fragment}" if parts.fragment else ""
            out = f"{head}?{query}{fragment}"
    return out


def env_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"expected a boolean, got {value!r}")


def split_url(url: str) -> tuple[str, str, str, dict[str, str]]:
    """(scheme, netloc, path, query options) with a clear error for garbage."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"malformed URL {redact_url(url)!r}: {exc}") from None
    if not parts.scheme:
        raise ConfigError(f"URL {redact_url(url)!r} has no scheme (file://, s3://, redis://, …)")
    return parts.scheme.lower(), parts.netloc, parts.path, dict(parse_qsl(parts.query))
