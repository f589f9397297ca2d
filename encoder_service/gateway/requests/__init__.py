"""The gateway's request path, from the client's bytes to the answer sent back.

- `admission.py`: the door: request ids, concurrency slots, bounded body reads.
- `chat.py`: one chat request: its items encoded (or found), overlap, the decode request.
- `relay.py`: the answer back, SSE chunks forwarded as they arrive; a broken stream handed to
  the resumer (`upstreams/resume.py`).
"""
