"""The AVX-512 VNNI row kernels (``quant/ggml_vnni.c``) give the AVX2 int8-activation kernels' outputs bit for bit,
at every row count, through ``GGMLLinear`` and the C decoder layer, and keep the engine's greedy identity; a
CPU without AVX-512 never enters them; a VNNI build that differs is refused at load.

Where the CPU has AVX-512 F/BW/VL/VNNI the tests run the real instructions (``native``); everywhere SIMDe is
installed (Debian's libsimde-dev, which ``make test`` installs) they run the same C code compiled against SIMDe's
portable intrinsics (``simde``)."""

from __future__ import annotations

import copy
import ctypes
from dataclasses import replace

import pytest
import torch

from dyntree_core.quant import native
from dyntree_core.quant.ggml_linear import GGMLLinear
from dyntree_core.quant.native import synthetic_blocks

#: target (Qwen2.5 1.5B) shapes, fewer output rows: every K the model has, a K of many blocks; the draft's (0.5B)
#: Q5_0 ones (K = 896)
SHAPES = (("Q4_K", 48, 1536), ("Q6_K", 40, 1536), ("Q4_K", 24, 8960), ("Q6_K", 16, 8960), ("Q5_0", 40, 896),
          ("Q5_0", 16, 4864))
ROWS = (*range(1, 18), 32)


