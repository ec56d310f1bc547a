"""A bucket body whose sender goes away mid-stream (a cancelled publish) is a quiet, typed refusal on the
engine side, not an error with a traceback from the server that read it."""

from __future__ import annotations

import asyncio

import pytest

from lorapub.sglang_patch.staging.receivers import fill
from lorapub.wire.refusal import Refused


async def body(*chunks: bytes, then: BaseException | None = None):
    for chunk in chunks:
        yield chunk
    if then is not None:
        raise then


@pytest.mark.parametrize("cut", [ConnectionResetError("Connection lost"), OSError("reset by peer"),
                                 RuntimeError("the server's own disconnect error")])
async def test_a_body_cut_by_its_sender_is_a_typed_refusal(cut):
    view = memoryview(bytearray(8))
    with pytest.raises(Refused) as refused:
        await fill(view, body(b"abc", then=cut), "bucket 3")
    assert refused.value.status == 400 and refused.value.code == "STAGE_INVALID"
    assert "bucket 3 broke off after 3 of 8 bytes: its sender went away" in refused.value.message


async def test_a_cancelled_read_stays_a_cancellation():
    view = memoryview(bytearray(8))
    with pytest.raises(asyncio.CancelledError):
        await fill(view, body(b"abc", then=asyncio.CancelledError()), "bucket 3")


async def test_a_whole_body_fills_its_view_exactly():
    view = memoryview(bytearray(6))
    await fill(view, body(b"abc", b"def"), "bucket 0")
    assert bytes(view) == b"abcdef"
    with pytest.raises(Refused, match="ended after 3 of 6 bytes"):
        await fill(memoryview(bytearray(6)), body(b"abc"), "bucket 0")
