"""The work directory: where `epd up` keeps its logs, secrets and sockets, the test models are
built (`models/`), and benchmarks write their results. `$EPD_WORK_DIR`, else `.work` under a
base directory: the current one for the `epd` commands, the checkout for tests and benchmarks.
(`scripts/setup_env.py` runs before the virtualenv exists and keeps its own copy of the rule.)"""

from __future__ import annotations

import os
from pathlib import Path


def work_dir(base: Path | None = None) -> Path:
    """`$EPD_WORK_DIR`, else `<base>/.work` (default base: the current directory)."""
    return Path(os.environ.get("EPD_WORK_DIR", (base or Path.cwd()) / ".work")).resolve()
