"""Mooncake TE transport: consumers pull items straight out of producers' pools.

Mooncake Transfer Engine transport: consumer workers pull items straight out of producer
workers' registered pools (RDMA or TCP), a ZMQ side channel carrying only control.

- transport.py: MooncakeTransport, the worker-role Transport: a facade over the rest.
- engine.py: starting the transfer engine, only where items move through it (needs_engine).
- producer_store.py: a producer's pinned items (buffers, pins) under the lease book, ../leases.py.
- producer.py: the ranges consumers proved, PullServer serving pulls.
- announcer.py: a producer's announcements of the items it holds.
- peer_link.py: a consumer's link to one producer (pulls in flight, quarantine).
- consumer.py: Puller, a consumer's pulls over its links (retries, verification).
- stream.py: the socket data path (`te_data_path` socket) both ends share: tickets, framing.
- stream_server.py: its producer side: the stream port, handshakes, a thread per connection.
- stream_client.py: its consumer side: warm data connections, one pull at a time on each.
- catalog.py: MooncakeCatalog, the scheduler/gateway view of what producers hold (torch-free).
- messages.py: the side-channel and announcement wire types (torch-free).

Import the module you need: `catalog` and `messages` load without torch (the gateway uses them).
The ZMQ channel under the side channel is the generic `ec_connectors.channel.Channel`.
"""
