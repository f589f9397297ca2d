"""What an item's placeholder needs besides its embedding, per model (vLLM's
`embedding_fields`: `image_grid_thw`, `video_grid_thw`, `audio_num_tokens`, ...).

A producer publishes it beside each item in `ec_transfer_params`, so a consumer can take a
metadata-only part (`{"type": "image_embeds", "image_embeds": {...}, "uuid": id}`) and skip
decoding and preprocessing the media. A consumer asks `metadata_only(feature)`: such an item
has no pixels, so vLLM cannot encode it locally; the connector must deliver it or fail the
request (vLLM's model runner would otherwise die on a missing embedding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec


class Placeholders:
    """SCHEDULER role: placeholder metadata of a model's items (vLLM's own resolver)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self._resolver = PlaceholderMetadataResolver(model_config)

    def describe(self, features: list[MultiModalFeatureSpec]) -> dict[str, dict[str, Any]]:
        """Producer: item id -> its placeholder metadata, for items whose metadata is
        complete (an item without it, e.g. a model with no `embedding_fields`, is left out:
        the consumer then gets its raw media)."""
        out: dict[str, dict[str, Any]] = {}
        for item_id, entry in collect_ec_item_metadata(features, self._resolver).items():
            modality = features[entry["item_indices"][0]].modality
            wanted = self._resolver.fields_for(modality)
            metadata = entry.get("metadata") or {}
            if wanted and wanted <= set(metadata):
                out[item_id] = metadata
        return out

    def metadata_only(self, feature: MultiModalFeatureSpec) -> bool:
        """Consumer: the request carried only this item's metadata (no media to encode)."""
        data = feature.data
        if data is None:  # processor-cache hit: the engine filled it before scheduling
            return False
        wanted = self._resolver.fields_for(feature.modality)
        return bool(wanted) and set(data.keys()) <= wanted
