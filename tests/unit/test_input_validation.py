"""Bad input is refused at the door with INVALID_INPUT, naming what is wrong, before anything is sent."""

from __future__ import annotations

import pytest

from lorapub.core.identity import SessionKey, VersionKey, check_digest, check_id, lora_name_for
from lorapub.errors import InvalidInput

DIGEST = "ab" * 32


@pytest.mark.parametrize("bad", ["v1\n", "v1\r\n", "\nv1", "v 1", "a/b", "../x", "", "x" * 129, "v1\x00", "é"])
def test_ids_with_newlines_separators_or_other_characters_are_refused(bad):
    with pytest.raises(InvalidInput) as e:
        VersionKey(1, bad)
    assert e.value.code == "INVALID_INPUT" and "version_id" in e.value.message
    with pytest.raises(InvalidInput, match="session_id"):
        SessionKey(1, bad, "n0")
    with pytest.raises(InvalidInput, match="nonce"):
        SessionKey(1, "s0", bad)
    with pytest.raises(InvalidInput):
        check_id("engine name", bad)


def test_a_trailing_newline_never_reaches_a_lora_name():
    with pytest.raises(InvalidInput):
        lora_name_for(VersionKey(1, "v1\n"), DIGEST)
    assert lora_name_for(VersionKey(1, "v1"), DIGEST) == "relax_policy_lora@1-v1-abababababab"


@pytest.mark.parametrize("bad", [DIGEST + "\n", DIGEST.upper(), DIGEST[:-1], None, 7])
def test_digests_must_be_exactly_64_lowercase_hex(bad):
    with pytest.raises(InvalidInput, match="digest"):
        check_digest(bad)
    assert check_digest(DIGEST) == DIGEST
