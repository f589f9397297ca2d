"""The elastic roles' decisions (scale_rules.py) on a hand-driven clock, and their configuration:
`--encoders MIN:MAX` on the command line, the up config's `scaling` table."""

from __future__ import annotations

import argparse

import pytest

from encoder_service.local.scale_rules import Decider, Direction, Reason, RoleScaling
from encoder_service.local.up_cli import count
from encoder_service.local.up_config import UpError, load_up_config

POLICY = RoleScaling(target=2.0, up_window_s=5, idle_below=0.0, idle_window_s=10,
                     up_cooldown_s=20, down_cooldown_s=30)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(d: Decider, clock: Clock, load: float, seconds: float, serving: int,
        step: float = 1.0) -> list:
    """Samples of `load` every `step` s for `seconds`; the decisions made."""
    out = []
    end = clock.t + seconds
    while clock.t < end:
        clock.t += step
        got = d.observe(load, serving)
        if got is not None:
            out.append((clock.t, got))
    return out


def test_grows_once_the_window_mean_is_above_target():
    clock = Clock()
    d = Decider("encoder", 1, 3, POLICY, clock)
    assert run(d, clock, 2.0, 10, serving=1) == []  # at the target is not above it
    assert run(d, clock, 0.0, 5, serving=1) == []
    got = run(d, clock, 3.0, 10, serving=1)
    assert len(got) == 1
    at, decision = got[0]
    assert (decision.direction, decision.reason) == (Direction.UP, Reason.LOAD)
    assert "target 2" in decision.detail and "1 -> 2" in decision.detail
    assert at - 1015.0 >= 3  # the window had to fill with samples above the target first


def test_a_short_spike_does_not_grow_the_role():
    clock = Clock()
    d = Decider("encoder", 1, 2, POLICY, clock)
    run(d, clock, 0.0, 10, serving=1)
    assert run(d, clock, 12.0, 1, serving=1) == []  # one sample: mean 12/5 over 5 s is 2.4
    assert run(d, clock, 0.0, 1, serving=1) == []


def test_load_is_per_serving_instance():
    clock = Clock()
    d = Decider("decode", 1, 3, POLICY, clock)
    assert run(d, clock, 5.0, 20, serving=3) == []  # at the maximum: never
    d = Decider("decode", 1, 4, POLICY, clock)
    assert run(d, clock, 5.0, 20, serving=3) == []  # 1.67 per instance: under the target
    d = Decider("decode", 1, 3, POLICY, clock)
    assert [x.direction for _, x in run(d, clock, 5.0, 6, serving=2)] == [Direction.UP]  # 2.5


def test_shrinks_after_a_whole_idle_window_never_below_min():
    clock = Clock()
    d = Decider("decode", 1, 2, POLICY, clock)
    assert run(d, clock, 0.0, 9, serving=2) == []
    got = run(d, clock, 0.0, 2, serving=2)
    assert [(x.direction, x.reason) for _, x in got] == [(Direction.DOWN, Reason.IDLE)]
    d.reset_window()
    assert run(d, clock, 0.0, 120, serving=1) == []  # at the minimum


def test_one_busy_sample_restarts_the_idle_window():
    clock = Clock()
    d = Decider("decode", 1, 2, POLICY.model_copy(update={"idle_below": 1.0}), clock)
    run(d, clock, 0.0, 8, serving=2)
    assert run(d, clock, 4.0, 1, serving=2) == []  # 2.0 per instance: not idle
    assert run(d, clock, 2.0, 9, serving=2) == []  # 1.0 per instance counts idle
    assert [x.direction for _, x in run(d, clock, 2.0, 2, serving=2)] == [Direction.DOWN]


def test_no_shrink_that_the_next_window_would_undo():
    """Idle per instance, but one fewer would carry more than the target: it stays."""
    clock = Clock()
    p = POLICY.model_copy(update={"idle_below": 1.5, "target": 2.0})
    d = Decider("decode", 1, 2, p, clock)
    assert run(d, clock, 3.0, 30, serving=2) == []  # 1.5 each; 3.0 on one is above 2
    assert [x.direction for _, x in run(d, clock, 2.0, 12, serving=2)] == [Direction.DOWN]


def test_nothing_while_an_instance_starts_or_drains():
    clock = Clock()
    d = Decider("encoder", 1, 3, POLICY, clock)
    for _ in range(30):
        clock.t += 1
        assert d.observe(9.0, 1, starting=1) is None
        assert d.observe(9.0, 2, draining=1) is None


def test_cooldowns_bound_the_changes_and_it_never_flaps():
    """Load swinging between a burst and idle every few seconds for ten minutes: the
    changes are at most what the cooldowns allow, and each follows a whole window."""
    clock = Clock()
    p = RoleScaling(target=1.0, up_window_s=2, idle_window_s=3, up_cooldown_s=10,
                    down_cooldown_s=15)
    d = Decider("encoder", 1, 4, p, clock)
    serving, changes = 1, []
    for i in range(1200):
        clock.t += 0.5
        got = d.observe(8.0 if (i // 8) % 2 else 0.0, serving)
        if got is not None:
            changes.append((clock.t, got.direction))
            serving += 1 if got.direction == Direction.UP else -1
            d.reset_window()
        assert 1 <= serving <= 4
    gaps = [b[0] - a[0] for a, b in zip(changes, changes[1:], strict=False)]
    assert changes and min(gaps) >= 10
    assert len(changes) <= 1 + 600 / 10


def test_bad_range():
    with pytest.raises(ValueError, match="MIN:MAX"):
        Decider("encoder", 2, 1, POLICY)


def test_command_line_count():
    assert count("3") == (3, None)
    assert count("1:2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        count("1-2")


def test_config_plans_the_maximum_and_checks_the_range(tmp_path):
    cfg = load_up_config(None, {"encoders": 1, "decoders": 1, "transport": "safetensors",
                                "scaling": {"encoders_max": 2, "decoders_max": 3}})
    assert (cfg.servers, cfg.planned_encoders, cfg.planned_decoders) == (5, 2, 3)
    assert len([p for p, what in cfg.fixed_ports.items() if what.startswith("server")]) == 5
    with pytest.raises(UpError, match="MIN:MAX"):
        load_up_config(None, {"encoders": 3, "scaling": {"encoders_max": 2}})
    with pytest.raises(UpError, match="Transfer Engine"):
        load_up_config(None, {"transport": "mooncake", "scaling": {"encoders_max": 2}})
    path = tmp_path / "up.json"
    path.write_text('{"scaling": {"encoders_max": 4, "interval_s": 0.5}}')
    cfg = load_up_config(path, {"scaling": {"decoders_max": 2}})  # merged, not replaced
    assert (cfg.scaling.encoders_max, cfg.scaling.decoders_max,
            cfg.scaling.interval_s) == (4, 2, 0.5)
