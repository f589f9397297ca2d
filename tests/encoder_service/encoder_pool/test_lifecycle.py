"""Feature lifecycle: legal/illegal transitions, byte budgets, eviction, cache-or-discard."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_service.encoder_pool.lifecycle import (
    TRANSITIONS,
    BudgetExceeded,
    FeatureState,
    FeatureStore,
    IllegalTransition,
)

S = FeatureState


def emb(rows: int, dim: int = 4) -> torch.Tensor:  # rows * dim * 4 bytes
    return torch.zeros(rows, dim, dtype=torch.float32)


def test_full_path_discards_after_prefill_by_default():
    store = FeatureStore(cpu_budget=1000, gpu_budget=1000)
    store.begin("a", "image", est_bytes=160)
    assert store.used["cpu"] == 160 and store.state("a") is S.ENCODING
    store.encoded("a", emb(5))  # 80 real bytes: the reservation shrinks to them
    assert store.used["cpu"] == 80 and store.state("a") is S.ENCODED_CPU
    store.stage("a", "cpu")
    assert store.used == {"cpu": 0, "gpu": 80} and store.state("a") is S.STAGED_GPU
    store.merged("a")
    assert store.prefilled("a") is S.DISCARDED
    assert store.used == {"cpu": 0, "gpu": 0} and store.get("a") is None
    assert store.peak == {"cpu": 160, "gpu": 80}


def test_keep_for_reuse_returns_to_cpu_and_is_served_again():
    store = FeatureStore(cpu_budget=1000, gpu_budget=1000)
    store.begin("a", "image", 80, keep=True)
    store.encoded("a", emb(5))
    store.stage("a")
    store.merged("a")
    assert store.prefilled("a") is S.ENCODED_CPU
    assert store.used == {"cpu": 80, "gpu": 0}
    assert store.lookup("a") is not None
    # per-call override beats the feature's flag
    store.stage("a")
    store.merged("a")
    assert store.prefilled("a", keep=False) is S.DISCARDED


def test_retain_keep_policy_and_release():
    store = FeatureStore(cpu_budget=1000, gpu_budget=1000, retain="keep")
    store.begin("a", "image", 80)
    store.encoded("a", emb(5))
    assert store.release("a") is S.ENCODED_CPU  # kept: multi-turn reuse
    assert store.release("a", keep=False) is S.DISCARDED
    assert store.release("a") is S.DISCARDED  # unknown: no-op
    assert store.used["cpu"] == 0


@pytest.mark.parametrize("bad", [
    lambda s: s.stage("a"),  # ENCODING -> STAGED_GPU
    lambda s: s.merged("a"),  # ENCODING -> MERGED
    lambda s: s.begin("a", "image", 10),  # twice
])
def test_illegal_transitions_raise_and_change_nothing(bad):
    store = FeatureStore(cpu_budget=1000, gpu_budget=1000)
    store.begin("a", "image", 80)
    with pytest.raises(IllegalTransition, match="'a'"):
        bad(store)
    assert store.state("a") is S.ENCODING and store.used == {"cpu": 80, "gpu": 0}


def test_prefilled_before_merge_is_illegal():
    store = FeatureStore(cpu_budget=1000, gpu_budget=1000)
    store.begin("a", "image", 80)
    store.encoded("a", emb(5))
    store.stage("a")
    with pytest.raises(IllegalTransition, match="STAGED_GPU -> PREFILLED"):
        store.prefilled("a")


def test_cpu_budget_evicts_oldest_unpinned_encoded_features():
    store = FeatureStore(cpu_budget=240, gpu_budget=1000)
    for name in "abc":
        store.begin(name, "image", 80)
        store.encoded(name, emb(5))
    store.lookup("a")  # a becomes the most recently used: b is now the oldest
    store.pin("c")
    store.begin("d", "image", 80)  # needs 80: evicts b (oldest, unpinned)
    assert store.get("b") is None and store.get("a") is not None
    assert store.evictions == 1 and store.used["cpu"] == 240
    store.begin("e", "image", 80)  # evicts a (c is pinned, d is ENCODING)
    assert store.get("a") is None and store.get("c") is not None
    with pytest.raises(BudgetExceeded, match="cpu budget"):
        store.begin("f", "image", 80)  # c pinned, d/e encoding: nothing evictable
    assert store.get("f") is None and store.used["cpu"] == 240
    store.unpin("c")
    store.begin("f", "image", 80)
    assert store.get("c") is None


def test_gpu_budget_is_enforced_on_staging():
    store = FeatureStore(cpu_budget=1000, gpu_budget=100)
    for name in "ab":
        store.begin(name, "image", 80)
        store.encoded(name, emb(5))
    store.stage("a")
    with pytest.raises(BudgetExceeded, match="gpu budget"):
        store.stage("b")
    assert store.state("b") is S.ENCODED_CPU and store.used == {"cpu": 80, "gpu": 80}
    store.unstage("a")
    store.stage("b")
    assert store.used == {"cpu": 80, "gpu": 80}


ACTIONS = ["encoded", "stage", "unstage", "merged", "prefilled", "discard"]
TARGET = {"encoded": S.ENCODED_CPU, "stage": S.STAGED_GPU, "unstage": S.ENCODED_CPU,
          "merged": S.MERGED, "prefilled": S.PREFILLED, "discard": S.DISCARDED}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ACTIONS), max_size=12), st.booleans())
def test_random_action_sequences_follow_the_transition_table(actions, keep):
    """Against a model of the table: legal actions move the state, illegal ones raise and
    change nothing; bytes per tier always equal the live feature's size in its tier."""
    store = FeatureStore(cpu_budget=10_000, gpu_budget=10_000, retain="keep" if keep else
                         "discard")
    store.begin("x", "image", 80)
    state = S.ENCODING
    for action in actions:
        target = TARGET[action]
        legal = state is not S.DISCARDED and target in TRANSITIONS[state]
        if action == "unstage":
            legal = state is S.STAGED_GPU
        if action == "encoded":
            legal = state is S.ENCODING
        args = (emb(5),) if action == "encoded" else ()
        if legal:
            getattr(store, action)("x", *args)
            state = target
            if action == "prefilled":
                state = S.ENCODED_CPU if keep else S.DISCARDED
        else:
            with pytest.raises((IllegalTransition, KeyError)):
                getattr(store, action)("x", *args)
        assert store.state("x") is state
        size = 80
        cpu = size if state in (S.ENCODING, S.ENCODED_CPU) else 0
        gpu = size if state in (S.STAGED_GPU, S.MERGED, S.PREFILLED) else 0
        assert store.used == {"cpu": cpu, "gpu": gpu}
