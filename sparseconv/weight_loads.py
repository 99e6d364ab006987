"""How kernels that read their weights as data load them: the weight table's
entries (sparseconv.table) and the gemv's weights and entries
(sparseconv.gemv), each read once a forward.

At batch 1 a forward walks its code, its tables and its classifier once, in
order, and the code of the first layers ran cold in the network: ResNet-50's
early code layers took 143 us in the graph against 100 hot (session 26's
profile). The weights read as data went through L2 after that code and
pushed it out before the next forward needed it. Loaded with an L2
evict-first policy they are the first lines to go instead: ResNet-50 at
batch 1, the graph's span 367 -> 355 us in two alternating pairs on an H200
(conv1 9.5-9.9 -> 7.1 us in the graph, the tables unchanged) and 393 -> 369
in one pair on an H100; VGG-16, whose code is more than L2 keeps, unchanged
(bench/network_ab.py, docs/PERFORMANCE.md, session 39).

Each such kernel's source includes weight_loads_cuda(): three loads, each
the same instruction with or without the policy, as the switch is when the
source is made. EVICT_FIRST False gives the loads as they were before
session 39 (no policy); bench/network_ab.py's evict-first-weights rule.
GPUs older than sm_80 have no cache policies and get the plain loads.
"""
from __future__ import annotations

EVICT_FIRST = True


def weight_loads_cuda() -> str:
    """The CUDA text of the weight loads:
    sc_load_weights4(const float4*)  16 bytes, not kept in L1 (the dense gemv's rows)
    sc_load_entry2(const uint2*)     8 bytes, not kept in L1 (the sparse gemv's entries)
    sc_load_entry2_l1(const int2*)   8 bytes through L1 (the table's entries, as __ldg)"""
    return f"#define SC_EVICT_FIRST_WEIGHTS {int(EVICT_FIRST)}\n" + _LOADS


_LOADS = r"""
#if SC_EVICT_FIRST_WEIGHTS && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#undef SC_EVICT_FIRST_WEIGHTS
#define SC_EVICT_FIRST_WEIGHTS 0  // createpolicy and .L2::cache_hint need sm_80: plain loads before it
#endif
#if SC_EVICT_FIRST_WEIGHTS
// Weights read once a forward: the first lines L2 gives up (sparseconv/weight_loads.py).
#define SC_HINT ".L2::cache_hint"
#define SC_POLICY(n) ", %" #n
#define SC_POLICY_DECL unsigned long long policy; asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy))
#else
#define SC_HINT ""
#define SC_POLICY(n) ""
#define SC_POLICY_DECL const unsigned long long policy = 0  // an operand the asm does not name
#endif
__device__ __forceinline__ float4 sc_load_weights4(const float4* p)
{
    SC_POLICY_DECL;
    float4 v;
    asm("ld.global.nc.L1::no_allocate" SC_HINT ".v4.f32 {%0, %1, %2, %3}, [%4]" SC_POLICY(5) ";"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p), "l"(policy));
    return v;
}
__device__ __forceinline__ uint2 sc_load_entry2(const uint2* p)
{
    SC_POLICY_DECL;
    uint2 v;
    asm("ld.global.nc.L1::no_allocate" SC_HINT ".v2.u32 {%0, %1}, [%2]" SC_POLICY(3) ";"
        : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(policy));
    return v;
}
__device__ __forceinline__ int2 sc_load_entry2_l1(const int2* p)
{
    SC_POLICY_DECL;
    int2 v;
    asm("ld.global.nc" SC_HINT ".v2.s32 {%0, %1}, [%2]" SC_POLICY(3) ";" : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(policy));
    return v;
}
"""
