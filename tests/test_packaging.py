"""Issue 29 #10: the package builds without setuptools warnings and ships the filler texts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_build_has_no_package_warning_and_ships_the_texts(tmp_path):
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "absent from the `packages` configuration" not in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "ctxcache" / "quality" / "corpus" / "prose.txt").is_file()
