"""Whether the browser tests can run here.

Without Debian's chromium and chromium-driver they skip on a developer's machine, but under CI=true
they fail: `.ci/run` installs both, so a missing one there is a broken install, and a skip would let
a green CI hide that the dashboard was never driven in a browser.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def running_in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("CI", "").strip().lower() == "true"


def require_browser(paths: Iterable[Path] = (CHROMIUM, CHROMEDRIVER),
                    environ: Mapping[str, str] = os.environ) -> None:
    """Return when every path exists; else skip the calling test, or fail it under CI=true."""
    missing = [str(path) for path in paths if not path.exists()]
    if not missing:
        return
    message = f"needs Debian's chromium and chromium-driver; missing: {', '.join(missing)}"
    if running_in_ci(environ):
        pytest.fail(f"{message} (CI=true: the browser tests must run; .ci/run installs both)", pytrace=False)
    pytest.skip(message)
