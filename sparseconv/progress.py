"""Progress on stderr for long work done one layer at a time (timing each
layer's paths, tuning each layer): one line, rewritten in place as each
layer starts, ended with a newline when the work is done. The parallel build
has its own bar (parallel.build_many)."""
from __future__ import annotations

import sys
from typing import IO, Callable, Optional

import click

NAME_WIDTH = 40  # layer names are cut or padded to this, so the line keeps its length


class StepLine:
    """`with StepLine("timing", len(layers), enabled) as line: line.step(name)`
    prints "\\rtiming: 3/53 layer1.1.conv2" for each layer; nothing at all
    when not enabled or when there is nothing to do. Without `with`, close()
    ends the line."""

    def __init__(self, label: str, total: int, enabled: bool = True, file: Optional[IO[str]] = None) -> None:
        self.label = label
        self.total = total
        self.enabled = enabled and total > 0
        self.file = file
        self.done = 0

    def step(self, name: str) -> None:
        self.done += 1
        if self.enabled:
            click.echo(f"\r{self.label}: {self.done}/{self.total} {name[:NAME_WIDTH]:{NAME_WIDTH}s}",
                       file=self.file or sys.stderr, nl=False)

    def close(self) -> None:
        """End the line (once), if anything was printed on it."""
        if self.enabled and self.done:
            click.echo("", file=self.file or sys.stderr)
            self.enabled = False

    def __enter__(self) -> "StepLine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_line(label: str, enabled: bool = True,
               file: Optional[IO[str]] = None) -> Optional[Callable[[int, int], None]]:
    """A callback for work that reports (done, total), as assemble_cubin does:
    "\\rlabel: done/total" rewritten in place, ended when done reaches total;
    None when not enabled (the callee then reports to no one)."""
    if not enabled:
        return None

    def report(done: int, total: int) -> None:
        click.echo(f"\r{label}: {done}/{total}", file=file or sys.stderr, nl=done >= total)

    return report


def ptxas_counter(name: str, enabled: bool = True, variant: int = 0,
                  variants: int = 1) -> Optional[Callable[[int, int], None]]:
    """count_line for one layer's (one variant's) ptxas functions, as
    compile_conv2d, compile_linear and `sparseconv layer` show them."""
    which = f" (variant {variant + 1} of {variants})" if variants > 1 else ""
    return count_line(f"{name}{which}: ptxas, functions assembled", enabled)
