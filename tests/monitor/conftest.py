"""The monitor tests run on one torch thread (the tiny target and drafts: tests/tiny_drafts.py)."""

import pytest

from tests.tiny_drafts import single_thread


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield
