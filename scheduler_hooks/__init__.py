"""Scheduler hooks: the consumer's scheduling policy as pure logic.

The scheduler-side policy of EPDConnector as pure logic over plain values (no threads
started, no I/O). It imports nothing from `ec_connectors/` and no vLLM:
`ec_connectors/sched/` wires it to vLLM's scheduler API, the control channel, the transports
and the availability index (`ec_connectors/sched/index.py`); `ec_connectors/sched/
item_steps.py` is where a consumer's per-item step asks it.

- `item_table.py`: the consumer's items, one table and one state machine per item (LOADING
  -> STAGED -> MERGED -> PREFILLED -> DISCARDED, FAILED; deadlines, bytes per state, waiters,
  the owner index, the transition table, `IllegalTransition`, the staging rule `fits`).
- `decisions.py`: the consumer's per-item plan and its readiness and failure decisions.
- `fit.py`: whether a stored item fits the metadata-only part naming it.
- `encoder_cache.py`: what vLLM's own encoder cache holds."""
