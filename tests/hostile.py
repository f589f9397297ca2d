"""Hostile metadata-only requests and transfer params (hypothesis strategies), shared by the
guard's fast-lane tests (tests/ec_connectors/guard/test_server_guard.py, the guard in-process) and
the slow lane (tests/e2e/test_qwen_modalities.py, a real prefill/decode server).

Every generated body breaks at least one bound of `ec_connectors/guard/request_checks.py` for the
tiny Qwen2.5-Omni thinker (context 1024 tokens, spatial merge 2, embeddings 128 wide, at most
64 items, params at most 256 KiB), so each must be refused with a 4xx and a reason."""

from __future__ import annotations

import base64
import io
import zipfile
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

MAX_MODEL_LEN, MERGE, HIDDEN, MAX_ITEMS = 1024, 2, 128, 64
HUGE_GRID = [1, 100000, 100000]  # a grid that once grew a server out of memory: 2.5e9 tokens


def body(model: str, parts: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "temperature": 0.0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
            **extra}


def meta_part(modality: str, metadata: Any, uuid: Any = "item-x", kind: str | None = None
              ) -> dict[str, Any]:
    kind = kind or f"{modality}_embeds"
    part = {"type": kind, kind: metadata}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def grid_part(grid: Any, modality: str = "image", uuid: Any = "item-x") -> dict[str, Any]:
    return meta_part(modality, {f"{modality}_grid_thw": grid}, uuid)


def _npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def _torch(tensor: torch.Tensor, compress: bool = False) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    raw = buf.getvalue()
    if compress:  # the same archive with deflated records: could inflate on load
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(raw)) as src, \
                zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info))
        raw = out.getvalue()
    return base64.b64encode(raw).decode()


def _sparse_huge() -> str:
    """One non-zero in a (2^20, 2^20) sparse tensor: 4 TiB once densified."""
    t = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (1 << 20, 1 << 20),
                                check_invariants=True)
    return _torch(t)


def _bad_tensors() -> st.SearchStrategy[str]:
    ok_rows = st.integers(1, 16)
    return st.one_of(
        ok_rows.map(lambda n: _npy(np.zeros((n, HIDDEN), np.int32))),  # wrong dtype
        ok_rows.map(lambda n: _npy(np.zeros((n, HIDDEN), np.float64))),
        st.sampled_from([HIDDEN - 1, HIDDEN + 1, 2 * HIDDEN, 1]).map(
            lambda h: _npy(np.zeros((4, h), np.float32))),  # wrong width
        st.just(_npy(np.zeros((2, 3, HIDDEN), np.float32))),  # wrong rank
        st.just(_npy(np.zeros((HIDDEN,), np.float16))),
        st.just(_npy(np.zeros((MAX_MODEL_LEN + 1, HIDDEN), np.float16))),  # too many tokens
        ok_rows.map(lambda n: _torch(torch.zeros(n, HIDDEN, dtype=torch.int64))),
        ok_rows.map(lambda n: _torch(torch.zeros(n, HIDDEN + 3))),
        ok_rows.map(lambda n: _torch(torch.zeros(n, HIDDEN), compress=True)),
        st.just(_sparse_huge()),
        st.just("%%% not base64 %%%"),
        st.binary(min_size=1, max_size=64).map(lambda b: base64.b64encode(b).decode()),
    )


# never an integer, nor a one-element list of one (the guard reads [n] as n)
_not_int = st.one_of(st.floats(allow_nan=True), st.text(max_size=4), st.booleans(),
                     st.none(), st.just([]), st.lists(st.integers(), min_size=2, max_size=3))


def _hostile_grid() -> st.SearchStrategy[Any]:
    pos = st.integers(1, 64).map(lambda n: 2 * n)
    return st.one_of(
        st.just(HUGE_GRID),
        st.tuples(st.integers(1, 10**6), st.integers(1000, 10**9).map(lambda n: 2 * n),
                  st.integers(1000, 10**9).map(lambda n: 2 * n)).map(list),  # too many tokens
        st.tuples(st.integers(-(10**9), 0), pos, pos).map(list),  # zero / negative
        st.tuples(st.just(1), st.integers(-(10**9), 0), pos).map(list),
        st.tuples(st.just(1), pos, st.integers(0, 10**6).map(lambda n: 2 * n + 1)).map(list),
        st.tuples(st.just(1), pos, _not_int).map(list),  # not an integer
        st.lists(pos, max_size=2),  # wrong length
        st.lists(pos, min_size=4, max_size=8),
        st.lists(st.lists(pos, min_size=3, max_size=3), min_size=2, max_size=3),
        _not_int.filter(lambda v: not isinstance(v, list)),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )


