"""Build tiny test models locally: random weights, a locally trained tokenizer, no downloads.
LLaVA (images, raw media only) here; the Qwen family (image, video, audio; metadata-only
parts) in `testmodel_qwen.py`.

`epd build-model --out DIR` (or `python -m encoder_service.local.testmodel`). The build is
deterministic (fixed seeds) and idempotent: a directory whose `epd_build.json` matches the
requested spec is left alone, so a second run costs milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

BUILDER_VERSION = 5
IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the generated model. `tiny` serves on 2 CPU cores; `large` gives
    realistic embedding sizes and a vision tower heavy enough to benchmark batching."""

    name: str = "tiny"
    family: str = "llava"  # llava | qwen2_5_vl | qwen2_5_omni | qwen3_vl
    image_size: int = 112  # 112 px / patch 14 -> 8x8 = 64 image tokens
    patch_size: int = 14
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2  # CPU attention needs head_dim >= 32
    lm_hidden: int = 128
    lm_layers: int = 2
    lm_heads: int = 4
    vocab_size: int = 512
    max_positions: int = 2048
    seed: int = 1234

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def model_name(self) -> str:
        """Its directory under the work dir's models/ and its default served name."""
        if self.family == "llava":
            return "tiny-llava" if self.name == "tiny" else f"{self.name}-llava"
        return f"tiny-{self.name}"

    @property
    def modalities(self) -> tuple[str, ...]:
        return {"llava": ("image",), "qwen2_5_vl": ("image", "video"),
                "qwen3_vl": ("image", "video")}.get(
            self.family, ("image", "video", "audio"))


SPECS = {
    "tiny": ModelSpec(),
    # 336 px -> 576 tokens x 1024 hidden: a 1.2 MB bf16 embedding, a ViT that costs real CPU.
    "large": ModelSpec(
        name="large", image_size=336, vision_hidden=512, vision_layers=6, vision_heads=8,
        lm_hidden=1024, lm_layers=2, lm_heads=16,
    ),
    # ViT-L/32-style tower (1024 wide, 12 layers, 49 tokens per 224 px image): per-image
    # matrices are small, so cross-request batching pays on CPU (benchmarks/pool_bench.py).
    "vitl32": ModelSpec(
        name="vitl32", image_size=224, patch_size=32, vision_hidden=1024, vision_layers=12,
        vision_heads=16, lm_hidden=2048, lm_layers=1, lm_heads=16,
    ),
    # The regime EPD exists for: a vision tower that costs far more than a decode step (tens
    # of ms per image on one CPU core) in front of the tiny language model.
    "heavy": ModelSpec(
        name="heavy", image_size=224, patch_size=14, vision_hidden=384, vision_layers=8,
        vision_heads=6,
    ),
    # Qwen family: dynamic resolution (a 112 px image -> 16 tokens after the 2x2 merge),
    # video (2-frame temporal patches) and, for the Omni thinker, audio (Whisper mels).
    "qwen-vl": ModelSpec(name="qwen-vl", family="qwen2_5_vl", lm_heads=2),
    "qwen-omni": ModelSpec(name="qwen-omni", family="qwen2_5_omni", lm_heads=2),
    # 16 px patches; a 128 px image -> 16 tokens, each 256 wide (DeepStack) for a 128-wide LM
    "qwen3-vl": ModelSpec(name="qwen3-vl", family="qwen3_vl", lm_heads=2, patch_size=16),
}


def _corpus() -> list[str]:
    words = (
        "the a an image picture photo shows shown color red green blue black white dog cat "
        "car tree house sky water person people is are of in on with and what describe this "
        "that there here left right top bottom large small one two three many answer question"
    ).split()
    lines = []
    for i in range(2000):
        n = 5 + i % 11
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(n)))
    return lines


def _build_tokenizer(spec: ModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN,
                "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _vllm_layout(state: dict) -> dict:
    """transformers 5.x names CLIP weights `...vision_tower.embeddings`; vLLM's CLIP loader
    expects `...vision_tower.vision_model.embeddings`. Rename before saving."""
    renamed = {}
    for key, value in state.items():
        for part in ("embeddings.", "encoder.", "pre_layrnorm.", "post_layernorm."):
            prefix = "model.vision_tower." + part
            if key.startswith(prefix):
                key = "model.vision_tower.vision_model." + key[len("model.vision_tower."):]
                break
        renamed[key] = value.contiguous()
    return renamed


def build(out: Path, spec: ModelSpec) -> Path:
    out = Path(out)
    stamp = out / "epd_build.json"
    wanted = {"builder_version": BUILDER_VERSION, **asdict(spec)}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        print(f"[model] {out} is up to date ({spec.name}, {spec.family})")
        return out

    print(f"[model] building {spec.name} ({spec.family}) into {out} (random weights, "
          "local tokenizer)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        if spec.family == "llava":
            _build_llava(tmp, spec)
        else:
            from encoder_service.local.testmodel_qwen import build_qwen

            build_qwen(tmp, spec, _corpus())
        (tmp / "epd_build.json").write_text(json.dumps(wanted, indent=1))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"[model] done: {out}")
    return out


def _build_llava(tmp: Path, spec: ModelSpec) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    _build_tokenizer(spec, tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 4,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden,
    )
    text = LlamaConfig(
        hidden_size=spec.lm_hidden, intermediate_size=spec.lm_hidden * 2,
        num_hidden_layers=spec.lm_layers, num_attention_heads=spec.lm_heads,
        num_key_value_heads=spec.lm_heads, vocab_size=len(tokenizer),
        max_position_embeddings=spec.max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        projector_hidden_act="gelu",
    )
    config.dtype = "bfloat16"
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    # Random init gives near-uniform logits; scale the LM head so greedy tokens are
    # well separated and output comparisons between servers are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    state = _vllm_layout(model.state_dict())
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": spec.image_size},
            crop_size={"height": spec.image_size, "width": spec.image_size},
        ),
        tokenizer=tokenizer, patch_size=spec.patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(tmp)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="the model directory (one --spec)")
    where.add_argument("--models-dir", type=Path,
                       help="build each --spec into DIR/<its name> (tiny -> tiny-llava)")
    parser.add_argument("--spec", choices=sorted(SPECS), action="append",
                        help="repeatable; default tiny")
    args = parser.parse_args(argv)
    specs = [SPECS[name] for name in args.spec or ["tiny"]]
    if args.out is not None:
        if len(specs) > 1:
            parser.error("--out takes one --spec; use --models-dir for several")
        build(args.out, specs[0])
        return
    for spec in specs:
        build(args.models_dir / spec.model_name, spec)


if __name__ == "__main__":
    main()
