"""The order `pytest -n` hands out the test files in (tests/conftest.py, `pytest_collection_modifyitems`)."""

from tests.conftest import LONGEST_FILES, ROOT


def test_the_longest_files_named_for_the_schedule_exist():
    """A file renamed or removed would silently drop out of the longest-first order."""
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    assert [path for path in LONGEST_FILES if not (ROOT / path).is_file()] == []
