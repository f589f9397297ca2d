"""The peer-pull core: consumers pull items out of producers' registered pools.

What the `mooncake` and `nixl` transports share, whatever moves the bytes: the data path is
given to the core (`data_path.DataPath`), and implemented in mooncake_te/ (the engine's
writes, the socket stream) and nixl_pull/ (NIXL reads), which import the core, never the
reverse.

- data_path.py: the DataPath and PeerReader Protocols, and PullCounters (health's counters).
- transport.py: PeerPullTransport, the worker-role Transport shell (put, get, leases, health).
- producer_store.py: a producer's pinned items (buffers, pins) under the lease book, ../leases.py.
- server.py: PullServer, a producer's side channel: pulls queued, answered, refused, served.
- announcer.py: a producer's announcements of the items it holds.
- link.py: PeerLink, a consumer's side channel to one producer (pulls in flight, quarantine).
- puller.py: Puller, a consumer's pulls over its readers (pool blocks, retries, verification).
- catalog.py: PeerCatalog, the scheduler/gateway view of what producers hold (torch-free).
- messages.py: the side-channel and announcement wire types (torch-free).

Import the module you need: `catalog` and `messages` load without torch (the gateway uses them).
The ZMQ channel under the side channel is the generic `ec_connectors.channel.Channel`.
"""
