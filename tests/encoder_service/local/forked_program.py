"""The program the fork server tests fork: reports what it was given, or sleeps.

`report CODE`: prints one JSON line (its arguments, working directory, temp directory, a few
variables, its parent, whether it leads its session, what the fork server's preload left)
and exits with CODE. `sleep` (or `serve ...`, standing in for `vllm serve`): sleeps until
signalled. `title NAME`: sets its process title as vLLM titles its processes (setproctitle)
and prints its /proc/self/cmdline."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def preload() -> None:
    """Leave a mark that outlives this module (the child runs it again as __main__)."""
    sys.epd_preloaded_by = os.getpid()


if __name__ == "__main__":
    if sys.argv[1] == "title":
        import setproctitle

        setproctitle.setproctitle(sys.argv[2])
        with open("/proc/self/cmdline", "rb") as f:
            print(json.dumps({"cmdline": f.read().decode(errors="replace")}), flush=True)
        raise SystemExit(0)
    if sys.argv[1] in ("sleep", "serve"):
        print("sleeping", flush=True)
        time.sleep(600)
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
                      "x": os.environ.get("EPD_TEST_X"),
                      "parent_env": os.environ.get("EPD_PARENT_PID"),
                      "ppid": os.getppid(), "leads_session": os.getsid(0) == os.getpid(),
                      "preloaded": getattr(sys, "epd_preloaded_by", None)}), flush=True)
    raise SystemExit(int(sys.argv[2]))
