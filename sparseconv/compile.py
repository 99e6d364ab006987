"""Stage 2, compile: CUDA C source -> PTX with nvcc, once per (template source,
layer shape, tiling, target, compiler), cached on disk."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from .shapes import Target

# Never --use_fast_math: results must be exact fp32.
# -unroll-runtime=0 (an option of NVVM's optimiser, passed through cicc): the
# specialiser copies the chunk loop's body once per chunk, so the loop must
# stay a loop with its body once in the PTX. `#pragma unroll 1` asks for that,
# but NVVM drops the pragma once the body holds inline asm (the cp.async
# staging), and then unrolls a small body 2x with a remainder copy at run time
# (seen on 1x1 layers with one or two input channels). Bigger bodies are never
# runtime-unrolled, so their PTX is the same with or without the option.
NVCC_FLAGS = ("-O3", "-Xcicc", "--Xopt", "-Xcicc", "-unroll-runtime=0")


class ToolNotFoundError(RuntimeError):
    pass


class CompileError(RuntimeError):
    """A CUDA tool failed. Carries its log and the input it was given."""

    def __init__(self, tool: str, log: str, source: str, what: str) -> None:
        self.tool, self.log, self.source, self.what = tool, log, source, what
        super().__init__(f"{tool} failed on {what}:\n{log.strip()}\n"
                         f"(call .dump() on this error for the numbered source)")

    def __reduce__(self):  # picklable, so a build in a worker process reports it intact
        return type(self), (self.tool, self.log, self.source, self.what)

    def dump(self) -> str:
        return "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(self.source.splitlines()))


def find_tool(name: str) -> Path:
    """nvcc / ptxas: $SPARSECONV_<NAME>, else PATH, else $CUDA_HOME/bin."""
    override = os.environ.get(f"SPARSECONV_{name.upper()}")
    if override:
        if not Path(override).is_file():
            raise ToolNotFoundError(f"SPARSECONV_{name.upper()}={override} is not a file")
        return Path(override)
    found = shutil.which(name)
    if found:
        return Path(found)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).is_file():
            return Path(home) / "bin" / name
    raise ToolNotFoundError(
        f"{name} not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin. Install the CUDA toolkit "
        f"(or `pip install nvidia-cuda-nvcc`) or point SPARSECONV_{name.upper()} at the binary.")


@functools.lru_cache(maxsize=None)
def tool_identity(name: str) -> str:
    """The tool's `--version` text: part of every cache key, so a toolkit upgrade
    never reuses PTX or cubins built by another compiler."""
    exe = find_tool(name)
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise ToolNotFoundError(f"`{exe} --version` failed: {res.stderr.strip()}")
    return res.stdout.strip()


def run_tool(args: Sequence[str], source: str, what: str) -> None:
    res = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise CompileError(Path(args[0]).name, res.stderr + res.stdout, source, what)


def compile_to_ptx(source: str, target: Target, what: str = "the template",
                   extra_flags: Optional[Sequence[str]] = None) -> str:
    """Compile CUDA C to PTX text with nvcc. `what` names the layer in errors."""
    nvcc = find_tool("nvcc")
    with tempfile.TemporaryDirectory(prefix="sparseconv-") as tmp:
        cu, ptx = Path(tmp) / "template.cu", Path(tmp) / "template.ptx"
        cu.write_text(source)
        run_tool([str(nvcc), "-ptx", f"-arch={target.arch}", *NVCC_FLAGS, *(extra_flags or ()),
                  str(cu), "-o", str(ptx)], source, what)
        return ptx.read_text()
