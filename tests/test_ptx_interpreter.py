"""CPU tests for tests/ptx_interpreter.py, the PTX interpreter CI uses instead of a GPU.

Every kernel here is hand-written PTX, checked by ptxas when it is built if ptxas is
on PATH (so the interpreter is tested on real PTX, not on a dialect of its own),
except the last test, which compiles a template-like CUDA source with nvcc and
rewrites it the way the specialiser does.

On a machine with a GPU, PTX_INTERPRETER_CROSSCHECK=1 makes every successful
launch also run on the GPU (through the CUDA driver API) and requires the GPU's
output buffers to equal the interpreter's, bit for bit (NaN payloads aside).
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ptx_interpreter import LAST_RUN_STATS, PtxInterpreterError, run_kernel

HEADER = ".version 8.0\n.target sm_90\n.address_size 64\n"


@functools.lru_cache(maxsize=None)
def ptxas_errors(ptx: str) -> str:
    """ptxas's complaints about a module ('' if it compiles or there is no ptxas)."""
    if shutil.which("ptxas") is None:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        res = subprocess.run(["ptxas", "-arch=sm_90", str(path), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    return "" if res.returncode == 0 else res.stderr or res.stdout or "ptxas failed"


def gpu_run_kernel(ptx: str, entry: str, grid, block, args, dynamic_shared_bytes: int = 0) -> None:
    """run_kernel's contract, on the GPU, through the CUDA driver API."""
    from ptx_interpreter import _parse  # param types of the entry

    cuda = ctypes.CDLL("libcuda.so.1")

    def ok(status: int) -> None:
        if status:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"CUDA error {status} {name.value}")

    ok(cuda.cuInit(0))
    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    ok(cuda.cuDeviceGet(ctypes.byref(dev), 0))
    ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    ok(cuda.cuCtxSetCurrent(ctx))
    ok(cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(ptx.encode() + b"\0")))
    ok(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, entry.encode()))
    ok(cuda.cuFuncSetAttribute(fn, 8, max(dynamic_shared_bytes, 0)))  # max dynamic shared size
    values, buffers = [], []
    for (_, t), arg in zip(_parse(ptx).funcs[entry].params, args):
        if isinstance(arg, np.ndarray):
            ptr = ctypes.c_uint64()
            ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), max(arg.nbytes, 1)))
            ok(cuda.cuMemcpyHtoD_v2(ptr, arg.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(arg.nbytes)))
            buffers.append((ptr, arg))
            values.append(ptr)
        elif t == "f32":
            values.append(ctypes.c_float(arg))
        else:
            values.append({4: ctypes.c_uint32, 8: ctypes.c_uint64}[int(t[1:]) // 8](int(arg) & (2 ** int(t[1:]) - 1)))
    params = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    ok(cuda.cuLaunchKernel(fn, *grid, *block, dynamic_shared_bytes, None, params, None))
    ok(cuda.cuCtxSynchronize())
    for ptr, arr in buffers:
        ok(cuda.cuMemcpyDtoH_v2(arr.ctypes.data_as(ctypes.c_void_p), ptr, ctypes.c_size_t(arr.nbytes)))
        ok(cuda.cuMemFree_v2(ptr))
    ok(cuda.cuModuleUnload(mod))


def launch(ptx: str, entry: str, grid, block, args, dynamic_shared_bytes: int = 0) -> None:
    """run_kernel, cross-checked against the GPU when PTX_INTERPRETER_CROSSCHECK=1."""
    if os.environ.get("PTX_INTERPRETER_CROSSCHECK") != "1":
        return run_kernel(ptx, entry, grid, block, args, dynamic_shared_bytes)
    on_gpu = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    gpu_run_kernel(ptx, entry, grid, block, on_gpu, dynamic_shared_bytes)
    run_kernel(ptx, entry, grid, block, args, dynamic_shared_bytes)
    for i, (mine, theirs) in enumerate(zip(args, on_gpu)):
        if isinstance(mine, np.ndarray):
            if mine.dtype.itemsize == 4:  # maybe float bits: the GPU's NaNs are 0x7FFFFFFF
                assert_same_f32(mine.view(np.float32), theirs.view(np.float32))
            else:
                np.testing.assert_array_equal(mine, theirs, err_msg=f"arg {i}: interpreter != GPU")


def kernel(name: str, body: str) -> str:
    """A hand-written PTX module, checked by ptxas."""
    ptx = HEADER + body
    errors = ptxas_errors(ptx)
    assert not errors, f"kernel {name} is not valid PTX: {errors}"
    return ptx


# ------------------------------------------------------------------ reference helpers
def s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def u32(v: int) -> int:
    return v & 0xFFFFFFFF


def u64(v: int) -> int:
    return v & ((1 << 64) - 1)


def tdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def trem(a: int, b: int) -> int:
    return a - b * tdiv(a, b)


def f32(bits: int) -> np.float32:
    return np.array(bits, np.uint32).view(np.float32)[()]


def bits_of(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def round_to_f32(q: Fraction) -> np.float32:
    """Round an exact rational to float32, to nearest, ties to even."""
    limit = Fraction(2 ** 128 - 2 ** 103)  # halfway between FLT_MAX and 2^128
    if q >= limit:
        return np.float32(np.inf)
    if q <= -limit:
        return np.float32(-np.inf)
    f = np.float32(float(q))  # at most one float32 step away
    best = None
    for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        if np.isfinite(c):
            key = (abs(Fraction(float(c)) - q), int(bits_of(c)) & 1)
            if best is None or key < best[0]:
                best = (key, c)
    return np.float32(best[1])


def exact_fma32(a, b, c) -> np.float32:
    """fma with one rounding, computed with rationals (the independent reference)."""
    if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)) or (a == 0 or b == 0) and c == 0:
        # IEEE rules for inf/NaN and for the sign of 0 * b + 0, where float64 is exact.
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    return round_to_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def assert_same_f32(got, want) -> None:
    """Bit-identical float32 arrays (any NaN matches any NaN)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    bad = (nan_g != nan_w) | (~nan_g & (bits_of(got) != bits_of(want)))
    assert not bad.any(), (f"{bad.sum()} mismatches, first at {np.argwhere(bad)[0]}: "
                           f"got {got[bad][:4]} want {want[bad][:4]}")


# ------------------------------------------------------------------ 32-bit integer ops
# Each op reads %ra, %rb (and %rsh = b & 63) and leaves its result in %ro.
INT32_OPS = [
    ("add.s32 %ro, %ra, %rb", lambda a, b, sh: a + b),
    ("sub.s32 %ro, %ra, %rb", lambda a, b, sh: a - b),
    ("mul.lo.s32 %ro, %ra, %rb", lambda a, b, sh: a * b),
    ("mul.lo.s32 %ro, %ra, -1431655765", lambda a, b, sh: a * -1431655765),
    ("mul.hi.s32 %ro, %ra, %rb", lambda a, b, sh: (a * b) >> 32),
    ("mul.hi.u32 %ro, %ra, %rb", lambda a, b, sh: (u32(a) * u32(b)) >> 32),
    ("mad.lo.s32 %ro, %ra, %rb, -7", lambda a, b, sh: a * b - 7),
    ("mad.hi.u32 %ro, %ra, %rb, %ra", lambda a, b, sh: ((u32(a) * u32(b)) >> 32) + a),
    ("div.s32 %ro, %ra, %rb", lambda a, b, sh: tdiv(a, b)),
    ("rem.s32 %ro, %ra, %rb", lambda a, b, sh: trem(a, b)),
    ("div.u32 %ro, %ra, %rb", lambda a, b, sh: u32(a) // u32(b)),
    ("rem.u32 %ro, %ra, %rb", lambda a, b, sh: u32(a) % u32(b)),
    ("neg.s32 %ro, %ra", lambda a, b, sh: -a),
    ("abs.s32 %ro, %ra", lambda a, b, sh: abs(a)),
    ("min.s32 %ro, %ra, %rb", lambda a, b, sh: min(a, b)),
    ("max.s32 %ro, %ra, %rb", lambda a, b, sh: max(a, b)),
    ("min.u32 %ro, %ra, %rb", lambda a, b, sh: min(u32(a), u32(b))),
    ("max.u32 %ro, %ra, %rb", lambda a, b, sh: max(u32(a), u32(b))),
    ("and.b32 %ro, %ra, -2", lambda a, b, sh: a & -2),
    ("or.b32 %ro, %ra, %rb", lambda a, b, sh: a | b),
    ("xor.b32 %ro, %ra, 0xF0F0F0F0", lambda a, b, sh: a ^ 0xF0F0F0F0),
    ("not.b32 %ro, %ra", lambda a, b, sh: ~a),
    ("shl.b32 %ro, %ra, 7", lambda a, b, sh: a << 7),
    ("shl.b32 %ro, %ra, %rsh", lambda a, b, sh: a << sh if sh < 32 else 0),
    ("shr.s32 %ro, %ra, 3", lambda a, b, sh: a >> 3),
    ("shr.u32 %ro, %ra, 3", lambda a, b, sh: u32(a) >> 3),
    ("shr.b32 %ro, %ra, 3", lambda a, b, sh: u32(a) >> 3),
    ("shr.s32 %ro, %ra, 40", lambda a, b, sh: a >> 31),
    ("shr.s32 %ro, %ra, %rsh", lambda a, b, sh: a >> min(sh, 31)),
    ("shr.u32 %ro, %ra, %rsh", lambda a, b, sh: u32(a) >> sh if sh < 32 else 0),
    # bit-field insert: a's low 30 bits into b at bit 2 (what NVVM makes of
    # (b & 3) | (a << 2)); a run-time position with 5 bits
    ("bfi.b32 %ro, %ra, %rb, 2, 30", lambda a, b, sh: (b & 3) | (a << 2)),
    ("bfi.b32 %ro, %ra, %rb, %rsh, 5",
     lambda a, b, sh: (b & ~(31 << sh)) | ((a & 31) << sh) if sh < 32 else b),
    ("add.sat.s32 %ro, %ra, %rb", lambda a, b, sh: min(max(a + b, -2 ** 31), 2 ** 31 - 1)),
    ("setp.lt.s32 %p1, %ra, %rb;\n\tselp.u32 %ro, 1, 0, %p1", lambda a, b, sh: int(a < b)),
    ("setp.lo.u32 %p1, %ra, %rb;\n\tselp.b32 %ro, %ra, %rb, %p1", lambda a, b, sh: a if u32(a) < u32(b) else b),
    ("setp.hs.u32 %p1, %ra, %rb;\n\tselp.u32 %ro, 1, 0, %p1", lambda a, b, sh: int(u32(a) >= u32(b))),
    ("setp.le.s32 %p1, %ra, -5;\n\tselp.u32 %ro, 1, 0, %p1", lambda a, b, sh: int(a <= -5)),
    ("setp.ne.b32 %p1, %ra, %rb;\n\tselp.u32 %ro, 1, 0, %p1", lambda a, b, sh: int(a != b)),
    ("mul.wide.s32 %dw, %ra, %rb;\n\tcvt.u32.u64 %ro, %dw", lambda a, b, sh: a * b),
    ("mul.wide.s32 %dw, %ra, %rb;\n\tshr.u64 %dw, %dw, 32;\n\tcvt.u32.u64 %ro, %dw", lambda a, b, sh: (a * b) >> 32),
    ("mul.wide.u32 %dw, %ra, %rb;\n\tshr.u64 %dw, %dw, 34;\n\tcvt.u32.u64 %ro, %dw",
     lambda a, b, sh: (u32(a) * u32(b)) >> 34),
    ("cvt.s64.s32 %dw, %ra;\n\tshr.u64 %dw, %dw, 32;\n\tcvt.u32.u64 %ro, %dw", lambda a, b, sh: -1 if a < 0 else 0),
    ("cvt.u64.u32 %dw, %ra;\n\tshr.u64 %dw, %dw, 32;\n\tcvt.u32.u64 %ro, %dw", lambda a, b, sh: 0),
    ("mov.b32 %ro, 0f3F800000", lambda a, b, sh: 0x3F800000),
    ("mov.u32 %ro, 017", lambda a, b, sh: 15),
]


def int32_kernel() -> str:
    lines = []
    for k, (op, _) in enumerate(INT32_OPS):
        lines.append(f"\t{op};\n\tst.global.u32 [%rd8+{4 * k}], %ro;")
    body = "\n".join(lines)
    return kernel("int32", f"""
.visible .entry int32_ops(.param .u64 pa, .param .u64 pb, .param .u64 pout, .param .u32 n)
{{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b32 %ra, %rb, %ro, %rsh;
	.reg .b64 %rd<9>;
	.reg .b64 %dw;

	ld.param.u64 %rd1, [pa];
	ld.param.u64 %rd2, [pb];
	ld.param.u64 %rd3, [pout];
	ld.param.u32 %r5, [n];
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, %tid.x;
	mad.lo.s32 %r4, %r1, %r2, %r3;
	setp.ge.u32 %p2, %r4, %r5;
	@%p2 bra $L_done;
	cvta.to.global.u64 %rd1, %rd1;
	mul.wide.u32 %rd4, %r4, 4;
	add.s64 %rd5, %rd1, %rd4;
	ld.global.u32 %ra, [%rd5];
	add.s64 %rd6, %rd2, %rd4;
	ld.global.nc.u32 %rb, [%rd6];
	and.b32 %rsh, %rb, 63;
	mul.lo.s32 %r6, %r4, {len(INT32_OPS)};
	mul.wide.u32 %rd7, %r6, 4;
	add.s64 %rd8, %rd3, %rd7;
{body}
$L_done:
	ret;
}}
""")


def int32_inputs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    edges = [0, 1, -1, 2, -2, 7, -7, 2 ** 31 - 1, -2 ** 31, 2 ** 30, 12345, -98765]
    pairs = [(x, y) for x in edges for y in edges if y != 0 and not (x == -2 ** 31 and y == -1)]
    a = [x for x, _ in pairs] + rng.integers(-2 ** 31, 2 ** 31, n - len(pairs)).tolist()
    b = [y for _, y in pairs] + rng.integers(-2 ** 31, 2 ** 31, n - len(pairs)).tolist()
    b = [v or 3 for v in b]  # no division by zero
    return np.array(a, np.int32), np.array(b, np.int32)


def test_int32_arithmetic_wraps_and_signedness():
    n = 200
    a, b = int32_inputs(n, seed=1)
    out = np.full((n, len(INT32_OPS)), 0xDEADBEEF, np.uint32)
    # 4 blocks of 64 threads: the last 56 threads are out of range and must not store.
    launch(int32_kernel(), "int32_ops", (4, 1, 1), (64, 1, 1), [a, b, out, n])
    for k, (op, ref) in enumerate(INT32_OPS):
        want = np.array([u32(ref(int(x), int(y), int(y) & 63)) for x, y in zip(a, b)], np.uint32)
        np.testing.assert_array_equal(out[:, k], want, err_msg=op)


# ------------------------------------------------------------------ 64-bit integer ops
INT64_OPS = [
    ("add.s64 %do, %da, %db", lambda a, b: a + b),
    ("sub.s64 %do, %da, %db", lambda a, b: a - b),
    ("mul.lo.s64 %do, %da, %db", lambda a, b: a * b),
    ("mul.lo.s64 %do, %da, 105", lambda a, b: a * 105),
    ("mul.hi.u64 %do, %da, %db", lambda a, b: (u64(a) * u64(b)) >> 64),
    ("mul.hi.s64 %do, %da, %db", lambda a, b: (a * b) >> 64),
    ("mad.lo.s64 %do, %da, %db, %da", lambda a, b: a * b + a),
    ("div.s64 %do, %da, %db", lambda a, b: tdiv(a, b)),
    ("rem.s64 %do, %da, %db", lambda a, b: trem(a, b)),
    ("div.u64 %do, %da, %db", lambda a, b: u64(a) // u64(b)),
    ("neg.s64 %do, %da", lambda a, b: -a),
    ("min.s64 %do, %da, %db", lambda a, b: min(a, b)),
    ("max.u64 %do, %da, %db", lambda a, b: max(u64(a), u64(b))),
    ("shl.b64 %do, %da, 40", lambda a, b: a << 40),
    ("shr.s64 %do, %da, 63", lambda a, b: a >> 63),
    ("shr.u64 %do, %da, 5", lambda a, b: u64(a) >> 5),
    ("xor.b64 %do, %da, %db", lambda a, b: a ^ b),
    ("cvt.u32.u64 %r1, %da;\n\tcvt.s64.s32 %do, %r1", lambda a, b: s32(a)),
    ("cvt.u32.u64 %r1, %da;\n\tcvt.u32.u64 %r2, %db;\n\tmad.wide.s32 %do, %r1, %r2, %da",
     lambda a, b: s32(a) * s32(b) + a),
    ("cvt.u32.u64 %r1, %da;\n\tmul.wide.u32 %do, %r1, -1431655765", lambda a, b: u32(a) * 2863311531),
    ("setp.gt.s64 %p1, %da, %db;\n\tselp.b64 %do, %da, 77, %p1", lambda a, b: a if a > b else 77),
    ("setp.ls.u64 %p1, %da, %db;\n\tselp.b64 %do, 1, 0, %p1", lambda a, b: int(u64(a) <= u64(b))),
]


def test_int64_arithmetic():
    rng = np.random.default_rng(2)
    edges = [0, 1, -1, 3, 2 ** 63 - 1, -2 ** 63, 2 ** 32 + 5, -(2 ** 40) - 3]
    pairs = [(x, y) for x in edges for y in edges if y != 0 and not (x == -2 ** 63 and y == -1)]
    n = len(pairs) + 40
    a = np.array([x for x, _ in pairs] + rng.integers(-2 ** 63, 2 ** 63 - 1, 40).tolist(), np.int64)
    b = np.array([y for _, y in pairs] + rng.integers(1, 2 ** 62, 40).tolist(), np.int64)
    lines = "\n".join(f"\t{op};\n\tst.global.u64 [%rd8+{8 * k}], %do;" for k, (op, _) in enumerate(INT64_OPS))
    ptx = kernel("int64", f"""
.visible .entry int64_ops(.param .u64 pa, .param .u64 pb, .param .u64 pout, .param .u32 n)
{{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<9>;
	.reg .b64 %da, %db, %do;

	ld.param.u64 %rd1, [pa];
	ld.param.u64 %rd2, [pb];
	ld.param.u64 %rd3, [pout];
	ld.param.u32 %r5, [n];
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, %tid.x;
	mad.lo.s32 %r4, %r1, %r2, %r3;
	setp.ge.u32 %p2, %r4, %r5;
	@%p2 bra $L_done;
	mul.wide.u32 %rd4, %r4, 8;
	add.s64 %rd5, %rd1, %rd4;
	ld.global.u64 %da, [%rd5];
	add.s64 %rd6, %rd2, %rd4;
	ld.global.u64 %db, [%rd6];
	mul.lo.s32 %r6, %r4, {len(INT64_OPS)};
	mul.wide.u32 %rd7, %r6, 8;
	add.s64 %rd8, %rd3, %rd7;
{lines}
$L_done:
	ret;
}}
""")
    out = np.zeros((n, len(INT64_OPS)), np.uint64)
    launch(ptx, "int64_ops", (-(-n // 32), 1, 1), (32, 1, 1), [a, b, out, n])
    for k, (op, ref) in enumerate(INT64_OPS):
        want = np.array([u64(ref(int(x), int(y))) for x, y in zip(a, b)], np.uint64)
        np.testing.assert_array_equal(out[:, k], want, err_msg=op)


# ------------------------------------------------------------------ float ops
NAN, INF, NINF = "0f7FC00000", "0f7F800000", "0fFF800000"
F32_OPS = [
    ("add.f32 %fo, %fa, %fb", lambda a, b, c: a + b),
    ("sub.f32 %fo, %fa, %fb", lambda a, b, c: a - b),
    ("mul.f32 %fo, %fa, %fb", lambda a, b, c: a * b),
    ("mul.rn.f32 %fo, %fa, 0f3F82B3C5", lambda a, b, c: a * f32(0x3F82B3C5)),
    ("fma.rn.f32 %fo, %fa, %fb, %fc", exact_fma32),
    ("fma.rn.f32 %fo, %fa, 0f3F82B3C5, %fc", lambda a, b, c: exact_fma32(a, f32(0x3F82B3C5), c)),
    ("mad.rn.f32 %fo, %fc, %fb, %fa", lambda a, b, c: exact_fma32(c, b, a)),
    (f"fma.rn.f32 %fo, %fa, {NAN}, %fc", lambda a, b, c: np.float32(np.nan)),
    (f"add.f32 %fo, %fa, {INF}", lambda a, b, c: a + np.float32(np.inf)),
    (f"fma.rn.f32 %fo, %fa, {INF}, {NINF}", lambda a, b, c: np.float32(a * np.inf - np.inf)),
    (f"mov.f32 %fo, {NINF}", lambda a, b, c: np.float32(-np.inf)),
    ("mov.f32 %fo, 0f00000000", lambda a, b, c: np.float32(0)),
    ("neg.f32 %fo, %fa", lambda a, b, c: -a),
    ("abs.f32 %fo, %fb", lambda a, b, c: abs(b)),
    ("min.f32 %fo, %fa, %fb", lambda a, b, c: np.fmin(a, b)),
    ("max.f32 %fo, %fa, %fb", lambda a, b, c: np.fmax(a, b)),
    (f"max.f32 %fo, %fa, {NAN}", lambda a, b, c: a),
    ("div.rn.f32 %fo, %fa, %fb", lambda a, b, c: a / b),
    ("rcp.rn.f32 %fo, %fb", lambda a, b, c: np.float32(1) / b),
    ("abs.f32 %fo, %fa;\n\tsqrt.rn.f32 %fo, %fo", lambda a, b, c: np.sqrt(abs(a))),
    # .ftz flushes the subnormal operand (and a subnormal a) to zero first.
    ("add.ftz.f32 %fo, %fa, 0f00000001",
     lambda a, b, c: (a if abs(a) >= np.finfo(np.float32).tiny else np.float32(0) * a) + np.float32(0)),
    ("add.sat.f32 %fo, %fa, %fb", lambda a, b, c: np.float32(0) if not a + b > 0 else min(a + b, np.float32(1))),
    ("setp.ne.f32 %p1, %fa, %fb;\n\tselp.f32 %fo, 0f3F800000, 0f00000000, %p1",
     lambda a, b, c: np.float32(a != b and not np.isnan(a) and not np.isnan(b))),
    ("setp.neu.f32 %p1, %fa, %fb;\n\tselp.f32 %fo, 0f3F800000, 0f00000000, %p1",
     lambda a, b, c: np.float32(not (a == b))),
    ("setp.ltu.f32 %p1, %fa, %fb;\n\tselp.f32 %fo, 0f3F800000, 0f00000000, %p1",
     lambda a, b, c: np.float32(not (a >= b))),
    ("setp.nan.f32 %p1, %fa, %fb;\n\tselp.f32 %fo, 0f3F800000, 0f00000000, %p1",
     lambda a, b, c: np.float32(np.isnan(a) or np.isnan(b))),
    ("mov.b32 %r1, %fa;\n\txor.b32 %r1, %r1, -2147483648;\n\tmov.b32 %fo, %r1", lambda a, b, c: -a),
]


def f32_inputs():
    """Scales from subnormal to huge, specials, and fma cases where rounding the
    float64 sum a second time would be wrong (double rounding)."""
    rng = np.random.default_rng(3)
    one_ulp = 2.0 ** -23
    special = [
        # a*b + c = 1 + 3*2^-24 - 2^-70: float64 rounds to the float32 midpoint
        # 1 + 3*2^-24, which ties to even 1 + 2^-22; the right answer is 1 + 2^-23.
        (1 + one_ulp, (1 - one_ulp) * 2.0 ** -24, 1 + one_ulp),
        (-(1 + one_ulp), (1 - one_ulp) * 2.0 ** -24, -(1 + one_ulp)),
        (1 + one_ulp, (1 + one_ulp) * 2.0 ** -24, 1.0),  # just above a midpoint
        (2.0 ** -70, 2.0 ** -70, 2.0 ** -149),  # subnormal result
        (1.5 * 2.0 ** -75, 2.0 ** -75, 3 * 2.0 ** -149),
        (3.0e38, 2.0, -3.0e38),  # product overflows float32 but not the fma
        (3.4e38, 1.0, 3.4e38),  # overflow to inf
        (0.0, -1.0, 0.0), (-0.0, 1.0, -0.0), (np.nan, 1.0, 2.0), (np.inf, 0.0, 1.0),
        (1e-45, 1e-45, 0.0), (1.0, 1.0, -1.0), (2.5, -4.0, 1e-30),
    ]
    a = [x for x, _, _ in special]
    b = [y for _, y, _ in special]
    c = [z for _, _, z in special]
    for scale in (1e-40, 1e-20, 1e-3, 1.0, 1e3, 1e20, 1e37):
        a += (rng.standard_normal(12) * scale).tolist()
        b += (rng.standard_normal(12) * 3).tolist()
        c += (rng.standard_normal(12) * scale).tolist()
    # Many products of random float32 close to -c: cancellation exercises the tails.
    x, y = rng.standard_normal(60).astype(np.float32), rng.standard_normal(60).astype(np.float32)
    a += x.tolist()
    b += y.tolist()
    c += (-(x.astype(np.float64) * y)).astype(np.float32).tolist()
    return np.array(a, np.float32), np.array(b, np.float32), np.array(c, np.float32)


def test_double_rounding_case_is_real():
    """The first special input really breaks the naive float64 fma."""
    a, b, c = (np.float32(v) for v in (1 + 2.0 ** -23, (1 - 2.0 ** -23) * 2.0 ** -24, 1 + 2.0 ** -23))
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert exact_fma32(a, b, c) == np.float32(1 + 2.0 ** -23)
    assert naive == np.float32(1 + 2.0 ** -22)


def test_f32_ops_are_bit_exact():
    a, b, c = f32_inputs()
    n = a.size
    lines = "\n".join(f"\t{op};\n\tst.global.f32 [%rd8+{4 * k}], %fo;" for k, (op, _) in enumerate(F32_OPS))
    ptx = kernel("f32", f"""
.visible .entry f32_ops(.param .u64 pa, .param .u64 pb, .param .u64 pc, .param .u64 pout, .param .u32 n)
{{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .f32 %fa, %fb, %fc, %fo;
	.reg .b64 %rd<9>;

	ld.param.u64 %rd1, [pa];
	ld.param.u64 %rd2, [pb];
	ld.param.u64 %rd3, [pc];
	ld.param.u32 %r5, [n];
	mov.u32 %r3, %tid.x;
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %ntid.x;
	mad.lo.s32 %r4, %r1, %r2, %r3;
	setp.ge.u32 %p2, %r4, %r5;
	@%p2 bra $L_done;
	mul.wide.u32 %rd4, %r4, 4;
	add.s64 %rd5, %rd1, %rd4;
	ld.global.f32 %fa, [%rd5];
	add.s64 %rd5, %rd2, %rd4;
	ld.global.f32 %fb, [%rd5];
	add.s64 %rd5, %rd3, %rd4;
	ld.global.f32 %fc, [%rd5];
	ld.param.u64 %rd3, [pout];
	mul.lo.s32 %r6, %r4, {len(F32_OPS)};
	mul.wide.u32 %rd7, %r6, 4;
	add.s64 %rd8, %rd3, %rd7;
{lines}
$L_done:
	ret;
}}
""")
    out = np.zeros((n, len(F32_OPS)), np.float32)
    launch(ptx, "f32_ops", (-(-n // 64), 1, 1), (64, 1, 1), [a, b, c, out, n])
    with np.errstate(all="ignore"):
        for k, (op, ref) in enumerate(F32_OPS):
            want = np.array([ref(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
            assert_same_f32(out[:, k], want)
    # The double-rounding input was computed right (see test_double_rounding_case_is_real).
    assert out[0, 4] == np.float32(1 + 2.0 ** -23)
    assert out[1, 4] == np.float32(-(1 + 2.0 ** -23))


CVT_OPS = [
    # (PTX producing %ro bits from %fa (f32) and %ra (s32), reference(f, i) -> uint32 bits)
    ("cvt.rzi.s32.f32 %ro, %fa", "rzi"),
    ("cvt.rni.s32.f32 %ro, %fa", "rni"),
    ("cvt.rmi.s32.f32 %ro, %fa", "rmi"),
    ("cvt.rpi.s32.f32 %ro, %fa", "rpi"),
    ("cvt.rzi.u32.f32 %ro, %fa", "rzi_u"),
    ("cvt.rn.f32.s32 %fo, %ra;\n\tmov.b32 %ro, %fo", "i2f"),
    ("cvt.rn.f32.u32 %fo, %ra;\n\tmov.b32 %ro, %fo", "u2f"),
    ("cvt.rni.f32.f32 %fo, %fa;\n\tmov.b32 %ro, %fo", "rint"),
    ("cvt.f64.f32 %dd, %fa;\n\tadd.f64 %dd, %dd, 0d3FF0000000000000;\n\tcvt.rn.f32.f64 %fo, %dd;\n\tmov.b32 %ro, %fo",
     "plus1_f64"),
    ("cvt.s64.s32 %rdw, %ra;\n\tcvt.rn.f32.s64 %fo, %rdw;\n\tmov.b32 %ro, %fo", "i2f"),
]


def cvt_reference(kind: str, f: np.float32, i: int) -> int:
    def sat(v, lo, hi):
        return 0 if np.isnan(v) else int(min(max(v, lo), hi))
    fl = float(f)
    if kind in ("rzi", "rni", "rmi", "rpi"):
        r = {"rzi": np.trunc, "rni": np.rint, "rmi": np.floor, "rpi": np.ceil}[kind](fl)
        return u32(sat(r, -2 ** 31, 2 ** 31 - 1))
    if kind == "rzi_u":
        return u32(sat(np.trunc(fl), 0, 2 ** 32 - 1))
    if kind == "i2f":
        return int(bits_of(np.float32(i)))
    if kind == "u2f":
        return int(bits_of(np.float32(u32(i))))
    if kind == "rint":
        return int(bits_of(np.rint(f)))
    return int(bits_of(np.float32(np.float64(f) + 1.0)))


def test_cvt_rounding_saturation_and_nan():
    fs = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.7, 2.7, 3e9, -3e9, 1e20, np.nan, np.inf, -np.inf,
                   2147483520.0, -2147483648.0, 1e-30, 123456.789, 16777217.0], np.float32)
    ints = np.array([0, 1, -1, 16777217, -16777219, 2 ** 31 - 1, -2 ** 31, 123456789, 2 ** 30 + 1,
                     33554435, -7, 99, 5, 6, 7, 8, 9, 10], np.int32)
    n = fs.size
    lines = "\n".join(f"\t{op};\n\tst.global.u32 [%rd8+{4 * k}], %ro;" for k, (op, _) in enumerate(CVT_OPS))
    ptx = kernel("cvt", f"""
.visible .entry cvt_ops(.param .u64 pf, .param .u64 pi, .param .u64 pout)
{{
	.reg .b32 %r<8>;
	.reg .b32 %ra, %ro;
	.reg .f32 %fa, %fo;
	.reg .f64 %dd;
	.reg .b64 %rd<9>;
	.reg .b64 %rdw;

	ld.param.u64 %rd1, [pf];
	ld.param.u64 %rd2, [pi];
	ld.param.u64 %rd3, [pout];
	mov.u32 %r4, %tid.x;
	mul.wide.u32 %rd4, %r4, 4;
	add.s64 %rd5, %rd1, %rd4;
	ld.global.f32 %fa, [%rd5];
	add.s64 %rd5, %rd2, %rd4;
	ld.global.s32 %ra, [%rd5];
	mul.lo.s32 %r6, %r4, {len(CVT_OPS)};
	mul.wide.u32 %rd7, %r6, 4;
	add.s64 %rd8, %rd3, %rd7;
{lines}
	ret;
}}
""")
    out = np.zeros((n, len(CVT_OPS)), np.uint32)
    launch(ptx, "cvt_ops", (1, 1, 1), (n, 1, 1), [fs, ints, out])
    with np.errstate(all="ignore"):
        for k, (op, kind) in enumerate(CVT_OPS):
            want = np.array([cvt_reference(kind, f, int(i)) for f, i in zip(fs, ints)], np.uint32)
            if kind == "rint":  # NaN in, NaN out: compare as floats
                assert_same_f32(out[:, k].view(np.float32), want.view(np.float32))
            else:
                np.testing.assert_array_equal(out[:, k], want, err_msg=op)


# ------------------------------------------------------------------ control flow
BRANCHY = kernel("branchy", """
// Divergent if/else, a loop with a per-thread trip count, a loop with a
// data-dependent break, predicate logic and guarded non-branch instructions.
.visible .entry branchy(
	.param .u64 branchy_param_0,
	.param .u64 branchy_param_1
)
{
	.reg .pred %p<12>;
	.reg .b32 %r<16>;
	.reg .b32 %rx, %ry, %racc, %ri, %rn, %rk;
	.reg .b64 %rd<8>;

	ld.param.u64 %rd1, [branchy_param_0];
	ld.param.u64 %rd2, [branchy_param_1];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.s32 %rx, [%rd4];
	setp.lt.s32 %p1, %rx, 0;
	@!%p1 bra $L_pos;
	neg.s32 %r2, %rx;
	shl.b32 %ry, %r2, 1;
	bra.uni $L_join;
$L_pos:
	add.s32 %ry, %rx, 100;
$L_join:
	/* acc = sum of i * y for i < tid % 5 */
	rem.u32 %rn, %r1, 5;
	mov.u32 %racc, 0;
	mov.u32 %ri, 0;
	setp.eq.u32 %p2, %rn, 0;
	@%p2 bra $L_loop_end;
$L_loop:
	.pragma "nounroll";
	mad.lo.s32 %racc, %ri, %ry, %racc;
	add.s32 %ri, %ri, 1;
	setp.lt.u32 %p3, %ri, %rn;
	@%p3 bra $L_loop;
$L_loop_end:
	// k = first i < 16 with x * i > 50, else 16
	mov.u32 %rk, 0;
$L_search:
	mul.lo.s32 %r3, %rx, %rk;
	setp.gt.s32 %p4, %r3, 50;
	@%p4 bra $L_found;
	add.s32 %rk, %rk, 1;
	setp.lt.u32 %p5, %rk, 16;
	@%p5 bra $L_search;
$L_found:
	// flags: bit0 = x > 10 && tid odd, bit1 = x == 7 || !bit0, bit2/3 from a
	// combining setp with two destinations, bit4 = guarded add.
	setp.gt.s32 %p6, %rx, 10;
	and.b32 %r4, %r1, 1;
	setp.eq.u32 %p7, %r4, 1;
	and.pred %p6, %p6, %p7;
	setp.eq.s32 %p8, %rx, 7;
	not.pred %p9, %p6;
	or.pred %p8, %p8, %p9;
	setp.gt.and.s32 %p10|%p11, %rx, 0, %p7;
	selp.u32 %r5, 1, 0, %p6;
	selp.u32 %r6, 2, 0, %p8;
	selp.u32 %r7, 4, 0, %p10;
	selp.u32 %r8, 8, 0, %p11;
	or.b32 %r9, %r5, %r6;
	or.b32 %r9, %r9, %r7;
	or.b32 %r9, %r9, %r8;
	@%p7 add.s32 %r9, %r9, 16;
	mul.wide.u32 %rd5, %r1, 16;
	add.s64 %rd6, %rd2, %rd5;
	st.global.u32 [%rd6], %ry;
	st.global.u32 [%rd6+4], %racc;
	st.global.u32 [%rd6+8], %rk;
	st.global.u32 [%rd6+12], %r9;
	ret;
}
""")


def test_branches_loops_and_predicates():
    n = 96
    x = np.random.default_rng(4).integers(-20, 21, n).astype(np.int32)
    x[:4] = [7, -7, 0, 11]
    out = np.zeros((n, 4), np.int32)
    launch(BRANCHY, "branchy", (1, 1, 1), (n, 1, 1), [x, out])
    for t, v in enumerate(x.tolist()):
        y = -v * 2 if v < 0 else v + 100
        acc = sum(i * y for i in range(t % 5))
        k = next((i for i in range(16) if v * i > 50), 16)
        odd = t & 1 == 1
        b0 = v > 10 and odd
        b1 = v == 7 or not b0
        flags = b0 + 2 * b1 + 4 * (v > 0 and odd) + 8 * ((not v > 0) and odd) + 16 * odd
        assert out[t].tolist() == [y, acc, k, flags], t
    # Divergence costs extra issued instructions, never extra per-thread work.
    assert LAST_RUN_STATS["group_instructions"] < LAST_RUN_STATS["thread_instructions"]


def test_labels_comments_nested_scopes_and_address_forms():
    ptx = kernel("syntax", """
/* a module comment with ; and { braces } in it */
.visible .entry syntax_kernel(.param .u64 p_out)   // trailing comment
{
	.reg .b32 %r<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [p_out];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd2, %r1, 16;
	add.s64 %rd3, %rd1, %rd2;
	{
		.reg .b32 %inner;
		{ .reg .b32 %deeper; mov.u32 %deeper, 5; add.s32 %inner, %deeper, %r1; }
		st.global.u32 [%rd3+8], %inner;
	}
$L_a: $L_b: mov.u32 %r2,
		%r1; bra $L_c;
$L_c:	st.global.u32 [%rd3+-0], %r2;
	add.s64 %rd3, %rd3, 16;
	st.global.u32 [%rd3+-12], %r2;
	ret;
}
""")
    out = np.zeros(8, np.int32)
    launch(ptx, "syntax_kernel", (1, 1, 1), (2, 1, 1), [out])
    # thread t writes out[4t] = t, out[4t + 1] = t, out[4t + 2] = t + 5
    assert out.tolist() == [0, 0, 5, 0, 1, 1, 6, 0]


# ------------------------------------------------------------------ shared memory
SHARED = kernel("shared", """
.extern .shared .align 16 .b8 dyn[];
.shared .align 4 .b8 red[1024];

// out_rev[b, t] = in[b, ntid-1-t] through dynamic shared memory (read back
// through a generic address), out_sum[b] = sum_t (t * (b + 1)) by a tree
// reduction in static shared memory: a loop with bar.sync in it.
.visible .entry shared_kernel(.param .u64 p_in, .param .u64 p_rev, .param .u64 p_sum)
{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .f32 %f<3>;
	.reg .b64 %rd<16>;

	ld.param.u64 %rd1, [p_in];
	ld.param.u64 %rd2, [p_rev];
	ld.param.u64 %rd3, [p_sum];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, %ctaid.x;
	mad.lo.s32 %r4, %r3, %r2, %r1;
	mul.wide.u32 %rd4, %r4, 4;
	add.s64 %rd5, %rd1, %rd4;
	ld.global.f32 %f1, [%rd5];
	mov.u32 %r5, dyn;
	shl.b32 %r6, %r1, 2;
	add.s32 %r7, %r5, %r6;
	st.shared.f32 [%r7], %f1;
	bar.sync 0;
	sub.s32 %r8, %r2, %r1;
	shl.b32 %r9, %r8, 2;
	cvt.u64.u32 %rd6, %r9;
	mov.u64 %rd7, dyn;
	add.s64 %rd8, %rd7, %rd6;
	cvta.shared.u64 %rd9, %rd8;
	ld.f32 %f2, [%rd9+-4];
	add.s64 %rd10, %rd2, %rd4;
	st.global.f32 [%rd10], %f2;

	add.s32 %r10, %r3, 1;
	mul.lo.s32 %r11, %r1, %r10;
	mov.u32 %r12, red;
	add.s32 %r13, %r12, %r6;
	st.shared.u32 [%r13], %r11;
	shr.u32 %r14, %r2, 1;
$L_red:
	bar.sync 0;
	setp.ge.u32 %p1, %r1, %r14;
	@%p1 bra $L_skip;
	shl.b32 %r15, %r14, 2;
	add.s32 %r16, %r13, %r15;
	ld.shared.u32 %r17, [%r16];
	ld.shared.u32 %r18, [%r13];
	add.s32 %r19, %r18, %r17;
	st.shared.u32 [%r13], %r19;
$L_skip:
	shr.u32 %r14, %r14, 1;
	setp.ne.s32 %p2, %r14, 0;
	@%p2 bra $L_red;
	barrier.sync.aligned 0;
	setp.ne.s32 %p3, %r1, 0;
	@%p3 bra $L_end;
	ld.shared.u32 %r20, [red];
	mul.wide.u32 %rd11, %r3, 4;
	add.s64 %rd12, %rd3, %rd11;
	st.global.u32 [%rd12], %r20;
$L_end:
	ret;
}
""")


def test_shared_memory_and_barriers_across_threads():
    blocks, threads = 5, 128
    x = np.random.default_rng(5).standard_normal(blocks * threads).astype(np.float32)
    rev = np.zeros_like(x)
    sums = np.zeros(blocks, np.uint32)
    launch(SHARED, "shared_kernel", (blocks, 1, 1), (threads, 1, 1), [x, rev, sums],
               dynamic_shared_bytes=threads * 4)
    assert_same_f32(rev, x.reshape(blocks, threads)[:, ::-1].reshape(-1))
    assert sums.tolist() == [sum(t * (b + 1) for t in range(threads)) for b in range(blocks)]


SHUFFLE = kernel("shuffle", """
.visible .entry shuffle(.param .u64 p_idx, .param .u64 p_bfly)
{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<7>;
	ld.param.u64 %rd1, [p_idx];
	ld.param.u64 %rd2, [p_bfly];
	mov.u32 %r1, %tid.x;
	mul.lo.s32 %r2, %r1, 10;
	mul.lo.s32 %r3, %r1, 7;
	and.b32 %r4, %r3, 63;
	shfl.sync.idx.b32 %r5|%p1, %r2, %r4, 31, -1;
	shfl.sync.bfly.b32 %r6|%p2, %r2, 5, 31, -1;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
	st.global.u32 [%rd4], %r5;
	add.s64 %rd5, %rd2, %rd3;
	st.global.u32 [%rd5], %r6;
	ret;
}
""")


def test_shuffles_read_other_lanes_of_the_same_warp():
    idx, bfly = np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    launch(SHUFFLE, "shuffle", (1, 1, 1), (64, 1, 1), [idx, bfly])
    t = np.arange(64)
    # idx: lane l reads lane (7 l & 63) & 31 of its own warp (the bits above 4 are ignored)
    assert idx.tolist() == ((t - t % 32 + ((7 * t) & 63 & 31)) * 10).tolist()
    assert bfly.tolist() == ((t ^ 5) * 10).tolist()


def test_uninitialised_shared_memory_reads_as_nan():
    ptx = kernel("uninit_shared", """
.extern .shared .align 16 .b8 buf[];
.visible .entry peek(.param .u64 p_out)
{
	.reg .b32 %r<4>;
	.reg .f32 %f<2>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [p_out];
	mov.u32 %r1, %tid.x;
	shl.b32 %r2, %r1, 2;
	mov.u32 %r3, buf;
	add.s32 %r3, %r3, %r2;
	ld.shared.f32 %f1, [%r3];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.f32 [%rd3], %f1;
	ret;
}
""")
    out = np.zeros(4, np.float32)
    run_kernel(ptx, "peek", (1, 1, 1), (4, 1, 1), [out], dynamic_shared_bytes=16)
    assert np.isnan(out).all()


# Thread t copies in[t] (zero-filled when t is odd, src-size 0) into shared
# word t with cp.async, waits (or not: WAIT), then after a barrier writes the
# shared word of thread t ^ 1 to out[t]. READER_FIRST: thread t reads its
# neighbour's word before the barrier instead, while that neighbour's copy may
# still be landing: a race.
def cp_async_kernel(wait: str, barrier_first: bool) -> str:
    sync = "bar.sync 0;\n\t" if barrier_first else ""
    late = "" if barrier_first else "bar.sync 0;\n\t"
    return kernel("cp_async", """
.extern .shared .align 16 .b8 buf[];
.visible .entry copy_kernel(.param .u64 p_in, .param .u64 p_out)
{
	.reg .pred %p<2>;
	.reg .b32 %r<12>;
	.reg .f32 %f<2>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [p_in];
	ld.param.u64 %rd2, [p_out];
	cvta.to.global.u64 %rd1, %rd1;
	cvta.to.global.u64 %rd2, %rd2;
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
	mov.u32 %r2, buf;
	shl.b32 %r3, %r1, 2;
	add.s32 %r4, %r2, %r3;
	and.b32 %r5, %r1, 1;
	setp.eq.u32 %p1, %r5, 0;
	selp.u32 %r6, 4, 0, %p1;
	cp.async.ca.shared.global [%r4], [%rd4], 4, %r6;
	cp.async.commit_group;
	""" + wait + """
	""" + sync + """xor.b32 %r7, %r1, 1;
	shl.b32 %r8, %r7, 2;
	add.s32 %r9, %r2, %r8;
	ld.shared.f32 %f1, [%r9];
	""" + late + """add.s64 %rd5, %rd2, %rd3;
	st.global.f32 [%rd5], %f1;
	ret;
}
""")


def test_cp_async_lands_at_the_wait_with_zero_fill():
    x = np.arange(1, 9, dtype=np.float32)
    out = np.zeros(8, np.float32)
    launch(cp_async_kernel("cp.async.wait_group 0;", True), "copy_kernel", (1, 1, 1), (8, 1, 1), [x, out],
           dynamic_shared_bytes=32)
    expected = np.where(np.arange(8) % 2 == 0, x, 0)  # odd threads copied 0 bytes: zeros
    assert out.tolist() == expected[np.arange(8) ^ 1].tolist()


def test_cp_async_not_waited_for_is_not_there():
    x = np.arange(1, 9, dtype=np.float32)
    out = np.zeros(8, np.float32)
    run_kernel(cp_async_kernel("", True), "copy_kernel", (1, 1, 1), (8, 1, 1), [x, out], dynamic_shared_bytes=32)
    assert np.isnan(out).all()  # shared memory as it was: never written


def test_shared_memory_race_between_barriers_is_detected():
    x, out = np.arange(1, 9, dtype=np.float32), np.zeros(8, np.float32)
    with pytest.raises(PtxInterpreterError, match="shared memory race: thread 0 reads byte offset 4"):
        # thread 0 reads word 1 before the barrier, while thread 1's copy into it may be landing
        run_kernel(cp_async_kernel("cp.async.wait_group 0;", False), "copy_kernel", (1, 1, 1), (8, 1, 1),
                   [x, out], dynamic_shared_bytes=32)


# ------------------------------------------------------------------ calls
CALLS = kernel("calls", """
// out[t] = 2 * in[t] * s + 1 for odd t (a divergent call into a function that
// calls another one, with a return value), -1 for even t.
.func (.param .b32 scale_ret) scale(
	.param .b64 scale_p0,
	.param .b32 scale_p1,
	.param .f32 scale_p2
)
{
	.reg .b32 %r<2>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [scale_p0];
	ld.param.u32 %r1, [scale_p1];
	ld.param.f32 %f1, [scale_p2];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	ld.global.f32 %f2, [%rd3];
	mul.f32 %f3, %f2, %f1;
	st.param.f32 [scale_ret+0], %f3;
	ret;
}

.func twice_plus_one(
	.param .b64 tpo_in,
	.param .b64 tpo_out,
	.param .b32 tpo_i,
	.param .f32 tpo_s
)
{
	.reg .b32 %r<2>;
	.reg .f32 %f<5>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [tpo_in];
	ld.param.u64 %rd2, [tpo_out];
	ld.param.u32 %r1, [tpo_i];
	ld.param.f32 %f1, [tpo_s];
	{
	.param .b64 param0;
	st.param.b64 [param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 [param1+0], %r1;
	.param .b32 param2;
	st.param.f32 [param2+0], %f1;
	.param .b32 retval0;
	call (retval0), scale, (param0, param1, param2);
	ld.param.f32 %f2, [retval0+0];
	}
	add.f32 %f3, %f2, %f2;
	add.f32 %f4, %f3, 0f3F800000;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	st.global.f32 [%rd4], %f4;
	ret;
}

.visible .entry calls(.param .u64 calls_in, .param .u64 calls_out, .param .f32 calls_s)
{
	.reg .pred %p<2>;
	.reg .b32 %r<3>;
	.reg .f32 %f<2>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [calls_in];
	ld.param.u64 %rd2, [calls_out];
	ld.param.f32 %f1, [calls_s];
	mov.u32 %r1, %tid.x;
	and.b32 %r2, %r1, 1;
	setp.eq.u32 %p1, %r2, 0;
	@%p1 bra $L_even;
	{ // callseq 0, 0
	.reg .b32 temp_param_reg;
	.param .b64 param0;
	st.param.b64 [param0+0], %rd1;
	.param .b64 param1;
	st.param.b64 [param1+0], %rd2;
	.param .b32 param2;
	st.param.b32 [param2+0], %r1;
	.param .b32 param3;
	st.param.f32 [param3+0], %f1;
	call.uni 
	twice_plus_one, 
	(
	param0, 
	param1, 
	param2, 
	param3
	);
	} // callseq 0
	ret;
$L_even:
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	st.global.f32 [%rd4], 0fBF800000;
	ret;
}
""")


def test_func_calls_with_params_and_return_values():
    n = 70
    x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    out = np.zeros(n, np.float32)
    s = 1.7
    launch(CALLS, "calls", (1, 1, 1), (n, 1, 1), [x, out, s])
    prod = x * np.float32(s)
    want = np.where(np.arange(n) % 2 == 1, (prod + prod) + np.float32(1), np.float32(-1))
    assert_same_f32(out, want)


def jump_table_kernel(n_funcs: int, shared_stores: bool = False) -> str:
    """The specialised form: copies sc_kblock_<i> of one .func and an entry
    that dispatches on %ctaid.y through brx.idx. Each case stores the call's
    arguments again; with shared_stores they are stored once, before brx.idx
    (which the GPU gets wrong, see test_arguments_stored_once_for_many_calls...)."""
    funcs = []
    for i in range(n_funcs):
        funcs.append(f"""
.func sc_kblock_{i}(
	.param .b64 sc_kblock_param_0,
	.param .b32 sc_kblock_param_1
)
{{
	.reg .b32 %r<8>;
	.reg .f32 %f<3>;
	.reg .b64 %rd<8>;

	ld.param.u64 %rd1, [sc_kblock_param_0];
	ld.param.s32 %rd2, [sc_kblock_param_1];
	cvta.to.global.u64 %rd3, %rd1;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %nctaid.x;
	mad.lo.s32 %r5, %r2, %r3, %r1;
	mul.lo.s32 %r6, %r4, %r3;
	mov.u32 %r7, %ctaid.y;
	mad.lo.s32 %r5, %r7, %r6, %r5;
	cvt.rn.f32.s32 %f1, %r5;
	fma.rn.f32 %f2, %f1, 0f3F82B3C5, 0f{0x42C80000 + 0x10000 * i:08X};
	add.s32 %r5, %r5, 1;
	mul.wide.s32 %rd4, %r5, 4;
	add.s64 %rd5, %rd3, %rd4;
	add.s64 %rd5, %rd5, %rd2;
	st.global.f32 [%rd5], %f2;
	ret;
}}""")
    labels = ", ".join(f"$sc_kb_{i}" for i in range(n_funcs))
    stores = "" if shared_stores else "\tst.param.b64 [param0+0], %rd1;\n\tst.param.b32 [param1+0], %r1;\n"
    cases = "\n".join(f"""$sc_kb_{i}:
{stores}	call.uni sc_kblock_{i}, (param0, param1);
	bra.uni $sc_done;""" for i in range(n_funcs))
    return "".join(funcs) + f"""
	// .globl	sc_conv2d
.visible .entry sc_conv2d(
	.param .u64 sc_conv2d_param_0,
	.param .u32 sc_conv2d_param_1
)
{{
	.reg .b32 %r<3>;
	.reg .b64 %rd<3>;

	ld.param.u64 %rd1, [sc_conv2d_param_0];
	ld.param.u32 %r1, [sc_conv2d_param_1];
	{{ // callseq 0, 0
	.reg .b32 temp_param_reg;
	.param .b64 param0;
	st.param.b64 [param0+0], %rd1;
	.param .b32 param1;
	st.param.b32 [param1+0], %r1;
	.reg .b32 %sc_kb;
	mov.u32 %sc_kb, %ctaid.y;
	$sc_targets: .branchtargets {labels};
	brx.idx.uni %sc_kb, $sc_targets;
{cases}
$sc_done:
	}} // callseq 0
	ret;
}}
"""


def test_brx_idx_jump_table_over_func_copies():
    ptx = kernel("jump_table", jump_table_kernel(3))
    gx, gy, threads = 2, 3, 32
    out = np.zeros(gx * gy * threads, np.float32)
    # Element i is stored at byte 4 * (i + 1) + offset. The offset is a .b32
    # param loaded with ld.param.s32 into a 64-bit register (as nvcc does): -4
    # must be sign-extended, or every store lands 4 GiB out of bounds.
    launch(ptx, "sc_conv2d", (gx, gy, 1), (threads, 1, 1), [out, -4])
    idx = np.arange(gx * gy * threads)
    kb = idx // (gx * threads)  # = %ctaid.y, which picks the function copy
    want = np.array([exact_fma32(np.float32(i), f32(0x3F82B3C5), f32(0x42C80000 + 0x10000 * k))
                     for i, k in zip(idx, kb)], np.float32)
    assert_same_f32(out, want)


def test_arguments_stored_once_for_many_calls_are_rejected(monkeypatch):
    """The jump table with one set of argument stores before brx.idx is fine by
    PTX's letter, but ptxas passes the stores to the first call only: on an H100
    the kernel faults as soon as a block takes another case. So it is an error."""
    import ptx_interpreter

    ptx = kernel("jump_table_shared_stores", jump_table_kernel(3, shared_stores=True))
    out = np.zeros(2 * 3 * 32, np.float32)
    with pytest.raises(PtxInterpreterError, match=r"argument param0 is not stored .* between the previous call"):
        run_kernel(ptx, "sc_conv2d", (2, 3, 1), (32, 1, 1), [out, -4])
    # With the check off, the interpreter runs it with PTX's param semantics.
    monkeypatch.setattr(ptx_interpreter, "CHECK_CALL_ARGUMENT_STORES", False)
    run_kernel(ptx, "sc_conv2d", (2, 3, 1), (32, 1, 1), [out, -4])
    assert out[-1] == exact_fma32(np.float32(191), f32(0x3F82B3C5), f32(0x42C80000 + 0x20000))


def test_brx_idx_index_out_of_range_is_an_error():
    ptx = jump_table_kernel(2)
    out = np.zeros(4 * 3 * 8, np.float32)
    with pytest.raises(PtxInterpreterError, match="out of range"):
        run_kernel(ptx, "sc_conv2d", (1, 3, 1), (8, 1, 1), [out, 0])


# ------------------------------------------------------------------ vectors
def test_vector_loads_and_stores():
    ptx = kernel("vectors", """
.visible .entry vec(.param .u64 p_in, .param .u64 p_out)
{
	.reg .b32 %r<4>;
	.reg .f32 %f<9>;
	.reg .b64 %rd<7>;
	.shared .align 16 .b8 stage[512];
	ld.param.u64 %rd1, [p_in];
	ld.param.u64 %rd2, [p_out];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 16;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.nc.v4.f32 {%f1, %f2, %f3, %f4}, [%rd4];
	mov.u32 %r2, stage;
	shl.b32 %r3, %r1, 4;
	add.s32 %r2, %r2, %r3;
	st.shared.v4.f32 [%r2], {%f1, %f2, %f3, %f4};
	bar.sync 0;
	ld.shared.v2.f32 {%f6, _}, [%r2+8];
	ld.shared.v2.f32 {%f7, %f8}, [stage+16];
	add.f32 %f5, %f1, %f4;
	mul.wide.u32 %rd5, %r1, 24;
	add.s64 %rd6, %rd2, %rd5;
	st.global.v2.f32 [%rd6], {%f5, %f6};
	st.global.v2.f32 [%rd6+8], {%f2, %f2};
	st.global.v2.f32 [%rd6+16], {%f8, %f7};
	ret;
}
""")
    n = 16
    x = np.arange(4 * n, dtype=np.float32) * 0.5
    out = np.zeros(6 * n, np.float32)
    launch(ptx, "vec", (1, 1, 1), (n, 1, 1), [x, out])
    v = x.reshape(n, 4)
    ones = np.ones(n, np.float32)
    want = np.stack([v[:, 0] + v[:, 3], v[:, 2], v[:, 1], v[:, 1], v[1, 1] * ones, v[1, 0] * ones], axis=1)
    assert_same_f32(out.reshape(n, 6), want)


# ------------------------------------------------------------------ errors
def simple_kernel(name: str, body: str, extra_decl: str = "") -> str:
    return kernel(name, f"""
{extra_decl}
.visible .entry {name}(.param .u64 p_buf, .param .u32 p_n)
{{
	.reg .pred %p<4>;
	.reg .b32 %r<10>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [p_buf];
	ld.param.u32 %r9, [p_n];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
{body}
	ret;
}}
""")


def test_global_out_of_bounds_is_detected():
    ptx = simple_kernel("oob", "\tld.global.f32 %f1, [%rd3];\n\tst.global.f32 [%rd3], %f1;")
    launch(ptx, "oob", (1, 1, 1), (8, 1, 1), [np.zeros(8, np.float32), 0])
    with pytest.raises(PtxInterpreterError, match=r"out-of-bounds.*offset 28 of arg 0"):
        run_kernel(ptx, "oob", (1, 1, 1), (8, 1, 1), [np.zeros(7, np.float32), 0])
    # A negative offset is out of bounds too.
    ptx2 = simple_kernel("oob_neg", "\tld.global.f32 %f1, [%rd3+-4];")
    with pytest.raises(PtxInterpreterError, match="out-of-bounds"):
        run_kernel(ptx2, "oob_neg", (1, 1, 1), (8, 1, 1), [np.zeros(8, np.float32), 0])


def test_bad_pointers_and_misalignment_are_detected():
    ptx = simple_kernel("mis", "\tst.global.f32 [%rd3+2], %f0;", )
    with pytest.raises(PtxInterpreterError, match="never written"):
        run_kernel(ptx, "mis", (1, 1, 1), (2, 1, 1), [np.zeros(8, np.float32), 0])
    ptx = simple_kernel("mis2", "\tmov.f32 %f0, 0f3F800000;\n\tst.global.f32 [%rd3+2], %f0;")
    with pytest.raises(PtxInterpreterError, match="misaligned"):
        run_kernel(ptx, "mis2", (1, 1, 1), (2, 1, 1), [np.zeros(8, np.float32), 0])
    ptx = simple_kernel("mis3", "\tld.global.v4.f32 {%f0, %f1, %f2, %f3}, [%rd3];")
    with pytest.raises(PtxInterpreterError, match="misaligned access of 16 bytes"):
        run_kernel(ptx, "mis3", (1, 1, 1), (2, 1, 1), [np.zeros(8, np.float32), 0])
    ptx = simple_kernel("null", "\tld.global.f32 %f1, [%rd3];")
    with pytest.raises(PtxInterpreterError, match="not inside any argument array"):
        run_kernel(ptx, "null", (1, 1, 1), (2, 1, 1), [0, 0])  # a null pointer


def test_shared_out_of_bounds_is_detected():
    body = "\tmov.u32 %r2, sh;\n\tshl.b32 %r3, %r1, 2;\n\tadd.s32 %r4, %r2, %r3;\n\tst.shared.u32 [%r4], %r1;"
    ptx = simple_kernel("sh_oob", body, ".extern .shared .align 16 .b8 sh[];")
    launch(ptx, "sh_oob", (1, 1, 1), (16, 1, 1), [np.zeros(1, np.float32), 0], dynamic_shared_bytes=64)
    with pytest.raises(PtxInterpreterError, match="out-of-bounds.*shared memory"):
        run_kernel(ptx, "sh_oob", (1, 1, 1), (16, 1, 1), [np.zeros(1, np.float32), 0], dynamic_shared_bytes=60)


def test_reading_a_register_never_written_is_detected():
    # %r5 is written only by the threads with tid < n.
    body = ("\tsetp.lt.u32 %p1, %r1, %r9;\n\t@%p1 mov.u32 %r5, 1;\n"
            "\tst.global.u32 [%rd3], %r5;")
    ptx = simple_kernel("partial", body)
    buf = np.zeros(8, np.uint32)
    launch(ptx, "partial", (1, 1, 1), (8, 1, 1), [buf, 8])
    assert buf.tolist() == [1] * 8
    with pytest.raises(PtxInterpreterError, match=r"%r5, never written by thread\(s\) \[6, 7\]"):
        run_kernel(ptx, "partial", (1, 1, 1), (8, 1, 1), [buf, 6])


def test_barrier_deadlock_is_detected():
    body = ("\tsetp.lt.u32 %p1, %r1, 4;\n\t@%p1 bra $L_other;\n\tbar.sync 0;\n\tbra.uni $L_end;\n"
            "$L_other:\n\tbar.sync 0;\n$L_end:")
    ptx = simple_kernel("deadlock", body)
    with pytest.raises(PtxInterpreterError, match="deadlock"):
        run_kernel(ptx, "deadlock", (1, 1, 1), (8, 1, 1), [np.zeros(8, np.float32), 0])
    # Threads that exit before the barrier do not block it.
    body = ("\tsetp.lt.u32 %p1, %r1, 4;\n\t@%p1 bra $L_end;\n\tbar.sync 0;\n"
            "\tst.global.u32 [%rd3], %r1;\n$L_end:")
    ptx = simple_kernel("early_exit", body)
    buf = np.zeros(8, np.uint32)
    launch(ptx, "early_exit", (1, 1, 1), (8, 1, 1), [buf, 0])
    assert buf.tolist() == [0, 0, 0, 0, 4, 5, 6, 7]


def cluster_kernel(name: str, skip_rank: int = -1, rank_offset: int = 0) -> str:
    """Clusters of 4 blocks along y: each block leaves in[block, t] in its
    shared memory; after a cluster barrier, out[block, t] = sum over ranks r
    (in order) of (r + 1) * rank r's value, + 1000 * its own rank. Rank
    `skip_rank` (if any) returns before the first barrier; the loads read rank
    r + `rank_offset`."""
    return kernel(name, f"""
.extern .shared .align 16 .b8 buf[];
.visible .entry {name}(.param .u64 p_in, .param .u64 p_out)
.maxntid 32, 1, 1
.explicitcluster
.reqnctapercluster 1, 4, 1
{{
	.reg .pred %p<3>;
	.reg .b32 %r<12>;
	.reg .f32 %f<6>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [p_in];
	ld.param.u64 %rd2, [p_out];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.y;
	mov.u32 %r3, %cluster_ctarank;
	shl.b32 %r4, %r2, 5;
	add.s32 %r4, %r4, %r1;
	mul.wide.u32 %rd3, %r4, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.f32 %f1, [%rd4];
	mov.u32 %r5, buf;
	shl.b32 %r6, %r1, 2;
	add.s32 %r5, %r5, %r6;
	st.shared.f32 [%r5], %f1;
	setp.eq.u32 %p2, %r3, {skip_rank & 0xFFFFFFFF};
	@%p2 bra $L_end;
	barrier.cluster.arrive.release.aligned;
	barrier.cluster.wait.acquire.aligned;
	cvt.rn.f32.u32 %f2, %r3;
	mul.rn.f32 %f2, %f2, 0f447A0000;
	mov.u32 %r7, 0;
$L_loop:
	add.s32 %r10, %r7, {rank_offset};
	mapa.shared::cluster.u32 %r8, %r5, %r10;
	ld.shared::cluster.f32 %f3, [%r8];
	add.s32 %r9, %r7, 1;
	cvt.rn.f32.u32 %f4, %r9;
	fma.rn.f32 %f2, %f3, %f4, %f2;
	mov.u32 %r7, %r9;
	setp.lt.u32 %p1, %r7, 4;
	@%p1 bra $L_loop;
	add.s64 %rd5, %rd2, %rd3;
	st.global.f32 [%rd5], %f2;
	barrier.cluster.arrive.aligned;
	barrier.cluster.wait.aligned;
$L_end:
	ret;
}}
""")


def test_thread_block_clusters_read_each_others_shared_memory():
    """The blocks of a cluster meet at its barrier and read each other's shared
    memory through mapa + ld.shared::cluster; two clusters of 4 along y."""
    ptx = cluster_kernel("cluster_sum")
    x = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)
    out = np.full((8, 32), np.nan, np.float32)
    launch(ptx, "cluster_sum", (1, 8, 1), (32, 1, 1), [x, out], dynamic_shared_bytes=128)
    for b in range(8):
        first, rank = b - b % 4, b % 4
        want = np.full(32, 1000 * rank, np.float32)
        for r in range(4):  # fma: the float64 product is exact, one rounding of the sum (seeded: no tie)
            want = (x[first + r].astype(np.float64) * (r + 1) + want).astype(np.float32)
        assert_same_f32(out[b], want)
    with pytest.raises(PtxInterpreterError, match="whole number of clusters"):
        run_kernel(ptx, "cluster_sum", (1, 6, 1), (32, 1, 1), [x, out], dynamic_shared_bytes=128)


def test_cluster_barrier_deadlock_and_bad_ranks_are_detected():
    x = np.zeros((4, 32), np.float32)
    out = np.zeros((4, 32), np.float32)
    with pytest.raises(PtxInterpreterError, match="cluster barrier deadlock"):
        run_kernel(cluster_kernel("cluster_skip", skip_rank=2), "cluster_skip", (1, 4, 1), (32, 1, 1),
                   [x, out], dynamic_shared_bytes=128)
    # a rank past the cluster: 4 on the last trip
    with pytest.raises(PtxInterpreterError, match="rank 4, but the cluster has 4 blocks"):
        run_kernel(cluster_kernel("cluster_far", rank_offset=1), "cluster_far", (1, 4, 1), (32, 1, 1),
                   [x, out], dynamic_shared_bytes=128)
    plain = simple_kernel("no_cluster", "\tbarrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;")
    with pytest.raises(PtxInterpreterError, match="launched without clusters"):
        run_kernel(plain, "no_cluster", (1, 1, 1), (8, 1, 1), [np.zeros(8, np.float32), 0])


def test_loads_with_an_l2_policy_load_and_need_the_policy_written():
    # the weight loads of sparseconv/weight_loads.py: createpolicy, then ld.global.nc.L2::cache_hint
    body = ("\tcreatepolicy.fractional.L2::evict_first.b64 %rd4, 1.0;\n"
            "\tld.global.nc.L1::no_allocate.L2::cache_hint.f32 %f1, [%rd3], %rd4;\n"
            "\tadd.f32 %f1, %f1, 0f3F800000;\n\tst.global.f32 [%rd3], %f1;")
    buf = np.arange(8, dtype=np.float32)
    launch(simple_kernel("hinted", body), "hinted", (1, 1, 1), (8, 1, 1), [buf, 0])
    np.testing.assert_array_equal(buf, np.arange(8, dtype=np.float32) + 1)
    unwritten = body.replace("\tcreatepolicy.fractional.L2::evict_first.b64 %rd4, 1.0;\n", "")
    with pytest.raises(PtxInterpreterError, match="never written|before it was written|unwritten"):
        run_kernel(simple_kernel("unhinted", unwritten), "unhinted", (1, 1, 1), (8, 1, 1), [buf, 0])
    # a store with a policy is not something the kernels do: refused, not silently run
    stored = body.replace("st.global.f32 [%rd3], %f1;", "st.global.L2::cache_hint.f32 [%rd3], %f1, %rd4;")
    with pytest.raises(PtxInterpreterError, match="cache_hint on st"):
        run_kernel(simple_kernel("hinted_store", stored), "hinted_store", (1, 1, 1), (8, 1, 1), [buf, 0])


def test_unsupported_instruction_names_instruction_and_line():
    ptx = simple_kernel("popc", "\tpopc.b32 %r2, %r1;")
    line = ptx.splitlines().index("\tpopc.b32 %r2, %r1;") + 1
    with pytest.raises(PtxInterpreterError, match=rf"line {line}.*unsupported instruction popc\.b32"):
        run_kernel(ptx, "popc", (1, 1, 1), (1, 1, 1), [np.zeros(1, np.float32), 0])


def test_other_launch_errors():
    ptx = simple_kernel("divz", "\tdiv.u32 %r2, %r1, %r9;\n\tst.global.u32 [%rd3], %r2;")
    with pytest.raises(PtxInterpreterError, match="division by zero"):
        run_kernel(ptx, "divz", (1, 1, 1), (2, 1, 1), [np.zeros(2, np.uint32), 0])
    with pytest.raises(PtxInterpreterError, match="takes 2 params"):
        run_kernel(ptx, "divz", (1, 1, 1), (2, 1, 1), [np.zeros(2, np.uint32)])
    with pytest.raises(PtxInterpreterError, match="no .entry"):
        run_kernel(ptx, "nope", (1, 1, 1), (2, 1, 1), [np.zeros(2, np.uint32), 0])
    uni = simple_kernel("uni", "\tsetp.lt.u32 %p1, %r1, 3;\n\t@%p1 bra.uni $L_x;\n$L_x:")
    with pytest.raises(PtxInterpreterError, match="diverges inside warp 0"):
        run_kernel(uni, "uni", (1, 1, 1), (8, 1, 1), [np.zeros(8, np.float32), 0])
    maxn = kernel("maxntid", ".visible .entry small() .maxntid 32, 1, 1\n{\n\tret;\n}\n")
    launch(maxn, "small", (1, 1, 1), (32, 1, 1), [])
    with pytest.raises(PtxInterpreterError, match="maxntid"):
        run_kernel(maxn, "small", (1, 1, 1), (33, 1, 1), [])


# ------------------------------------------------------------------ speed
def test_speed_on_a_loop_heavy_kernel():
    ptx = kernel("speed", """
.visible .entry speed(.param .u64 p_out, .param .u32 p_iters)
{
	.reg .pred %p<2>;
	.reg .b32 %r<6>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [p_out];
	ld.param.u32 %r1, [p_iters];
	mov.u32 %r2, %tid.x;
	cvt.rn.f32.u32 %f1, %r2;
	mov.f32 %f2, 0f00000000;
	mov.u32 %r3, 0;
$L_loop:
	fma.rn.f32 %f2, %f1, 0f3F800001, %f2;
	fma.rn.f32 %f2, %f2, 0f3F7FFFFE, %f1;
	add.s32 %r3, %r3, 1;
	setp.lt.s32 %p1, %r3, %r1;
	@%p1 bra $L_loop;
	mul.wide.u32 %rd2, %r2, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.f32 [%rd3], %f2;
	ret;
}
""")
    threads, blocks, iters = 256, 4, 400
    out = np.zeros(blocks * threads, np.float32)
    t0 = time.perf_counter()
    run_kernel(ptx, "speed", (blocks, 1, 1), (threads, 1, 1), [out, iters])
    elapsed = time.perf_counter() - t0
    rate = LAST_RUN_STATS["thread_instructions"] / elapsed
    assert LAST_RUN_STATS["thread_instructions"] == blocks * threads * (iters * 5 + 10)
    assert rate > 300_000, f"{rate:.0f} instructions/s"
    # Spot-check the values against an exact sequential reference.
    for t in (0, 1, 255):
        f1, f2 = np.float32(t), np.float32(0)
        for _ in range(iters):
            f2 = exact_fma32(f1, f32(0x3F800001), f2)
            f2 = exact_fma32(f2, f32(0x3F7FFFFE), f1)
        assert_same_f32(out[t], f2)


# ------------------------------------------------------------------ ptxas check
def test_ptxas_check_rejects_invalid_ptx():
    """kernel() really checks: ptxas refuses an undeclared register."""
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    assert ptxas_errors(HEADER + ".visible .entry bad()\n{\n\tmov.u32 %r1, 0;\n\tret;\n}\n")


# ------------------------------------------------------------------ nvcc-compiled template
CONV_CU = r"""
// A small copy of the sparseconv template structure: a __noinline__ .func with
// an extern shared patch, a `#pragma unroll 1` chunk loop with a run-time trip
// count, and weights baked in as float constants.
#define C_TOTAL {C}
#define K_TOTAL {K}
#define IN_H {H}
#define IN_W {W}
#define OUT_H {OH}
#define OUT_W {OW}
#define STRIDE {STRIDE}
#define PAD {PAD}
#define R 3
#define S 3
#define K_BLOCK {KB}
#define C_BLOCK {CB}
#define THREAD_W 2
#define THREADS_X {TX}
#define THREADS {THREADS}
#define TILE_H (THREADS / THREADS_X)
#define TILE_W (THREADS_X * THREAD_W)
#define TILES_W ((OUT_W + TILE_W - 1) / TILE_W)
#define PATCH_H ((TILE_H - 1) * STRIDE + R)
#define PATCH_W ((TILE_W - 1) * STRIDE + S)
#define PATCH_SIZE (PATCH_H * PATCH_W)

extern "C" __device__ __noinline__ void sc_kblock(
    const float* __restrict__ x, float* __restrict__ y,
    const float* __restrict__ bias, int kblock, int n, int n_chunks)
{
    extern __shared__ float patch[];
    const int tid = threadIdx.x;
    const int tx = tid % THREADS_X, ty = tid / THREADS_X;
    const int tile_x = blockIdx.x % TILES_W, tile_y = blockIdx.x / TILES_W;
    const int k_first = kblock * K_BLOCK;
    const int ih0 = tile_y * TILE_H * STRIDE - PAD, iw0 = tile_x * TILE_W * STRIDE - PAD;
    const float* x_img = x + (size_t)n * C_TOTAL * IN_H * IN_W;
    float acc[K_BLOCK][THREAD_W];
#pragma unroll
    for (int kb = 0; kb < K_BLOCK; ++kb) {
        const float b = (k_first + kb < K_TOTAL) ? bias[k_first + kb] : 0.0f;
#pragma unroll
        for (int bw = 0; bw < THREAD_W; ++bw) acc[kb][bw] = b;
    }
#pragma unroll 1
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        const int c_first = chunk * C_BLOCK;
        __syncthreads();
        for (int i = tid; i < C_BLOCK * PATCH_SIZE; i += THREADS) {
            const int cb = i / PATCH_SIZE, ph = (i % PATCH_SIZE) / PATCH_W, pw = i % PATCH_W;
            const int ih = ih0 + ph, iw = iw0 + pw;
            float v = 0.0f;
            if (c_first + cb < C_TOTAL && ih >= 0 && ih < IN_H && iw >= 0 && iw < IN_W)
                v = x_img[(size_t)(c_first + cb) * IN_H * IN_W + ih * IN_W + iw];
            patch[i] = v;
        }
        __syncthreads();
{BODY}
    }
    const int oh = tile_y * TILE_H + ty, ow0 = tile_x * TILE_W + tx * THREAD_W;
    float* y_img = y + (size_t)n * K_TOTAL * OUT_H * OUT_W;
#pragma unroll
    for (int kb = 0; kb < K_BLOCK; ++kb) {
        const int k = k_first + kb;
        if (k >= K_TOTAL) break;
#pragma unroll
        for (int bw = 0; bw < THREAD_W; ++bw) {
            const int ow = ow0 + bw;
            if (oh < OUT_H && ow < OUT_W) y_img[(size_t)k * OUT_H * OUT_W + oh * OUT_W + ow] = acc[kb][bw];
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) sc_conv2d(
    const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ bias, int n_chunks)
{
    sc_kblock(x, y, bias, blockIdx.y, blockIdx.z, n_chunks);
}
"""


def conv_source(dims: dict, weight_bits: np.ndarray) -> str:
    """weight_bits[kb, cb, r, s]: the constants of the one template body."""
    body = []
    for cb in range(dims["CB"]):
        for r in range(3):
            body.append("        {")
            for s in range(3):
                for kb in range(dims["KB"]):
                    w = f"__int_as_float(0x{int(weight_bits[kb, cb, r, s]):08X})"
                    for bw in range(2):
                        body.append(
                            f"            acc[{kb}][{bw}] = __fmaf_rn(patch[{cb} * PATCH_SIZE + "
                            f"(ty * STRIDE + {r}) * PATCH_W + tx * THREAD_W * STRIDE + {bw} * STRIDE + {s}], "
                            f"{w}, acc[{kb}][{bw}]);")
            body.append("        }")
    src = CONV_CU.replace("{BODY}", "\n".join(body))
    for key, value in dims.items():
        src = src.replace("{" + key + "}", str(value))
    return src


def specialise(ptx: str, n_kblocks: int, bits: np.ndarray, per_kblock_bits: list) -> str:
    """What the real specialiser does, in miniature: one copy of sc_kblock per
    output-channel block with that block's weights, and a brx.idx jump table on
    %ctaid.y in place of the call."""
    start = ptx.index(".func sc_kblock(")
    end = ptx.index("\t// .globl\tsc_conv2d")
    func = ptx[start:end]
    copies = []
    for kb in range(n_kblocks):
        mapping = {f"0f{int(b):08X}": f"0f{int(nb):08X}" for b, nb in zip(bits.ravel(), per_kblock_bits[kb].ravel())}
        copy = re.sub(r"0f[0-9A-F]{8}", lambda m: mapping.get(m.group(0), m.group(0)), func)
        copies.append(copy.replace(".func sc_kblock(", f".func sc_kblock_{kb}(", 1))
    call = re.search(r"call\.uni\s*sc_kblock,\s*\(([^)]*)\);", ptx)
    params = ", ".join(p.strip() for p in call.group(1).split(","))
    # Each case stores the arguments again: ptxas gives stored arguments to
    # the first call after them only.
    stores = re.findall(r"\tst\.param\.\w+\s+\[param\d+\+0\],\s*%\w+;", ptx[end:])
    table = ["\t.reg .b32 %sc_kb;", "\tmov.u32 %sc_kb, %ctaid.y;",
             "\t$sc_targets: .branchtargets " + ", ".join(f"$sc_kb_{i}" for i in range(n_kblocks)) + ";",
             "\tbrx.idx.uni %sc_kb, $sc_targets;"]
    for i in range(n_kblocks):
        table += [f"$sc_kb_{i}:", *stores, f"\tcall.uni sc_kblock_{i}, ({params});", "\tbra.uni $sc_done;"]
    table.append("$sc_done:")
    entry = ptx[end:].replace(call.group(0), "\n".join(table))
    return ptx[:start] + "".join(copies) + entry


def test_nvcc_template_like_kernel_matches_exact_reference(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    dims = dict(C=3, K=8, H=9, W=7, STRIDE=2, PAD=1, KB=4, CB=2, TX=2, THREADS=6)
    dims["OH"] = (dims["H"] + 2 * dims["PAD"] - 3) // dims["STRIDE"] + 1
    dims["OW"] = (dims["W"] + 2 * dims["PAD"] - 3) // dims["STRIDE"] + 1
    rng = np.random.default_rng(7)
    n_kb, n_chunks = dims["K"] // dims["KB"], -(-dims["C"] // dims["CB"])
    # Distinct float32 in [1, 2): bit patterns that NVVM cannot fold together.
    all_bits = 0x3F800000 + rng.choice(1 << 23, size=(n_kb + 1) * dims["KB"] * dims["CB"] * 9, replace=False)
    bits = all_bits[:dims["KB"] * dims["CB"] * 9].reshape(dims["KB"], dims["CB"], 3, 3).astype(np.uint32)
    per_kb = [all_bits[(i + 1) * bits.size:(i + 2) * bits.size].reshape(bits.shape).astype(np.uint32)
              for i in range(n_kb)]
    cu = tmp_path / "conv.cu"
    cu.write_text(conv_source(dims, bits))
    res = subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "-O3", str(cu), "-o", str(tmp_path / "conv.ptx")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    ptx = specialise((tmp_path / "conv.ptx").read_text(), n_kb, bits, per_kb)
    assert "brx.idx.uni" in ptx and "sc_kblock_1" in ptx

    N = 2
    x = rng.standard_normal((N, dims["C"], dims["H"], dims["W"])).astype(np.float32)
    bias = rng.standard_normal(dims["K"]).astype(np.float32)
    y = np.full((N, dims["K"], dims["OH"], dims["OW"]), np.nan, np.float32)
    tile_h, tile_w = dims["THREADS"] // dims["TX"], dims["TX"] * 2
    tiles = -(-dims["OH"] // tile_h) * -(-dims["OW"] // tile_w)
    patch = ((tile_h - 1) * dims["STRIDE"] + 3) * ((tile_w - 1) * dims["STRIDE"] + 3)
    launch(ptx, "sc_conv2d", (tiles, n_kb, N), (dims["THREADS"], 1, 1), [x, y, bias, n_chunks],
               dynamic_shared_bytes=dims["CB"] * patch * 4)

    # Sequential exact FMAs in the template's order: chunk, cb, r, s.
    p = dims["PAD"]
    xp = np.zeros((N, n_chunks * dims["CB"], dims["H"] + 2 * p, dims["W"] + 2 * p), np.float32)
    xp[:, :dims["C"], p:p + dims["H"], p:p + dims["W"]] = x
    want = np.zeros_like(y)
    st = dims["STRIDE"]
    for n in range(N):
        for k in range(dims["K"]):
            w = per_kb[k // dims["KB"]][k % dims["KB"]].view(np.float32)
            for oh in range(dims["OH"]):
                for ow in range(dims["OW"]):
                    acc = bias[k]
                    for c in range(n_chunks * dims["CB"]):
                        for r in range(3):
                            for s in range(3):
                                acc = exact_fma32(xp[n, c, oh * st + r, ow * st + s], w[c % dims["CB"], r, s], acc)
                    want[n, k, oh, ow] = acc
    assert_same_f32(y, want)
