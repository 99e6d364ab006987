"""CPU: the arithmetic of sparseconv.timing that does not need a GPU."""
from sparseconv import timing
import numpy as np

from sparseconv.timing import Timing, l2_flush, time_cold


def test_cold_timing_runs_the_preparation_first_and_subtracts_it(monkeypatch):
    """time_cold times [prepare, launch] and [prepare] alone; the launch's time
    is the difference. time_gpu stands in with a clock of fixed costs: the
    GPU timing itself cannot run here."""
    calls = []
    cost = {"flush": 40.0, "layer": 7.5}

    def fake_time_gpu(launch, *, repeat, max_seconds, capture):
        calls.clear()
        launch()
        us = sum(cost[c] for c in calls)
        return Timing(us, "graph", us + 1.0, 3.0, us, 4, note="")

    monkeypatch.setattr(timing, "time_gpu", fake_time_gpu)
    order = []

    def flush():
        calls.append("flush")
        order.append("flush")

    def layer():
        calls.append("layer")
        order.append("layer")

    t = time_cold(layer, flush, repeat=5, max_seconds=0.1, capture=None)
    assert order == ["flush", "layer", "flush"]  # [flush, layer], then [flush] alone
    assert t.us == t.graph_us == 7.5 and t.events_us == 7.5 and t.method == "graph"


def test_a_cold_time_lost_in_the_flushs_spread_gives_the_hot_time(monkeypatch):
    """[flush, layer] timed below [flush] alone (the spread of a long flush
    over a kernel of a few us): the layer's hot time, not 0, which would
    win every tuning."""
    figures = iter([39.0, 40.0, 2.5])  # [flush, layer], [flush], [layer]
    timed = []

    def fake_time_gpu(launch, *, repeat, max_seconds, capture):
        timed.append(launch)
        us = next(figures)
        return Timing(us, "graph", us, 3.0, us, 4, note="")

    monkeypatch.setattr(timing, "time_gpu", fake_time_gpu)

    def layer():
        pass

    t = time_cold(layer, lambda: None, repeat=5, max_seconds=0.1, capture=None)
    assert timed[-1] is layer and len(timed) == 3
    assert t.us == 2.5 and "hot time given" in t.note


def test_l2_flush_overwrites_the_scratch_and_leaves_the_inputs():
    """The real helper on NumPy arrays (same fill / max interface as CuPy)."""
    scratch = np.zeros(1000, np.float32)
    x = np.arange(6, dtype=np.float32)
    l2_flush(scratch, x, None)()
    assert (scratch == 1.0).all() and (x == np.arange(6)).all()


def test_the_flush_scratch_is_twice_the_l2():
    from sparseconv.timing import l2_scratch_floats

    assert l2_scratch_floats(50 << 20) * 4 == 100 << 20  # the H100's 50 MB L2
    assert l2_scratch_floats(None) * 4 == 128 << 20       # a device that does not say: 64 MB assumed
