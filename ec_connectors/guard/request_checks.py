"""Bounds a vLLM server checks on a request body before vLLM parses it (`server_guard.py`).

A metadata-only item (`{"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h,
w]}, "uuid": id}`: the embedding comes through the connector) makes vLLM expand its
placeholder into t*h*w / merge^2 tokens while it renders the prompt, before any length check:
`[1, 100000, 100000]` grew an API server to 21 GB until the kernel killed it. Here every
item's token count is computed from its metadata and bounded by `max_model_len` (each item
and the request's sum), grids must be three positive integers, embedding tensors sent in the
request must be dense float tensors of the model's hidden size, and the request may hold at
most `max_items` items; `ec_transfer_params` are checked by the connector's own validation
(`protocol/params.TransferParams.parse`), plus their size and the hosts they name. A violation
raises `Refusal` (400/413 with a machine-readable code) and vLLM never sees the request.

Parts are found the way vLLM finds them (`_parse_chat_message_content_mm_part`: with a `uuid`
or without a `type`, the key present decides the kind), anywhere in the body but in the
fields that hold no content parts (tools, response formats, transfer params).
"""

from __future__ import annotations

import binascii
import io
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pybase64

from ec_connectors.protocol.keys import InvalidItemId, item_key
from ec_connectors.protocol.params import BadParams, TransferParams
from ec_connectors.protocol.refusals import Refusal

KiB = 1 << 10
_EMBEDS = {"image_embeds": "image", "video_embeds": "video", "audio_embeds": "audio"}
# keys that make a dict a multimodal content part for vLLM, whatever its `type`
_PART_KEYS = frozenset({"image_url", "image_pil", "image_embeds", "audio_embeds",
                        "video_embeds", "prompt_embeds", "audio_url", "input_audio",
                        "video_url", "input_image"})
_MEDIA_KINDS = _PART_KEYS - {"prompt_embeds"}
# top-level fields that hold no content parts: not searched for parts
_NOT_CONTENT = frozenset({"tools", "tool_choice", "response_format", "structured_outputs",
                          "ec_transfer_params", "kv_transfer_params", "features",
                          "logit_bias", "mm_processor_kwargs", "media_io_kwargs",
                          "chat_template_kwargs", "sampling_params", "vllm_xargs"})
_MAX_DEPTH = 64
_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32"})
_NPY_MAGIC = b"\x93NUMPY"


def _bad(message: str, code: str = "invalid_request", status: int = 400) -> Refusal:
    return Refusal(status, code, message)


@dataclass(frozen=True)
class ModelBounds:
    """The limits a served model and its server put on requests.

    What a served model admits: its context, modalities, embedding fields per modality
    (vLLM's `embedding_fields`: field -> "metadata" | "values"), embedding width and spatial
    merge size; and the server's limits on items and transfer params."""

    max_model_len: int
    modalities: frozenset[str]
    fields: Mapping[str, Mapping[str, str]]
    hidden_size: int | None
    merge_size: int = 1
    max_items: int = 64
    max_params_bytes: int = 256 * KiB
    producers: tuple[str, ...] = ()  # where params may say items live (empty: anywhere)

    @property
    def max_item_bytes(self) -> int:
        """The largest embedding an item may be, in bytes.

        The largest embedding an item may be: every token of the context, float32, with
        room for multi-level features (deepstack)."""
        return self.max_model_len * (self.hidden_size or 8192) * 4 * 4

    @classmethod
    def from_vllm(cls, model_config: Any, info: Any = None, *, max_items: int = 64,
                  max_params_bytes: int = 256 * KiB, producers: tuple[str, ...] = ()
                  ) -> ModelBounds:
        """Build the bounds from vLLM's model config and processing info.

        From vLLM's ModelConfig and the model's processing info (the renderer's
        `mm_processor.info`; made here when not given)."""
        if info is None and model_config.is_multimodal_model:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            info = MULTIMODAL_REGISTRY.create_processor(model_config).info
        parser = info.data_parser if info is not None else None
        modalities = frozenset(info.get_supported_mm_limits()) if info is not None else frozenset()
        hidden = getattr(parser, "expected_hidden_size", None)
        if hidden is None:
            hidden = model_config.get_inputs_embeds_size()
        return cls(max_model_len=int(model_config.max_model_len), modalities=modalities,
                   fields={m: dict(f) for m, f in
                           (getattr(type(parser), "embedding_fields", None) or {}).items()},
                   hidden_size=hidden,
                   merge_size=int(getattr(parser, "_spatial_merge_size", None) or 1),
                   max_items=max_items, max_params_bytes=max_params_bytes,
                   producers=tuple(producers))


