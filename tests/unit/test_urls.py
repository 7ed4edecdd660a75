"""URL helpers: a URL is shown exactly as given, minus its secrets."""

from __future__ import annotations

import pytest

from kvcloud.errors import ConfigError
from kvcloud.urls import env_bool, redact_url, split_url


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////tmp/x.db",  # absolute: four slashes, kept
        "sqlite://relative/x.db",
        "file:///var/lib/kvcloud/objects",
        "s3://bucket/prefix?endpoint_url=http://minio:9000&region=us-east-1",
        "redis://redis:6379/0",
        "redis+cluster://a:7000,b:7001/0",
        "s3://b/p?region=x#frag",
    ],
)
def test_urls_without_secrets_are_shown_unchanged(url: str) -> None:
    assert redact_url(url) == url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:hunter2@h/0", "redis://user:***@h/0"),
        ("rediss://hunter2@h", "rediss://***@h"),
        (
            "s3://b/p?endpoint_url=http://x:9000&secret_key=hunter2&region=us",
            "s3://b/p?endpoint_url=http://x:9000&secret_key=%2A%2A%2A&region=us",
        ),
        ("s3://b?token=hunter2#f", "s3://b?token=%2A%2A%2A#f"),
        ("sqlite:////tmp/x.db?password=hunter2", "sqlite:////tmp/x.db?password=%2A%2A%2A"),
    ],
)
def test_secrets_are_masked_and_nothing_else_changes(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in redact_url(url)


def test_split_url_and_env_bool() -> None:
    assert split_url("S3://b/p?region=x") == ("s3", "b", "/p", {"region": "x"})
    with pytest.raises(ConfigError, match="no scheme"):
        split_url("/just/a/path")
    assert env_bool(" Yes ") is True and env_bool("off") is False
    with pytest.raises(ConfigError):
        env_bool("maybe")
