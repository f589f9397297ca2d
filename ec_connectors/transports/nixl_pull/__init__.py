"""NIXL transport: consumers READ items out of producers' NIXL-registered pools.

NIXL (UCX back end) as the data path of the Mooncake TE transport's peer-pull machinery
(mooncake_te/: pool, lease book, announcements, catalog, authenticated side channel, pulls
with deadlines, verification), `"transport": "nixl"`.

- transport.py: NixlTransport, the worker-role Transport: the TE transport's hooks for NIXL.
- agent.py: one process's NIXL agent: registration (DRAM, or VRAM for a GPU pool), peers'
  metadata (checked), reads with deadlines, notifications; no progress thread.
- server.py: the producer's end: the agent handshake, pins held until a read's notification.
- link.py: the consumer's end: a producer's agent loaded and warmed, pulls as NIXL reads.
- messages.py: the side-channel handshake (`NixlHello`, `NixlPeer`).
- catalog.py: the scheduler's view (`NixlCatalog`): the TE catalog under this name, as
  announcements are the same. Every module here needs NIXL only when an agent starts.
"""
