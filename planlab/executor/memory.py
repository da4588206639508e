"""A rank's peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the resident set's
high-water mark (``VmHWM``) on a CPU.

:meth:`PeakMemory.reset` starts a new measurement (on Linux the high-water mark is reset
through ``/proc/self/clear_refs``; where that fails the process's lifetime peak is read) and
records the memory in use at that moment as the ``base``: for a CPU rank, the Python
interpreter, torch and the process group, which the simulator's prediction leaves out.
"""

from __future__ import annotations

import resource

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of this process on ``device`` since :meth:`reset`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.kind = "CUDA allocated" if self.cuda else "RSS"
        self.base = 0

    def current(self) -> int:
        """Bytes in use now."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        kib = _status_kib("VmRSS")
        return 1024 * kib if kib is not None else 0

    def reset(self) -> None:
        """Start measuring from now; ``base`` is what is in use now."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets the peak resident set size (Linux >= 4.0)
            except OSError:
                pass
        self.base = self.current()

    def peak(self) -> int:
        """The most in use since :meth:`reset` (bytes)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        kib = _status_kib("VmHWM")
        if kib is None:
            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return 1024 * kib