@dataclass
class Checked:
    """What the guard learned of an accepted request.

    What the guard learned of an accepted request: the item ids it names (for the reason
    of an engine-side failure) and whether any item is metadata-only."""

    item_ids: list[str] = field(default_factory=list)
    metadata_only: bool = False
    items: int = 0
    tokens: int = 0


def check_request(body: Any, bounds: ModelBounds) -> Checked:
    """Raise Refusal unless `body` (a parsed JSON request) is within `bounds`."""
    out = Checked()
    if not isinstance(body, dict):
        return out  # not a request vLLM reads parts from: its own validation answers
    _check_params(body.get("ec_transfer_params"), bounds, out)
    features = body.get("features")  # /inference/v1/generate: items rendered elsewhere
    if isinstance(features, dict) and isinstance(features.get("mm_hashes"), dict):
        for hashes in features["mm_hashes"].values():
            _count(out, len(hashes) if isinstance(hashes, list) else 1, bounds)
    token_ids = body.get("token_ids")
    if isinstance(token_ids, list) and len(token_ids) > bounds.max_model_len:
        raise _bad(f"token_ids holds {len(token_ids)} tokens; this model's context is "
                   f"{bounds.max_model_len}", "context_length_exceeded")
    stack: list[tuple[Any, int]] = [(v, 1) for k, v in body.items() if k not in _NOT_CONTENT]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise _bad(f"the request is nested deeper than {_MAX_DEPTH} levels")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, dict):
            ptype = node.get("type")
            if not _PART_KEYS.isdisjoint(node) or isinstance(ptype, str) and ptype.endswith(
                    "_embeds"):
                _check_part(node, bounds, out)
            stack.extend((v, depth + 1) for k, v in node.items() if k not in _PART_KEYS)
    return out


def _count(out: Checked, n: int, bounds: ModelBounds) -> None:
    out.items += n
    if out.items > bounds.max_items:
        raise _bad(f"more than {bounds.max_items} multimodal items in one request",
                   "too_many_items")


def _part_kind(part: dict[str, Any]) -> tuple[str, Any]:
    """(kind, content) of a content part, as vLLM's chat parser sees it."""
    from vllm.renderers.chat_utils import _parse_chat_message_content_mm_part

    try:
        return _parse_chat_message_content_mm_part(part)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - whatever vLLM would have failed on
        raise _bad(f"bad content part: {exc}", "bad_content_part") from None


def _check_part(part: dict[str, Any], bounds: ModelBounds, out: Checked) -> None:
    kind, content = _part_kind(part)
    ptype = part.get("type")
    if isinstance(ptype, str) and ptype.endswith("_embeds") and ptype not in _EMBEDS \
            and ptype != "prompt_embeds":
        raise _bad(f"unknown content part type {ptype[:40]!r}", "bad_content_part")
    if kind not in _MEDIA_KINDS:
        return
    _count(out, 1, bounds)
    uuid = part.get("uuid")
    if uuid is not None:
        if not isinstance(uuid, str):
            raise _bad("uuid must be a string", "bad_uuid")
        try:
            item_key(uuid)
        except InvalidItemId as exc:
            raise _bad(f"bad uuid: {exc}", "bad_uuid") from None
        out.item_ids.append(uuid)
    modality = _EMBEDS.get(kind)
    if modality is None:
        return
    if modality not in bounds.modalities:
        raise _bad(f"this model takes no {modality} input", "unsupported_modality")
    if content is None:
        if uuid is None:
            raise _bad(f"a {kind} part without data needs its uuid", "missing_uuid")
        return  # vLLM's processor cache holds it, or vLLM refuses it
    if isinstance(content, str):
        shape = _tensor_shape(content, kind, bounds)
        _embeds_shape(shape, None, kind, bounds)
        _add_tokens(out, shape[0], bounds)
        return
    if not isinstance(content, dict):
        raise _bad(f"{kind} must be a base64 tensor or an object of fields", "bad_embeds")
    _check_fields(content, modality, kind, uuid, bounds, out)


