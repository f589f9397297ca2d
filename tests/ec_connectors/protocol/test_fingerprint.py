"""The model fingerprint: content of the weights and config, not paths; and what it keeps
apart (a model under another's served name, in a shared directory or producer)."""

import json
import shutil
import time

import torch
from safetensors.torch import save_file

from ec_connectors.config import EPDConfig
from ec_connectors.protocol.fingerprint import model_fingerprint
from ec_connectors.protocol.seal import Seal
from ec_connectors.transports.safetensors_fs import SafetensorsTransport


def make_model(path, seed: int = 0, hidden: int = 8):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(256, 512, generator=g)}, str(path / "model.safetensors"))
    return path


def test_the_fingerprint_follows_content_not_paths(tmp_path):
    a = make_model(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(a, copy)
    assert model_fingerprint(a) == model_fingerprint(copy)
    assert model_fingerprint(make_model(tmp_path / "retrained", seed=1)) != model_fingerprint(a)
    assert model_fingerprint(make_model(tmp_path / "wider", hidden=16)) != model_fingerprint(a)
    # one weight value changed in the middle of the file
    tweaked = tmp_path / "tweaked"
    shutil.copytree(a, tweaked)
    raw = bytearray((tweaked / "model.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (tweaked / "model.safetensors").write_bytes(bytes(raw))
    assert model_fingerprint(tweaked) != model_fingerprint(a)
    # not a directory (a hub id): named by the id and its config
    assert model_fingerprint("org/model", "{}") != model_fingerprint("org/model", '{"a": 1}')


def test_the_scope_is_the_namespace_and_the_fingerprint():
    assert EPDConfig.from_dict({"namespace": "m"}).scope == "m"
    assert EPDConfig.from_dict({"namespace": "m", "model_fingerprint": "ab12"}).scope == "m#ab12"
    assert EPDConfig.from_dict({}).scope == "default"


def test_a_shared_directory_never_mixes_two_models_under_one_name(tmp_path):
    for seal in (Seal(None), Seal(b"a-deployment-secret-of-some-length")):
        root = tmp_path / str(seal.active)
        a = SafetensorsTransport(root, "served-name", 1 << 30, seal=seal, model="aaaa")
        b = SafetensorsTransport(root, "served-name", 1 << 30, seal=seal, model="bbbb")
        a.put("same-id", torch.ones(3))
        assert b.get("same-id", time.monotonic()) is None and b.events.corrupt == 1
        assert torch.equal(a.get("same-id", time.monotonic()), torch.ones(3))
