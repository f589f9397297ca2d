"""What the consumer's scheduler knows vLLM's encoder cache holds (pure logic)."""

from __future__ import annotations

from scheduler_hooks.encoder_cache import EncoderCacheView


def test_allocated_items_stay_until_vllm_evicts_them():
    v = EncoderCacheView()
    v.allocated("a")
    v.allocated("b")
    assert "a" in v and "b" in v and "c" not in v
    v.evicted(["a", "never-there"])
    assert "a" not in v and "b" in v and len(v) == 1
