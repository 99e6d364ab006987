"""Draw a saved sparsity sweep again, without a GPU: the JSON that
`sparseconv bench --sweep --json FILE` wrote, as the PNG that `--plot` draws
today (cuDNN fp32 and TF32 side by side, one row per batch size).

    python bench/replot_sweep.py bench/results/results_sweep_2026-11-22.json --out docs/sweep_2026-11-22.png

Bad input (a missing or damaged file, a run that is not a sweep, an --out
that is not a .png in an existing folder) exits 2 with one line, and writes
nothing."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sparseconv.benchmark.report import LABELS, sweep_figure


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="the JSON that `sparseconv bench --sweep --json` wrote")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    try:
        if args.out.suffix.lower() != ".png":
            raise ValueError(f"--out {args.out}: the plot is a PNG; name it *.png")
        if not args.out.parent.is_dir():
            raise ValueError(f"--out {args.out}: folder {args.out.parent} does not exist")
        try:
            doc = json.loads(args.results.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{args.results}: cannot read a bench result ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not all(
                isinstance(r, dict) and {"layer", "batch", "sparsity", "speedup"} <= set(r)
                and isinstance(r["speedup"], dict) for r in doc["rows"]):
            raise ValueError(f"{args.results}: not a result of `sparseconv bench --json` (rows of layer, batch, "
                             "sparsity and speedup expected)")
        try:
            fig, baselines = sweep_figure(doc)
        except ValueError as exc:
            raise ValueError(f"{args.results}: {exc}") from None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import matplotlib.pyplot as plt

    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp.png")
    try:  # written whole or not at all
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, args.out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    print(f"wrote {args.out} (speedup over {' and '.join(LABELS[b] for b in baselines)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
