"""How much straight-line code can an SM run again without fetching it again,
and how fast does it fetch code it does not hold? Our kernels are such code:
a block walks its k-block's FMAs (weights as immediates) once, top to bottom.

Each block of the kernel `run` calls its own copy (one of COPIES) of a
straight-line function of FMAs with immediate weights, like a specialised
k-block (PTX written here, ptxas -O3), once and then `--passes` times. With
the code hot in L2, an extra pass costs what the SM spends on code it holds
(issue-bound) or fetches again (fetch-bound). Rows: code size x threads a
block; --blocks 264 puts two blocks with different code on each SM.

--pointers also asks whether a device function pointer is the address of the
function's code in global memory (so that a kernel could prefetch its own
code into L2): it prints the pointers of the copies and reads 256 bytes at
each as data. On the H100 (session 18) the pointers were 0x8, 0x10, ... and
the read faulted, which ends the CUDA context, so it runs last.

    python bench/icache_probe.py [--sizes-kb 8,16,32,64] [--threads 256] [--pointers]
"""
from __future__ import annotations

import argparse
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List

import numpy as np

from sparseconv.compile import find_tool

ACCS = 8    # independent accumulators (the output channels of a k-block)
COPIES = 8  # distinct functions; block b runs copy b % COPIES
FFMA_BYTES = 16  # an sm_90 instruction, an FFMA with an immediate among them


def ptx_source(fmas: int, seed: int = 0) -> str:
    """PTX of COPIES functions f<i> of `fmas` FMAs each, with immediates drawn
    from `seed`, and three kernels: run(x, y, passes) (block b calls
    f<b % COPIES> `passes` times, each thread stores the sum of its results),
    pointers(out) (out[i] = the function pointer of f<i>) and peek(at, out,
    words) (block b reads `words` 32-bit words at at[b] as data)."""
    rng = np.random.default_rng(seed)
    out = [".version 8.0", ".target sm_90", ".address_size 64", ""]
    for i in range(COPIES):
        w = rng.uniform(-1, 1, fmas).astype(np.float32).view(np.uint32)
        out += [f".func (.param .b32 ret) f{i}(.param .b64 px)", "{",
                f"    .reg .b64 %x; .reg .f32 %v<{ACCS}>; .reg .f32 %a<{ACCS}>; .reg .f32 %s;",
                "    ld.param.b64 %x, [px];"]
        out += [f"    ld.global.f32 %v{j}, [%x+{4 * j}];" for j in range(ACCS)]
        out += [f"    mov.f32 %a{j}, 0f00000000;" for j in range(ACCS)]
        out += [f"    fma.rn.f32 %a{n % ACCS}, %v{(n // ACCS) % ACCS}, 0f{int(w[n]):08X}, %a{n % ACCS};"
                for n in range(fmas)]
        out.append("    mov.f32 %s, %a0;")
        out += [f"    add.f32 %s, %s, %a{j};" for j in range(1, ACCS)]
        out += ["    st.param.b32 [ret], %s;", "    ret;", "}", ""]
    out += [".visible .entry run(.param .u64 px, .param .u64 py, .param .u32 ppasses)", "{",
            "    .reg .b64 %rd<8>; .reg .b32 %r<12>; .reg .pred %p1; .reg .f32 %f<3>;",
            "    ld.param.u64 %rd1, [px]; ld.param.u64 %rd2, [py]; ld.param.u32 %r1, [ppasses];",
            "    cvta.to.global.u64 %rd1, %rd1; cvta.to.global.u64 %rd2, %rd2;",
            f"    mov.u32 %r2, %ctaid.x; rem.u32 %r3, %r2, {COPIES};",
            "    mov.u32 %r4, %tid.x; mov.u32 %r5, %ntid.x; mad.lo.u32 %r6, %r2, %r5, %r4;",
            f"    mul.wide.u32 %rd3, %r6, {4 * ACCS}; add.s64 %rd4, %rd1, %rd3;",
            "    mul.wide.u32 %rd5, %r6, 4; add.s64 %rd6, %rd2, %rd5;",
            "    mov.u32 %r7, 0; mov.f32 %f2, 0f00000000;",
            "pass:",
            "cases: .branchtargets " + ", ".join(f"$C{i}" for i in range(COPIES)) + ";",
            "    brx.idx.uni %r3, cases;"]
    for i in range(COPIES):
        out += [f"$C{i}: {{ .param .b64 a; st.param.b64 [a], %rd4; .param .b32 r; call.uni (r), f{i}, (a);",
                "    ld.param.b32 %f1, [r]; } bra.uni next;"]
    out += ["next:", "    add.f32 %f2, %f2, %f1; add.u32 %r7, %r7, 1;",
            "    setp.lt.u32 %p1, %r7, %r1; @%p1 bra.uni pass;",
            "    st.global.f32 [%rd6], %f2;", "    ret;", "}", ""]
    out += [".visible .entry pointers(.param .u64 pout)", "{", "    .reg .b64 %rd<4>;",
            "    ld.param.u64 %rd1, [pout]; cvta.to.global.u64 %rd1, %rd1;"]
    for i in range(COPIES):
        out += [f"    mov.u64 %rd2, f{i}; st.global.u64 [%rd1+{8 * i}], %rd2;"]
    out += ["    ret;", "}", ""]
    out += [".visible .entry peek(.param .u64 pat, .param .u64 pout, .param .u32 pwords)", "{",
            "    .reg .b64 %rd<8>; .reg .b32 %r<8>; .reg .pred %p1;",
            "    ld.param.u64 %rd1, [pat]; ld.param.u64 %rd2, [pout]; ld.param.u32 %r1, [pwords];",
            "    cvta.to.global.u64 %rd1, %rd1; cvta.to.global.u64 %rd2, %rd2;",
            "    mov.u32 %r2, %ctaid.x; mov.u32 %r3, %tid.x;",
            "    mul.wide.u32 %rd3, %r2, 8; add.s64 %rd3, %rd1, %rd3; ld.global.u64 %rd4, [%rd3];",
            "    setp.ge.u32 %p1, %r3, %r1; @%p1 bra.uni done;",
            "    mul.wide.u32 %rd5, %r3, 4; add.s64 %rd6, %rd4, %rd5; ld.global.u32 %r4, [%rd6];",
            "    mad.lo.u32 %r5, %r2, %r1, %r3; mul.wide.u32 %rd7, %r5, 4; add.s64 %rd7, %rd2, %rd7;",
            "    st.global.u32 [%rd7], %r4;", "done:", "    ret;", "}", ""]
    return "\n".join(out)


