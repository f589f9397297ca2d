"""Fixtures of the gateway's fast-lane modules: a module's stubs and gateway start on the
ports of that module's `LAB` (stubs.Lab), so modules never share a port under xdist."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stubs(request):
    """A recording encoder and decode instance (stubs.Stub), shared by the module."""
    lab = request.module.LAB
    enc, dec = lab.stub("encoder"), lab.stub("decoder")
    yield enc, dec
    enc.stop()
    dec.stop()


@pytest.fixture(scope="module")
def gw(request, stubs):
    """A gateway in front of `stubs`: images only, small limits (200 KB bodies, 50 KB
    media items)."""
    enc, dec = stubs
    g = request.module.LAB.gateway([enc.url], [dec.url],
                                   limits={"max_request_bytes": 200_000,
                                           "max_media_bytes": 50_000},
                                   media={"modalities": ["image"]})
    yield g
    g.stop()
