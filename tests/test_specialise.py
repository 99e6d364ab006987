"""CPU: the specialisation pass on real nvcc-compiled template PTX, and ptxas on its output."""
import functools
import re
from collections import Counter

import numpy as np
import pytest

from sparseconv.assemble import assemble_cubin, function_code, module_functions, split_module
from sparseconv.compile import compile_to_ptx
from sparseconv.operators import benchmark_operators
from sparseconv.render import render
from sparseconv.shapes import ConvShape, Epilogue, Target, Tiling, residual_after_loop
from sparseconv.tilings import default_tiling
from sparseconv.specialise import SpecialiseError, analyse_template, specialise

from sparseconv.testing import pruned_weight

pytestmark = pytest.mark.nvcc

LAYERS = {
    "strided_rect": (ConvShape(3, 4, 5, 7, 3, 3, (2, 2), (1, 1)), None),
    "multi_block_multi_chunk": (ConvShape(5, 6, 9, 13, 3, 5, (2, 1), (0, 2)), Tiling(3, 2, 4, 8, 1, 2)),
    "dilated": (ConvShape(8, 12, 17, 15, 3, 3, (1, 1), (2, 2), (2, 2)), Tiling(4, 3, 8, 8, 1, 4)),
    "grouped": (ConvShape(12, 18, 10, 10, 3, 3, (1, 1), (1, 1), groups=3), None),
    "depthwise": (ConvShape(16, 16, 14, 14, 3, 3, (1, 1), (1, 1), groups=16), None),
    "pointwise": (ConvShape(24, 40, 7, 9, 1, 1), Tiling(8, 5, 7, 9, 1, 3)),
    "thread_h2": (ConvShape(10, 13, 19, 23, 3, 3, (1, 1), (1, 1)), Tiling(5, 3, 6, 12, 2, 3)),
}


@functools.lru_cache(maxsize=None)
def template(name):
    shape, tiling = LAYERS[name]
    r = render(shape, tiling or default_tiling(shape))
    return r, compile_to_ptx(r.source, Target(), name)


def f32_hex(v):
    return "0f%08X" % np.float32(v).view(np.uint32)


def fma_weights(ptx):
    """Multiset of the weight immediates of the FMAs in specialised PTX."""
    return Counter(re.findall(r"fma\.rn\.f32 [^,]+, [^,]+, (0f[0-9A-F]{8}),", ptx))


@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95, 1.0])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_pass_deletes_exactly_the_zero_weight_fmas(name, sparsity):
    rendered, tptx = template(name)
    shape = rendered.shape
    rng = np.random.default_rng()
    w = pruned_weight(rng, shape.weight_shape, sparsity, zero_channels=1)
    ptx, stats = specialise(tptx, rendered, w)
    mult = rendered.tiling.thread_h * rendered.tiling.thread_w
    nnz = int(np.count_nonzero(w))
    assert stats.fmas_per_weight == mult
    assert stats.fmas_kept == nnz * mult
    assert stats.fmas_before == stats.kblocks * stats.chunks * rendered.tiling.k_block * \
        rendered.tiling.c_block * shape.kernel_h * shape.kernel_w * mult
    assert stats.fmas_deleted == stats.fmas_before - nnz * mult
    # Every surviving FMA carries a real nonzero weight, each exactly `mult` times.
    want = Counter({f32_hex(v): 0 for v in w[w != 0]})
    for v in w[w != 0]:
        want[f32_hex(v)] += mult
    assert fma_weights(ptx) == want
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == nnz * mult
    # No placeholder survives, anywhere. A real weight may have a placeholder's
    # exact value (placeholders lie in [1, 2); about 1 run in 350 at sparsity 0):
    # its immediate is then a weight, checked by fma_weights above.
    weight_bits = set(w[w != 0].view(np.uint32).tolist())
    for bits in rendered.placeholders:
        if bits not in weight_bits:
            assert f"0f{bits:08X}" not in ptx.upper().replace("0F", "0f")
    # One function per output-channel block, and the jump table names them all.
    assert len(re.findall(r"^\.func sc_kblock_\d+\(", ptx, re.M)) == stats.kblocks
    assert ptx.count("call.uni sc_kblock_") == stats.kblocks
    cubin = assemble_cubin(ptx, Target(), name)
    assert cubin[:4] == b"\x7fELF"


