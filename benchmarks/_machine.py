"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """The CPU model as ``lscpu`` names it, with its family and model numbers and its widest
    vector instructions (two CPUs of one name, AVX2 and AVX-512, differ twofold in the CPU
    kernels' speed), else what ``platform`` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = fields.get("Flags", "").split()
    vector = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                           ("asimd", "NEON")) if flag in flags), None)
    details = [f"family {fields['CPU family']} model {fields['Model']}"
               if "CPU family" in fields and "Model" in fields else None, vector]
    name = fields.get("Model name") or platform.processor() or platform.machine()
    details = ", ".join(d for d in details if d)
    return f"{name}, {details}" if details else name
