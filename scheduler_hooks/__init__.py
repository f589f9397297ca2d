"""Scheduler hooks: the consumer's scheduling policy as pure logic.

The scheduler-side policy of EPDConnector as pure logic over plain values (no threads
started, no I/O): the consumer's items, one table and one state machine per item
(`item_table.py`:
LOADING -> STAGED -> MERGED -> PREFILLED -> DISCARDED, FAILED; deadlines, bytes per state,
waiters, the owner index, the transition table and `IllegalTransition`), the consumer's
per-item plan and its readiness and failure decisions (`decisions.py`), whether a stored
item fits the metadata-only part naming it (`fit.py`), what vLLM's own encoder cache holds
(`encoder_cache.py`). It imports nothing from `ec_connectors/` and no
vLLM: `ec_connectors/sched/scheduler.py` wires it to vLLM's scheduler API, the control channel, the
transports and the availability index (`ec_connectors/sched/index.py`)."""
