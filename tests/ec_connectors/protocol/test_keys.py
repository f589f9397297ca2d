import re

import pytest

from ec_connectors.protocol.keys import MAX_ID_BYTES, InvalidItemId, item_key, safe_key

HOSTILE = [
    "../../etc/passwd", "/etc/passwd", "..", ".", "a/../../b", "x\0y", "\0", "C:\\windows",
    "~root/.ssh", "a" * 10_000, "é" * 3000, "\ud800", " ", "-rf", ".hidden", "a\nb",
]


@pytest.mark.parametrize("item_id", HOSTILE)
def test_hostile_ids_become_safe_filenames(item_id):
    key = item_key(item_id)
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,80}", key), key
    assert key[0].isalnum()  # no leading "." (hidden) or "-" (looks like an option)
    assert "/" not in key and "\0" not in key and ".." not in key


def test_keys_are_deterministic_and_distinct():
    ids = HOSTILE + ["img-1", "img_1", "img 1", "img/1"]
    keys = [item_key(i) for i in ids]
    assert keys == [item_key(i) for i in ids]
    assert len(set(keys)) == len(ids)  # sanitizing collapses names, the digest keeps them apart


def test_readable_prefix_kept_for_plain_ids():
    assert item_key("6cb81974fdf4e37f").startswith("6cb81974fdf4e37f-")


@pytest.mark.parametrize("bad", ["", None, 42, b"bytes", "x" * (MAX_ID_BYTES + 1)])
def test_unusable_ids_are_refused(bad):
    with pytest.raises((InvalidItemId, TypeError)):
        item_key(bad)
    assert safe_key(bad) is None