def test_stores_survive_when_every_weight_is_zero():
    rendered, tptx = template("multi_block_multi_chunk")
    w = np.zeros(rendered.shape.weight_shape, np.float32)
    ptx, stats = specialise(tptx, rendered, w)
    assert stats.fmas_kept == 0
    stores_template = len(re.findall(r"\bst\.global\.f32\b", tptx))
    assert len(re.findall(r"\bst\.global\.f32\b", ptx)) == stores_template * stats.kblocks
    assert_valid_ptx(ptx)


def assert_valid_ptx(ptx):
    assert assemble_cubin(ptx, Target(), "test")[:4] == b"\x7fELF"


def to_immediate_form(tptx):
    """Rewrite NVVM's `mov.f32 %fA, 0fP` + `fma ... %fA ...` into `fma ... 0fP ...`."""
    movs = dict(re.findall(r"mov\.f32\s+(%f\d+),\s+(0f3F[0-9A-F]{6});", tptx))
    lines = []
    for line in tptx.splitlines():
        m = re.match(r"\s*mov\.f32\s+(%f\d+),\s+0f3F[0-9A-F]{6};", line)
        if m and m.group(1) in movs:
            continue
        if "fma.rn.f32" in line:
            line = re.sub(r"%f\d+", lambda mm: movs.get(mm.group(0), mm.group(0)), line)
        lines.append(line)
    return "\n".join(lines)


def test_immediate_form_gives_the_same_kernel():
    rendered, tptx = template("multi_block_multi_chunk")
    imm = to_immediate_form(tptx)
    assert imm.count("mov.f32") < tptx.count("mov.f32")
    assert re.search(r"fma\.rn\.f32 [^;]*0f3F", imm)
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.7)
    a, sa = specialise(tptx, rendered, w)
    b, sb = specialise(imm, rendered, w)
    assert sa.fmas_kept == sb.fmas_kept and sa.fmas_deleted == sb.fmas_deleted
    assert fma_weights(a) == fma_weights(b)
    assert_valid_ptx(b)


def test_repeated_placeholder_mov_is_accepted():
    """NVVM may materialise the same placeholder twice; both movs are dropped."""
    rendered, tptx = template("strided_rect")
    m = re.search(r"^(\s*mov\.f32\s+(%f\d+),\s+0f3F[0-9A-F]{6};)$", tptx, re.M)
    doubled = tptx.replace(m.group(1), m.group(1) + "\n" + m.group(1), 1)
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.5)
    a, _ = specialise(tptx, rendered, w)
    b, _ = specialise(doubled, rendered, w)
    assert fma_weights(a) == fma_weights(b)


def test_nonfinite_weights_become_immediates():
    rendered, tptx = template("strided_rect")
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.5)
    w[0, 0, 0, 0], w[1, 1, 1, 1], w[2, 2, 2, 2] = np.nan, np.inf, -np.inf
    ptx, _ = specialise(tptx, rendered, w)
    for v in (np.nan, np.inf, -np.inf):
        assert f32_hex(v) in ptx
    assert_valid_ptx(ptx)


def first_placeholder_fma(tptx):
    return re.search(r"^\s*fma\.rn\.f32[^\n]*$", tptx, re.M).group(0)


def without_loop_back_edge(tptx):
    """The template with its last backward branch (the chunk loop's) commented out."""
    lines = tptx.splitlines(keepends=True)
    seen, back = set(), None
    for i, line in enumerate(lines):
        label = re.match(r"^(\$L\w+):", line.strip())
        if label:
            seen.add(label.group(1))
        target = re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", line)
        if target and target.group(1) in seen:
            back = i
    lines[back] = "// " + lines[back]
    return "".join(lines)


