"""Both roles of EPDConnector over this vLLM's own classes: connectors made by its
ECConnectorFactory from a real VllmConfig/ECTransferConfig, its Request (with
MultiModalFeatureSpec and SamplingParams carrying ec_transfer_params), its SchedulerOutput
(metadata pickled as vLLM ships it to workers), its ECConnectorOutput, and every V2 adapter
it ships. Producer then consumer, one image item, over the safetensors transport."""

from __future__ import annotations

import pickle
import time

import pytest
import torch

from tests.compat import sources
from tests.ec_connectors.test_v2_runner import vllm_configs  # noqa: F401 - the fixture
from tests.helpers import wait_for

pytestmark = pytest.mark.compat
NUM = 16


def real_request(req_id: str, item: str, params: dict | None = None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"ec_transfer_params": params} if params
                        else None)
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=item,
                                    mm_position=PlaceholderRange(offset=4, length=NUM))
    return Request(request_id=req_id, prompt_token_ids=list(range(40)), sampling_params=sp,
                   pooling_params=None, mm_features=[feature])


def step(sched, **fields):
    """This vLLM's SchedulerOutput for one step, with the connector's metadata, after the
    round trip vLLM makes to its workers (pickle)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    for k, v in fields.items():
        setattr(out, k, v)
    out.ec_connector_metadata = sched.build_connector_meta(out)
    assert isinstance(out.ec_connector_metadata, ECConnectorMetadata)
    return pickle.loads(pickle.dumps(out))


class Instance:
    def __init__(self, config, adapter: str, monkeypatch) -> None:
        import importlib

        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        import ec_connectors.plugin

        if "EPDConnector" not in ECConnectorFactory._registry:
            ec_connectors.plugin.register()
        self.sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        self.worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        mod = importlib.import_module(adapter)
        monkeypatch.setattr(mod, "get_ec_transfer", lambda: self.worker)
        self.cache: dict[str, torch.Tensor] = {}
        self.adapter = mod.ActiveECConnector(config, self.cache)
        assert wait_for(lambda: self.sched._sched.num_workers == 1, 10)
        self.sent: set[str] = set()
        self.received: set[str] = set()

    def run(self, out, computed: dict | None = None) -> None:
        from vllm.v1.outputs import ECConnectorOutput

        with self.adapter.maybe_get_output(out) as output:
            self.cache.update(computed or {})
        assert isinstance(output, ECConnectorOutput)
        self.sent |= output.finished_sending or set()
        self.received |= output.finished_recving or set()
        self.sched.update_connector_output(output)  # what vLLM's scheduler does with it

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


@pytest.mark.parametrize("adapter", sources.v2_adapter_modules())
def test_both_roles_over_this_versions_classes(vllm_configs, adapter, monkeypatch,  # noqa: F811
                                               report):
    item = f"compat-{adapter}"
    x = torch.randn(NUM, 128).bfloat16()
    prod = Instance(vllm_configs["producer"], adapter, monkeypatch)
    try:
        req = real_request("p1", item)
        assert not prod.sched.has_cache_item(item)
        prod.sched.update_state_after_alloc(req, 0)
        prod.run(step(prod.sched, total_num_scheduled_tokens=40,
                      num_scheduled_tokens={"p1": 40},
                      scheduled_encoder_inputs={"p1": [0]}), {item: x})
        deadline = time.monotonic() + 10
        while item not in prod.sent:
            assert time.monotonic() < deadline, "save never reported"
            prod.run(step(prod.sched))
            time.sleep(0.01)
        delay, params = prod.sched.request_finished(req)
        assert delay is False and params["epd"]["items"][item]["num_embeds"] == NUM
    finally:
        prod.close()

    cons = Instance(vllm_configs["consumer"], adapter, monkeypatch)
    try:
        creq = real_request("c1", item, params=params)
        assert creq.ec_transfer_params == params  # vLLM hands them to the request
        steps = 0
        while not cons.sched.ensure_cache_available(creq, 0):
            cons.run(step(cons.sched))
            steps += 1
            assert steps < 2000, "never staged"
            time.sleep(0.005)
        assert cons.sched.has_cache_item(item)
        cons.sched.update_state_after_alloc(creq, 0)
        cons.run(step(cons.sched, total_num_scheduled_tokens=40,
                      num_scheduled_tokens={"c1": 40}))
        assert torch.equal(cons.cache[item], x)
        assert cons.received == {item}
        assert cons.sched.take_unavailable_requests() == set()
        assert cons.sched.request_finished(creq) == (False, None)
    finally:
        cons.close()
    report(f"{adapter.rsplit('.', 2)[-2]} adapter: producer and consumer roles over Request, "
           "SchedulerOutput (pickled), ECConnectorMetadata, ECConnectorOutput, "
           "ECTransferConfig of this version")
