import sys
import cupy
from sparseconv.pool import MaxPoolShape, max_pool2d
from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu
pool = MaxPoolShape.of(3, 2, 1)
dev = cupy.cuda.Device().id
flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)
for n, c, s in [(1, 64, 112), (64, 64, 112)]:
    x = cupy.random.standard_normal((n, c, s, s), dtype=cupy.float32)
    y = cupy.empty((n, c, s // 2, s // 2), cupy.float32)
    call = lambda: max_pool2d(dev, x, y, pool)
    call()
    hot = [time_gpu(call, repeat=50, max_seconds=0.5, capture=cupy_graph).us for _ in range(3)]
    cold = [time_cold(call, l2_flush(flush, x), repeat=50, max_seconds=0.5, capture=cupy_graph).us for _ in range(3)]
    print(f"batch {n}: hot {', '.join(f'{t:.2f}' for t in hot)}; cold {', '.join(f'{t:.2f}' for t in cold)} us")
