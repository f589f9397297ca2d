"""Start a container's command once what it needs is there: files (the model a sibling
container builds) and TCP endpoints (the Mooncake Store master). The compose services' entry
point (/opt/epd/wait_for.py in the image).

Why: compose's `depends_on` conditions are not honoured everywhere. podman-compose before
podman 4.6 ignores `service_healthy` (no systemd: podman schedules no healthchecks), so a
vLLM server could start before the master answers, and the connector would skip the store
tier for good. The dependant waits here instead, so the same file starts in order under
docker compose and podman-compose. A deadline bounds the wait: past it the command starts
anyway (and says what was missing) rather than never.

    python wait_for.py [--file PATH]... [--tcp HOST:PORT]... [--timeout S] -- COMMAND...
Standard library only.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _missing(files: list[str], endpoints: list[str]) -> list[str]:
    out = [f"file {f}" for f in files if not os.path.exists(f)]
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except OSError:
            out.append(f"tcp {ep}")
    return out


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: wait_for.py [--file PATH]... [--tcp HOST:PORT]... -- COMMAND...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="wait_for.py")
    p.add_argument("--file", action="append", default=[])
    p.add_argument("--tcp", action="append", default=[])
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("no command after --")
    deadline = time.monotonic() + args.timeout
    missing = _missing(args.file, args.tcp)
    said = 0.0
    while missing and time.monotonic() < deadline:
        if time.monotonic() - said >= 10:
            print(f"[wait_for] waiting for {', '.join(missing)}", flush=True)
            said = time.monotonic()
        time.sleep(1.0)
        missing = _missing(args.file, args.tcp)
    if missing:
        print(f"[wait_for] still missing after {args.timeout:.0f} s: {', '.join(missing)}; "
              "starting anyway", flush=True)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
