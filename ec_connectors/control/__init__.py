"""The scheduler <-> worker wire, between vLLM's EngineCore and its worker processes.

- `endpoint.py`: the control channel (ZMQ over unix sockets, one per engine and DP rank).
- `messages.py`: its messages (msgspec: Prefetch, Staged, Saved, ...; never pickle) and what
  the scheduler hands its workers inside vLLM's SchedulerOutput each step.
"""
