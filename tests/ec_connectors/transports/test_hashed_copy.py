"""The peer transports' checksum: one value however the bytes are copied or arrive."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ec_connectors.transports.hashed_copy import (
    PEER_CHUNK,
    PeerChecksum,
    copy_with_peer_checksum,
    peer_checksum,
)
from ec_connectors.transports.memory import MemoryPool
from ec_connectors.transports.peer_pull.puller import StreamVerifier


@pytest.mark.parametrize("n", [0, 1, PEER_CHUNK, 3 * PEER_CHUNK + 12345])
def test_copied_hashed_and_streamed_checksums_agree(n):
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    view = memoryview(src.numpy()).cast("B")
    whole = peer_checksum(view)
    dst = torch.zeros(max(n, 1), dtype=torch.uint8)
    with ThreadPoolExecutor(1) as pool:
        copied = copy_with_peer_checksum(dst.data_ptr(), memoryview(dst.numpy())[:n],
                                         src.data_ptr(), n, pool, 2) if n else whole
        assert peer_checksum(view, pool, 2) == whole
    assert copied == whole and torch.equal(dst[:n], src)
    # a pool block larger than the item, filled in uneven steps, as a pull's chunks land
    pool_ = MemoryPool(n + 3 * PEER_CHUNK, "cpu")
    try:
        buf = pool_.try_allocate(n + 2 * PEER_CHUNK)
        buf.as_bytes()[:n] = view
        verifier = StreamVerifier(buf)
        for upto in range(0, n, 700_001):
            verifier.advance(upto)
        verifier.advance(n, n)
        assert verifier.hexdigest() == whole
        with ThreadPoolExecutor(1) as pool:  # all in one piece (one NIXL read), two threads
            at_once = StreamVerifier(buf, pool, 2)
            at_once.advance(n, n)
            assert at_once.hexdigest() == whole
        buf.release()
    finally:
        pool_.close()
    pieces = PeerChecksum()
    with ThreadPoolExecutor(1) as pool:
        pieces.add(view[:PEER_CHUNK * (n // PEER_CHUNK)], pool, 2)
        pieces.add(view[PEER_CHUNK * (n // PEER_CHUNK):])
    assert pieces.hexdigest() == whole


def test_a_changed_byte_or_a_moved_chunk_changes_the_checksum():
    src = torch.randint(0, 256, (2 * PEER_CHUNK,), dtype=torch.uint8)
    whole = peer_checksum(memoryview(src.numpy()))
    flipped = src.clone()
    flipped[PEER_CHUNK + 5] ^= 1
    swapped = torch.cat([src[PEER_CHUNK:], src[:PEER_CHUNK]])
    assert peer_checksum(memoryview(flipped.numpy())) != whole
    assert peer_checksum(memoryview(swapped.numpy())) != whole