@pytest.mark.parametrize("tamper, message", [
    (lambda t: t.replace(first_placeholder_fma(t), "", 1), "counts do not add up"),
    (lambda t: t.replace(first_placeholder_fma(t), first_placeholder_fma(t) + "\n" + first_placeholder_fma(t), 1),
     "counts do not add up"),
    (lambda t: t.replace(first_placeholder_fma(t), first_placeholder_fma(t).replace("fma.rn.f32", "add.f32")
                         .rsplit(",", 1)[0] + ";", 1), "placeholder used by add.f32"),
    (without_loop_back_edge, "one loop around all placeholder FMAs"),
    (lambda t: re.sub(r"0f3F[0-9A-F]{6}", "0f3F800000", t), "no placeholder FMA"),
    (lambda t: t.replace("call.uni", "// call.uni", 1), "call"),
])
def test_broken_invariants_raise(tamper, message):
    rendered, tptx = template("multi_block_multi_chunk")
    broken = tamper(tptx)
    assert broken != tptx
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.5)
    with pytest.raises(SpecialiseError, match=message):
        specialise(broken, rendered, w)


def test_wrong_weight_shape_is_rejected():
    rendered, tptx = template("strided_rect")
    with pytest.raises(ValueError, match="weight shape"):
        specialise(tptx, rendered, np.ones((4, 3, 3, 2), np.float32))


def test_split_module_compiles_separately_and_links():
    rendered, tptx = template("depthwise")
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.5)
    ptx, stats = specialise(tptx, rendered, w)
    pieces = split_module(ptx)
    assert len(pieces) == stats.kblocks + 1
    assert all(".visible .func sc_kblock_" in p for p in pieces[:-1])
    assert pieces[-1].count(".extern .func sc_kblock_") == stats.kblocks
    assert assemble_cubin(ptx, Target(), "depthwise")[:4] == b"\x7fELF"


def test_assemble_reports_each_function_of_a_split_module():
    """assemble_cubin tells its caller how far a split module's ptxas got:
    (0, n) first, then once per function in order, up to (n, n)."""
    rendered, tptx = template("depthwise")
    w = pruned_weight(np.random.default_rng(0), rendered.shape.weight_shape, 0.5)
    ptx, _ = specialise(tptx, rendered, w)
    n = len(split_module(ptx))
    assert n > 2
    calls = []
    cubin = assemble_cubin(ptx, Target(), "depthwise", on_function=lambda done, total: calls.append((done, total)))
    assert cubin[:4] == b"\x7fELF"
    # Functions that share a ptxas run (GROUP_LINES) are counted when it ends.
    assert calls[0] == (0, n) and calls[-1] == (n, n) and all(total == n for _, total in calls)
    assert [done for done, _ in calls] == sorted({done for done, _ in calls})


@pytest.mark.parametrize("name, piece_lines", [("depthwise", None), ("multi_block_multi_chunk", 1)])
def test_split_module_groups_functions_that_call_none(name, piece_lines):
    """With a line budget, consecutive k-block functions that call no other
    share a module, each function in exactly one, the budget kept; a function
    that calls others (a split k-block's chain of pieces) stays alone, and the
    entry's module comes last, alone."""
    rendered, tptx = template(name)
    w = pruned_weight(np.random.default_rng(2), rendered.shape.weight_shape, 0.5)
    ptx, _ = specialise(tptx, rendered, w, **({} if piece_lines is None else {"piece_lines": piece_lines}))
    alone = split_module(ptx)
    longest = max(len(m.splitlines()) for m in alone[:-1])
    grouped = split_module(ptx, group_lines=3 * longest)
    assert len(grouped) < len(alone) and grouped[-1] == alone[-1]
    names = [n for m in grouped[:-1] for n in module_functions(m)]
    assert sorted(names) == sorted(n for m in alone[:-1] for n in module_functions(m))
    for m in grouped[:-1]:
        funcs = module_functions(m)
        if len(funcs) > 1:
            assert "call" not in m and len(m.splitlines()) <= 3 * longest + 20  # + the shared header
    assert assemble_cubin(ptx, Target(), name)[:4] == b"\x7fELF"
    # min_modules: no fewer modules than asked (the ptxas runs that keep the threads busy)
    kblocks = len(alone) - 1
    assert len(split_module(ptx, group_lines=10 ** 6, min_modules=kblocks)) == len(alone)
    assert len(split_module(ptx, group_lines=10 ** 6, min_modules=2)) - 1 >= 2


