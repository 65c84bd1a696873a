"""The package's import rules (pyproject.toml's [tool.importlinter] contracts): no import circles, and each layer
imports only the layers below it, checked by import-linter over the whole package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_keeps_its_import_contracts():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "4 kept, 0 broken" in result.stdout, result.stdout[-2000:]
