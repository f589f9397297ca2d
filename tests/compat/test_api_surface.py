"""EPDConnector against the installed vLLM's connector API: abstract methods, signatures,
every hook its scheduler and model runners call, the plugin, the factory, the config."""

from __future__ import annotations

import inspect

import pytest

from tests.compat import sources

pytestmark = pytest.mark.compat


def _base():
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

    return ECConnectorBase


def _ours():
    from ec_connectors.connector import EPDConnector

    return EPDConnector


def _params(fn) -> tuple[list[str], set[str], bool]:
    """(positional names after self/cls, keyword-only names, takes **kwargs)."""
    sig = inspect.signature(fn)
    ps = list(sig.parameters.values())
    if ps and ps[0].name in ("self", "cls"):
        ps = ps[1:]
    positional = [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwonly = {p.name for p in ps if p.kind is p.KEYWORD_ONLY}
    return positional, kwonly, any(p.kind is p.VAR_KEYWORD for p in ps)


def signature_problem(base_fn, our_fn) -> str | None:
    """Why a call written against `base_fn`'s signature could fail on `our_fn` (None: none)."""
    bpos, bkw, bvar = _params(base_fn)
    opos, okw, ovar = _params(our_fn)
    if opos[:len(bpos)] != bpos:
        return f"positional parameters {opos} where vLLM has {bpos}"
    extra = inspect.signature(our_fn).parameters
    for name in opos[len(bpos):]:
        if extra[name].default is inspect.Parameter.empty:
            return f"extra required parameter {name!r}"
    if bvar and not ovar:
        return "vLLM's method takes **kwargs (callers pass extra keywords); ours does not"
    missing = bkw - okw
    if missing and not ovar:
        return f"keyword-only parameters {sorted(missing)} missing"
    return None


def _raw(cls, name):
    """The function behind `name` on `cls` (unwrapping classmethods), or None."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            return getattr(attr, "__func__", attr), klass
    return None, None


def test_every_abstract_method_is_implemented_with_a_compatible_signature(report):
    base, ours = _base(), _ours()
    abstract = set(base.__abstractmethods__)
    assert abstract, "this vLLM's ECConnectorBase declares no abstract method"
    missing = sorted(n for n in abstract if n not in ours.__dict__)
    assert not missing, f"EPDConnector does not implement {missing}"
    assert not getattr(ours, "__abstractmethods__", None), ours.__abstractmethods__
    problems = {n: signature_problem(_raw(base, n)[0], _raw(ours, n)[0]) for n in abstract}
    assert not any(problems.values()), {n: p for n, p in problems.items() if p}
    report(f"abstract methods implemented, signatures compatible: {sorted(abstract)}")


def test_every_overridden_method_keeps_vllms_signature(report):
    base, ours = _base(), _ours()
    overridden = sorted(n for n, v in ours.__dict__.items()
                        if not n.startswith("__") and callable(getattr(v, "__func__", v))
                        and _raw(base, n)[0] is not None)
    problems = {n: signature_problem(_raw(base, n)[0], _raw(ours, n)[0]) for n in overridden}
    assert not any(problems.values()), {n: p for n, p in problems.items() if p}
    report(f"{len(overridden)} overridden methods keep vLLM's signatures")


def test_every_hook_vllm_calls_exists_on_the_connector(report):
    sites = sources.call_sites()
    assert {"has_cache_item", "start_load_caches", "save_caches"} <= set(sites.names), \
        "the source scan found none of the core calls: the scan is broken"
    ours, base = _ours(), _base()
    missing = sorted(n for n in sites.names if not hasattr(ours, n))
    assert not missing, {n: sorted(sites.names[n]) for n in missing}
    own = sorted(n for n in sites.names if n in ours.__dict__)
    inherited = sorted(n for n in sites.names if n not in ours.__dict__)
    assert all(_raw(base, n)[0] is not None for n in inherited)
    files = {f for where in sites.names.values() for f in where}
    report(f"{len(sites.names)} hooks vLLM calls ({len(files)} source files): "
           f"{len(own)} ours, inherited from the base: {inherited}")


def test_the_stats_and_metrics_classmethods_build_for_this_version(report):
    ours = _ours()
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

    stats = ours.build_ec_connector_stats({"counters": {"saves": 1}})
    assert isinstance(stats, ECConnectorStats) and not stats.is_empty()
    merged = stats.aggregate(ours.build_ec_connector_stats({"counters": {"saves": 2}}))
    assert merged.reduce()["saves"] == 3
    report("connector stats build and aggregate through this version's ECConnectorStats")


def test_the_plugin_registers_through_vllms_general_plugins(report):
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the entry point, as every vLLM process loads it
    assert "EPDConnector" in ECConnectorFactory._registry
    from vllm.config import ECTransferConfig

    for cfg in (ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_consumer"),
                ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_producer",
                                 ec_connector_module_path="ec_connectors.connector")):
        assert ECConnectorFactory.get_connector_class(cfg) is _ours()
    report("plugin entry point registers EPDConnector; the factory loads it by name and "
           "by module path")


def test_every_ec_transfer_config_field_our_code_reads_exists(report):
    from vllm.config import ECTransferConfig

    read = ("ec_connector", "ec_role", "engine_id", "ec_connector_extra_config",
            "ec_connector_module_path", "is_ec_producer", "is_ec_consumer")
    cfg = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_both",
                           ec_connector_extra_config={"transport": "safetensors"})
    missing = [f for f in read if not hasattr(cfg, f)]
    assert not missing, missing
    assert cfg.is_ec_producer and cfg.is_ec_consumer and cfg.engine_id
    from ec_connectors.config import EPDConfig

    assert EPDConfig.from_dict(cfg.ec_connector_extra_config).transport == "safetensors"
    report(f"ECTransferConfig fields read exist: {list(read)}")


def test_what_this_version_runs_the_connector_through(report):
    """The runners differ by version: 0.34 has no V1 GPU runner (every GPU worker call
    goes through a V2 adapter) and adds a CPU V2 adapter; each adapter is driven by
    tests/ec_connectors/test_v2_runner.py in this lane."""
    adapters = sources.v2_adapter_modules()
    assert "vllm.v1.worker.gpu.ec_connector" in adapters
    import importlib

    for name in adapters:
        mod = importlib.import_module(name)
        assert hasattr(mod, "ActiveECConnector"), name
    report(f"V2 adapters: {adapters}; V1 GPU runner: "
           f"{'present' if sources.has_v1_gpu_runner() else 'gone'}")
