"""Loaded at start-up by the side environments of the version lane (scripts/compat.py),
never by .venv or a deployment.

vLLM's GPU wheels (0.33, 0.34) run here on the CPU torch of .venv. Their CPU platform
refuses to build a `VllmConfig` on x86 without Triton ("vLLM on x86 CPUs requires Triton
(triton-cpu)"); PyPI has no triton-cpu. The lane builds configs and drives connectors, it
runs no model, so this lets that one check pass: `CpuPlatform.check_and_update_config`
sees Triton as present for the duration of the call and does the rest of its work as
written. Nothing else in vLLM is touched."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "vllm.platforms.cpu"


def relax_triton_check(module) -> bool:
    cls = getattr(module, "CpuPlatform", None)
    method = cls.__dict__.get("check_and_update_config") if cls is not None else None
    if method is None or getattr(method, "epd_compat", False):
        return False
    func = method.__func__

    def check_and_update_config(klass, vllm_config):
        import vllm.triton_utils as triton_utils

        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return func(klass, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    wrapped = classmethod(check_and_update_config)
    wrapped.epd_compat = True  # type: ignore[attr-defined]
    cls.check_and_update_config = wrapped
    return True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_relax(module):
            exec_module(module)
            relax_triton_check(module)

        spec.loader.exec_module = exec_and_relax
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