def test_grouped_functions_compile_to_the_same_code_as_alone(tmp_path):
    """ptxas -c compiles each function of a grouped module as it compiles the
    function alone: every function's code bytes are equal."""
    import subprocess

    from sparseconv.compile import find_tool

    rendered, tptx = template("depthwise")
    ptx, _ = specialise(tptx, rendered, pruned_weight(np.random.default_rng(3), rendered.shape.weight_shape, 0.5))

    def text_sections(modules, tag):
        found = {}
        for i, module in enumerate(modules):
            src, obj = tmp_path / f"{tag}{i}.ptx", tmp_path / f"{tag}{i}.o"
            src.write_text(module)
            subprocess.run([str(find_tool("ptxas")), "-c", "-arch=sm_90", "-O3", str(src), "-o", str(obj)], check=True)
            found.update(function_code(obj.read_bytes()))
        return found

    alone = text_sections(split_module(ptx)[:-1], "a")
    grouped_modules = split_module(ptx, group_lines=10 ** 6)[:-1]
    assert len(grouped_modules) == 1 and len(alone) > 2 and all(alone.values())
    assert text_sections(grouped_modules, "g") == alone


def test_a_ptxas_failure_names_the_functions_it_was_compiling(tmp_path, monkeypatch):
    """Where ptxas fails on one module of a split (or grouped) layer, the
    error names that module's functions, not a piece number."""
    from sparseconv.compile import CompileError, find_tool

    rendered, tptx = template("depthwise")
    ptx, _ = specialise(tptx, rendered, pruned_weight(np.random.default_rng(5), rendered.shape.weight_shape, 0.5))
    tool = tmp_path / "ptxas"  # fails on the module that defines sc_kblock_1, the real ptxas otherwise
    tool.write_text(f"""#!/bin/sh
for a; do case "$a" in *.ptx) src="$a";; esac; done
if [ -n "$src" ] && grep -q '^\\.visible \\.func.* sc_kblock_1(' "$src"; then
  echo 'ptxas fatal: made to fail here' >&2; exit 1
fi
exec {find_tool("ptxas")} "$@"
""")
    tool.chmod(0o755)
    monkeypatch.setenv("SPARSECONV_PTXAS", str(tool))
    with pytest.raises(CompileError, match="made to fail here") as info:
        assemble_cubin(ptx, Target(), "layer dw", jobs=2)
    names = module_functions(info.value.source)
    assert "sc_kblock_1" in names and info.value.what.startswith("layer dw, function")
    assert names[0] in info.value.what and names[-1] in info.value.what


def test_a_cached_build_reports_no_assembly(tmp_path):
    """build_conv2d passes the callback to ptxas only when it assembles:
    the second build of the same layer comes from the cache, silently."""
    from sparseconv.build import build_conv2d
    from sparseconv.cache import ArtifactCache

    shape, _ = LAYERS["depthwise"]
    w = pruned_weight(np.random.default_rng(1), shape.weight_shape, 0.5)
    cache = ArtifactCache(str(tmp_path))
    calls = []
    first = build_conv2d(w, shape, target=Target(), cache=cache, on_function=lambda *c: calls.append(c))
    assert calls and calls[-1][0] == calls[-1][1] and not first.stats["kernel_cache_hit"]
    calls.clear()
    again = build_conv2d(w, shape, target=Target(), cache=cache, on_function=lambda *c: calls.append(c))
    assert again.stats["kernel_cache_hit"] and calls == []


