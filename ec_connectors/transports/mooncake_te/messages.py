"""Wire types the Mooncake TE data paths add to the peer side channel (msgspec, never pickle).

The engine path's connection-opening claim (`Register`) and the socket path's data
connection ticket (`StreamOpen`); the pulls, answers and announcements are the core's
(peer_pull/messages.py). `decode_peer` decodes everything a `mooncake` side channel carries."""

from __future__ import annotations

import msgspec

from ec_connectors.transports.peer_pull.messages import PullFailed, side_channel_decoder


class StreamOpen(msgspec.Struct, tag=True):
    """A consumer's ticket for one data connection to a producer's stream port.

    consumer -> producer (te_data_path socket): `ticket` opens one data connection to the
    producer's stream port, presented there within a few seconds (mooncake_te/stream.py).
    The side channel is the only way a ticket travels, so with a deployment secret only
    holders of it (CURVE) get a connection served."""

    ticket: bytes


class Register(msgspec.Struct, tag=True):
    """A consumer's claim of the memory range pulls may be written into.

    consumer -> producer, on every (re)connection of the side channel: "write my pulls only
    into [base, base + length) of transfer engine session `session`". The proof that the
    session is the sender's own: `nonce` sits at `proof_addr` in that session's registered
    memory, which the producer reads through the engine before it accepts the range (the
    channel is encrypted, so nobody else knows the nonce). Pulls on a connection are written
    only into a range it registered this way."""

    session: str
    base: int
    length: int
    proof_addr: int
    nonce: bytes


MESSAGES: tuple[type, ...] = (Register, StreamOpen)
decode_peer = side_channel_decoder(MESSAGES)


def writes_nothing(pull_id: int, endpoint: str, who: str) -> PullFailed:
    """The answer to a pull the engine would have to write where `who` runs no engine."""
    return PullFailed(pull_id=pull_id, code="unregistered", error=f"{endpoint} writes "
                      f"nothing: {who} runs no transfer engine (te_data_path socket); set "
                      "te_data_path alike everywhere")
