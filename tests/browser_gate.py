"""Whether the browser tests can run here: they need Debian's chromium and chromium-driver.

A missing browser fails the browser tests, with the command that installs it, on every machine:
a skip would let a green run hide that the dashboard was never driven in a browser. `.ci/run`
installs both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install chromium chromium-driver"


def require_browser(paths: Iterable[Path] = (CHROMIUM, CHROMEDRIVER)) -> None:
    """Return when every path exists; else fail the calling test, saying how to install what is missing."""
    missing = [str(path) for path in paths if not path.exists()]
    if missing:
        pytest.fail(f"the browser tests need Debian's chromium and chromium-driver; missing: {', '.join(missing)} "
                    f"(install them: {INSTALL})", pytrace=False)