@pytest.mark.parametrize("op", benchmark_operators(), ids=lambda o: o.name)
def test_benchmark_layer_templates_compile_and_analyse(op):
    r = render(op.shape, default_tiling(op.shape))
    layout = analyse_template(compile_to_ptx(r.source, Target(), op.name), r)
    assert layout.fmas_per_weight == default_tiling(op.shape).thread_w


@pytest.mark.parametrize("name", ["multi_block_multi_chunk", "dilated", "thread_h2", "grouped", "pointwise"])
def test_split_k_blocks_keep_every_fma_and_assemble(name):
    """piece_lines=1 puts each chunk copy in a function of its own: the same
    FMAs, one piece function per (k-block, chunk), the entry calling each
    k-block's pieces in order, the loop state in one shared array, and ptxas
    + nvlink accept the result."""
    rendered, tptx = template(name)
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.8)
    whole, s1 = specialise(tptx, rendered, w)
    split, s2 = specialise(tptx, rendered, w, piece_lines=1)
    assert fma_weights(split) == fma_weights(whole)
    assert s2.pieces == s2.kblocks * s2.chunks
    funcs = re.findall(r"^\.func (sc_kblock_\w+)\(", split, re.M)
    calls = re.findall(r"call\.uni\s+(sc_kblock_\w+),", split)
    assert calls == funcs  # each function called once, in order
    if s2.chunks > 1:
        assert funcs == [f"sc_kblock_{b}_p{j}" for b in range(s2.kblocks) for j in range(s2.chunks)]
        assert split.count(".weak .shared .align 16 .b8 sc_state[") == 1
        assert split.count("// loop state for the next piece") == s2.kblocks * (s2.chunks - 1)
        assert split.count("// loop state from the previous piece") == s2.kblocks * (s2.chunks - 1)
    else:
        assert split == whole
    assert len(split_module(split)) == len(funcs) + 1
    assert_valid_ptx(split)


def test_default_piece_budget_leaves_small_layers_unsplit():
    rendered, tptx = template("multi_block_multi_chunk")
    w = pruned_weight(np.random.default_rng(), rendered.shape.weight_shape, 0.5)
    ptx, stats = specialise(tptx, rendered, w)
    assert stats.pieces == stats.kblocks and "sc_state" not in ptx


# --------------------------------------------------------------------------- fast paths of the pass

def one_by_one_plan(items, ren, labels, aliasable, consumers, in_body):
    """A _copy_plan that pre-renders nothing: every statement and FMA handled on its own."""
    return tuple((pos if in_body else None, it) for pos, it in enumerate(items))


def all_special(body_plan, aliasable, liveness):
    """Every FMA takes the general form (_emit_fma), alias bookkeeping and all."""
    return frozenset(aliasable)


def specialise_three_ways(monkeypatch, tptx, rendered, w, piece_lines=None):
    """The PTX as the pass makes it, with every FMA in its general form, and
    with every item handled one by one (the pass without its shortcuts)."""
    from sparseconv.specialise import emit

    fast = specialise(tptx, rendered, w, piece_lines=piece_lines)
    with monkeypatch.context() as m:
        m.setattr(emit, "_special_registers", all_special)
        general = specialise(tptx, rendered, w, piece_lines=piece_lines)
        m.setattr(emit, "_copy_plan", one_by_one_plan)
        one_by_one = specialise(tptx, rendered, w, piece_lines=piece_lines)
    return fast, general, one_by_one


