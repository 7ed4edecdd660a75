"""The vLLM versions the connector checks at start, and its refusal of vLLM's sleep mode
(vLLM 0.33's connector hooks: ``supports_sleep_mode``, ``release_kv_caches`` /
``unregister_kv_caches``, ``restore_kv_caches``). The connector's own hooks and its check at
start need vLLM: tests/vllm/test_vllm_config_checks.py runs them in vLLM's venv."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvcloud import ConfigError
from kvcloud.integrations.vllm import versions
from kvcloud.integrations.vllm.keys import check_supported
from kvcloud.integrations.vllm.versions import (
    SLEEP_MODE_REASON,
    TESTED_VLLM,
    check_vllm_version,
    parse_minor,
)


@pytest.mark.parametrize(
    ("version", "minor"),
    [
        ("0.32.0", (0, 32)),
        ("0.32.0+cpu", (0, 32)),
        ("0.33.1.dev12+gabcdef", (0, 33)),
        ("v0.34.0rc1", (0, 34)),
        ("1.0", (1, 0)),
        ("", None),
        ("dev", None),
    ],
)
def test_parse_minor(version: str, minor: tuple[int, int] | None) -> None:
    assert parse_minor(version) == minor


def test_tested_versions_pass_silently_others_warn(caplog: pytest.LogCaptureFixture) -> None:
    assert {(0, 32), (0, 33)} <= set(TESTED_VLLM)
    caplog.set_level(logging.DEBUG, logger="vllm.kvcloud")
    logger = logging.getLogger("vllm.kvcloud")
    logger.addHandler(caplog.handler)  # vLLM's logging setup may stop propagation
    try:
        for ok in ("0.32.0", "0.32.3+cpu", "0.33.0", "0.33.2.dev5"):
            assert check_vllm_version(ok) is None
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        for outside in ("0.31.2", "0.34.0rc1", "1.0.0", ""):
            msg = check_vllm_version(outside)
            assert msg is not None and "outside the versions it is tested with" in msg
            assert "0.32.x, 0.33.x" in msg
        # one record per version (seen once or twice: through propagation and the handler)
        warned = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
        assert len(warned) == 4 and any("vLLM 0.34.0rc1 " in m for m in warned)
    finally:
        logger.removeHandler(caplog.handler)


def test_the_installed_vllm_is_checked_when_no_version_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.40.0")
    assert "vLLM 0.40.0" in (check_vllm_version() or "")
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.32.0")
    assert check_vllm_version() is None


def test_sleep_mode_is_refused_at_start() -> None:
    """--enable-sleep-mode: sleep unmaps the KV cache under in-flight restores and a
    wake-up with new weights would push under the old namespace; refused in one line."""
    vc = SimpleNamespace(
        model_config=SimpleNamespace(enable_sleep_mode=True, use_mla=False),
        parallel_config=SimpleNamespace(),
        speculative_config=None,
    )
    groups = SimpleNamespace(kv_cache_groups=[object()])
    with pytest.raises(ConfigError, match=r"does not support vLLM sleep mode") as err:
        check_supported(vc, groups)
    assert str(err.value) == SLEEP_MODE_REASON and "\n" not in SLEEP_MODE_REASON
    vc.model_config.enable_sleep_mode = False
    check_supported(vc, groups)
