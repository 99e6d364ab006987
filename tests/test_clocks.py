"""The GPU's state during a benchmark (sparseconv/benchmark/clocks.py): what
makes a run's times suspect, the summary its JSON keeps, a ClockWatch where
NVML cannot answer (CPU), and one that samples a real GPU (gpu)."""
import pytest

from sparseconv.benchmark.clocks import (CLOCK_DROP, ClockSample, ClockWatch, clock_warning, reason_names,
                                         summarise)

POWER_CAP, HW_SLOWDOWN, HW_THERMAL = 0x4, 0x8, 0x40


def _steady(n=4, **kw):
    base = dict(sm_mhz=1980, temperature_c=55, power_w=600.0, reasons=0, processes=1)
    return [ClockSample(**{**base, **kw}) for _ in range(n)]


def test_a_steady_run_is_not_warned_about_even_at_its_power_cap():
    assert clock_warning([]) is None
    assert clock_warning(_steady()) is None
    assert clock_warning(_steady(reasons=POWER_CAP)) is None  # how a busy H100 boosts


def test_a_clock_that_fell_a_slowdown_or_a_second_process_is_named():
    fell = _steady(3) + _steady(1, sm_mhz=int(1980 * CLOCK_DROP) - 1)
    text = clock_warning(fell)
    assert text.startswith("the GPU's state moved during this run (the SM clock ranged 1781-1980 MHz; 4 samples)")
    assert "Rerun on an idle GPU" in text
    assert clock_warning(_steady(3) + _steady(1, sm_mhz=int(1980 * CLOCK_DROP) + 1)) is None
    assert "clocks lowered by hardware slowdown, hardware thermal slowdown" in \
        clock_warning(_steady(2) + _steady(1, reasons=HW_SLOWDOWN | HW_THERMAL | POWER_CAP))
    assert "3 processes computing on the GPU at once" in clock_warning(_steady(2) + _steady(1, processes=3))


def test_reasons_are_named_and_unknown_bits_kept():
    assert reason_names(0) == []
    assert reason_names(POWER_CAP | HW_SLOWDOWN) == ["software power cap", "hardware slowdown"]
    assert reason_names(0x1 | 0x4000) == ["idle", "0x4000"]


def test_the_summary_keeps_each_range():
    samples = _steady(2) + [ClockSample(1410, 71, 699.94, HW_THERMAL, 2)]
    assert summarise(samples) == {"samples": 3, "sm_mhz": [1410, 1980], "temperature_c": [55, 71],
                                  "power_w": [600.0, 699.9], "reasons": ["hardware thermal slowdown"],
                                  "max_processes": 2}
    assert summarise([]) == {"samples": 0}


def test_a_watch_nvml_cannot_serve_samples_nothing_and_says_why():
    """Here no NVML, or (on a GPU machine) no GPU at this bus id: either way
    nothing is sampled, the summary names the reason, and nothing is warned."""
    watch = ClockWatch("0000:FF:1F.7")
    watch.sample()
    summary = watch.summary()
    assert summary["samples"] == 0 and "NVML" in summary["unavailable"], summary
    assert watch.samples == [] and watch.warning() is None


@pytest.mark.gpu
def test_a_watch_samples_the_gpu_it_is_given():
    import cupy

    watch = ClockWatch(cupy.cuda.Device().pci_bus_id)
    assert watch.why_not is None, watch.why_not
    x = cupy.ones((4096, 4096), cupy.float32)
    for _ in range(3):
        (x @ x).sum().item()  # some work, so the clocks are not idle ones
        watch.sample()
    summary = watch.summary()
    assert summary["samples"] == 3
    low, high = summary["sm_mhz"]
    assert 0 < low <= high <= summary["max_sm_mhz_of_gpu"]
    assert 0 < summary["temperature_c"][0] < 120 and summary["power_w"][0] > 0
    assert summary["max_processes"] >= 0 and isinstance(summary["reasons"], list)
