"""Q4_K, Q6_K and Q5_0 rows repacked 8 at a time (``ggml_kernels.c``'s "Q4_K x8", "Q6_K x8" and "Q5_0 x8"): the tile
kernels compute exactly their stated arithmetic at every row count (a numpy model of it, bit for bit), their AVX-512
VNNI twins give the same bits, the layouts round-trip to the GGUF's bytes, and models on them keep plain decoding's tokens in trees,
through ``GGMLLinear``, the fused gate/up, the C decoder layer, the kernel table and the packed cache."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dyntree_core.quant import kernel_table as kt
from dyntree_core.quant import native
from dyntree_core.quant.ggml_linear import GGMLLinear
from dyntree_core.quant.native import synthetic_blocks

from test_ggml_kernels import _fma32, _k_quant_ints, _quantize_q8k, nk  # noqa: F401 (nk: a fixture)
from test_ggml_vnni import _same_bits, vk  # noqa: F401 (vk: a fixture, the real VNNI instructions or SIMDe's)

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 17)


def _q5_0_x8_reference(blocks, n, k, x, bias):
    """Q5_0 x8: per block I = sum_v (u_v - 16) q_v with u = the 5-bit quants (the GGUF's low nibbles, high nibbles
    and qh bits), then acc = fma(float(I), d*dx, acc) in block order from 0; y = acc + bias."""
    raw = blocks.numpy().reshape(n, k // 32, 22).astype(np.int64)
    d = raw[..., 0:2].astype(np.uint8).copy().view(np.float16)[..., 0].astype(np.float32)
    qh = raw[..., 2] | raw[..., 3] << 8 | raw[..., 4] << 16 | raw[..., 5] << 24
    u = np.concatenate([raw[..., 6:] & 0xF, raw[..., 6:] >> 4], -1) | (((qh[..., None] >> np.arange(32)) & 1) << 4)
    q, dx = _quantize_q8k(x, block=32)  # (Q8_0 activations)
    ints = np.einsum("nbv,mbv->nbm", u - 16, q)
    acc = np.zeros((n, q.shape[0]), np.float32)
    for b in range(k // 32):
        acc = _fma32(ints[:, b].astype(np.float32), d[:, b, None] * dx[None, :, b], acc)
    return torch.from_numpy((acc + bias.numpy()[:, None]).T.copy())


def _x8_reference(type_name, blocks, n, k, x, bias):
    """y [M, N] of the x8 kernels, bit for bit: per block the exact integers, Q4_K I = sum_j sc_j sum(u q)_j and
    N = sum_j m_j sum(q)_j (per 32 values), then acc = fma(float(I), d*dx, acc) and acc = fma(-float(N), dmin*dx,
    acc); Q6_K I = sum_v sc_v (u_v - 32) q_v, then acc = fma(float(I), d*dx, acc); in block order from 0; then
    y = acc + bias. Q5_0: ``_q5_0_x8_reference``."""
    if type_name == "Q5_0":
        return _q5_0_x8_reference(blocks, n, k, x, bias)
    u, scale, d, dmin, mins = _k_quant_ints(type_name, blocks, n, k)
    q, dx = _quantize_q8k(x)
    m, nb = q.shape[0], k // 256
    acc = np.zeros((n, m), np.float32)
    for b in range(nb):
        if type_name == "Q6_K":
            ints = np.einsum("nv,mv->nm", scale[:, b] * (u[:, b] - 32), q[:, b])
            acc = _fma32(ints.astype(np.float32), d[:, b, None] * dx[None, :, b], acc)
            continue
        ints = np.einsum("nv,mv->nm", u[:, b] * scale[:, b], q[:, b])
        mins_sum = np.einsum("nj,mj->nm", mins[:, b], q[:, b].reshape(m, 8, 32).sum(-1))
        acc = _fma32(ints.astype(np.float32), d[:, b, None] * dx[None, :, b], acc)
        acc = _fma32(-mins_sum.astype(np.float32), dmin[:, b, None] * dx[None, :, b], acc)
    return torch.from_numpy((acc + bias.numpy()[:, None]).T.copy())


def _inputs(k, rows=max(ROWS), seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 64, generator=gen)[:, :k] * 4  # a row stride wider than K
    x[2] = 0.0  # an all-zero row: activation scale 0
    x[4, :256] *= 1e4  # one block of large values
    return x, gen


@pytest.mark.parametrize("type_name", native.X8_TYPES)
def test_the_layout_round_trips_to_the_gguf_bytes(nk, type_name):
    blocks = synthetic_blocks(type_name, 48, 768, seed=3)
    x8 = nk.repack_x8(type_name, blocks, 48, 768)
    assert tuple(x8.shape) == native.x8_shape(type_name, 48, 768) == (6, 768 // native.BLOCKS[type_name][1]
                                                                          * native.X8[type_name][1])
    assert torch.equal(nk.unpack_x8(type_name, x8, 48, 768), blocks)
    with pytest.raises(ValueError, match="N % 8"):
        native.x8_shape(type_name, 44, 768)


@pytest.mark.parametrize("type_name", native.X8_TYPES)
def test_the_x8_kernels_are_their_arithmetic_bit_for_bit_at_every_row_count(nk, type_name):
    n, k = 40, 768  # 5 groups of 8 rows, 3 blocks per row
    blocks = synthetic_blocks(type_name, n, k, seed=11)
    x8 = nk.repack_x8(type_name, blocks, n, k)
    x, gen = _inputs(k)
    bias = torch.randn(n, generator=gen)
    for m in ROWS:  # every tile height (AVX2 1..4, VNNI 1..8; VNNI pairs of groups from 5 rows) and combinations
        got = nk.matmul(type_name, x[:m], x8, n, k, bias, int8_activations=True, x8=True)
        assert _same_bits(got, _x8_reference(type_name, blocks, n, k, x[:m], bias)), m
        # rows stay independent: each row alone gives its row of the batch (trees get plain decoding's numbers)
        assert _same_bits(got[m - 1:m], nk.matmul(type_name, x[m - 1:m], x8, n, k, bias, True, x8=True))
    rows = nk.matmul(type_name, x, blocks, n, k, bias, int8_activations=True)  # the row kernels: rounding apart
    assert torch.allclose(nk.matmul(type_name, x, x8, n, k, bias, True, x8=True), rows, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("type_name", native.X8_TYPES)
def test_the_vnni_x8_tiles_give_the_avx2_tiles_bits(vk, type_name):
    for n, k in ((48, 1536), (24, 8960)):
        x8 = vk.repack_x8(type_name, synthetic_blocks(type_name, n, k, seed=7), n, k)
        x, gen = _inputs(k)
        bias = torch.randn(n, generator=gen)
        before = vk.vnni_products()
        for m in ROWS:
            ref = vk.matmul(type_name, x[:m], x8, n, k, bias, True, vnni_min_rows=0, x8=True)
            got = vk.matmul(type_name, x[:m], x8, n, k, bias, True, vnni_min_rows=1, x8=True)
            assert _same_bits(ref, got), (n, k, m, (ref - got).abs().max().item())
        assert vk.vnni_products() - before == len(ROWS)  # every vnni_min_rows=1 product ran the VNNI tile


def test_a_vnni_x8_tile_that_differs_is_refused(vk):
    from test_ggml_vnni import _DifferentVnni

    class _DifferentX8(_DifferentVnni):
        def dyntree_ggml_matmul_q8v(self, *args):  # only the x8 products nudged (type id 112)
            return (super().dyntree_ggml_matmul_q8v if args[0] == self.x8_type
                    else self._lib.dyntree_ggml_matmul_q8v)(*args)

    for type_name, (type_id, _) in native.X8.items():
        lib = _DifferentX8(vk.lib)
        lib.x8_type = type_id
        why = native.vnni_mismatch(replace(vk, lib=lib, vnni=False))
        assert why is not None and "x8" in why and f"{type_name}, 3 rows" in why


def test_ggml_linear_repacks_keeps_the_gguf_rows_and_joins_gate_and_up(nk):
    g, u = synthetic_blocks("Q4_K", 64, 512, seed=1), synthetic_blocks("Q4_K", 32, 512, seed=2)
    lg = GGMLLinear("Q4_K", g, 512, kernels=nk, int8_activations=True, x8=True)
    lu = GGMLLinear("Q4_K", u, 512, kernels=nk, int8_activations=True, x8=True)
    assert lg.x8 and tuple(lg.blocks.shape) == native.x8_shape("Q4_K", 64, 512) and torch.equal(lg.ggml_blocks(), g)
    rows = GGMLLinear("Q4_K", g, 512, kernels=nk, int8_activations=True)
    assert torch.equal(lg.dequantized_weight(), rows.dequantized_weight())
    x = torch.randn(5, 512)
    assert torch.allclose(lg(x), rows(x), rtol=1e-5, atol=1e-4)
    # the x8 layout of joined rows is the join of the layouts (FusedGateUp joins gate and up so)
    both = GGMLLinear("Q4_K", torch.cat([lg.blocks, lu.blocks]), 512, None, nk, True, True, 96)
    assert torch.equal(both(x), torch.cat([lg(x), lu(x)], dim=1))
    with pytest.raises(ValueError, match="x8 layout is for Q4_K, Q6_K"):
        GGMLLinear("Q8_0", synthetic_blocks("Q8_0", 8, 256), 256, kernels=nk, int8_activations=True, x8=True)
    with pytest.raises(ValueError, match="float32 activations"):
        GGMLLinear("Q4_K", g, 512, kernels=nk, x8=True)


def _tiny_model(kernels, x8: bool, vnni_rows: int = 0):
    """``testing.tiny_ggml_qwen2`` on int8 activations, its layers (Q4_K; N a multiple of 8: all but the head)
    repacked when ``x8``, fused."""
    from dyntree_core.quant.apply import set_submodule
    from dyntree_core.quant.fused import fuse_forward
    from dyntree_core.testing import tiny_ggml_qwen2

    model = tiny_ggml_qwen2(kernels)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, GGMLLinear):
            layer = GGMLLinear(mod.type_name, mod.blocks, mod.in_features, mod.bias, kernels, True,
                               x8 and kt.x8_takes(kt.LayerShape(mod.type_name, mod.out_features, mod.in_features)))
            layer.vnni_min_rows = vnni_rows
            set_submodule(model, name, layer)
    fuse_forward(model)
    return model


def test_the_c_decoder_layer_and_trees_keep_plain_decodings_tokens_on_the_x8_tiles(nk):
    """The C decoder layer runs the x8 products (its type id goes through), its logits differ from the row kernels'
    by float rounding only, and chain and DySpec trees give plain decoding's tokens on the x8 tiles."""
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.decode.forward import causal_forward
    from dyntree_core.decode.kv import new_cache
    from dyntree_core.quant.native_layer import native_plan

    rows, x8 = _tiny_model(nk, False), _tiny_model(nk, True)
    plan = native_plan(x8)
    assert plan is not None
    assert [list(d.type) for d in plan.descs] == [[native.X8["Q4_K"][0]] * 6] * 2  # q, k, v, o, gate_up, down
    with torch.inference_mode():
        a = causal_forward(rows, new_cache(rows, 32), [1, 5, 9, 200, 7, 42], 0)
        b = causal_forward(x8, new_cache(x8, 32), [1, 5, 9, 200, 7, 42], 0)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-3) and not torch.equal(a, b)
    plain = SpeculativeDecoder(copy.deepcopy(x8), x8, DecodeConfig(method="autoregressive", trace_block_counts=False))
    want = [c.token_id for tr in plain.generate([1, 5, 9, 200, 7], 24) for c in tr.committed]
    for method in ("chain", "dyspec_greedy", "sequoia"):
        cfg = DecodeConfig(method=method, budget=10, depth=4, width=3, trace_block_counts=False)
        dec = SpeculativeDecoder(copy.deepcopy(x8), x8, cfg)
        assert [c.token_id for tr in dec.generate([1, 5, 9, 200, 7], 24) for c in tr.committed] == want, method


