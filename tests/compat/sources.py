"""What the installed vLLM asks of an EC connector, read from its own sources.

Every `ec_connector.NAME` / `get_ec_transfer().NAME` in vLLM's scheduler, workers and model
runners (V1 and V2), minus the V2 runners' own adapter methods (`maybe_get_output`,
`no_forward`: the runner's `self.ec_connector` is vLLM's adapter object, not the connector)
and the `ec_connector` package's module names (`ec_connector.base` in imports)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

CALL = re.compile(r"\b(?:ec_connector|get_ec_transfer\(\))\.([A-Za-z_]\w*)")


@dataclass
class CallSites:
    names: dict[str, set[str]] = field(default_factory=dict)  # name -> files (relative)

    def add(self, name: str, where: str) -> None:
        self.names.setdefault(name, set()).add(where)


def vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).parent


def adapter_methods(root: Path) -> set[str]:
    """Methods of vLLM's V2 runner adapters (classes in v1/worker/**/ec_connector.py that
    are not connectors)."""
    names: set[str] = set()
    for path in (root / "v1" / "worker").rglob("ec_connector.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not any(
                    "ECConnectorBase" in ast.unparse(b) for b in node.bases):
                names |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def connector_modules(root: Path) -> set[str]:
    pkg = root / "distributed" / "ec_transfer" / "ec_connector"
    return {p.stem for p in pkg.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def runner_files(root: Path) -> list[Path]:
    """The scheduler, engine and worker sources (not the connectors' own package)."""
    files = [*(root / "v1").rglob("*.py"),
             root / "distributed" / "ec_transfer" / "ec_transfer_state.py"]
    return [f for f in files if f.exists()]


def call_sites(root: Path | None = None) -> CallSites:
    root = root or vllm_root()
    skip = adapter_methods(root) | connector_modules(root)
    sites = CallSites()
    for path in runner_files(root):
        text = path.read_text(errors="replace")
        if "ec_connector" not in text and "get_ec_transfer" not in text:
            continue
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ", "#")):
                continue
            for name in CALL.findall(line):
                if name not in skip:
                    sites.add(name, str(path.relative_to(root)))
    return sites


def v2_adapter_modules(root: Path | None = None) -> list[str]:
    """The V2 runners' adapter modules this version ships (GPU; 0.34 adds a CPU one)."""
    root = root or vllm_root()
    return sorted("vllm." + ".".join(p.relative_to(root).with_suffix("").parts)
                  for p in (root / "v1" / "worker").rglob("ec_connector.py"))


def has_v1_gpu_runner(root: Path | None = None) -> bool:
    root = root or vllm_root()
    return (root / "v1" / "worker" / "gpu_model_runner.py").exists()
