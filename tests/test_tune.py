"""CPU: argument checks of the tuning options and the tuning cache kind."""
import numpy as np
import pytest

from sparseconv import compile_conv2d
from sparseconv.cache import ArtifactCache


@pytest.mark.parametrize("kwargs,match", [({"backend": "fastest"}, "backend must be"),
                                          ({"tiling": "best"}, "tiling must be"),
                                          ({"tiling": "auto", "tune_batch": 0}, "tune_batch must be")])
def test_bad_tuning_options_are_refused_before_any_work(kwargs, match):
    w = np.ones((4, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match=match):
        compile_conv2d(w, input_size=(8, 8), **kwargs)


def test_tuning_choices_round_trip_through_the_cache(tmp_path):
    from sparseconv.cache import cache_key

    cache = ArtifactCache(tmp_path)
    key = cache_key("tuning", "layer")
    cache.put_json("tuning", key, {"tiling": {"k_block": 8}, "backend": "dense"})
    assert ArtifactCache(tmp_path).get_json("tuning", key)["backend"] == "dense"
    assert any(e.kind == "tuning" and e.ok for e in cache.entries())
