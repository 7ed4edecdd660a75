"""The docs a reader of this repository meets: the README's first screen says what kvcloud is
and how to turn it on in vLLM; no page points at things outside the repository (private
notes, issue numbers, work sessions); every relative link, and every ``#anchor`` into a
Markdown page, leads somewhere; the connector's metrics and settings (with their defaults) are
all documented."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# every page a reader of the repository reads (docs/bench/*.md: the benchmark history and the
# reports the benchmarks write)
PAGES = [README, *sorted(DOCS.glob("**/*.md"))]
# the pages whose relative links are checked
LINKED = [README, *sorted(DOCS.glob("*.md")), *sorted((DOCS / "bench").glob("*.md"))]

# what a reader cannot see: the folder beside the repository, its private notes, issue and
# work-session numbers, which machine was lent to whom
OUTSIDE = re.compile(r"\.\./shared|shared folder|\bissue \d+|\bstop \d+|was lent", re.IGNORECASE)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_names_what_the_reader_cannot_see(page: Path) -> None:
    found = [
        f"{_rel(page)}:{n}: {m.group(0)!r}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in OUTSIDE.finditer(line)
    ]
    assert found == []


def test_the_check_sees_what_it_forbids() -> None:
    for text in (
        "see ../shared/DESIGN.md",
        "DESIGN.md in the shared folder",
        "the bound of Issue 41",
        "measured at stop 48",
        "no GPU was lent",
    ):
        assert OUTSIDE.search(text), text
    for text in ("vLLM issue #49250", "a shared directory", "stop the server", "lentil"):
        assert not OUTSIDE.search(text), text


def test_the_first_screen_of_the_readme_turns_it_on_in_vllm() -> None:
    """What kvcloud is, for a vLLM fleet, and the lines that make it work there."""
    first = "\n".join(README.read_text().splitlines()[:40])
    needed = ("vLLM", "KVCLOUD_STORE", "KVCLOUD_INDEX", "KVCLOUD_SECRET", "kv-transfer-config")
    for word in needed:
        assert word in first, word
    assert '"kv_connector":"KVCloudConnector"' in first.replace(" ", "")


# -- links ----------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def _prose(text: str) -> str:
    """The text outside code blocks and code spans (a link inside code is not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(_prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = _FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set(_HTML_ANCHOR.findall(text))
    for _, heading in _HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def test_slugs_and_links_are_read_as_github_does() -> None:
    assert slug("Paired: routing and `auto` (2026-12-03)") == "paired-routing-and-auto-2026-12-03"
    assert slug("kvcloud's own workers") == "kvclouds-own-workers"
    assert slug("S3 servers without conditional writes (Swift, rclone)") == (
        "s3-servers-without-conditional-writes-swift-rclone"
    )
    text = "see [a](a.md#x), ![img](b.png) and `[c](not-a-link.md)`\n```\n[d](e.md)\n```\n"
    assert links(text) == ["a.md#x", "b.png"]


@pytest.mark.parametrize("page", LINKED, ids=_rel)
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif not dest.resolve().is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert broken == [], f"{_rel(page)}: {broken}"


# -- the connector's metrics ------------------------------------------------------------------


def _connector_metrics() -> dict[str, list[str]]:
    """COUNTERS, HISTOGRAMS and GAUGES of the connector, read from its source (it imports
    vLLM, which this virtualenv does not have)."""
    tree = ast.parse((ROOT / "kvcloud/integrations/vllm/metadata.py").read_text())
    found: dict[str, list[str]] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        name = getattr(target, "id", None)
        if name in ("COUNTERS", "HISTOGRAMS", "GAUGES") and isinstance(node.value, ast.Dict):
            found[name] = [ast.literal_eval(k) for k in node.value.keys]
    return found


def test_every_connector_metric_is_documented_in_operations() -> None:
    metrics = _connector_metrics()
    assert set(metrics) == {"COUNTERS", "HISTOGRAMS", "GAUGES"}
    assert "hit_tokens" in metrics["COUNTERS"]
    text = (DOCS / "OPERATIONS.md").read_text()
    missing = [
        name
        for names in metrics.values()
        for name in names
        if f"`{name}`" not in text and f"vllm:kvcloud_{name}" not in text
    ]
    assert missing == []
    assert "vllm:kvcloud_info" in text


def test_every_connector_setting_is_in_vllm_md_with_its_default() -> None:
    """docs/VLLM.md's settings table: a row per ``kv_connector_extra_config`` key, with the
    variable and the default the connector reads (``kvcloud/integrations/vllm/config.py``)."""
    from dataclasses import MISSING, fields

    from kvcloud.integrations.vllm.config import VLLMConnectorConfig

    text = (DOCS / "VLLM.md").read_text()
    rows = {
        m.group(1): (m.group(2), m.group(3).strip())
        for m in re.finditer(r"^\| `(\w+)` \| `(KVCLOUD_\w+)` \| ([^|]*) \|", text, re.MULTILINE)
    }
    wrong = []
    for f in fields(VLLMConnectorConfig):
        if f.name not in rows:
            wrong.append(f"{f.name}: no row")
            continue
        env, shown = rows[f.name]
        if env != f.metadata["env"]:
            wrong.append(f"{f.name}: {env}, the code reads {f.metadata['env']}")
        default = f.default
        if default is MISSING or default == "":  # computed at start (store, index, digest)
            continue
        if isinstance(default, bool):
            want = f"`{str(default).lower()}`"
        elif isinstance(default, str):
            want = f"`{default}`"
        else:
            want = f"{default:g}"
        if shown != want:
            wrong.append(f"{f.name}: the table says {shown}, the default is {want}")
    assert wrong == []
