"""bench/icache_probe.py's CPU side: the PTX it writes assembles, each block's
copy is the straight line of FMAs the table's code sizes say, and the ELF
reading it sizes them with."""
import importlib.util
import re
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("icache_probe", Path(__file__).parent.parent / "bench" / "icache_probe.py")
icache_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(icache_probe)


@pytest.mark.parametrize("kb", [2, 8])
def test_each_copy_is_a_straight_line_of_its_fmas(kb, tmp_path):
    """ptxas -O3 keeps every FMA of each copy (distinct immediates: nothing to
    fold), and a copy's code is those FMAs plus a fixed few instructions, so
    the code size the probe reports follows --sizes-kb."""
    fmas = icache_probe.fmas_for(kb)
    ptx = icache_probe.ptx_source(fmas, seed=3)
    f0 = ptx[ptx.index(".func (.param .b32 ret) f0("):ptx.index(".func (.param .b32 ret) f1(")]
    assert f0.count("fma.rn.f32") == fmas and "bra" not in f0
    immediates = set(re.findall(r"0f[0-9A-F]{8}", ptx)) - {"0f00000000"}
    assert len(immediates) > 0.99 * fmas * icache_probe.COPIES  # the copies differ (bar chance collisions)

    funcs = icache_probe.elf_functions(icache_probe.assemble(ptx, tmp_path).read_bytes())
    assert {"run", "pointers", "peek"} <= set(funcs)
    for i in range(icache_probe.COPIES):
        code = icache_probe.copy_of(funcs, "run", i)
        instructions = len(code) // icache_probe.FFMA_BYTES
        assert len(code) % icache_probe.FFMA_BYTES == 0
        assert fmas <= instructions <= fmas + 64, (i, instructions)
        assert icache_probe.copy_of(funcs, "pointers", i)  # the copy the pointers kernel names


def test_elf_functions_refuses_what_is_not_a_cubin():
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF file"):
        icache_probe.elf_functions(b"SPARSECONV-CACHE v1 ...")