def test_the_table_takes_x8_only_where_it_wins_at_one_row_and_at_the_most_rows():
    table = kt.KernelTable("k", {}, "", "n", None, [1, 4, 16, 64])
    shape = kt.LayerShape("Q4_K", 8960, 1536)

    def ms(**at):
        return {str(m): at.get(f"m{m}") for m in (1, 4, 16, 64)}

    timings = {"aten": ms(m1=1.0), "native_rows": ms(m1=0.9), "native_q8": ms(m1=0.4, m64=12.0),
               "native_q8_vnni": ms(m1=0.41, m64=11.0), "native_x8": ms(m1=0.2, m4=0.5, m16=1.5, m64=6.0),
               "native_x8_vnni": ms(m1=0.21, m4=0.4, m16=1.0, m64=4.0)}
    table.timings[shape.label] = copy.deepcopy(timings)
    plan = table.plan_for(shape)
    assert plan.x8 and plan.int8_activations and plan.vnni_min_rows == 4, plan
    table.timings[shape.label]["native_x8"]["64"] = table.timings[shape.label]["native_x8_vnni"]["64"] = 13.0
    plan = table.plan_for(shape)
    assert not plan.x8 and plan.int8_activations, plan  # slower for trees: the row kernels at every M
    table.timings[shape.label] = {**copy.deepcopy(timings), "native_x8": ms(), "native_x8_vnni": ms()}
    assert not table.plan_for(shape).x8  # not measured (a shape it does not take)
    assert not kt.x8_takes(kt.LayerShape("Q4_K", 300, 256)) and not kt.x8_takes(kt.LayerShape("Q8_0", 256, 256))
    assert kt.x8_takes(kt.LayerShape("Q6_K", 256, 512))