@pytest.fixture(scope="module", params=["native", "simde"])
def vk(request) -> native.NativeKernels:
    """Kernels whose VNNI row kernels run here: the real instructions, or the SIMDe build."""
    if request.param == "native":
        nk = native.native_kernels()
        if nk is None or not nk.vnni:
            pytest.skip(f"the VNNI kernels do not run on this CPU ({nk.vnni_reason if nk else 'no native kernels'})")
        return nk
    if not native.SIMDE_HEADER.is_file():
        pytest.skip(f"no SIMDe headers ({native.SIMDE_HEADER}; Debian's libsimde-dev)")
    sk = native.build_simde_kernels()
    if sk is None:
        pytest.skip(f"no native kernels here ({native.native_unavailable_reason()})")
    assert sk.emulated
    # the tests below check the arithmetic themselves: they run it even where the load-time check refused it
    return replace(sk, vnni=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("type_name,n,k", SHAPES)
def test_vnni_rows_equal_the_avx2_rows_bit_for_bit(vk, type_name, n, k):
    blocks = synthetic_blocks(type_name, n, k, seed=11)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(max(ROWS), k + 64, generator=gen)[:, :k] * 4  # a row stride wider than K
    x[2] = 0.0  # an all-zero row: activation scale 0
    x[4, :256] *= 1e4  # one block of large values
    x[5, 32:64] = -x[5, 32:64].abs()  # a block of negative values only: its absmax quantizes to -127
    before = vk.vnni_products()
    for m in ROWS:
        ref = vk.matmul(type_name, x[:m], blocks, n, k, bias, int8_activations=True, vnni_min_rows=0)
        got = vk.matmul(type_name, x[:m], blocks, n, k, bias, int8_activations=True, vnni_min_rows=1)
        assert _same_bits(ref, got), (m, (ref - got).abs().max().item())
        # rows stay independent: each row alone gives its row of the batch
        assert _same_bits(got[m - 1:m], vk.matmul(type_name, x[m - 1:m], blocks, n, k, bias, True, 1))
    assert vk.vnni_products() - before == 2 * len(ROWS)  # every vnni_min_rows=1 product ran the VNNI kernels


def test_vnni_min_rows_switches_by_row_count_and_skips_other_types(vk):
    blocks = synthetic_blocks("Q4_K", 16, 512, seed=2)
    x = torch.randn(8, 512)
    before = vk.vnni_products()
    for m in (1, 3, 4, 8):
        vk.matmul("Q4_K", x[:m], blocks, 16, 512, None, True, vnni_min_rows=4)
    assert vk.vnni_products() - before == 2  # 4 and 8 rows
    q5_0 = synthetic_blocks("Q5_0", 16, 512, seed=2)
    for m in (1, 2, 4, 8):
        vk.matmul("Q5_0", x[:m], q5_0, 16, 512, None, True, vnni_min_rows=2)
    assert vk.vnni_products() - before == 5  # and 2, 4 and 8 rows of Q5_0
    vk.matmul("Q8_0", x, synthetic_blocks("Q8_0", 16, 512, seed=2), 16, 512, None, True, vnni_min_rows=1)
    assert vk.vnni_products() - before == 5  # no VNNI kernel for Q8_0


def test_a_cpu_without_vnni_never_enters_the_vnni_kernels():
    nk = native.native_kernels()
    if nk is None or nk.vnni:
        pytest.skip("needs the native kernels on a CPU without AVX-512 VNNI")
    assert "AVX-512" in nk.vnni_reason and not nk.lib.dyntree_ggml_vnni()
    blocks = synthetic_blocks("Q4_K", 16, 256)
    x = torch.randn(3, 256)
    y = torch.empty(3, 16)
    before = nk.vnni_products()
    # the C entry asked for the VNNI kernels directly (the Python side would not ask): it checks the CPU itself
    assert nk.lib.dyntree_ggml_matmul_q8v(12, x.data_ptr(), 256, blocks.data_ptr(), None, y.data_ptr(), 16, 3, 16,
                                          256, 1) == 0
    assert nk.vnni_products() == before
    assert _same_bits(y, nk.matmul("Q4_K", x, blocks, 16, 256, None, True))
    layer = GGMLLinear("Q4_K", blocks, 256, kernels=nk, int8_activations=True)
    layer.vnni_min_rows = 1
    assert layer.effective_vnni_rows == 0 and layer._extra == (0,)


class _DifferentVnni:
    """A library whose VNNI path is off by one ulp in one output: what ``vnni_mismatch`` must catch."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def dyntree_ggml_matmul_q8v(self, *args):
        rc = self._lib.dyntree_ggml_matmul_q8v(*args)
        if args[-1] > 0 and args[7] >= 3:  # from 3 rows: one output nudged
            y = (ctypes.c_float * 1).from_address(args[5])
            y[0] = float(torch.nextafter(torch.tensor(y[0]), torch.tensor(float("inf"))))
        return rc


def test_a_vnni_build_that_differs_is_refused(vk):
    assert native.vnni_mismatch(vk) is None
    broken = replace(vk, lib=_DifferentVnni(vk.lib), vnni=False)
    why = native.vnni_mismatch(broken)
    assert why is not None and "differ" in why and "3 rows" in why


def _tiny_model(kernels, vnni_rows: int):
    from dyntree_core.quant.fused import fuse_forward
    from dyntree_core.testing import tiny_ggml_qwen2

    model = tiny_ggml_qwen2(kernels)
    for mod in model.modules():
        if isinstance(mod, GGMLLinear):
            mod.int8_activations = True
            mod.vnni_min_rows = vnni_rows  # rebinds the entry point
    fuse_forward(model)
    return model


def test_the_c_decoder_layer_and_the_engine_keep_plain_decodings_tokens_on_the_vnni_kernels(vk):
    """Plain decoding on the AVX2 kernels, chain and DySpec trees on the VNNI kernels from 2 rows: the same tokens
    (the tree forwards run VNNI, plain decoding's one-row forwards AVX2), and the same logits bit for bit."""
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.decode.forward import causal_forward
    from dyntree_core.decode.kv import new_cache
    from dyntree_core.quant.native_layer import native_plan

    avx2 = _tiny_model(vk, 0)
    vnni = _tiny_model(vk, 2)
    plan = native_plan(vnni)
    assert plan is not None and all(r == (2,) * 6 for r in plan.vnni_rows)
    with torch.inference_mode():
        a = causal_forward(avx2, new_cache(avx2, 32), [1, 5, 9, 200, 7, 42], 0)
        before = vk.vnni_products()
        b = causal_forward(vnni, new_cache(vnni, 32), [1, 5, 9, 200, 7, 42], 0)
        assert vk.vnni_products() - before == 2 * 6 + 1  # two layers' six products in the C layer, and the head
    assert _same_bits(a, b)
    plain = SpeculativeDecoder(copy.deepcopy(avx2), avx2, DecodeConfig(method="autoregressive",
                                                                       trace_block_counts=False))
    want = [c.token_id for tr in plain.generate([1, 5, 9, 200, 7], 20) for c in tr.committed]
    for method in ("chain", "dyspec_greedy"):
        before = vk.vnni_products()
        cfg = DecodeConfig(method=method, budget=10, depth=4, width=3, trace_block_counts=False)
        dec = SpeculativeDecoder(copy.deepcopy(vnni), vnni, cfg)
        got = [c.token_id for tr in dec.generate([1, 5, 9, 200, 7], 20) for c in tr.committed]
        assert got == want, method
        assert vk.vnni_products() > before  # the trees' forwards ran the VNNI kernels


def test_a_compiler_that_cannot_build_the_vnni_file_leaves_it_out_and_says_why(tmp_path, monkeypatch):
    """The AVX2 kernels still build and run; the reason is kept beside the cached object, so a later process
    that finds the object says the same."""
    cc = native._compiler()
    if cc is None or native._cpu_ok() is not None:
        pytest.skip("needs the native kernels")
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "VNNI_FLAGS", ("-mno-such-instruction-set",))
    digest = native.kernel_digest(cc)
    path, why = native._build(cc, digest)
    assert why is not None and why.startswith("the VNNI kernels did not compile:")
    assert native._build(cc, digest) == (path, why)  # cached: the same reason
    kernels = native._load(path, digest, why)
    assert not kernels.vnni and kernels.vnni_reason == why and not kernels.lib.dyntree_ggml_vnni()
    blocks = synthetic_blocks("Q4_K", 8, 256)
    x = torch.randn(3, 256)
    assert _same_bits(kernels.matmul("Q4_K", x, blocks, 8, 256, None, True, vnni_min_rows=1),
                      native.native_kernels().matmul("Q4_K", x, blocks, 8, 256, None, True))
