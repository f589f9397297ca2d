"""Stand-ins for vLLM's Request and MultiModalFeatureSpec in tests of the connector's
scheduler side (the e2e tests prove the same logic inside vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

NUM_EMBEDS = 16


@dataclass
class Pos:
    offset: int
    length: int

    def get_num_embeds(self) -> int:
        return self.length


@dataclass
class Feature:
    identifier: str
    mm_position: Pos
    modality: str = "image"
    data: object = None  # a dict of processed keys; metadata-only features hold only those


@dataclass
class FakeRequest:
    request_id: str
    mm_features: list[Feature]
    ec_transfer_params: dict | None = None
    embeds: list[int] = field(default_factory=list)

    def get_num_encoder_embeds(self, i: int) -> int:
        return self.embeds[i] if self.embeds else NUM_EMBEDS


def request(req_id: str, *item_ids: str, params: dict | None = None) -> FakeRequest:
    feats = [Feature(i, Pos(4 + 20 * n, NUM_EMBEDS)) for n, i in enumerate(item_ids)]
    return FakeRequest(req_id, feats, params)
