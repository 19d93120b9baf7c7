"""The browser tests fail, never skip, where chromium or its driver is missing."""
import pytest
from browser_gate import INSTALL, require_browser


@pytest.fixture
def browser_parts(tmp_path):
    parts = [tmp_path / "chromium", tmp_path / "chromedriver"]
    for part in parts:
        part.touch()
    return parts


def test_present_browser_lets_the_tests_run(browser_parts):
    require_browser(browser_parts)


@pytest.mark.parametrize("missing", [0, 1], ids=["chromium", "chromedriver"])
def test_a_missing_part_fails_and_says_how_to_install_it(browser_parts, missing):
    browser_parts[missing].unlink()
    with pytest.raises(pytest.fail.Exception, match=browser_parts[missing].name) as failed:
        require_browser(browser_parts)
    assert INSTALL in str(failed.value)