def _check_fields(content: dict[str, Any], modality: str, kind: str, uuid: Any,
                  bounds: ModelBounds, out: Checked) -> None:
    fields = bounds.fields.get(modality)
    if not fields:
        raise _bad(f"this model takes {kind} only as one base64 tensor, not as fields",
                   "bad_embeds")
    unknown = set(content) - set(fields)
    if unknown:
        raise _bad(f"{kind} has unknown fields {sorted(map(str, unknown))[:4]}; this model "
                   f"takes {sorted(fields)}", "bad_embeds")
    metadata = [f for f, role in fields.items() if role == "metadata"]
    missing = [f for f in metadata if f not in content]
    if missing:
        raise _bad(f"{kind} needs {missing}", "bad_embeds")
    tokens = 0
    for name in metadata:
        tokens += _metadata_tokens(name, content[name], kind, bounds)
    values = [f for f, role in fields.items() if role == "values" and f in content]
    for name in values:
        if not isinstance(content[name], str):
            raise _bad(f"{kind}.{name} must be a base64 tensor", "bad_embeds")
        shape = _tensor_shape(content[name], f"{kind}.{name}", bounds)
        if name == kind:
            _embeds_shape(shape, tokens, kind, bounds)
    if not values:
        if not isinstance(uuid, str):
            raise _bad(f"a metadata-only {kind} part needs the uuid of its embedding",
                       "missing_uuid")
        out.metadata_only = True
    _add_tokens(out, tokens, bounds)


def _add_tokens(out: Checked, tokens: int, bounds: ModelBounds) -> None:
    out.tokens += tokens
    if out.tokens > bounds.max_model_len:
        raise _bad(f"the request's multimodal items take {out.tokens} tokens; this model's "
                   f"context is {bounds.max_model_len}", "context_length_exceeded")


def _positive_int(value: Any, what: str, code: str = "bad_metadata") -> int:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"{what} must be a positive integer", code)
    return value


