"""NIXL transport: consumers READ items out of producers' NIXL-registered pools.

NIXL (UCX back end) as the data path of the peer-pull core (../peer_pull/: pool, lease book,
announcements, catalog, authenticated side channel, pulls with deadlines, verification),
`"transport": "nixl"`.

- transport.py: NixlTransport, the worker-role Transport, and NixlPath, its data path.
- agent.py: one process's NIXL agent: started, its registrations (DRAM, or VRAM for a GPU
  pool); no progress thread.
- peers.py: the agent's views of its peers: metadata (checked), item regions, rebuilds.
- reads.py: reads with deadlines on the agent's lanes, notifications.
- host.py: what the host allows: memory kinds, kernel copies (UCX_TLS, /proc), RDMA (/sys).
- server.py: the producer's end: the agent handshake, pins held until a read's notification.
- link.py: the consumer's end: a producer's agent loaded and warmed, pulls as NIXL reads.
- messages.py: the side-channel handshake (`NixlHello`, `NixlPeer`).
- catalog.py: the scheduler's view (`NixlCatalog`): the core's catalog under this name, as
  announcements are the same. Every module here needs NIXL only when an agent starts.
"""
