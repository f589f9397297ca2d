"""Media in a chat request: checked, fetched and named by content.

- `parsing.py`: a chat body's media parts -> checked items with content-derived, signed ids.
- `checks.py`: the limits on images, video frames and audio, checked without decoding more
  than needed.
- `urls.py`: http(s) media URLs fetched under the SSRF policy.
"""
