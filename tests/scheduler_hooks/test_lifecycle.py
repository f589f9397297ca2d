"""The consumer's feature lifecycle as a pure table: every path the table allows is walked,
every move it does not allow raises, and the bytes per state always sum to the entries'."""

from __future__ import annotations

import itertools

import pytest

from scheduler_hooks.lifecycle import (
    ALLOWED,
    HELD,
    FeatureState,
    IllegalTransition,
    Lifecycle,
    fits,
)

S = FeatureState
ILLEGAL = [(a, b) for a, b in itertools.product(S, S) if b not in ALLOWED[a]]


def _paths(state: FeatureState) -> list[list[FeatureState]]:
    """Every path from `state` to DISCARDED the table allows (it has no cycles)."""
    if state is S.DISCARDED:
        return [[state]]
    return [[state, *rest] for nxt in sorted(ALLOWED[state]) for rest in _paths(nxt)]


def _to(life: Lifecycle, item_id: str, state: FeatureState, nbytes: int = 10) -> None:
    """Bring an item to `state` along the main path (DISCARDED: begun, then dropped)."""
    life.begin(item_id, nbytes)
    main = [S.STAGED, S.MERGED, S.PREFILLED]
    for s in main[:main.index(state) + 1] if state in main else []:
        life.move(item_id, s)
    if state is S.DISCARDED:
        life.move(item_id, S.DISCARDED)


def test_the_design_names_and_the_main_path():
    assert [s.value for s in S] == ["loading", "staged", "merged", "prefilled", "discarded"]
    assert [S.LOADING, S.STAGED, S.MERGED, S.PREFILLED, S.DISCARDED] in _paths(S.LOADING)
    assert frozenset({S.LOADING, S.STAGED}) == HELD


@pytest.mark.parametrize("path", _paths(S.LOADING), ids=lambda p: "-".join(s.name for s in p))
def test_every_legal_path_ends_with_no_bytes(path):
    life = Lifecycle()
    life.begin("x", 100)
    assert life.by_state()["loading"] == 100
    for state in path[1:]:
        life.move("x", state, nbytes=120 if state is S.STAGED else None, owner="r1")
        assert life.state("x") is state
        if state is not S.DISCARDED:
            assert life.by_state()[state.value] == (120 if state is not S.LOADING else 100)
            assert sum(life.by_state().values()) == life.get("x").nbytes
    assert life.by_state() == dict.fromkeys([s.value for s in S], 0) and len(life) == 0


@pytest.mark.parametrize("frm, to", ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_transition_raises_and_changes_nothing(frm, to):
    life = Lifecycle()
    _to(life, "x", frm)
    before = (life.state("x"), life.by_state())
    with pytest.raises(IllegalTransition, match=f"{frm.name} -> {to.name}"):
        life.move("x", to)
    assert (life.state("x"), life.by_state()) == before


def test_the_illegal_list_is_the_table_complement():
    # a back step or a skipped step is illegal; DISCARDED (untracked) goes nowhere
    assert (S.STAGED, S.LOADING) in ILLEGAL and (S.LOADING, S.MERGED) in ILLEGAL
    assert (S.STAGED, S.PREFILLED) in ILLEGAL and (S.PREFILLED, S.MERGED) in ILLEGAL
    assert all((S.DISCARDED, s) in ILLEGAL for s in S)
    assert len(ILLEGAL) == len(S) ** 2 - sum(len(v) for v in ALLOWED.values())


def test_a_live_item_cannot_begin_again_and_an_untracked_one_is_discarded():
    life = Lifecycle()
    assert life.state("never") is S.DISCARDED
    life.begin("x", 5)
    with pytest.raises(IllegalTransition, match="begins again while LOADING"):
        life.begin("x", 5)
    life.move("x", S.DISCARDED)
    life.begin("x", 7)  # a new life once discarded
    assert life.by_state()["loading"] == 7


def test_bytes_per_state_sum_over_many_items_and_return_to_zero():
    life = Lifecycle()
    for n, state in enumerate([S.LOADING, S.STAGED, S.MERGED, S.PREFILLED] * 3):
        _to(life, f"i{n}", state, nbytes=n + 1)
    by = life.by_state()
    assert by["loading"] == 1 + 5 + 9 and by["prefilled"] == 4 + 8 + 12
    assert life.bytes_in(*HELD) == by["loading"] + by["staged"]
    assert sorted(life.items_in(S.MERGED)) == ["i10", "i2", "i6"]
    for item_id in [f"i{n}" for n in range(12)]:
        life.move(item_id, S.DISCARDED)
    assert sum(life.by_state().values()) == 0 and len(life) == 0


def test_owner_and_real_size():
    life = Lifecycle()
    life.begin("x", 0)  # size unknown: nothing reserved
    life.move("x", S.STAGED, nbytes=64)
    life.move("x", S.MERGED, owner="req-1")
    assert life.get("x").owner == "req-1" and life.by_state()["merged"] == 64


@pytest.mark.parametrize("held, nbytes, budget, ok", [
    (0, 10, 5, True),  # nothing held: an item larger than the budget loads alone
    (3, 2, 5, True), (3, 3, 5, False), (5, 0, 5, True),
])
def test_fits(held, nbytes, budget, ok):
    assert fits(held, nbytes, budget) is ok
