"""The pool's refusals (`epd_pool_rejected_total{code}`) export every known code at 0 from the
start, so `rate()` and the dashboard have a series before the first refusal; every code the
pool counts is one of batching.REJECT_CODES, counted through `PoolStats.reject`. The fake
encoder of fakes.py; the registry the pool's /metrics serves (metrics.make_registry)."""

from __future__ import annotations

import ast

from prometheus_client import generate_latest

from encoder_service.encoder_pool import batching
from encoder_service.encoder_pool.batching import EncoderPool
from encoder_service.encoder_pool.jobs import REJECT_CODES, Worker
from encoder_service.encoder_pool.lifecycle import FeatureStore
from encoder_service.encoder_pool.metrics import make_registry
from tests.encoder_service.encoder_pool.fakes import FakeEncoder
from tests.helpers import ROOT


def samples(pool: EncoderPool) -> set[str]:
    registry, _ = make_registry(pool)
    text = generate_latest(registry).decode()
    return {line for line in text.splitlines() if not line.startswith("#")}


def test_a_fresh_pool_exports_every_refusal_code_at_0():
    pool = EncoderPool([Worker(FakeEncoder(), name="w0")], FeatureStore(1 << 20))
    lines = samples(pool)
    assert set(REJECT_CODES) == {"queue_full", "budget"}
    for code in REJECT_CODES:
        assert f'epd_pool_rejected_total{{code="{code}"}} 0.0' in lines, code
    pool.stats.reject(batching.QUEUE_FULL)
    assert 'epd_pool_rejected_total{code="queue_full"} 1.0' in samples(pool)


def test_every_refusal_is_counted_with_a_known_code():
    """`stats.reject(CODE)` with a constant of REJECT_CODES; nothing writes `rejected[...]`
    itself (so no code can appear that did not start at 0)."""
    calls, writes = [], []
    for path in sorted((ROOT / "encoder_service" / "encoder_pool").glob("*.py")):
        where = path.relative_to(ROOT)
        tree = ast.parse(path.read_text())
        own = {id(n) for f in ast.walk(tree)  # PoolStats.reject's own `rejected[code] += 1`
               if isinstance(f, ast.FunctionDef) and f.name == "reject" for n in ast.walk(f)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "reject"):
                arg = node.args[0]
                ok = isinstance(arg, ast.Name) and getattr(batching, arg.id, None) in REJECT_CODES
                calls.append((f"{where}:{node.lineno}", ok))
            target = node.value if isinstance(node, ast.Subscript) else None
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                    and "rejected" in (getattr(target, "attr", None), getattr(target, "id", None))
                    and id(node) not in own):
                writes.append(f"{where}:{node.lineno}")
    assert len(calls) >= 3, calls  # the batcher's queue and budget, the server's admission
    assert all(ok for _, ok in calls), calls
    assert not writes, writes
