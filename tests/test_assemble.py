"""CPU: PTX version vs driver checks."""
import pytest

from sparseconv.runtime import DriverTooOldError, check_ptx_loadable, max_ptx_version

PTX = ".version {}\n.target sm_90\n.address_size 64\n"


def test_max_ptx_version_follows_cuda_version():
    assert max_ptx_version(13000) == (9, 0)
    assert max_ptx_version(12080) == (8, 8)
    assert max_ptx_version(11080) == (7, 8)


def test_newer_ptx_than_driver_is_refused_with_advice():
    check_ptx_loadable(PTX.format("9.0"), 13000)
    check_ptx_loadable(PTX.format("8.5"), 13000)
    with pytest.raises(DriverTooOldError, match=r"\.version 9\.5.*CUDA 13\.0.*ptxas"):
        check_ptx_loadable(PTX.format("9.5"), 13000)