def test_a_gguf_model_on_x8_keeps_its_tiles_and_loads_them_again_without_a_repack(tmp_path, monkeypatch, nk):
    from safetensors.torch import load_file
    from test_ggml_kernels import _write_tiny_qwen2

    from dyntree_core.models import gguf_model
    from dyntree_core.models.gguf_model import load_gguf_model
    from dyntree_core.quant.gate_up import FusedGateUp
    from dyntree_core.quant.native import NativeKernels, x8_layout_tag

    def cfg_layers(folder) -> int:
        return json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]

    path, cfg = _write_tiny_qwen2(tmp_path)
    ids = torch.tensor([[3, 17, 99, 5, 250, 31, 8, 319, 0]])
    monkeypatch.setenv("DYNTREE_KERNELS", "native_q8")
    rows = load_gguf_model(path, cfg, "int4")
    monkeypatch.setenv("DYNTREE_KERNELS", "native_x8")
    model = load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")
    layers = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert {(m.type_name, m.x8) for m in layers} == {("Q4_K", True), ("Q6_K", True)}  # the Q6_K head too (320 rows)
    packed = list((tmp_path / "packed").rglob("*.safetensors"))
    assert len(packed) == 1 and packed[0].name.endswith(f"-x8{x8_layout_tag(nk)}.safetensors")  # the layout kept
    stored = load_file(str(packed[0]))
    q = model.model.layers[0].self_attn.q_proj
    assert torch.equal(stored["model.layers.0.self_attn.q_proj.blocks"], q.blocks)  # its tiles, as the kernels read
    with torch.inference_mode():
        got = model(ids).logits

        def no_repack(*_a, **_k):
            raise AssertionError("a load from the packed cache repacked a layer")

        with monkeypatch.context() as m:
            m.setattr(NativeKernels, "repack_x8", no_repack)
            m.setattr(FusedGateUp, "from_mlp", no_repack)  # (gate and up joined as they are read, not after)
            again = load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")  # from the packed cache
        assert all(m.x8 for m in again.modules() if isinstance(m, GGMLLinear))
        fused = [m for m in again.modules() if isinstance(m, FusedGateUp)]  # gate/up joined as the file is read
        assert len(fused) == cfg_layers(cfg) and again._dyntree_fused["gate_up"] == len(fused)
        assert torch.equal(again(ids).logits, got)
        assert torch.allclose(got, rows(ids).logits, rtol=1e-4, atol=1e-3)
        # kernels that lay the tiles out otherwise read a file of their own, not this one
        monkeypatch.setattr(gguf_model, "x8_layout_tag", lambda _k: "0ther0ne")
        other = load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")
        assert sorted(p.name.endswith("-x80ther0ne.safetensors")
                      for p in (tmp_path / "packed").rglob("*.safetensors")) == [False, True]
        assert torch.equal(other(ids).logits, got)


