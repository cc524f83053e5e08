"""System usage of this process, for the status view: CPU %, resident memory, accelerator.

`UsageSampler().sample()` returns NodeStatus fields; the daemon applies them with
`status.update(**sampler.sample())` every few seconds. Cheap: /proc reads and, when the
process already uses CUDA, torch.cuda's counters. It never imports torch itself (the `status`
and `monitor` commands must start fast) and never raises: what it cannot read is None.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """Resident set size now (Linux /proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        pass
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (OSError, ValueError):
        return None


class UsageSampler:
    def __init__(self, device: str = "cpu"):
        self.device = device
        self._last_cpu = time.process_time()
        self._last_wall = time.monotonic()

    def cpu_percent(self) -> float | None:
        """Process CPU time over wall time since the previous call, % of one core."""
        cpu, wall = time.process_time(), time.monotonic()
        d_cpu, d_wall = cpu - self._last_cpu, wall - self._last_wall
        self._last_cpu, self._last_wall = cpu, wall
        if d_wall <= 0:
            return None
        return round(100.0 * d_cpu / d_wall, 1)

    def accelerator(self) -> dict[str, Any]:
        torch = sys.modules.get("torch")
        if torch is None or not self.device.startswith("cuda"):
            return {}
        out: dict[str, Any] = {}
        try:
            if not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return {}
            index = torch.device(self.device).index or 0
            out["device_name"] = torch.cuda.get_device_name(index)
            out["device_memory_bytes"] = int(torch.cuda.memory_reserved(index))
            free, total = torch.cuda.mem_get_info(index)
            out["device_memory_total_bytes"] = int(total)
        except Exception:  # a driver hiccup must not break the status view
            return out
        try:  # needs NVML (pynvml / nvidia-ml-py); absent on many installs
            out["device_util_percent"] = float(torch.cuda.utilization(index))
        except Exception:
            pass
        return out

    def sample(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"cpu_percent": self.cpu_percent(), "rss_bytes": rss_bytes()}
        fields.update(self.accelerator())
        return fields
