"""Speed of the specialisation pass alone on vgg-conv3 (90% zeros), plus a profile.

    python bench/pass_speed.py

Prints template lines visited per second (the pass's input, copies counted),
output PTX lines per second, and a hash of the output (same hash = same PTX)."""
import cProfile
import pstats
import time

import numpy as np
from sparseconv import ConvShape, Target, default_tiling
from sparseconv.render import render
from sparseconv.compile import compile_to_ptx
from sparseconv.specialise import specialise, analyse_template
s=ConvShape(128,128,112,112,3,3,(1,1),(1,1)); r=render(s, default_tiling(s)); tp=compile_to_ptx(r.source, Target())
w=np.random.default_rng(0).standard_normal(s.weight_shape).astype(np.float32); w[np.random.default_rng(1).random(w.shape)<0.9]=0
lay=analyse_template(tp,r)
t=time.perf_counter(); ptx,st=specialise(tp,r,w,lay); dt=time.perf_counter()-t
print(f"visited {st.ptx_lines_visited:,}: {st.ptx_lines_visited/dt:,.0f}/s;  {st.ptx_lines} lines in {dt:.2f}s = {st.ptx_lines/dt:,.0f} lines/s; body items {len(lay.loop_body)} x {st.kblocks*st.chunks} copies = {len(lay.loop_body)*st.kblocks*st.chunks:,} visited")
import hashlib; print(hashlib.sha256(ptx.encode()).hexdigest()[:16])
cProfile.run('specialise(tp,r,w,lay)', '/tmp/p.out')
pstats.Stats('/tmp/p.out').sort_stats('tottime').print_stats(8)
