"""A consumer's clock of a gateway's pending promises, without a scheduler around it."""

from __future__ import annotations

from types import SimpleNamespace

from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.params import Source
from ec_connectors.sched.promises import Promises
from ec_connectors.stats import StatsRecorder
from scheduler_hooks.decisions import Promise


class Index:  # nothing indexed; saves are followed (so "not indexed" means "not landed")
    watching = True

    def __contains__(self, key: object) -> bool:
        return False


def test_a_promise_is_waited_for_its_timeout_from_the_first_look_then_expires():
    transport = SimpleNamespace(announces=True, locate=lambda key: None)
    promises = Promises(Index(), transport, timeout_s=2.0, stats=StatsRecorder())
    pending = Source(pending=True)
    key = item_key("a")
    assert promises.state("a", key, Source(), now=0.0) is Promise.NONE
    assert promises.state("a", None, pending, now=0.0) is Promise.NONE  # no valid key
    assert promises.state("a", key, pending, now=0.0) is Promise.WAITING
    promises.went_by("a", Promise.WAITING, now=0.0)
    assert promises.state("a", key, pending, now=1.9) is Promise.WAITING
    assert promises.state("a", key, pending, now=2.0) is Promise.EXPIRED
    transport.locate = lambda k: ("10.0.0.1:1", 64)  # announced: it landed
    assert promises.state("a", key, pending, now=2.5) is Promise.LANDED
    promises.went_by("a", Promise.LANDED, now=2.5)
    assert not promises
