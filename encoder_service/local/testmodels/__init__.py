"""Tiny test models, built locally: random weights, a locally trained tokenizer, no downloads.

- spec.py: `ModelSpec` (family, sizes, seed) and the named `SPECS` (tiny, large, vitl32, heavy,
  qwen-vl, qwen-omni, qwen3-vl).
- tokenizer.py: the one tokenizer trainer (byte-level BPE on a fixed corpus).
- llava.py: the LLaVA family (images, raw media only).
- qwen.py: the Qwen family (Qwen2.5-VL, the Qwen2.5-Omni thinker, Qwen3-VL), which also takes
  metadata-only parts.

`epd build-model --out DIR` (or `python -m encoder_service.local.testmodels`). A build is
deterministic (fixed seeds) and idempotent: a directory whose `epd_build.json` matches the
requested spec is left alone, so a second run costs milliseconds.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from encoder_service.local.testmodels.spec import BUILDER_VERSION, SPECS, ModelSpec

__all__ = ["BUILDER_VERSION", "SPECS", "ModelSpec", "build", "main"]


def _build_family(tmp: Path, spec: ModelSpec) -> None:
    if spec.family == "llava":
        from encoder_service.local.testmodels.llava import build_llava

        build_llava(tmp, spec)
    else:
        from encoder_service.local.testmodels.qwen import build_qwen

        build_qwen(tmp, spec)


def build(out: Path, spec: ModelSpec) -> Path:
    """Build the test model of a spec, unless it is built already.

    The model of `spec` in `out`: built into a temporary sibling and moved in whole, or
    left alone when its stamp says it is this spec already. One build at a time per `out`
    across processes (a lock file beside it): a second caller waits, then finds it built."""
    out = Path(out)
    stamp = out / "epd_build.json"
    wanted = {"builder_version": BUILDER_VERSION, **asdict(spec)}

    def current() -> bool:
        return stamp.exists() and json.loads(stamp.read_text()) == wanted

    if current():
        print(f"[model] {out} is up to date ({spec.name}, {spec.family})")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if current():  # another process built it while this one waited
            return out
        print(f"[model] building {spec.name} ({spec.family}) into {out} (random weights, "
              "local tokenizer)")
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
        try:
            _build_family(tmp, spec)
            (tmp / "epd_build.json").write_text(json.dumps(wanted, indent=1))
            if out.exists():
                shutil.rmtree(out)
            tmp.chmod(0o755)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    print(f"[model] done: {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build tiny test models locally (random "
                                     "weights, a locally trained tokenizer, no downloads).")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="the model directory (one --spec)")
    where.add_argument("--models-dir", type=Path,
                       help="build each --spec into DIR/<its name> (tiny -> tiny-llava)")
    parser.add_argument("--spec", choices=sorted(SPECS), action="append",
                        help="repeatable; default tiny")
    args = parser.parse_args(argv)
    specs = [SPECS[name] for name in args.spec or ["tiny"]]
    if args.out is not None:
        if len(specs) > 1:
            parser.error("--out takes one --spec; use --models-dir for several")
        build(args.out, specs[0])
        return
    for spec in specs:
        build(args.models_dir / spec.model_name, spec)
