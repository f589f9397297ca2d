"""A consumer's step for one item: gather its facts, ask the policy, act on the answer.

The policy is `scheduler_hooks.decisions.plan_item`; `ItemSteps` gathers what it asks about
(vLLM's caches, the availability index, the request's params, the staging) and carries out
what it answers (probe, load, wait, local encode, fail). It is given what it reads and the two
actions of the scheduler it takes (`load`, `release`), and keeps what it alone writes: which
items each request waited for and since when.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Container
from typing import TYPE_CHECKING, Any

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.keys import safe_key
from ec_connectors.protocol.params import Source
from ec_connectors.sched.hints import RequestHints
from ec_connectors.sched.part_fit import PartFit
from ec_connectors.sched.promises import Promises
from ec_connectors.sched.unavailable import Unavailable
from ec_connectors.stats import StatsRecorder
from scheduler_hooks.decisions import (
    STEPS,
    ItemAction,
    ItemFacts,
    ItemPlan,
    Lookup,
    covered,
    decide,
    lookup_of,
    plan_item,
)
from scheduler_hooks.encoder_cache import EncoderCacheView
from scheduler_hooks.item_table import ItemTable

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ec_connectors.placeholders import Placeholders

logger = get_logger(__name__)

# Start loading an item: (item_id, source, num_embeds, now) -> False when the staging budget
# has no room for it.
LoadFn = Callable[[str, Source, int, float], bool]
ReleaseFn = Callable[[str, str], None]  # (item_id, req_id): the request no longer waits for it


class ItemSteps:
    """The consumer's per-item step of `EPDSchedulerSide` (see the module doc)."""

    def __init__(self, config: EPDConfig, *, items: ItemTable, index: Container[str],
                 hints: RequestHints, promises: Promises, engine_cache: EncoderCacheView,
                 fit: PartFit | None, placeholders: Placeholders | None,
                 unavailable: Unavailable, stats: StatsRecorder,
                 probe: Callable[[str], bool | None], load: LoadFn,
                 release: ReleaseFn) -> None:
        self.config = config
        self.items, self.index, self.hints, self.promises = items, index, hints, promises
        self.engine_cache, self.fit, self.placeholders = engine_cache, fit, placeholders
        self.unavailable, self.stats = unavailable, stats
        self._probe, self._load, self._release = probe, load, release
        self._deferred_since: dict[str, float] = {}  # first deferral of a request
        self._waits: dict[str, set[str]] = {}  # items a request waited for

    def step(self, request: Request, i: int, hints: dict[str, Source],
             num_computed_tokens: int, now: float, first_look: bool) -> bool:
        """Plan item `i` of a request and act on the plan; True: the request must wait."""
        facts, plan = self._plan(request, i, hints, num_computed_tokens, now)
        self._act(request, request.mm_features[i].identifier, facts, plan, first_look)
        return plan.defer

    def deferred(self, req_id: str, now: float) -> None:
        """The request waits this step (its first deferral starts its wait)."""
        self._deferred_since.setdefault(req_id, now)

    def ready(self, req_id: str) -> tuple[float, Collection[str]] | None:
        """The request waits no more: since when, and for which items (None: it never did)."""
        since = self._deferred_since.pop(req_id, None)
        return None if since is None else (since, self._waits.get(req_id, ()))

    def finished(self, req_id: str) -> set[str]:
        """Forget a finished request; the items it still waited for."""
        self._deferred_since.pop(req_id, None)
        return self._waits.pop(req_id, set())

    def _plan(self, request: Request, i: int, hints: dict[str, Source],
              num_computed_tokens: int, now: float) -> tuple[ItemFacts, ItemPlan]:
        """Plan one item of a request and take the steps the plan asks for.

        Gather the item's facts, ask `plan_item`, take the steps it asks for (probe the
        transport, start the load, join the staging) and ask again, up to its answer."""
        req_id, item_id = request.request_id, request.mm_features[i].identifier
        facts = self._facts(request, i, hints, num_computed_tokens, now)
        plan = plan_item(facts)
        while plan.action in STEPS:
            self.promises.went_by(item_id, plan.promise, now)
            if plan.action is ItemAction.PROBE:  # stores that cannot list
                facts = dataclasses.replace(
                    facts, lookup=lookup_of(self._probe(item_id)))
            elif plan.action is ItemAction.LOAD:  # or wait for room in the budget
                room = self._load(item_id, self.hints.source(item_id, hints),
                                  request.get_num_encoder_embeds(i), now)
                waited = now - self._deferred_since.get(req_id, now)
                facts = dataclasses.replace(facts, staged=room, over_budget=not room,
                                            budget_expired=waited >= self.config.load_timeout_s)
            else:  # CHECK: the request waits for the staging; where does it stand?
                self.items.want(item_id, req_id)
                self._waits.setdefault(req_id, set()).add(item_id)
                expected = request.get_num_encoder_embeds(i)
                facts = dataclasses.replace(
                    facts, decision=decide(self.items, item_id, expected, now))
            plan = plan_item(facts)
        self.promises.went_by(item_id, plan.promise, now)
        return facts, plan

    def _facts(self, request: Request, i: int, hints: dict[str, Source],
               num_computed_tokens: int, now: float) -> ItemFacts:
        feature = request.mm_features[i]
        item_id, req_id = feature.identifier, request.request_id
        pos = feature.mm_position
        if covered(pos.offset, pos.length, num_computed_tokens):
            return ItemFacts(covered=True)  # vLLM has it: nothing else is looked up
        in_cache, metadata_only = item_id in self.engine_cache, self._metadata_only(feature)
        if in_cache and not metadata_only:  # (metadata-only: staged all the same, plan_item)
            return ItemFacts(in_engine_cache=True)
        key = safe_key(item_id)
        source = hints.get(item_id)
        lookup = (Lookup.NO if key is None else
                  Lookup.YES if source is not None or key in self.index else Lookup.UNASKED)
        load = self.items.current(item_id, now)  # a metadata-only part: does the item fit?
        misfit = self.fit.check(request, i, load) if metadata_only and self.fit else ""
        return ItemFacts(
            staged=load is not None and not (metadata_only and PartFit.refits(load)),
            promise=self.promises.state(item_id, key, source, now), lookup=lookup,
            hinted=source is not None, metadata_only=metadata_only, in_engine_cache=in_cache,
            policy=self.config.on_unavailable,
            reported=self.unavailable.reported(req_id, item_id),
            load_timeout_s=self.config.load_timeout_s, mismatch=misfit)

    def _act(self, request: Request, item_id: str, facts: ItemFacts, plan: ItemPlan,
             first_look: bool) -> None:
        req_id = request.request_id
        if plan.action is ItemAction.SKIP:
            # In the KV cache, or in vLLM's own encoder cache (placed there, or encoded;
            # vLLM serves it: no load, no wait): a copy staged for it is not needed. A
            # preempted request whose item was evicted since is loaded again.
            if facts.in_engine_cache:
                self.stats.inc("engine_cache_hits")
            elif first_look:  # computed before this request ran: the prefix cache
                self.stats.inc("prefix_cached")
            if item_id in self._waits.get(req_id, ()):  # (no lock: the usual case)
                self._release(item_id, req_id)
            return
        if plan.action not in (ItemAction.LOCAL_ENCODE, ItemAction.FAIL):
            if facts.over_budget:
                self.stats.inc("budget_waits")
            return  # USE (has_cache_item says yes), WAIT (plan.defer)
        if plan.failed_now:
            logger.warning("EPD: item %r for request %s: %s; not loaded", item_id, req_id,
                           plan.why)
        if plan.timeout:
            self.stats.inc("timeouts")
        if not plan.report:  # an item nobody promised
            logger.debug("EPD: request %s item %r is not in the transport; vLLM encodes it "
                         "locally", req_id, item_id)
        elif plan.action is ItemAction.FAIL:
            self.unavailable.fail(req_id, item_id, plan.why, facts.metadata_only)
        else:
            self.unavailable.local_encode(req_id, item_id, plan.why)

    def _metadata_only(self, feature: Any) -> bool:
        return self.placeholders is not None and self.placeholders.metadata_only(feature)
