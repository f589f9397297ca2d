"""Run each test of the given modules alone, each in its own pytest process: a test that
passes only after others (a module fixture's state, counts left by earlier tests) fails
here. Slow (every e2e test starts its module's servers again), so not part of
`./run.sh test`; run it after changing e2e tests, one module at a time or several:

    PYTHONPATH=$PWD flock /tmp/epd-vllm.lock .venv/bin/python tests/run_alone.py \\
        tests/e2e/test_epd_kv.py tests/e2e/test_gateway.py

Extra pytest arguments go after `--` (e.g. `-- -x`). Exit status 1 when any test failed
alone (each failure's last lines are printed), 0 when all passed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collect(modules: list[str]) -> list[str]:
    """The test ids pytest collects from `modules` (its `--collect-only -q` listing)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *modules], cwd=ROOT,
                          capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        sys.exit(f"collecting {modules} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help="test modules (paths)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: more arguments for each pytest run")
    args = parser.parse_args(argv)
    extra = [a for a in args.pytest_args if a != "--"]
    failed: list[str] = []
    ids = collect(args.modules)
    for n, test_id in enumerate(ids, 1):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               test_id, *extra], cwd=ROOT, capture_output=True, text=True)
        ok = done.returncode == 0
        print(f"[{n}/{len(ids)}] {'ok  ' if ok else 'FAIL'} {test_id} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        if not ok:
            failed.append(test_id)
            print("\n".join(done.stdout.splitlines()[-25:]), flush=True)
    print(f"{len(ids) - len(failed)} of {len(ids)} passed alone"
          + (": failed alone: " + ", ".join(failed) if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
