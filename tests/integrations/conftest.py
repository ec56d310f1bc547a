"""Fail a test that leaves asyncio work behind.

asyncio reports a task destroyed while pending ("Task was destroyed but it is pending!"), an
unclosed aiohttp session and the like through its logger at ERROR when the object is
collected, not as a warning, so a warnings filter would not see them: each test's teardown
collects garbage and fails on any such record. That covers event loops of the code under test
(a publication's own thread); on the test's loop pytest-asyncio cancels leftover tasks
silently, so a fixture also fails a test that ends with tasks still pending there.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

_LOGGER = logging.getLogger("asyncio")
_RECORDS = pytest.StashKey["_Records"]()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_RECORDS] = records = _Records()
    _LOGGER.addHandler(records)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # A hook, not a fixture: the check must come after every fixture (and the event loop) is gone.
    records = item.stash[_RECORDS]
    try:
        result = yield
    finally:
        # pytest drops the test's fixture values only after this hook; they would keep a leak alive.
        item.funcargs.clear()
        gc.collect()  # asyncio reports a pending task only when it is collected
        _LOGGER.removeHandler(records)
    if records.messages:
        pytest.fail("asyncio reported work left behind:\n" + "\n".join(records.messages), pytrace=False)
    return result


@pytest.fixture(autouse=True)
async def _no_task_left_pending():
    yield  # autouse: torn down after the test's own fixtures, before its loop closes
    left = [repr(t) for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if left:
        pytest.fail("tasks still pending at the end of the test:\n" + "\n".join(left), pytrace=False)
