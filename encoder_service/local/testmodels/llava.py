"""The tiny LLaVA test model, in vLLM's weight layout.

The tiny LLaVA (images, raw media only): a CLIP vision tower and projector in front of a
small Llama, random weights, in the weight layout vLLM's LLaVA loader expects."""

from __future__ import annotations

from pathlib import Path

from encoder_service.local.testmodels.spec import ModelSpec
from encoder_service.local.testmodels.tokenizer import train_tokenizer

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
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN, "<|user|>", "<|assistant|>",
             "<|system|>"]


def _vllm_layout(state: dict) -> dict:
    """Rename CLIP weights to the layout vLLM's loader expects.

    transformers 5.x names CLIP weights `...vision_tower.embeddings`; vLLM's CLIP loader
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


def build_llava(tmp: Path, spec: ModelSpec) -> None:
    """Write the tiny LLaVA of `spec` into `tmp` (the caller stamps and moves it)."""
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

    train_tokenizer(tmp, spec.vocab_size, _SPECIALS, CHAT_TEMPLATE, unk_token="<unk>",
                    bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                    extra_special_tokens={"image_token": IMAGE_TOKEN})
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
