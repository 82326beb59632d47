"""The documentation builds (strict: nav complete, no broken links/anchors) and the README starts right."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (extra [docs])")
def test_docs_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "operations" / "index.html").is_file()


def _first_fenced_block(text: str) -> list[str]:
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    assert match, "README.md has no fenced code block"
    return match.group(1).splitlines()


def test_docs_readme_starts_with_the_two_newcomer_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line.split("#", 1)[0].strip() for line in _first_fenced_block(text)]
    assert [line for line in lines if line] == ["make demo", "make test"]
    # ... and that block comes first: nothing but the title before it.
    before = text.split("```", 1)[0]
    assert [line for line in before.splitlines() if line.strip()] == ["# securetrain"]


def test_docs_every_nav_page_exists() -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return []

    missing = [p for p in pages(nav) if not (ROOT / "docs" / p).is_file()]
    assert not missing, f"nav entries without a page: {missing}"
