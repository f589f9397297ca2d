"""Feature lifecycle: legal/illegal transitions, the byte budget, eviction, release-or-keep."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_service.encoder_pool.lifecycle import (
    TRANSITIONS,
    BudgetExceeded,
    FeatureStore,
    IllegalTransition,
    PoolItemState,
)

S = PoolItemState


def emb(rows: int, dim: int = 4) -> torch.Tensor:  # rows * dim * 4 bytes
    return torch.zeros(rows, dim, dtype=torch.float32)


def test_full_path_discards_on_release_by_default():
    store = FeatureStore(budget=1000)
    store.begin("a", "image", est_bytes=160)
    assert store.used == 160 and store.state("a") is S.ENCODING
    store.encoded("a", emb(5))  # 80 real bytes: the reservation shrinks to them
    assert store.used == 80 and store.state("a") is S.ENCODED_CPU
    assert store.lookup("a") is not None
    assert store.release("a") is S.DISCARDED
    assert store.used == 0 and store.get("a") is None and store.lookup("a") is None
    assert store.peak == 160 and store.discarded == 1


def test_bytes_per_state_sum_to_used_and_return_to_zero():
    store = FeatureStore(budget=1000)
    store.begin("a", "image", est_bytes=160)
    store.begin("b", "image", est_bytes=40)
    store.encoded("b", emb(2))  # 32 bytes
    assert store.bytes_by_state() == {S.ENCODING: 160, S.ENCODED_CPU: 32, S.DISCARDED: 0}
    assert sum(store.bytes_by_state().values()) == store.used
    store.discard("a")
    store.release("b")
    assert set(store.bytes_by_state().values()) == {0} and store.used == 0


def test_keep_for_reuse_survives_release_until_told_otherwise():
    store = FeatureStore(budget=1000)
    store.begin("a", "image", 80, keep=True)
    store.encoded("a", emb(5))
    assert store.release("a") is S.ENCODED_CPU  # the feature's flag: kept
    assert store.used == 80 and store.lookup("a") is not None
    # per-call override beats the feature's flag
    assert store.release("a", keep=False) is S.DISCARDED
    assert store.used == 0


def test_retain_keep_policy_and_release():
    store = FeatureStore(budget=1000, retain="keep")
    store.begin("a", "image", 80)
    store.encoded("a", emb(5))
    assert store.release("a") is S.ENCODED_CPU  # kept: multi-turn reuse
    assert store.release("a", keep=False) is S.DISCARDED
    assert store.release("a") is S.DISCARDED  # unknown: no-op
    assert store.used == 0


def test_release_of_an_encoding_feature_discards_it():
    store = FeatureStore(budget=1000, retain="keep")
    store.begin("a", "image", 80)
    assert store.release("a") is S.DISCARDED  # nothing to keep yet
    assert store.used == 0 and store.get("a") is None


@pytest.mark.parametrize("bad", [
    lambda s: s.begin("a", "image", 10),  # twice
    lambda s: (s.encoded("a", emb(5)), s.encoded("a", emb(5))),  # ENCODED_CPU -> ENCODED_CPU
])
def test_illegal_transitions_raise_and_change_nothing(bad):
    store = FeatureStore(budget=1000)
    store.begin("a", "image", 80)
    with pytest.raises(IllegalTransition, match="'a'"):
        bad(store)
    assert store.state("a") in (S.ENCODING, S.ENCODED_CPU) and store.used == 80


def test_encoded_twice_names_both_states():
    store = FeatureStore(budget=1000)
    store.begin("a", "image", 80)
    store.encoded("a", emb(5))
    with pytest.raises(IllegalTransition, match="ENCODED_CPU -> ENCODED_CPU"):
        store.encoded("a", emb(5))


def test_budget_evicts_oldest_unpinned_encoded_features():
    store = FeatureStore(budget=240)
    for name in "abc":
        store.begin(name, "image", 80)
        store.encoded(name, emb(5))
    store.lookup("a")  # a becomes the most recently used: b is now the oldest
    store.pin("c")
    store.begin("d", "image", 80)  # needs 80: evicts b (oldest, unpinned)
    assert store.get("b") is None and store.get("a") is not None
    assert store.evictions == 1 and store.used == 240
    store.begin("e", "image", 80)  # evicts a (c is pinned, d is ENCODING)
    assert store.get("a") is None and store.get("c") is not None
    with pytest.raises(BudgetExceeded, match="cpu budget"):
        store.begin("f", "image", 80)  # c pinned, d/e encoding: nothing evictable
    assert store.get("f") is None and store.used == 240
    store.unpin("c")
    store.begin("f", "image", 80)
    assert store.get("c") is None


def test_real_size_beyond_the_reservation_evicts_or_fails():
    store = FeatureStore(budget=160)
    store.begin("a", "image", 80)
    store.encoded("a", emb(5))
    store.begin("b", "image", 40)
    store.encoded("b", emb(7))  # 112 real bytes > 40 reserved: evicts a to fit
    assert store.get("a") is None and store.used == 112 and store.evictions == 1
    store.begin("c", "image", 40)
    with pytest.raises(BudgetExceeded):
        store.encoded("c", emb(11))  # 176 bytes: b is the only victim and not enough
    assert store.state("c") is S.ENCODING and store.used == 152


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="budget"):
        FeatureStore(budget=0)
    with pytest.raises(ValueError, match="retain"):
        FeatureStore(budget=10, retain="sometimes")


ACTIONS = ["encoded", "release", "release_keep", "discard"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ACTIONS), max_size=12), st.booleans())
def test_random_action_sequences_follow_the_transition_table(actions, keep):
    """Against a model of the table: legal actions move the state, illegal ones raise and
    change nothing; the bytes held always equal the live feature's size."""
    store = FeatureStore(budget=10_000, retain="keep" if keep else "discard")
    store.begin("x", "image", 80)
    state = S.ENCODING
    for action in actions:
        if action == "encoded":
            if state is S.ENCODING and S.ENCODED_CPU in TRANSITIONS[state]:
                store.encoded("x", emb(5))
                state = S.ENCODED_CPU
            else:
                with pytest.raises((IllegalTransition, KeyError)):
                    store.encoded("x", emb(5))
        elif action in ("release", "release_keep"):
            kept = keep if action == "release" else True
            # a release never raises: unknown ids are a no-op, kept features stay
            got = store.release("x", None if action == "release" else True)
            if state is S.ENCODED_CPU and kept:
                assert got is S.ENCODED_CPU
            else:
                assert S.DISCARDED in TRANSITIONS[state] or state is S.DISCARDED
                state = S.DISCARDED
                assert got is S.DISCARDED
        else:  # discard
            if state is not S.DISCARDED and S.DISCARDED in TRANSITIONS[state]:
                store.discard("x")
                state = S.DISCARDED
            else:
                with pytest.raises(KeyError):
                    store.discard("x")
        assert store.state("x") is state
        assert store.used == (0 if state is S.DISCARDED else 80)
