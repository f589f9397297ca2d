"""Items keep their EPD id as vLLM's name on servers with media or processor settings
(item_ids.py), through vLLM's own hashing (`ProcessorInputs.get_mm_hashes`)."""

from __future__ import annotations

import pytest
from PIL import Image

from ec_connectors.guard.item_ids import keep_item_ids, named_by_uuid
from ec_connectors.protocol.item_ids import IdSigner

parse = pytest.importorskip("vllm.multimodal.parse")
inputs_mod = pytest.importorskip("vllm.multimodal.processing.inputs")


class _Processor:
    """What the renderer calls: vLLM's naming of a request's items (as BaseMultiModalProcessor
    does, and what Qwen3-VL's override adds to)."""

    calls = 0

    def _get_mm_hashes(self, inputs):
        self.calls += 1
        return inputs.get_mm_hashes("model-x", "blake3")


def _inputs(uuids, media_io=None, mm_kwargs=None):
    images = [Image.new("RGB", (8, 8), c) for c in ("red", "green", "blue")]
    items = parse.MultiModalDataParser().parse_mm_data({"image": images})
    return inputs_mod.ProcessorInputs(prompt=[1], mm_data_items=items,
                                      mm_uuid_items={"image": uuids},
                                      media_io_kwargs=media_io or {},
                                      hf_processor_mm_kwargs=mm_kwargs or {})


@pytest.mark.parametrize("settings", [
    {"media_io": {"image": {"some_option": 1}}},
    {"mm_kwargs": {"max_pixels": 4096}},
])
def test_vllm_hashes_uuids_with_settings_and_the_wrapper_keeps_them(settings):
    uuids = ["a" * 64, None, "b" * 64]
    plain = _Processor()._get_mm_hashes(_inputs(uuids, **settings))["image"]
    assert plain[0] != uuids[0] and plain[2] != uuids[2]  # vLLM alone: hashed names
    proc = _Processor()
    assert keep_item_ids(proc, IdSigner(None))
    named = proc._get_mm_hashes(_inputs(uuids, **settings))["image"]
    assert named[0] == uuids[0] and named[2] == uuids[2]
    assert named[1] == plain[1]  # no uuid: vLLM's content hash, as before
    assert keep_item_ids(proc, IdSigner(None)) and proc.calls == 1  # wrapped once


def test_with_a_secret_only_ids_the_gateway_signed_are_kept():
    signer = IdSigner(b"s" * 32)
    signed, foreign = signer.sign("c" * 64), "d" * 64
    settings = {"media_io": {"image": {"some_option": 1}}}
    plain = _Processor()._get_mm_hashes(_inputs([signed, foreign, None], **settings))["image"]
    proc = _Processor()
    keep_item_ids(proc, signer)
    named = proc._get_mm_hashes(_inputs([signed, foreign, None], **settings))["image"]
    assert named == [signed, plain[1], plain[2]]  # a client's own uuid stays hashed


def test_without_settings_vllm_already_uses_the_uuid():
    proc = _Processor()
    keep_item_ids(proc, IdSigner(None))
    assert proc._get_mm_hashes(_inputs(["e" * 64, "f" * 64, "0" * 64]))["image"] == \
        ["e" * 64, "f" * 64, "0" * 64]


def test_named_by_uuid_ignores_what_does_not_line_up():
    hashes = {"image": ["h0", "h1"], "video": ["v0"]}
    out = named_by_uuid(hashes, {"image": ["u0", None, "u2"], "audio": ["x"],
                                 "video": [""]}, lambda _: True)
    assert out == {"image": ["u0", "h1"], "video": ["v0"]}
    assert hashes["image"] == ["h0", "h1"]  # vLLM's own dict is not changed


def test_a_processor_without_the_hook_is_left_alone():
    assert not keep_item_ids(object(), IdSigner(None))
    assert not keep_item_ids(None, IdSigner(None))
