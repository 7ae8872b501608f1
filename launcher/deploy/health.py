"""Health probes for the SuperLink and SuperNodes: GET /health on their HTTP API.

The probe is a stdlib-only Python one-liner, because the official superlink/supernode images hold
Python and Flower but not curl or this project. docker-compose.yml uses it as the healthcheck and
the local launcher runs the very same code to wait for readiness, so the tests exercise it.
"""

from __future__ import annotations

import subprocess
import sys

_PROBE = ("import ssl,sys,urllib.request as u;"
          "c=ssl.create_default_context(cafile=sys.argv[2]) if len(sys.argv)>2 else None;"
          "sys.exit(0 if u.urlopen(sys.argv[1],context=c,timeout=3).status==200 else 1)")


def probe_command(url: str, ca_cert: str | None = None, python: str = "python") -> list[str]:
    """argv that exits 0 when `url` answers 200 (TLS verified against `ca_cert` when given)."""
    return [python, "-c", _PROBE, url, *([ca_cert] if ca_cert else [])]


def healthy(url: str, ca_cert: str | None = None) -> bool:
    """Run the probe here (with this Python)."""
    try:
        done = subprocess.run(probe_command(url, ca_cert, sys.executable), capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0
