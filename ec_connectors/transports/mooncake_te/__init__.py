"""Mooncake TE transport: the peer-pull core on a Mooncake data path.

`"transport": "mooncake"`: consumer workers pull items straight out of producer workers'
pools with the peer-pull core (../peer_pull/), the bytes moved by the data path `te_data_path`
names: the Transfer Engine's writes (RDMA or TCP) or a socket stream.

- transport.py: MooncakeTransport, the worker-role Transport: the core with the chosen path.
- engine.py: starting the transfer engine (needs_engine) and EnginePath, its writes.
- ranges.py: ConsumerRanges, the memory ranges consumers proved (where the engine writes).
- socket_path.py: SocketPath, the socket data path (`te_data_path` socket), both ends.
- stream.py: the socket data path's protocol both ends share: tickets, framing.
- stream_server.py: its producer side: the stream port, handshakes, a thread per connection.
- stream_client.py: its consumer side: warm data connections, one pull at a time on each.
- catalog.py: MooncakeCatalog, the scheduler/gateway view under this name (torch-free).
- messages.py: the side-channel messages these paths add (`Register`, `StreamOpen`).

Import the module you need: `catalog` and `messages` load without torch (the gateway uses them).
"""
