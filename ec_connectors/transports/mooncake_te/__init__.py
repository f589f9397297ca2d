"""Mooncake Transfer Engine transport: consumer workers pull items straight out of producer
workers' registered pools (RDMA or TCP), a ZMQ side channel carrying only control.

- engine.py: starting the transfer engine (TransferEngineUnavailable when it cannot).
- producer.py: the items a producer holds (leases, pins, LRU), their announcements, the ranges
  consumers proved, and PullServer: the side channel that serves pulls.
- consumer.py: a consumer's link to one producer (pulls in flight, quarantine), streamed
  checksum, and Puller: pulls with retries across producers, verification, hand-over.
- transport.py: MooncakeTransport, the worker-role Transport: a facade over the above.
- catalog.py: MooncakeCatalog, the scheduler/gateway view of what producers hold (torch-free).
- messages.py: the peer side-channel and announcement wire types.

Import the module you need: `catalog` and `messages` load without torch (the gateway uses them).
The ZMQ channel under the side channel is the generic `ec_connectors.protocol.channel.Channel`.
"""
