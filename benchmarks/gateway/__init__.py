"""The gateway on its own:

- `hop.py`: what the gateway adds to a request beside nginx and a bare Python proxy
  (`bare_proxy.py`, also the gateway's layers one by one), against a stand-in decode
  instance.
- `tracing.py`: what tracing costs the gateway (in process, toggled, end to end).
- `routing.py`: the routing policies over four encoder pools and two decode instances.
"""
