"""Make vLLM name each item by the EPD item id it was sent with.

An item's name in vLLM is the EPD item id it was sent with (the part's `uuid`), also on a
server with media or processor settings.

vLLM names a multimodal item (`MultiModalFeatureSpec.identifier`: the key of its encoder
cache, and what an EC connector stores and loads) by the request's `uuid` only when the
request has no hash factors. A server started with `--media-io-kwargs` (e.g. video
`num_frames`, needed for clips over 32 frames) or `--mm-processor-kwargs` (e.g. `max_pixels`),
or a request carrying either, gets `hash(model, uuid, settings)` instead: a name the gateway,
the encoder pool and the other servers cannot know. Measured before this module: with
`media_io_kwargs` set, every video lost metadata-only (the gateway found none of the names it
sent in the producer's answer) and a deployment secret would have kept producers from sharing
anything (the hashed names carry no signature).

vLLM hashes the settings in so that one uuid sent with two settings cannot share a cache
entry. EPD ids already cover them: the gateway derives an item's id from its bytes and the
request's `media_io_kwargs` and `mm_processor_kwargs` (docs/routing.md), and every server of
a deployment runs with the same server settings. So on an EPD server the `uuid` is kept as
the identifier: with a deployment secret only ids the gateway signed (`IdSigner.vouched`;
any other uuid gets vLLM's name, as before), without one every uuid (the gateway is the only
client then, docs/trust.md).

`keep_item_ids` wraps one processor instance (the API server's renderer's: the only place
vLLM names items), from the server guard; nothing else in the process changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ec_connectors.log import get_logger
from ec_connectors.protocol.item_ids import IdSigner

logger = get_logger(__name__)

_WRAPPED = "_epd_keeps_item_ids"


def named_by_uuid(hashes: Mapping[str, Sequence[str]],
                  uuids: Mapping[str, Sequence[str | None]] | None,
                  keep: Callable[[str], bool]) -> dict[str, list[str]]:
    """vLLM's item names, with kept uuids in place of its hashes.

    vLLM's item names (`hashes`, per modality, in item order) with each item whose
    `uuids` entry is given and kept by `keep` named by that uuid instead."""
    out = {modality: list(names) for modality, names in hashes.items()}
    for modality, given in (uuids or {}).items():
        names = out.get(modality)
        if names is None:
            continue
        for i, uuid in enumerate(given):
            if i < len(names) and isinstance(uuid, str) and uuid and keep(uuid):
                names[i] = uuid
    return out


def keep_item_ids(processor: Any, signer: IdSigner) -> bool:
    """Make a vLLM processor name items by their uuid; False when it cannot.

    Make `processor` (a vLLM `BaseMultiModalProcessor`) name items by their uuid as the
    module doc says. Idempotent; False when the processor has no `_get_mm_hashes` (another
    vLLM version: items keep vLLM's names, and this is logged once)."""
    if processor is None:
        return False
    if getattr(processor, _WRAPPED, False):
        return True
    original = getattr(processor, "_get_mm_hashes", None)
    if original is None:
        logger.warning("EPD: this vLLM's multimodal processor has no _get_mm_hashes; items "
                       "sent with media or processor settings keep vLLM's hashed names "
                       "(no metadata-only, no sharing for them)")
        return False
    keep = signer.vouched  # without a secret every id is vouched for

    def get_mm_hashes(inputs: Any) -> dict[str, list[str]]:
        return named_by_uuid(original(inputs), getattr(inputs, "mm_uuid_items", None), keep)

    processor._get_mm_hashes = get_mm_hashes  # this instance only
    setattr(processor, _WRAPPED, True)
    return True
