"""Run one benchmark command against two trees of sparseconv, alternating
(ABAB) in one process tree, so their figures come from the same device call.

The device's copy of the repository has a stale git history, so the old
tree is exported here first, as an untracked folder that travels with the
working tree:

    python bench/tree_ab.py export 0fa06eb bench/_old      # sparseconv/ and templates/ of that commit

and on the device:

    python bench/tree_ab.py run --old bench/_old --rounds 2 --out-dir $OUT/ab -- \\
        python bench/weight_table_probe.py --layers resnet50:layer4.1.conv2 --out $OUT/ab/{round}{side}.json

Each run gets PYTHONPATH pointing at one tree (the old folder, or this
repository for "new") and PYTHONSAFEPATH=1, so neither the working folder
nor the script's folder comes first on the import path (Python 3.11 and later);
"{side}" (old / new) and "{round}" (1, 2, ...) in the command are replaced.
Each run's output goes to <out-dir>/<round><side>.txt, and one line a run
says its exit status. Both trees build into one compile cache (run()).
Session 23 did this by hand (run n) and lost a device call to a tree
exported without its templates.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
TREE = ("sparseconv", "templates")  # what an import of sparseconv needs: the package and its templates
SHARED_CACHE = Path(tempfile.gettempdir()) / "sparseconv-tree-ab-cache"  # both trees' builds (run())


class TreeAbError(ValueError):
    """Bad input: main() prints it as one line and exits 2, before anything is written or run."""


def export(rev: str, dest: Path) -> None:
    """sparseconv/ and templates/ of commit `rev` into dest (which must not exist), atomically."""
    if dest.exists():
        raise TreeAbError(f"export: {dest} exists; remove it or name another folder")
    check = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise TreeAbError(f"export: {rev!r} is not a commit of {ROOT}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        archive = subprocess.run(["git", "archive", "--format=tar", rev, *TREE], cwd=ROOT, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"exported {', '.join(TREE)} of {rev} to {dest}")


def run(old: Path, rounds: int, out_dir: Path, command: List[str], shared_cache: bool = True) -> int:
    """The command, old then new, `rounds` times; returns the number of runs that failed.

    Both trees build into one compile cache: $SPARSECONV_CACHE_DIR if set, else
    SHARED_CACHE (not under out_dir, whose files a device call brings back).
    A kernel's key hashes its template source, the specialiser's code, the
    weights, tiling and ptxas flags, so a kernel both trees build is built
    once. Each tree's default (its own checkout's ptx_cache/) made each side
    build everything: session 27's run bj spent its device call building
    ResNet-50 twice. shared_cache False keeps the defaults, for a change in
    how a cubin is made from the same PTX and flags (assemble.py): cubins
    are keyed by those alone, so the two trees would share them."""
    missing = [name for name in TREE if not (old / name).is_dir()]
    if missing:
        raise TreeAbError(f"run: {old} has no {', '.join(missing)}/; make it with "
                          f"`python bench/tree_ab.py export <commit> {old}`")
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = os.environ.get("SPARSECONV_CACHE_DIR") or str(SHARED_CACHE)
    failed = 0
    for r in range(1, rounds + 1):
        for side, tree in (("old", old.resolve()), ("new", ROOT)):
            argv = [a.replace("{side}", side).replace("{round}", str(r)) for a in command]
            # PYTHONSAFEPATH: no cwd (the repository, for -c and -m) ahead of PYTHONPATH on the import path
            env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
            if shared_cache:
                env["SPARSECONV_CACHE_DIR"] = cache
            log = out_dir / f"{r}{side}.txt"
            with open(log, "w") as f:
                rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            failed += rc != 0
            print(f"round {r} {side}: rc {rc}, output {log}", flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    ex = sub.add_parser("export", help="copy sparseconv/ and templates/ of a commit into a new folder")
    ex.add_argument("rev")
    ex.add_argument("dest", type=Path)
    rn = sub.add_parser("run", help="run a command against the old tree and this one, alternating")
    rn.add_argument("--old", type=Path, required=True, help="a folder made by `export`")
    rn.add_argument("--rounds", type=int, default=2)
    rn.add_argument("--out-dir", type=Path, required=True)
    rn.add_argument("--separate-caches", action="store_true",
                    help="each tree builds into its own default cache, not one shared cache (see run())")
    rn.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args()
    try:
        if args.what == "export":
            export(args.rev, args.dest)
            return
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise TreeAbError("run: give the command after --, e.g. -- python bench/weight_table_probe.py ...")
        if args.rounds < 1:
            raise TreeAbError(f"run: --rounds must be 1 or more, got {args.rounds}")
        failed = run(args.old, args.rounds, args.out_dir, command, shared_cache=not args.separate_caches)
    except TreeAbError as e:
        ap.error(str(e))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
