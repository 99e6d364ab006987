"""Speed of the specialisation pass alone on vgg-conv3 (90% zeros), plus a profile.

    python bench/pass_speed.py [runs]

Runs the pass `runs` times (default 7; the machine is noisy) and prints the
median and best time, template lines visited per second (the pass's input,
copies counted) and output PTX lines per second, both at the median, and a
hash of the output (same hash = same PTX)."""
import cProfile
import hashlib
import pstats
import statistics
import sys
import time

import numpy as np
from sparseconv import ConvShape, Target, default_tiling
from sparseconv.render import render
from sparseconv.compile import compile_to_ptx
from sparseconv.specialise import specialise, analyse_template
runs = int(sys.argv[1]) if len(sys.argv) > 1 else 7
s=ConvShape(128,128,112,112,3,3,(1,1),(1,1)); r=render(s, default_tiling(s)); tp=compile_to_ptx(r.source, Target())
w=np.random.default_rng(0).standard_normal(s.weight_shape).astype(np.float32); w[np.random.default_rng(1).random(w.shape)<0.9]=0
lay=analyse_template(tp,r)
times = []
for _ in range(runs):
    t=time.perf_counter(); ptx,st=specialise(tp,r,w,lay); times.append(time.perf_counter()-t)
dt = statistics.median(times)
print(f"{runs} runs: median {dt:.3f}s, best {min(times):.3f}s")
print(f"visited {st.ptx_lines_visited:,}: {st.ptx_lines_visited/dt:,.0f}/s;  {st.ptx_lines} lines in {dt:.3f}s = {st.ptx_lines/dt:,.0f} lines/s; body items {len(lay.loop_body)} x {st.kblocks*st.chunks} copies = {len(lay.loop_body)*st.kblocks*st.chunks:,} visited")
print(hashlib.sha256(ptx.encode()).hexdigest()[:16])
cProfile.run('specialise(tp,r,w,lay)', '/tmp/p.out')
pstats.Stats('/tmp/p.out').sort_stats('tottime').print_stats(8)
