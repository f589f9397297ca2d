"""The connector's SCHEDULER role, in vLLM's EngineCore process (torch-free but for types).

- `scheduler.py`: `EPDSchedulerSide`, vLLM's scheduler hooks wired to `scheduler_hooks/` (the
  policy), the control channel to the workers and the transports. Start here.
- `staging_budget.py`: the consumer's items (one `scheduler_hooks.item_table.ItemTable`), the byte
  budget of what the connector holds and the gauges per state.
- `item_steps.py`: a consumer's step for one item (facts -> `plan_item` -> act).
- `roster.py`: the workers connected over the control channel (ranks, item endpoints).
- `hints.py`: each request's `ec_transfer_params`, parsed once; where an item is pulled from.
- `part_fit.py`: does the stored item a metadata-only part names fit it (rows, grid, modality).
- `index.py`: the availability index (which items the transport holds), kept by a thread.
- `inline.py`: small items read and verified here, on one thread, without a worker round trip.
- `promises.py`: items a gateway sent as `pending` (still encoding), waited for with a deadline.
- `unavailable.py`: requests whose items cannot arrive: failed once, with a reason, or encoded
  locally.
- `producer_saves.py`: `ProducerSaves`, a producer's saves and the `ec_transfer_params` a
  finished request returns.
- `load_spans.py`: a deferred request's loads as spans in vLLM's trace of it (when vLLM traces).
"""
