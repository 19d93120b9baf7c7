"""The browser tests skip where chromium or its driver is missing, except under CI=true, where they fail."""
import pytest
from browser_gate import require_browser


@pytest.fixture
def browser_parts(tmp_path):
    parts = [tmp_path / "chromium", tmp_path / "chromedriver"]
    for part in parts:
        part.touch()
    return parts


def test_present_browser_lets_the_tests_run(browser_parts):
    require_browser(browser_parts, environ={"CI": "true"})
    require_browser(browser_parts, environ={})


@pytest.mark.parametrize("missing", [0, 1], ids=["chromium", "chromedriver"])
def test_a_missing_part_skips_outside_ci(browser_parts, missing):
    browser_parts[missing].unlink()
    with pytest.raises(pytest.skip.Exception, match=browser_parts[missing].name):
        require_browser(browser_parts, environ={"CI": "false"})


@pytest.mark.parametrize("missing", [0, 1], ids=["chromium", "chromedriver"])
def test_a_missing_part_fails_under_ci(browser_parts, missing):
    browser_parts[missing].unlink()
    with pytest.raises(pytest.fail.Exception, match=browser_parts[missing].name):
        require_browser(browser_parts, environ={"CI": "true"})