def _metadata_tokens(name: str, value: Any, kind: str, bounds: ModelBounds) -> int:
    """The placeholder tokens one metadata field implies (vLLM's own arithmetic)."""
    what, limit = f"{kind}.{name}", bounds.max_model_len
    if name.endswith("_grid_thw"):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
            value = value[0]  # one row of a batch
        if not isinstance(value, list) or len(value) != 3:
            raise _bad(f"{what} must be three positive integers [t, h, w]", "bad_grid")
        t, h, w = (_positive_int(v, f"{what} entries", "bad_grid") for v in value)
        m = bounds.merge_size
        if h % m or w % m:
            raise _bad(f"{what}: h and w must be multiples of the spatial merge size {m}",
                       "bad_grid")
        tokens = t * h * w // (m * m)
    elif name == "audio_num_tokens":
        tokens = _positive_int(value, what)
    elif name == "audio_feature_lengths":  # mel frames -> tokens (Qwen2-Audio's encoder)
        if not isinstance(value, list):  # vLLM's renderer takes it as a tensor: a bare
            raise _bad(f"{what} must be a list of one positive integer [frames]",  # number
                       "bad_metadata")  # failed the API server's render with a bare 500
        frames = _positive_int(value, what)
        tokens = (((frames - 1) // 2 + 1) - 2) // 2 + 1 if frames <= 8 * limit else limit + 1
        if tokens < 1:
            raise _bad(f"{what}: {frames} frames make no audio token", "bad_metadata")
    elif name == "timestamps":  # Qwen3-VL video: seconds of each temporal patch (as text)
        values = value if isinstance(value, list) else [value]
        if not 1 <= len(values) <= limit or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1e6
                for v in values):
            raise _bad(f"{what} must be 1 to {limit} numbers of seconds", "bad_metadata")
        tokens = len(values)  # at least one text token each
    else:
        raise _bad(f"{what}: this server cannot bound that field", "bad_metadata")
    if tokens > limit:
        raise _bad(f"{what} {value} makes {tokens} tokens; this model's context is "
                   f"{limit}", "context_length_exceeded")
    return tokens


def _embeds_shape(shape: tuple[int, ...], tokens: int | None, kind: str,
                  bounds: ModelBounds) -> None:
    if len(shape) != 2 or shape[0] < 1:
        raise _bad(f"{kind} must be a 2-D tensor (tokens, hidden), got shape {list(shape)}",
                   "bad_embeds")
    if bounds.hidden_size is not None and shape[1] != bounds.hidden_size:
        raise _bad(f"{kind} has width {shape[1]}; this model's embeddings are "
                   f"{bounds.hidden_size} wide", "bad_embeds")
    if shape[0] > bounds.max_model_len:
        raise _bad(f"{kind} holds {shape[0]} tokens; this model's context is "
                   f"{bounds.max_model_len}", "context_length_exceeded")
    if tokens is not None and shape[0] != tokens:
        raise _bad(f"{kind} holds {shape[0]} tokens; its metadata says {tokens}",
                   "bad_embeds")


def _tensor_shape(data: str, what: str, bounds: ModelBounds) -> tuple[int, ...]:
    """Read and check the shape of a base64 tensor without loading it.

    Shape of a base64 tensor (numpy .npy or torch.save), checked to be a dense float
    tensor no larger than an item may be, without loading anything else."""
    limit = bounds.max_item_bytes + 64 * KiB
    if len(data) > limit * 4 // 3 + 8:
        raise _bad(f"{what} is larger than {limit} bytes", "embedding_too_large", 413)
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{what}: malformed base64", "bad_embeds") from None
    if raw[:6] == _NPY_MAGIC:
        return _npy_shape(raw, what)
    return _torch_shape(raw, what)


def _npy_shape(raw: bytes, what: str) -> tuple[int, ...]:
    import numpy as np
    from numpy.lib import format as npf

    buf = io.BytesIO(raw)
    try:
        version = npf.read_magic(buf)
        header = {(1, 0): npf.read_array_header_1_0, (2, 0): npf.read_array_header_2_0}[version]
        shape, _fortran, dtype = header(buf)
    except Exception as exc:  # noqa: BLE001 - any malformed header
        raise _bad(f"{what}: not a valid .npy tensor ({exc})", "bad_embeds") from None
    if dtype.kind != "f" or dtype.name not in _FLOAT_DTYPES or not dtype.isnative:
        raise _bad(f"{what} has dtype {dtype}; expected float16 or float32", "bad_embeds")
    if len(raw) - buf.tell() != int(np.prod(shape, dtype=object)) * dtype.itemsize:
        raise _bad(f"{what}: its data does not match shape {list(shape)}", "bad_embeds")
    return tuple(int(d) for d in shape)


def _torch_shape(raw: bytes, what: str) -> tuple[int, ...]:
    import torch

    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise _bad(f"{what}: not a torch.save or .npy tensor", "bad_embeds") from None
    # stored records only, together no larger than the payload: loading cannot inflate
    if len(infos) > 64 or any(i.compress_type != zipfile.ZIP_STORED for i in infos) or \
            sum(i.file_size for i in infos) > len(raw):
        raise _bad(f"{what}: compressed or inconsistent tensor archive", "bad_embeds")
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - anything torch refuses
        raise _bad(f"{what}: cannot load the tensor ({type(exc).__name__})",
                   "bad_embeds") from None
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise _bad(f"{what} must be one dense tensor", "bad_embeds")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _FLOAT_DTYPES:
        raise _bad(f"{what} has dtype {dtype}; expected one of {sorted(_FLOAT_DTYPES)}",
                   "bad_embeds")
    if tensor.numel() * tensor.element_size() > len(raw):
        raise _bad(f"{what}: its shape claims more data than it holds", "bad_embeds")
    return tuple(tensor.shape)


def _check_params(params: Any, bounds: ModelBounds, out: Checked) -> None:
    """`ec_transfer_params`: the connector's own validation, then sizes and hosts."""
    if params is None:
        return
    size = len(msgspec.json.encode(params))
    if size > bounds.max_params_bytes:
        raise _bad(f"ec_transfer_params is {size} bytes; the limit is "
                   f"{bounds.max_params_bytes}", "bad_ec_transfer_params", 413)
    try:
        sources = TransferParams.parse(params).sources()
    except BadParams as exc:
        raise _bad(f"ec_transfer_params: {exc}", "bad_ec_transfer_params") from None
    if len(sources) > bounds.max_items:
        raise _bad(f"ec_transfer_params names {len(sources)} items; the limit is "
                   f"{bounds.max_items}", "too_many_items")
    for item_id, source in sources.items():
        if source.nbytes > bounds.max_item_bytes:
            raise _bad(f"ec_transfer_params: item {item_id[:64]!r} claims {source.nbytes} "
                       f"bytes; an item of this model is at most {bounds.max_item_bytes}",
                       "bad_ec_transfer_params")
        host = source.location.rpartition(":")[0]
        if source.location and (host in ("0.0.0.0", "::", "[::]") or bounds.producers
                                and source.location not in bounds.producers):
            raise _bad(f"ec_transfer_params: item {item_id[:64]!r} names "
                       f"{source.location[:80]!r}, which is not a producer of this "
                       "deployment", "bad_ec_transfer_params")
    out.item_ids.extend(sources)