def _params_junk() -> st.SearchStrategy[Any]:
    ids = st.text(min_size=1, max_size=12)
    return st.one_of(
        st.sampled_from([[], "epd", 7, True]),
        st.sampled_from([{"epd": []}, {"epd": "x"}, {"epd": {"items": 5}},
                         {"epd": {"items": [""]}}, {"epd": {"items": [3]}},
                         {"epd": {"items": {"a": 5}}}, {"epd": {"items": {"a": {"nbytes": -1}}}},
                         {"epd": {"items": {"a": {"nbytes": 1.5}}}},
                         {"epd": {"items": {"a": {"pending": "yes"}}}}]),
        st.sampled_from(["0.0.0.0:5000", "bad host:1", "x:0", "x:70000", "no-port",
                         "::1", "[::]:80"]).map(
            lambda loc: {"epd": {"items": {"a": {"location": loc}}}}),
        st.sampled_from(["0.0.0.0:5000", "h:99999", "h:"]).map(
            lambda loc: {"epd": {"items": ["a"], "endpoint": loc}}),
        st.integers(1 << 40, 1 << 62).map(lambda n: {"epd": {"items": {"a": {"nbytes": n}}}}),
        st.integers(MAX_MODEL_LEN * HIDDEN * 16 + 1, (1 << 40) - 1).map(
            lambda n: {"epd": {"items": {"a": {"nbytes": n}}}}),  # larger than any item
        st.lists(ids, min_size=MAX_ITEMS + 1, max_size=MAX_ITEMS + 40, unique=True).map(
            lambda v: {"epd": {"items": v}}),  # too many items
        st.integers(300, 1000).map(  # over 256 KiB
            lambda n: {"epd": {"items": {f"{i:04d}" + "x" * 1000: {} for i in range(n)}}}),
        st.just({"epd": {"items": ["x" * (65 * 1024)]}}),  # an id over MAX_ID_BYTES
    )


def _nested(depth: int) -> Any:
    node: Any = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 8]},
                 "uuid": "deep"}
    for _ in range(depth):
        node = [node]
    return node


@st.composite
def hostile_request(draw: Any, model: str, producers: tuple[str, ...] = ()) -> dict[str, Any]:
    """One request body that breaks at least one bound. `producers`: where the server lets
    params say items live (a location elsewhere is refused only when there is a list)."""
    modality = draw(st.sampled_from(["image", "video"]))
    ok = grid_part([1, 8, 8], modality, "ok-item")
    case = draw(st.sampled_from(
        ["grid", "audio", "modality", "items", "total", "params", "tensor", "uuid",
         "fields", "junk", "nested", "token_ids"] + (["producer"] if producers else [])))
    if case == "grid":
        return body(model, [ok, grid_part(draw(_hostile_grid()), modality)])
    if case == "audio":  # Qwen2.5-Omni: mel frames, ~4 per token
        frames = draw(st.one_of(st.integers(8 * MAX_MODEL_LEN, 1 << 62),
                                st.integers(-(10**6), 2), _not_int,
                                st.integers(1, 100),  # a bare number: vLLM wants [n]
                                st.lists(st.integers(1, 100), min_size=2, max_size=3)))
        return body(model, [meta_part("audio", {"audio_feature_lengths": frames})])
    if case == "modality":
        kind = draw(st.sampled_from(["pointcloud_embeds", "foo_embeds", "Image_embeds",
                                     "_embeds", "imageembeds_embeds"]))
        return body(model, [{"type": kind, kind: {"image_grid_thw": [1, 8, 8]},
                             "uuid": "u"}])
    if case == "items":
        n = draw(st.integers(MAX_ITEMS + 1, MAX_ITEMS + 60))
        return body(model, [grid_part([1, 2, 2], "image", f"i{k}") for k in range(n)])
    if case == "total":  # each item fits, together they do not
        per = draw(st.sampled_from([(1, 32, 32), (2, 16, 32), (1, 64, 20), (3, 14, 14)]))
        tokens = per[0] * per[1] * per[2] // 4
        n = MAX_MODEL_LEN // tokens + 1
        return body(model, [grid_part(list(per), "image", f"t{k}") for k in range(n)])
    if case == "params":
        return body(model, [ok], ec_transfer_params=draw(_params_junk()))
    if case == "producer":
        loc = draw(st.sampled_from(["10.9.9.9:1234", "evil.example:17000", "127.0.0.1:1"])
                   .filter(lambda v: v not in producers))
        return body(model, [ok], ec_transfer_params={"epd": {"items": {"ok-item": {
            "location": loc}}}})
    if case == "tensor":
        data = draw(_bad_tensors())
        if draw(st.booleans()):
            return body(model, [{"type": "image_embeds", "image_embeds": data}])
        return body(model, [meta_part("image", {"image_grid_thw": [1, 8, 8],
                                                "image_embeds": data})])
    if case == "uuid":
        return body(model, [grid_part([1, 8, 8], modality, uuid=draw(
            st.sampled_from([None, 5, "", ["a"], {"a": 1}, "x" * (65 * 1024)])))])
    if case == "fields":
        other = "video" if modality == "image" else "image"
        extra = draw(st.sampled_from([{"evil": 1}, {"pixel_values": "AAAA"},
                                      {f"{other}_grid_thw": [1, 8, 8]}, {}]))
        meta = {**extra} if not extra else {f"{modality}_grid_thw": [1, 8, 8], **extra}
        return body(model, [meta_part(modality, meta)])
    if case == "junk":
        content = draw(st.sampled_from([
            [1, 2, 3], "AAAA", {"image_grid_thw": {"a": 1}}, {"image_grid_thw": "1,8,8"},
            {"image_grid_thw": [[[1, 8, 8]]]}, True]))
        return body(model, [{"type": "image_embeds", "image_embeds": content, "uuid": "j"}])
    if case == "nested":
        return body(model, [_nested(draw(st.integers(65, 200)))])
    return {"model": model, "token_ids": [1] * draw(st.integers(MAX_MODEL_LEN + 1, 5000)),
            "sampling_params": {"max_tokens": 1}}