@pytest.mark.parametrize("sparsity", [0.0, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("name", ["multi_block_multi_chunk", "thread_h2", "grouped", "pointwise"])
def test_fast_paths_give_the_same_ptx_as_one_by_one(monkeypatch, name, sparsity):
    """Statements rendered once per template (_copy_plan) and FMAs that skip
    the alias bookkeeping (_special_registers) are shortcuts only: the PTX is
    byte for byte the same without them, split into pieces or not."""
    rendered, tptx = template(name)
    w = pruned_weight(np.random.default_rng(5), rendered.shape.weight_shape, sparsity, zero_channels=1)
    for piece_lines in (None, 1):
        fast, general, one_by_one = specialise_three_ways(monkeypatch, tptx, rendered, w, piece_lines)
        assert fast[0] == general[0] == one_by_one[0]
        assert fast[1] == general[1] == one_by_one[1]


def fma_lines(tptx):
    return [i for i, line in enumerate(tptx.splitlines()) if re.match(r"\s*fma\.rn\.f32\s", line)]


def with_items_handled_one_by_one(tptx):
    """The template, computing the same, with items the pass cannot take its
    fast paths for in the loop body: an FMA guarded by an always-true
    predicate, and a no-op mov writing another FMA's destination again."""
    lines = tptx.splitlines()
    func = next(i for i, line in enumerate(lines) if re.match(r"^\.\w.*\bsc_kblock\(", line))
    last_reg = max(i for i, line in enumerate(lines) if i > func and line.strip().startswith(".reg ")
                   and i < next(j for j in range(func, len(lines)) if lines[j].strip() == "}"))
    fmas = fma_lines(tptx)
    guarded, rewritten = fmas[2], fmas[5]
    dest = re.match(r"\s*fma\.rn\.f32\s+(%f\d+),", lines[rewritten]).group(1)
    lines[guarded] = re.sub(r"^(\s*)fma", r"\1@%sc_t fma", lines[guarded])
    lines.insert(rewritten + 1, f"\tmov.f32 \t{dest}, {dest};")
    lines[last_reg + 1:last_reg + 1] = ["\t.reg .pred %sc_t;", "\t.reg .b32 %sc_tid;",
                                        "\tmov.u32 %sc_tid, %tid.x;", "\tsetp.ge.u32 %sc_t, %sc_tid, 0;"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("piece_lines", [None, 1])
def test_items_handled_one_by_one_compute_the_convolution(monkeypatch, piece_lines):
    """A guarded FMA and a statement that rewrites an FMA register take the
    general path: the same PTX as without shortcuts, the right convolution
    (CPU interpreter) and ptxas accepts it."""
    from sparseconv.ptx import Stmt
    from sparseconv.specialise import emit
    from sparseconv.specialise.analysis import PlaceholderFma
    from specialised_runs import run_ptx
    from sparseconv.testing import conv2d_reference, relative_l2

    rendered, tptx = template("multi_block_multi_chunk")
    tampered = with_items_handled_one_by_one(tptx)
    layout = analyse_template(tampered, rendered)
    general = [seg[1] for seg in emit.emission_plan(layout).body_plan if type(seg) is tuple]
    assert any(isinstance(it, PlaceholderFma) and it.pred for it in general)
    assert any(isinstance(it, Stmt) and it.opcode == "mov.f32" for it in general)
    rng = np.random.default_rng(11)
    shape = rendered.shape
    w = pruned_weight(rng, shape.weight_shape, 0.6, zero_channels=1)
    fast, _, one_by_one = specialise_three_ways(monkeypatch, tampered, rendered, w, piece_lines)
    assert fast[0] == one_by_one[0]
    assert "@%sc_t " in fast[0]
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    y = run_ptx(fast[0], rendered, x, bias)
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups)
    assert relative_l2(y, ref) <= 1e-5
    assert_valid_ptx(fast[0])


def test_an_fma_with_an_immediate_accumulator(monkeypatch):
    """An FMA adding to a constant, not a register: deleted, its destination
    gets the constant by a mov; the same PTX as without shortcuts."""
    rendered, tptx = template("multi_block_multi_chunk")
    lines = tptx.splitlines()
    i = fma_lines(tptx)[3]
    lines[i] = re.sub(r",\s*%f\d+;$", ", 0f3F800000;", lines[i])
    tampered = "\n".join(lines) + "\n"
    for fill in (0.0, 2.0):  # the FMA deleted in every copy, or kept in every copy
        w = np.full(rendered.shape.weight_shape, fill, np.float32)
        fast, general, one_by_one = specialise_three_ways(monkeypatch, tampered, rendered, w)
        assert fast[0] == general[0] == one_by_one[0]
        if fill == 0.0:
            assert re.search(r"mov\.f32 %f\d+, 0f3F800000;", fast[0])
        else:
            assert re.search(r"fma\.rn\.f32 %f\d+, %f\d+, 0f40000000, 0f3F800000;", fast[0])
        assert_valid_ptx(fast[0])


@pytest.mark.parametrize("shape, tiling, where", [
    (ConvShape(16, 24, 6, 5, 1, 1), Tiling(8, 4, 1, 32, family="pointwise"), "prologue"),  # 3 k-blocks
    (ConvShape(16, 24, 6, 5, 1, 1), Tiling(24, 4, 1, 32, family="pointwise"), "epilogue"),  # one holds all 24
    (ConvShape(16, 24, 6, 5, 1, 1), Tiling(24, 4, 1, 32, family="pointwise", ptxas_level=1), "prologue"),
    (ConvShape(6, 5, 7, 7, 3, 3, padding=(1, 1)), Tiling(4, 2, 4, 7), "prologue"),
])
def test_the_residual_is_loaded_all_at_once(shape, tiling, where):
    """The residual's loads are all in flight together, never one at a time
    behind the store's tests (ResNet-50's layer1 conv3 at batch 64 ran 5x
    slower so). A sum starts at bias + residual, the loads in the prologue,
    except where shapes.residual_after_loop says the pointwise family adds it
    after the chunk loop: then they sit in the epilogue, all before its first
    store (before the loop, ptxas -O3 issued MNASNet layers.10.1.layers.6's
    chunk loads late)."""
    def global_loads(stmts):
        return sum(1 for s in stmts if s.kind == "instr" and s.opcode.startswith("ld.global"))

    assert residual_after_loop(shape, tiling) == (where == "epilogue")
    layouts = {}
    for residual in (False, True):
        rendered = render(shape, tiling, Epilogue("relu", residual=residual))
        layouts[residual] = analyse_template(compile_to_ptx(rendered.source, Target(), "residual"), rendered)
    outputs = tiling.k_block * tiling.thread_h * tiling.thread_w
    other = "epilogue" if where == "prologue" else "prologue"
    assert global_loads(getattr(layouts[True], where)) - global_loads(getattr(layouts[False], where)) == outputs
    assert global_loads(getattr(layouts[True], other)) == global_loads(getattr(layouts[False], other))
    assert global_loads(layouts[False].epilogue) == 0
    if where == "epilogue":
        stmts = [s for s in layouts[True].epilogue if s.kind == "instr"]
        first_store = next(i for i, s in enumerate(stmts) if s.opcode.startswith("st.global"))
        assert global_loads(stmts[:first_store]) == outputs


def test_statements_with_state_space_qualifiers_keep_their_opcode():
    """`ld.shared::cluster.f32` (the cluster sum's reads) is one opcode: split
    at '::', it was printed back as `ld.shared ::cluster.f32`, which ptxas
    rejects."""
    from sparseconv.ptx import make_instr

    st = make_instr("ld.shared::cluster.f32 %f1, [%r27]", 7)
    assert (st.opcode, st.dest, st.srcs) == ("ld.shared::cluster.f32", "%f1", "[%r27]")
    assert st.render().strip() == "ld.shared::cluster.f32 %f1, [%r27];"
    assert make_instr("mapa.shared::cluster.u32 %r8, %r5, %r10", 8).opcode == "mapa.shared::cluster.u32"
    assert make_instr("barrier.cluster.arrive.relaxed.aligned", 9).dest == ""
