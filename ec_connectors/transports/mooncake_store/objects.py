"""The format of one item in the Mooncake Store: key, header and payload.

The format of one item in the Mooncake Store: key `epd/<namespace>/<dtype>/<item key>`, and an
object made of a fixed-size header (magic, namespace, key, dtype, shape, size, xxh3 of the
payload, the deployment secret's seal) followed by the raw tensor bytes, so a reader can tell a
foreign, stale or damaged object from the item it asked for."""

from __future__ import annotations

import struct

import msgspec

from ec_connectors.protocol.keys import item_key, namespace_key

MAGIC = b"EPDSTOR1"
HEADER_BYTES = 512  # fixed: the payload starts aligned, right after it
_PREFIX = struct.Struct("<8sI")


class StoreHeader(msgspec.Struct, frozen=True):
    namespace: str  # namespace_key of the model namespace
    key: str  # item_key of the item id
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    mac: str = ""  # the deployment secret's seal (protocol/seal.py); "" without one


_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(StoreHeader).decode


def pack_header(header: StoreHeader) -> bytes:
    body = _encode_header(header)
    if _PREFIX.size + len(body) > HEADER_BYTES:
        raise ValueError("store header too large")
    return (_PREFIX.pack(MAGIC, len(body)) + body).ljust(HEADER_BYTES, b"\0")


def unpack_header(raw: bytes | memoryview) -> StoreHeader:
    magic, n = _PREFIX.unpack_from(raw, 0)
    if magic != MAGIC or _PREFIX.size + n > HEADER_BYTES:
        raise ValueError("not an EPD store object")
    return _decode_header(bytes(raw[_PREFIX.size:_PREFIX.size + n]))


def store_key(namespace: str, dtype: str, item_id: str) -> str:
    return f"epd/{namespace_key(namespace)}/{namespace_key(dtype)}/{item_key(item_id)}"