def test_a_tied_embedding_shares_the_heads_x8_blocks_and_looks_up_the_same_rows(tmp_path, monkeypatch, nk):
    from test_ggml_kernels import _reference, _write_tiny_qwen2

    from dyntree_core.models.gguf_model import load_gguf_model
    from dyntree_core.quant.ggml_embedding import GGMLEmbedding

    path, cfg = _write_tiny_qwen2(tmp_path, "Q6_K", True)
    monkeypatch.setenv("DYNTREE_KERNELS", "native_x8")
    model = load_gguf_model(path, cfg, "int4")
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, GGMLEmbedding) and emb.x8 and head.x8
    assert emb.blocks.data_ptr() == head.blocks.data_ptr()  # one copy of the table
    ids = torch.tensor([[3, 17, 99, 5, 250, 31, 8, 319, 0, 7, 8]])
    table = _reference("Q6_K", head.ggml_blocks(), 320, 256)
    assert torch.equal(emb(ids), table[ids]) and emb(ids).shape == (1, 11, 256)
    with pytest.raises(IndexError, match=r"\[0, 320\)"):
        emb(torch.tensor([[320]]))


def test_the_x8_layout_tag_names_what_the_repack_writes(monkeypatch, nk):
    from dyntree_core.quant import native
    from dyntree_core.quant.native import NativeKernels, x8_layout_tag

    monkeypatch.setattr(native, "_X8_TAGS", {})
    tag = x8_layout_tag(nk)
    assert len(tag) == 8 and x8_layout_tag(nk) == tag
    real = NativeKernels.repack_x8

    def swapped(self, type_name, blocks, n, k):  # another layout: the groups' bytes in another order
        return real(self, type_name, blocks, n, k).flip(1).contiguous()

    monkeypatch.setattr(native, "_X8_TAGS", {})
    monkeypatch.setattr(NativeKernels, "repack_x8", swapped)
    assert x8_layout_tag(nk) != tag
