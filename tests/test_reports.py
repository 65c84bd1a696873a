"""Offline reports: `dvc plots show` writes a page that renders with no network (vega inlined, no CDN)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, Project

# Made by make test and make repro (docs/plots_template.mjs) where node and npm are installed.
TEMPLATE = PROJECT_ROOT / ".dvc" / "plots_offline.html"
pytestmark = pytest.mark.skipif(
    not TEMPLATE.is_file() and not (shutil.which("node") and shutil.which("npm")),
    reason="no node and npm here to build .dvc/plots_offline.html (make test builds it where they are installed)",
)


def test_template_is_built_and_named_in_dvc_config():
    assert TEMPLATE.is_file(), "run `make test` or `make repro`: they write .dvc/plots_offline.html with npm"
    assert "html_template = plots_offline.html" in (PROJECT_ROOT / ".dvc" / "config").read_text()
    page = TEMPLATE.read_text(encoding="utf8")
    assert "{plot_divs}" in page and "{scripts}" not in page


def test_dvc_plots_show_page_is_offline(tmp_path: Path):
    project = Project(tmp_path / "p")
    history = project.path / "metrics" / "pretrain" / "plots" / "metrics" / "train_loss.tsv"
    history.parent.mkdir(parents=True)
    history.write_text("step\ttrain_loss\n0\t2.30125\n1\t1.70625\n2\t0.98765\n")

    project.run("dvc", "plots", "show", "--out", "dvc_plots")
    page = (project.path / "dvc_plots" / "index.html").read_text(encoding="utf8")

    script_tags = re.findall(r"<script\b[^>]*>", page, flags=re.IGNORECASE)
    assert script_tags, "no script at all"
    assert not [tag for tag in script_tags if "src" in tag], script_tags
    assert not re.search(r"https?://[^\s\"'<>]*cdn", page, flags=re.IGNORECASE)
    assert "{scripts}" not in page and "{plot_divs}" not in page
    for package, global_name in (("vega", ".vega={}"), ("vega-lite", ".vegaLite={}"), ("vega-embed", ".vegaEmbed=")):
        assert f"/* {package}@" in page, f"{package} not inlined"
        assert global_name in page, f"{package}'s UMD global {global_name!r} missing"
    assert "vegaEmbed(" in page  # DVC's plot div calls it
    assert "train_loss" in page
    for value in ("2.30125", "1.70625", "0.98765"):
        assert value in page, f"the plot's data point {value} is missing"
