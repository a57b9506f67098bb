"""The graph step's Triton kernels compile for NVIDIA GPUs on any machine: Triton's compiler and the ``ptxas`` its
wheel ships lower each kernel to a cubin for Hopper (sm_90: H100/H200) and Ampere (sm_80) without a GPU. The CPU
tests run these kernels in Triton's interpreter, which accepts programs the GPU compiler refuses (and the other
way round); this is what shows, between GPU sessions, that a kernel edited on the CPU still builds for the GPU.

It runs in a subprocess: this process selected the interpreter before importing Triton (``conftest.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dyntree_core.decode import layer_kernels as lk
from dyntree_core.verify import alpha_kernel as ak

i32 = "i32"
kernels = {
    "rope_write": (lk._rope_write_kernel, dict(
        y_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", buf_ptr="*bf16", slots_ptr="*i64", q_ptr="*bf16", N=i32,
        NH=i32, H=i32, sy_h=i32, sy_n=i32, sc_h=i32, sc_n=i32, ss_h=i32, ss_n=i32, sb_h=i32, sb_c=i32),
        dict(D=128, HALF=64, BLOCK=128)),
    "silu_mul": (lk._silu_mul_kernel, dict(gu_ptr="*bf16", out_ptr="*bf16", FF=i32, s_row=i32), dict(BLOCK=1024)),
    "token_level_alphas": (ak._alphas_kernel, dict(
        key_ptr="*fp32", p_ptr="*fp64", q_ptr="*fp64", left_ptr="*fp64", out_ptr="*fp64", B=i32, V=i32, K=i32,
        key_stride=i32, cum_stride=i32, left_stride=i32),
        dict(EMPTY_MASS=ak.EMPTY, COARSE=512, STEP=297, FINE=512)),
}
out = {}
for arch in (90, 80):
    for name, (fn, sig, consts) in kernels.items():
        sig = dict(sig, **{k: "constexpr" for k in consts})
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
            out[f"{name} sm_{arch}"] = len(k.asm["cubin"])
        except Exception as e:
            out[f"{name} sm_{arch}"] = f"{type(e).__name__}: {e}"[:2000]
print(json.dumps(out))
'''


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_the_graph_steps_triton_kernels_compile_for_hopper_and_ampere(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cubins = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(cubins) == 6
    failed = {k: v for k, v in cubins.items() if not isinstance(v, int)}
    assert not failed, failed
    assert all(size > 1000 for size in cubins.values()), cubins
