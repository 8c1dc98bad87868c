"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """The CPU model as ``lscpu`` names it, else what ``platform`` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()
