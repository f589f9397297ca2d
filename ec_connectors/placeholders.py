"""The placeholder metadata an item needs besides its embedding, per model.

What an item's placeholder needs besides its embedding, per model (vLLM's
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

# Processed fields that change an item's positions or placeholders but that vLLM's
# metadata-only parsers do not carry (not in `embedding_fields`), with the value a consumer
# assumes when they are absent. Qwen2.5-VL's `second_per_grid_ts` is 1.0 only for 2 fps
# video (a JPEG frame list gets 2.0): sent metadata-only, such a video's M-RoPE time axis
# would be wrong. An item whose value differs is not described, so the consumer gets its raw
# media (the embedding still comes from the encoder) and computes the field itself.
_DROPPED_BY_METADATA_ONLY: dict[str, float | bool] = {
    "second_per_grid_ts": 1.0,
    "use_audio_in_video": False,  # Qwen2.5-Omni: interleaves the audio's placeholders
}


class Placeholders:
    """SCHEDULER role: placeholder metadata of a model's items (vLLM's own resolver)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self._resolver = PlaceholderMetadataResolver(model_config)

    def describe(self, features: list[MultiModalFeatureSpec]) -> dict[str, dict[str, Any]]:
        """Producer: the placeholder metadata of each item that has it complete.

        Producer: item id -> its placeholder metadata, for items whose metadata is
        complete (an item without it, e.g. a model with no `embedding_fields`, is left out:
        the consumer then gets its raw media)."""
        out: dict[str, dict[str, Any]] = {}
        for item_id, entry in collect_ec_item_metadata(features, self._resolver).items():
            modality = features[entry["item_indices"][0]].modality
            wanted = self._resolver.fields_for(modality)
            metadata = entry.get("metadata") or {}
            if wanted and wanted <= set(metadata) and not _loses_fields(
                    features[i].data for i in entry["item_indices"]):
                out[item_id] = metadata
        return out

    def metadata_only(self, feature: MultiModalFeatureSpec) -> bool:
        """Consumer: the request carried only this item's metadata (no media to encode).

        Fields the processor adds to every item of a modality (Qwen2.5-Omni's
        `use_audio_in_video` on each video) are no media: without this, a metadata-only video
        whose embedding could not be used was sent to vLLM's encoder, which, with no frames,
        killed the engine."""
        data = feature.data
        if data is None:  # processor-cache hit: the engine filled it before scheduling
            return False
        wanted = self._resolver.fields_for(feature.modality)
        return bool(wanted) and set(data.keys()) - _DROPPED_BY_METADATA_ONLY.keys() <= wanted

    def asked(self, feature: MultiModalFeatureSpec) -> dict[str, Any]:
        """Consumer: the placeholder metadata a request's part gives an item.

        Consumer: the placeholder metadata the request's part gives the item, as its
        producer would publish it (`describe`), to compare with what was published."""
        entry = collect_ec_item_metadata([feature], self._resolver).get(feature.identifier)
        return dict(entry.get("metadata") or {}) if entry else {}


def _loses_fields(datas) -> bool:
    """Whether any item data would lose a field on the metadata-only path.

    True when any item data carries a `_DROPPED_BY_METADATA_ONLY` field at a value other
    than the one a metadata-only consumer would assume."""
    for data in datas:
        if not data:
            continue
        for key, default in _DROPPED_BY_METADATA_ONLY.items():
            field = data.get(key)
            if field is None:
                continue
            value = getattr(field, "data", field)
            try:
                value = value.tolist() if hasattr(value, "tolist") else value
            except (TypeError, ValueError):
                return True
            values = value if isinstance(value, list) else [value]
            if any(v != default for v in values):
                return True
    return False
