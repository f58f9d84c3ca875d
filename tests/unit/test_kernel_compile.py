"""The verification kernels compile for real GPUs, without one.

The interpreter runs kernels as Python and misses what only the compiler checks (types of values
carried through loops and branches, layouts, what ptxas accepts). triton.compile can target a GPU
architecture with no driver present: this lowers every kernel through TTIR, TTGIR, LLVM and PTX to
a cubin with triton's bundled ptxas, for Ampere and Hopper, in the configurations the launchers
use, including the specializations triton makes at run time (unit strides become constants,
16-divisible sizes and pointers get alignment hints). It also checks that pass 1 streams the
logits with 16-byte vector loads and that nothing spills registers to local memory.

Runs in a subprocess: tests/conftest.py sets TRITON_INTERPRET=1 for this process on a machine
without CUDA, and triton.jit would then hand back interpreted functions that cannot be compiled.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
# Where a GPU is present the kernels compile for it and run there (tests/gpu); this check is for
# machines without one, against the triton this project pins (the GPU image brings its own).
pytestmark = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check: tests/gpu compiles and runs the kernels on this GPU")

SCRIPT = r'''
import json, re, shutil, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from draftsmith.runtime.kernels import verify_kernels as vk

POINTERS = {
    "logits_ptr": "*bf16", "draft_ptr": "*fp32", "num_nodes_ptr": "*i64", "uniforms_ptr": "*fp32",
    "stats_ptr": "*fp32", "ws_p_ptr": "*fp32", "ws_q_ptr": "*fp32", "part_a_ptr": "*fp32",
}
UNIT_STRIDES = ("stride_lv", "stride_tn", "stride_pn", "stride_dv", "stride_un")
ALIGNED = ("stride_lb", "stride_ln", "stride_db", "stride_dn", "V")
objdump = shutil.which("cuobjdump") or str(
    __import__("pathlib").Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
)


def compile_kernel(fn, constexprs, typical, arch, num_warps, part_b="*i32"):
    sig, attrs, consts = {}, {}, dict(constexprs)
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif typical and name in UNIT_STRIDES:
            sig[name] = "constexpr"  # triton turns an int argument equal to 1 into a constant
            consts[name] = 1
        elif name.endswith("_ptr"):
            sig[name] = part_b if name == "part_b_ptr" else POINTERS.get(name, "*i64")
            if typical:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "temperature" else "i32"
            if typical and name in ALIGNED:
                attrs[(index,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    usage = ""
    if objdump and __import__("os").path.exists(objdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([objdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    local = [int(x) for x in re.findall(r"LOCAL:(\d+)", usage)]
    return {
        "kernel": fn.__name__, "arch": arch, "typical": typical, "constexprs": constexprs,
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]", ptx)),
        "local_bytes": max(local) if local else None,
    }


results = []
for arch, variants in ((90, (True, False)), (80, (True,))):
    for typical in variants:
        for kind, part_b in ((0, "*i32"), (1, "*fp32")):
            results.append(compile_kernel(
                vk._node_partials_kernel, {"KIND": kind, "BLOCK_V": vk.PARTIALS_BLOCK_V},
                typical, arch, vk.PARTIALS_WARPS, part_b))
        for N in (16, 64):
            meta = vk.tree_meta(N, path_len=N, splits=8)
            results.append(compile_kernel(
                vk._greedy_tree_kernel, dict(meta, LOG_N=meta["BLOCK_N"].bit_length() - 1),
                typical, arch, vk.greedy_warps(meta["BLOCK_N"])))
            for deterministic in (False, True):
                results.append(compile_kernel(
                    vk._sample_tree_kernel, dict(meta, BLOCK_V=vk.WALK_BLOCK_V, DETERMINISTIC=deterministic),
                    typical, arch, vk.SAMPLE_WARPS, "*fp32"))
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice; same default
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("triton's bundled ptxas is missing")
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_ampere_and_hopper(compiled):
    kernels = {(r["kernel"], r["arch"]) for r in compiled}
    for name in ("_node_partials_kernel", "_greedy_tree_kernel", "_sample_tree_kernel"):
        assert (name, 80) in kernels and (name, 90) in kernels
    walks = {(r["arch"], r["constexprs"]["DETERMINISTIC"]) for r in compiled if r["kernel"] == "_sample_tree_kernel"}
    assert walks == {(a, d) for a in (80, 90) for d in (False, True)}  # drawn children and fixed candidates


def test_pass_one_uses_vector_loads_on_aligned_rows(compiled):
    typical = [r for r in compiled if r["kernel"] == "_node_partials_kernel" and r["typical"]]
    assert typical and all(r["vector_loads"] > 0 for r in typical), typical


def test_no_register_spills(compiled):
    measured = [r for r in compiled if r["local_bytes"] is not None]
    if not measured:
        pytest.skip("cuobjdump not available to read the cubins' resource usage")
    spills = [r for r in measured if r["local_bytes"] > 0]
    assert not spills, json.dumps(spills, indent=1)