def fmas_for(kb: float) -> int:
    """FMAs of a function of about `kb` KB of code."""
    return max(ACCS, int(kb * 1024 / FFMA_BYTES))


def elf_functions(cubin: bytes) -> Dict[str, bytes]:
    """name -> code bytes of each function symbol (STT_FUNC) of a 64-bit
    little-endian ELF (a cubin), read from its symbol table."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    funcs: Dict[str, bytes] = {}
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_off, info, _, shndx, value, size = struct.unpack_from("<IBBHQQ", cubin, off)
            if info & 0xF != 2 or not 0 < shndx < shnum:
                continue
            start = strtab[4] + name_off
            name = cubin[start:cubin.index(b"\0", start)].decode()
            text = sections[shndx]
            funcs[name] = cubin[text[4] + value:text[4] + value + size]
    return funcs


def assemble(ptx: str, tmp: Path) -> Path:
    """One whole-program ptxas run (not assemble_cubin's per-function split:
    ptxas then keeps each kernel's callees next to it, as measured)."""
    src, cubin = tmp / "icache.ptx", tmp / "icache.cubin"
    src.write_text(ptx)
    subprocess.run([str(find_tool("ptxas")), "-arch=sm_90", "-O3", "-o", str(cubin), str(src)], check=True)
    return cubin


def copy_of(funcs: Dict[str, bytes], kernel: str, i: int) -> bytes:
    """The code of f<i> as `kernel` calls it: ptxas gives each kernel its own
    copy of the functions it names, $<kernel>$f<i>."""
    return funcs.get(f"${kernel}$f{i}", funcs.get(f"f{i}", b""))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-kb", default="8,12,16,20,24,32,64,128",
                    help="code a function, KB, comma-separated (default 8,12,16,20,24,32,64,128)")
    ap.add_argument("--threads", type=int, action="append",
                    help="threads a block, a multiple of 32 (repeatable; default 256 and 512)")
    ap.add_argument("--passes", type=int, default=8, help="calls a block in the long run (default 8)")
    ap.add_argument("--blocks", type=int, default=132, help="blocks (default 132: one an SM of an H100)")
    ap.add_argument("--repeat", type=int, default=20, help="timed launches a point (default 20)")
    ap.add_argument("--pointers", action="store_true", help="also read code at device function pointers (last)")
    args = ap.parse_args(argv)
    try:
        args.sizes = [float(s) for s in args.sizes_kb.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes-kb: comma-separated numbers of KB, got {args.sizes_kb!r}")
    if not args.sizes or min(args.sizes) <= 0:
        ap.error(f"--sizes-kb: sizes above 0, got {args.sizes_kb!r}")
    args.threads = args.threads or [256, 512]
    bad = [t for t in args.threads if not 32 <= t <= 1024 or t % 32]
    if bad:
        ap.error(f"--threads {bad[0]}: a multiple of 32 from 32 to 1024")
    if args.passes < 2:
        ap.error(f"--passes {args.passes}: at least 2 (one pass is the baseline)")
    if args.blocks < 1 or args.repeat < 1:
        ap.error("--blocks and --repeat: 1 or more")
    return args


def main() -> None:
    args = parse_args()
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    clock_ghz, sms = props["clockRate"] / 1e6, props["multiProcessorCount"]
    print(f"device: {props['name'].decode()}, {sms} SMs; {args.blocks} blocks, each runs its copy (of {COPIES}) "
          f"once and {args.passes} times, code hot in L2; extra pass = (long - once) / {args.passes - 1}; "
          f"issue = warp instructions an SM a cycle in the extra passes, at {clock_ghz:.2f} GHz")
    print("| code a function (cubin) | threads | once, µs | extra pass, µs | issue / SM / cycle |")
    print("|---|---|---|---|---|")
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for kb in args.sizes:
        fmas = fmas_for(kb)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = assemble(ptx_source(fmas), Path(tmp))
            run = cp.RawModule(path=str(cubin)).get_function("run")  # loaded while the file exists
            funcs = elf_functions(cubin.read_bytes())
        code_kb = np.mean([len(copy_of(funcs, "run", i)) for i in range(COPIES)]) / 1024
        for t in args.threads:
            x = cp.random.standard_normal(args.blocks * t * ACCS, dtype=cp.float32)
            y = cp.zeros(args.blocks * t, dtype=cp.float32)

            def timed(passes: int) -> float:
                run((args.blocks,), (t,), (x, y, np.int32(passes)))  # the code into L2
                times: List[float] = []
                for _ in range(args.repeat):
                    start.record()
                    run((args.blocks,), (t,), (x, y, np.int32(passes)))
                    stop.record()
                    stop.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
                return float(np.median(times))

            once, long = timed(1), timed(args.passes)
            extra = (long - once) / (args.passes - 1)
            # an SM's warp instructions in one pass (16 bytes an instruction)
            warp_instructions = code_kb * 1024 / FFMA_BYTES * (t // 32) * -(-args.blocks // sms)
            issue = warp_instructions / (extra * 1e3 * clock_ghz) if extra > 0 else float("nan")
            print(f"| {code_kb:.1f} KB | {t} | {once:.1f} | {extra:.2f} | {issue:.2f} |", flush=True)

    if args.pointers:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = assemble(ptx_source(fmas_for(1)), Path(tmp))
            module = cp.RawModule(path=str(cubin))
            pointers, peek = module.get_function("pointers"), module.get_function("peek")
            funcs = elf_functions(cubin.read_bytes())
        at = cp.zeros(COPIES, dtype=cp.uint64)
        pointers((1,), (1,), (at,))
        print("device function pointers of f0..f7:", ", ".join(hex(int(a)) for a in at.get()), flush=True)
        words = 64
        got = cp.zeros(COPIES * words, dtype=cp.uint32)
        try:
            peek((COPIES,), (words,), (at, got, np.int32(words)))
            cp.cuda.runtime.deviceSynchronize()
        except cp.cuda.runtime.CUDARuntimeError as exc:  # the context is lost from here on
            print(f"reading {words * 4} bytes at each pointer as data failed: {exc}")
            return
        same = sum(got.get()[i * words:(i + 1) * words].tobytes() == copy_of(funcs, "pointers", i)[:words * 4]
                   for i in range(COPIES))
        print(f"the {words * 4} bytes at the pointer are the function's code in the cubin: {same} of {COPIES}")


if __name__ == "__main__":
    main()
