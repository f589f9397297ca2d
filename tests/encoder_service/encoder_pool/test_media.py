"""The pool's media decode equals vLLM's on the same bytes (pure numpy, no model, no server):
what the pool hands the multimodal processor is what a vLLM server's chat front end hands it
(`MediaConnector.fetch_*`), for seeded frame lists and mp4s (2-9 frames, sizes, fps), audio
(8-48 kHz, mono/stereo, wav/flac/ogg/mp3) and images; and after vLLM's data parser (audio
resampled to 16 kHz mono) too. The embeddings themselves: tests/e2e/test_connector_safetensors.py
and test_qwen_modalities.py."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.parse import MultiModalDataParser

from encoder_service.encoder_pool.media import (
    BadMedia,
    decode_audio,
    decode_image,
    decode_video,
)
from encoder_service.local.requests import (
    data_url,
    sample_audio,
    sample_frames,
    sample_image_png,
    sample_mp4,
    video_part,
)

BIG = 1 << 30
QWEN_VIDEO = "Qwen2VLVideoProcessor"  # the Qwen2.5 family's: vLLM picks its loader by it


def video_cases(seed: int):
    rng = random.Random(seed)
    sizes = [(128, 96), (112, 112), (80, 120), (64, 48), (140, 84)]
    for n in range(2, 10):
        w, h = rng.choice(sizes)
        yield f"list-{n}f-{w}x{h}", video_part(sample_frames(n, n, width=w, height=h))
        fps = rng.choice([1, 2, 4, 10, 24])
        yield f"mp4-{n}f-{w}x{h}-{fps}fps", video_part(sample_mp4(n, n, w, h, fps))


@pytest.mark.parametrize("processor", [QWEN_VIDEO, None])
def test_videos_decode_as_vllm_decodes_them(processor):
    for name, part in video_cases(7):
        url = part["video_url"]["url"]
        ours = decode_video(name, url, BIG, BIG, processor).media
        theirs = MediaConnector().fetch_video(url, video_processor=processor)
        (f1, m1), (f2, m2) = ours.media, theirs.media
        assert f1.dtype == f2.dtype == np.uint8 and np.array_equal(f1, f2), name
        assert m1 == m2, name


def test_a_frame_list_keeps_the_frames_vllm_keeps_and_checks_each_frames_pixels():
    url = video_part(sample_frames(3, 40, size=32))["video_url"]["url"]
    frames, meta = decode_video("long", url, BIG, BIG).media.media
    vllm_frames, _ = MediaConnector().fetch_video(url).media
    assert len(frames) == len(vllm_frames) == 32 and meta["total_num_frames"] == 32
    with pytest.raises(BadMedia, match="pixels"):
        decode_video("big", video_part(sample_frames(3, 2, size=64))["video_url"]["url"],
                     BIG, 63 * 64)
    mixed = video_part(sample_frames(3, 1, size=32) + sample_frames(4, 1, size=48))
    with pytest.raises(BadMedia, match="cannot decode video"):
        decode_video("mixed", mixed["video_url"]["url"], BIG, BIG)


@pytest.mark.parametrize("num_frames", [40, -1])
def test_server_media_io_kwargs_keep_the_frames_vllm_keeps_with_them(num_frames):
    """A server given --media-io-kwargs keeps other frames than 32: the pool, given the
    same, keeps the same ones (-1: every frame), each frame's pixels checked."""
    kwargs = {"video": {"num_frames": num_frames}}
    url = video_part(sample_frames(5, 48, size=32))["video_url"]["url"]
    frames, meta = decode_video("long", url, BIG, BIG, None, kwargs).media.media
    theirs, their_meta = MediaConnector(media_io_kwargs=kwargs).fetch_video(url).media
    assert len(frames) == len(theirs) == (48 if num_frames < 0 else num_frames)
    assert np.array_equal(frames, theirs) and meta == their_meta
    with pytest.raises(BadMedia, match="pixels"):  # the 40th frame is checked too
        decode_video("big", video_part(sample_frames(3, 39, size=32) + sample_frames(
            4, 1, size=64))["video_url"]["url"], BIG, 32 * 32, None, kwargs)


AUDIO = [(8000, 1, "WAV"), (8000, 2, "OGG"), (16000, 1, "FLAC"), (16000, 2, "MP3"),
         (22050, 1, "OGG"), (22050, 2, "WAV"), (44100, 1, "MP3"), (44100, 2, "FLAC"),
         (48000, 1, "WAV"), (48000, 2, "OGG")]


@pytest.mark.parametrize(("rate", "channels", "fmt"), AUDIO)
def test_audio_decodes_and_resamples_as_vllm(rate, channels, fmt):
    raw = sample_audio(rate % 97, 1.3, rate, channels, fmt)
    samples, sr = decode_audio("a", raw).media
    vllm_samples, vllm_sr = MediaConnector().fetch_audio(
        f"data:audio/{fmt.lower()};base64," + base64.b64encode(raw).decode())
    assert sr == vllm_sr and samples.ndim == 1
    assert np.array_equal(samples, vllm_samples)
    # what the model's processor gets: vLLM's parser resamples to 16 kHz and mixes to mono
    parser = MultiModalDataParser(target_sr=16000, target_channels=1)
    ours = parser.parse_mm_data({"audio": [(samples, sr)]})["audio"].get(0)
    theirs = parser.parse_mm_data({"audio": [(vllm_samples, vllm_sr)]})["audio"].get(0)
    assert np.array_equal(ours, theirs)
    assert abs(len(ours) - 1.3 * 16000) <= 1200  # resampled (mp3 pads its frames)


def test_images_decode_as_vllm_decodes_them():
    for side in (29, 140, 333):
        png = sample_image_png(side, side)
        ours = decode_image("i", png, BIG).media
        theirs = MediaConnector().fetch_image(data_url(png))
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
