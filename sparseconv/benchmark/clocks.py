"""What the GPU did while a benchmark ran: its SM clock, temperature, power,
the reasons NVML gives for lowered clocks, and how many processes were
computing on it, sampled after each measurement. A run whose clocks fell, or
that shared the GPU, says so in its report instead of passing for slower (or
faster) kernels: session 40's `bench --model` on an H100 timed ResNet-50's
three identical layer1.x.conv3 at batch 64 in 118, 149 and 222 µs, and
cuDNN's figures moved more, with nothing in the report to tell.

Read through NVML (libnvidia-ml.so.1, installed with the NVIDIA driver) by
ctypes, as sparseconv.launch reaches libcuda: no package to add. Where NVML
cannot be loaded or answer, the summary says why and nothing is sampled.

    watch = ClockWatch(cupy.cuda.Device().pci_bus_id)
    ... time something; watch.sample() ...
    watch.summary()   # for the JSON: ranges over the samples, or why there are none
    watch.warning()   # one line for the report where the samples make the times suspect, else None
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

# nvml.h's nvmlClocksEventReason* bits (nvmlClocksThrottleReason* before CUDA 12.2)
REASONS = {0x1: "idle", 0x2: "applications clocks setting", 0x4: "software power cap", 0x8: "hardware slowdown",
           0x10: "sync boost", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
           0x80: "hardware power brake", 0x100: "display clock setting"}
# The reasons warned about: heat or the power hardware pulled the clocks down. A software power
# cap alone is how a busy H100 boosts and is listed, not warned about; the clock range says what it cost.
SLOWDOWNS = 0x8 | 0x20 | 0x40 | 0x80
CLOCK_DROP = 0.9  # warned where the lowest SM clock sampled is below this share of the highest

_NVML_SUCCESS, _NVML_INSUFFICIENT_SIZE = 0, 7
_NVML_CLOCK_SM, _NVML_TEMPERATURE_GPU = 1, 0


@dataclass(frozen=True)
class ClockSample:
    sm_mhz: int
    temperature_c: int
    power_w: float
    reasons: int     # the nvmlClocksEventReason bits at the moment
    processes: int   # compute processes NVML lists on the GPU (this one among them where the container shows it)


def reason_names(mask: int) -> List[str]:
    """The names of the bits set in an NVML clocks-event-reason mask, unknown bits as hex."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([f"{rest:#x}"] if rest else [])


def clock_warning(samples: Sequence[ClockSample]) -> Optional[str]:
    """One line on what in `samples` makes the run's times suspect (the SM
    clock moved by more than CLOCK_DROP allows, a slowdown in SLOWDOWNS,
    another process computing on the GPU), or None."""
    if not samples:
        return None
    problems = []
    low, high = min(s.sm_mhz for s in samples), max(s.sm_mhz for s in samples)
    if low < CLOCK_DROP * high:
        problems.append(f"the SM clock ranged {low}-{high} MHz")
    slow = 0
    for s in samples:
        slow |= s.reasons & SLOWDOWNS
    if slow:
        problems.append("clocks lowered by " + ", ".join(reason_names(slow)))
    most = max(s.processes for s in samples)
    if most > 1:
        problems.append(f"{most} processes computing on the GPU at once")
    if not problems:
        return None
    return (f"the GPU's state moved during this run ({'; '.join(problems)}; {len(samples)} samples): its times "
            f"are suspect. Rerun on an idle GPU, and compare only figures taken in one run")


def summarise(samples: Sequence[ClockSample]) -> Dict[str, Any]:
    """The samples' ranges, for a report's JSON."""
    if not samples:
        return {"samples": 0}
    reasons = 0
    for s in samples:
        reasons |= s.reasons
    return {"samples": len(samples),
            "sm_mhz": [min(s.sm_mhz for s in samples), max(s.sm_mhz for s in samples)],
            "temperature_c": [min(s.temperature_c for s in samples), max(s.temperature_c for s in samples)],
            "power_w": [round(min(s.power_w for s in samples), 1), round(max(s.power_w for s in samples), 1)],
            "reasons": reason_names(reasons), "max_processes": max(s.processes for s in samples)}


class ClockWatch:
    """Samples one GPU (by PCI bus id, as CuPy's Device.pci_bus_id gives it:
    NVML's device order need not be CUDA's) through NVML."""

    def __init__(self, pci_bus_id: str) -> None:
        self.samples: List[ClockSample] = []
        self.why_not: Optional[str] = None
        self.max_sm_mhz: Optional[int] = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as exc:
            self.why_not = f"NVML (libnvidia-ml.so.1) cannot be loaded: {exc}"
            return
        self._lib = lib
        self._handle = ctypes.c_void_p()
        self._reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or getattr(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        self._processes = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        if self._reasons is None:
            self.why_not = "this NVML has no nvmlDeviceGetCurrentClocksEventReasons"
            return
        if not self._call("nvmlInit_v2") or \
                not self._call("nvmlDeviceGetHandleByPciBusId_v2", pci_bus_id.encode(), ctypes.byref(self._handle)):
            return
        top = ctypes.c_uint()
        if self._call("nvmlDeviceGetMaxClockInfo", self._handle, _NVML_CLOCK_SM, ctypes.byref(top)):
            self.max_sm_mhz = top.value

    def _call(self, name: str, *args: Any) -> bool:
        """Call an NVML function; on failure record why (once) and say False."""
        result = getattr(self._lib, name)(*args)
        if result != _NVML_SUCCESS and self.why_not is None:
            text = self._lib.nvmlErrorString
            text.restype = ctypes.c_char_p
            self.why_not = f"NVML's {name} failed: {text(result).decode()} ({result})"
        return result == _NVML_SUCCESS

    def sample(self) -> None:
        """Read the GPU's state now; nothing where NVML is unavailable."""
        if self.why_not is not None:
            return
        sm, temp, milliwatts = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        reasons, count = ctypes.c_ulonglong(), ctypes.c_uint(0)
        ok = (self._call("nvmlDeviceGetClockInfo", self._handle, _NVML_CLOCK_SM, ctypes.byref(sm))
              and self._call("nvmlDeviceGetTemperature", self._handle, _NVML_TEMPERATURE_GPU, ctypes.byref(temp))
              and self._call("nvmlDeviceGetPowerUsage", self._handle, ctypes.byref(milliwatts)))
        if not ok or self._reasons(self._handle, ctypes.byref(reasons)) != _NVML_SUCCESS:
            self.why_not = self.why_not or "NVML's clocks event reasons could not be read"
            return
        # with no room given, NVML answers how many there are (or success where there are none)
        if self._processes is None or self._processes(self._handle, ctypes.byref(count), None) \
                not in (_NVML_SUCCESS, _NVML_INSUFFICIENT_SIZE):
            count.value = 0
        self.samples.append(ClockSample(sm.value, temp.value, milliwatts.value / 1000.0, reasons.value, count.value))

    def summary(self) -> Dict[str, Any]:
        """summarise(samples), with the GPU's top SM clock, or why nothing was sampled."""
        if self.why_not is not None and not self.samples:
            return {"samples": 0, "unavailable": self.why_not}
        return {**summarise(self.samples), "max_sm_mhz_of_gpu": self.max_sm_mhz}

    def warning(self) -> Optional[str]:
        return clock_warning(self.samples)
