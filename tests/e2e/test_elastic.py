"""Elastic roles end to end: a real `epd up --encoders 1:2 --decoders 1:2` (tiny
LLaVA, encoder pools, vLLM decode instances) with short windows and cooldowns from its config.

A burst of new images (six clients, each image new) makes a second encoder and a second
decode instance join within the up window plus their start-up; once both serve, the burst
stops and two long greedy streams open, one on each decode instance (least loaded: text has
no item to follow); with one stream per instance the decode role counts idle (its
`idle_below`), so the newest decode instance is drained with its stream in flight: the stream
completes, exact, then the instance stops; the idle encoder is drained and stopped too. Every
answer equals the aggregated vLLM server's; per role the scale events alternate up and down,
each a cooldown after the last (the decode role: one of each; the encoders, idle while the
decode instance is the bottleneck, may leave and come back during the burst, as the rule
says); the drained instances' processes are gone while `epd up` still
serves, and nothing at all is left once it stops. The gateway's `epd_instances` and
`epd_scale_events_total`, GET /instances' "scaling" and `epd top --once` show it."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from encoder_service.gateway.telemetry import top
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.e2e.client import MODEL_NAME, PROMPT, answer, ask
from tests.helpers import WORK, alive, descendants, epd_up, port_block, wait_for

BASE = port_block(__name__)[0]  # gateway; encoder-0, encoder-1, decode-0, decode-1 after it
ROLE = {"up_window_s": 2, "idle_window_s": 4, "up_cooldown_s": 5, "down_cooldown_s": 5}
PACE_S = 0.1  # each burst client's pause between requests
STREAM = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 960, "ignore_eos": True,
          "return_token_ids": True, "messages": [{"role": "user", "content": PROMPT}]}


def config(model) -> dict:
    return {"model": str(model), "base_port": BASE, "encoders": 1, "decoders": 1,
            "encoder_backend": "pool", "cpu_cores": [0, 1, 1, 0],
            "connector_extra": {"shm_arena_bytes": 64 << 20},
            "scaling": {"encoders_max": 2, "decoders_max": 2, "interval_s": 0.25,
                        "drain_timeout_s": 120,
                        "encoder": {**ROLE, "target": 0.25},
                        # a short idle window: the drain starts while the streams run (one
                        # each counts idle; both on one instance stay under the target)
                        "decode": {**ROLE, "target": 2.5, "idle_below": 1.0,
                                   "idle_window_s": 2}}}


def scaling(client, gw) -> dict:
    return client.get(gw + "/instances").json()["scaling"]


def serving(client, gw) -> dict[str, int]:
    return {r: v["serving"] for r, v in scaling(client, gw)["roles"].items()}


def events(client, gw) -> dict[tuple[str, str], float]:
    out = {}
    for line in client.get(gw + "/metrics").text.splitlines():
        m = re.match(r'epd_scale_events_total\{direction="(\w+)",reason="\w+",role="(\w+)"\} '
                     r"(\S+)", line)
        if m:
            out[(m[2], m[1])] = out.get((m[2], m[1]), 0) + float(m[3])
    return out


class Burst:
    """`n` clients sending new images through `gw` until stopped; each answer kept."""

    def __init__(self, gw: str, n: int) -> None:
        self.answers: dict[int, list[int]] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.next = iter(range(1000, 100000))
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(gw,), daemon=True)
                        for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, gw: str) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.wait(PACE_S):  # paced: fewer answers to check, load enough
                with self.lock:
                    seed = next(self.next)
                try:
                    self.answers[seed] = ask(c, gw, sample_image_png(seed, 64))[
                        "choices"][0]["token_ids"]
                except (AssertionError, httpx.HTTPError) as exc:
                    self.errors.append(f"{seed}: {exc!r}")

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def stream(gw: str, out: dict, key: str, opened: threading.Event) -> None:
    got: list[int] = []
    with httpx.Client(timeout=300) as c, c.stream(
            "POST", gw + "/v1/chat/completions", json={**STREAM, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    out.setdefault("errors", []).append(event)
                    continue
                got += (event["choices"][0].get("token_ids") or []) if event["choices"] else []
                if got:
                    opened.set()
    out[key] = got


@pytest.fixture(scope="module")
def model():
    return build(WORK / "models" / "tiny-llava", SPECS["tiny"])


def test_encoders_and_decoders_grow_under_a_burst_and_drain_when_idle(model, aggregated):
    work = WORK / "test-elastic"
    with httpx.Client(timeout=60) as client, epd_up(config(model), work) as (up, gw, log):
        log_text = log.read_text
        # the scaler attaches its view once `epd up` has started it, after the gateway answers
        assert wait_for(lambda: "scaling" in client.get(gw + "/instances").json(),
                        timeout=30, interval=0.2)
        assert serving(client, gw) == {"encoder": 1, "decode": 1}
        t0 = time.monotonic()
        burst = Burst(gw, 6)
        try:
            # the encoders may come and go meanwhile (idle while decode is the bottleneck)
            assert wait_for(lambda: serving(client, gw)["decode"] == 2
                            and "encoder-1 serving after" in log_text(),
                            timeout=240, interval=0.5), (scaling(client, gw), log_text()[-3000:])
        finally:
            burst.end()
        wall0 = time.time() - (time.monotonic() - t0)
        first_up = {}
        for d in scaling(client, gw)["decisions"]:
            first_up.setdefault((d["role"], d["direction"]), d["at"])
        for role in ("encoder", "decode"):  # within the window (+ sampling) of the burst
            assert first_up[(role, "up")] - wall0 <= ROLE["up_window_s"] + 20, first_up
        started = re.findall(r"scale (\w+): (\S+) serving after (\d+) s", log_text())
        assert {(r, n) for r, n, _ in started} == {("encoder", "encoder-1"),
                                                   ("decode", "decode-1")}
        pids = descendants(up.pid)  # now with the added instances'

        # two long streams, one per decode instance; the newest is drained under its stream
        out: dict = {}
        threads = []
        for key in ("a", "b"):
            opened = threading.Event()
            threads.append(threading.Thread(target=stream, args=(gw, out, key, opened)))
            threads[-1].start()
            assert opened.wait(60), out
        per_instance = {d["url"]: d["inflight"] for d in client.get(
            gw + "/instances").json()["decoders"]}
        assert sorted(per_instance.values()) == [1, 1], per_instance
        assert wait_for(lambda: "decode-1 draining" in log_text(), timeout=30, interval=0.2)
        assert re.search(r"decode-1 draining: .*, 1 request\(s\) in flight", log_text())
        for t in threads:
            t.join(timeout=300)
        assert "errors" not in out, out["errors"]
        aggregated.wait()
        with httpx.Client(timeout=120) as agg:
            reference = agg.post(aggregated.url + "/v1/chat/completions", json=STREAM).json()
        expected = reference["choices"][0]["token_ids"]
        assert out["a"] == expected and out["b"] == expected

        def settled() -> bool:
            roles = scaling(client, gw)["roles"]
            return all((r["serving"], r["starting"], r["draining"]) == (1, 0, 0)
                       for r in roles.values())

        assert wait_for(settled, timeout=120, interval=0.5), log_text()[-3000:]
        assert "decode-1 drained (its requests in flight finished)" in log_text()
        assert "undrained" not in log_text()
        # no more changes than the cooldowns allow: per role up, down, up, ... one at a time,
        # each at least a cooldown after the one before (the encoders, idle while the decode
        # instance is the bottleneck, may leave and come back during the burst)
        counted = events(client, gw)
        decisions = scaling(client, gw)["decisions"]
        for role in ("encoder", "decode"):
            mine = [d for d in decisions if d["role"] == role]
            assert [d["direction"] for d in mine] == ["up", "down"] * (len(mine) // 2), mine
            assert counted[(role, "up")] == counted[(role, "down")] == len(mine) // 2 >= 1
            gaps = [b["at"] - a["at"] for a, b in zip(mine, mine[1:], strict=False)]
            assert all(g >= ROLE["up_cooldown_s"] - 0.5 for g in gaps), gaps
        assert counted[("decode", "up")] == 1  # one burst, one more decode instance
        gone = pids - descendants(up.pid)
        assert gone and not any(alive(p) for p in gone)  # the drained instances' sessions
        frame = io.StringIO()
        assert top.main([gw, "--once"], out=frame) == 0
        assert re.search(r"scale decode down .*decode-1", frame.getvalue()), frame.getvalue()
        metrics = client.get(gw + "/metrics").text
        assert 'epd_instances{role="decode",state="serving"} 1.0' in metrics

        # every burst answer equals the aggregated server's
        assert not burst.errors, burst.errors[:3]
        assert len(burst.answers) >= 6
        with httpx.Client(timeout=120) as agg, ThreadPoolExecutor(4) as pool:
            expected = dict(zip(burst.answers, pool.map(
                lambda seed: answer(agg, aggregated, sample_image_png(seed, 64)),
                burst.answers), strict=True))
        assert burst.answers == expected
    assert up.returncode == 0, log.read_text()[-3000:]
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=15), "left behind"
