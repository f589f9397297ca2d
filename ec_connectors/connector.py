"""EPDConnector: vLLM's encoder-cache connector, a thin delegate to two role objects.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "EPDConnector",
        "ec_role": "ec_producer" | "ec_consumer" | "ec_both", "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"transport": "safetensors", "storage_path": "/shared"}}'

The bare name works through the `vllm.general_plugins` entry point; the module path
`"ec_connector_module_path": "ec_connectors.connector"` works too.
SCHEDULER role -> ec_connectors.sched.scheduler.EPDSchedulerSide (EngineCore process)
WORKER role    -> ec_connectors.workers.worker.EPDWorker (each worker process)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorRole,
)

from ec_connectors.config import EPDConfig
from ec_connectors.control.endpoint import control_address
from ec_connectors.control.messages import EPDConnectorMetadata
from ec_connectors.log import get_logger
from ec_connectors.placeholders import Placeholders
from ec_connectors.plugin import shorten_worker_spin
from ec_connectors.sched.scheduler import EPDSchedulerSide
from ec_connectors.stats import EPDPromMetrics, EPDStats
from ec_connectors.transports import Placement, make_transport
from ec_connectors.workers.worker import EPDWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group
    except Exception:
        return 0


def _placement(vllm_config: VllmConfig, role: ECConnectorRole, is_producer: bool,
               is_consumer: bool) -> Placement:
    par = vllm_config.parallel_config
    world = max(1, (par.tensor_parallel_size or 1) * (par.pipeline_parallel_size or 1))
    return Placement(
        role="scheduler" if role == ECConnectorRole.SCHEDULER else "worker",
        is_producer=is_producer, is_consumer=is_consumer,
        dp_rank=getattr(par, "data_parallel_rank", 0) or 0,
        rank=0 if role == ECConnectorRole.SCHEDULER else _worker_rank() % world,
        world_size=world,
    )


def _worker_device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)


class EPDConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self.config = EPDConfig.from_vllm_config(vllm_config)
        ec = vllm_config.ec_transfer_config
        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
        address = control_address(self.config.control_dir, ec.engine_id, dp_rank)
        transport = make_transport(
            self.config, _placement(vllm_config, role, self.is_producer, self.is_consumer))
        self._sched: EPDSchedulerSide | None = None
        self._worker: EPDWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._sched = EPDSchedulerSide(
                self.config, transport, is_producer=self.is_producer,
                is_consumer=self.is_consumer, address=address, engine_id=ec.engine_id,
                placeholders=Placeholders(vllm_config.model_config),
            )
            logger.info("EPDConnector scheduler: role=%s transport=%s namespace=%s config=%s",
                        ec.ec_role, transport.name, self.config.namespace,
                        self.config.model_dump(exclude={"namespace"}))
        else:
            shorten_worker_spin(self.config.worker_spin_s)  # before vLLM makes the step queue
            self._worker = EPDWorker(
                self.config, transport, is_producer=self.is_producer,
                is_consumer=self.is_consumer, address=address, rank=_worker_rank(),
                device=_worker_device(),
            )

    # -- worker role ----------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """WORKER, every step of a consumer: place this step's items (staged, or inline)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, EPDConnectorMetadata) and self._worker is not None
        if meta.place:
            self._worker.place(encoder_cache, meta.place, meta.inline)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str,
                    **kwargs: Any) -> None:
        """WORKER, right after an encoder output lands in the encoder cache: queue its save."""
        if self.is_producer and self._worker is not None:
            self._worker.save(mm_hash, encoder_cache[mm_hash])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """WORKER, end of each executed step: (item ids saved, item ids loaded) since last call."""
        return self._worker.get_finished() if self._worker else (None, None)

    def get_ec_connector_stats(self) -> EPDStats | None:
        """This interval's connector stats, from the scheduler only.

        SCHEDULER: this interval's counters and latencies, workers' included (they ship
        theirs over the control channel). WORKER: None, so nothing is counted twice."""
        return self._sched.stats.take() if self._sched else None

    def shutdown(self) -> None:
        """Either role: flush pending saves, stop threads, close sockets."""
        for side in (self._worker, self._sched):
            if side is not None:
                side.close()
        self._worker = self._sched = None

    # -- scheduler role -------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """SCHEDULER hot path: O(1), never touches storage."""
        assert self._sched is not None
        return self._sched.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """SCHEDULER, before scheduling a request: start prefetches; False defers it."""
        assert self._sched is not None
        return self._sched.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """SCHEDULER, after an encoder-cache slot is allocated for request input `index`."""
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, index)

    def update_state_after_free(self, request: Request, index: int) -> None:
        """SCHEDULER, once the request's prefill passed input `index` (its KV cache holds it)."""
        if self._sched is not None:
            self._sched.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EPDConnectorMetadata:
        """SCHEDULER, once per step: this step's placements; resets per-step state."""
        assert self._sched is not None
        return self._sched.build_connector_meta(
            getattr(scheduler_output, "free_encoder_mm_hashes", None) or (),
            idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """SCHEDULER, after each executed step: completion feedback from the workers."""
        if self._sched is not None:
            self._sched.update_connector_output(connector_output.finished_sending)

    def has_pending_push_work(self) -> bool:
        """Whether the engine should step once more so workers' reports land.

        SCHEDULER, whenever the engine looks for work: True while workers still owe
        reports (saves of items already encoded, stats that missed the last step), so the
        engine steps once more and they reach the metrics now, not at the next request."""
        return self._sched.has_pending_push_work() if self._sched else False

    def take_unavailable_requests(self) -> set[str]:
        """SCHEDULER, each step: requests to fail (only with on_unavailable=fail)."""
        return self._sched.take_unavailable_requests() if self._sched else set()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """SCHEDULER: producer returns the items it made as ec_transfer_params."""
        if self._sched is None:
            return False, None
        return False, self._sched.request_finished(request)

    # -- metrics --------------------------------------------------------------------------
    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> EPDStats:
        return EPDStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return EPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
