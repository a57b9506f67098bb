"""``op_count.LaunchCounter`` (the kernels a block launches on CUDA, counted on the CPU) and the attention
fold that keeps a masked grouped-query SDPA on CUDA's fused kernels (``dense_forward.fold_gqa``)."""

import torch
import torch.nn.functional as F
from conftest import DEVICE

from dyntree_core.decode.dense_forward import fold_gqa, fold_gqa_mask, unfold_gqa
from dyntree_core.decode.op_count import LaunchCounter


def _qkv(heads: int = 8, kv_heads: int = 2, n: int = 5, span: int = 12, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g).to(DEVICE)
    k = torch.randn(1, kv_heads, span, d, generator=g).to(DEVICE)
    v = torch.randn(1, kv_heads, span, d, generator=g).to(DEVICE)
    visible = torch.rand(n, span, generator=g) < 0.6
    visible[:, 0] = True  # every row sees a slot
    mask = torch.where(visible, 0.0, float("-inf"))[None, None].to(DEVICE)
    return q, k, v, mask


def test_views_launch_nothing_and_in_place_writes_launch_one():
    x = torch.randn(4, 6, device=DEVICE)
    row, at = torch.ones(1, 6, device=DEVICE), torch.tensor([1], device=DEVICE)
    with LaunchCounter() as launches:
        x.view(6, 4).t()[1:].unsqueeze(0).transpose(1, 2).reshape(1, 6, 3)
    assert launches.kernels == 0, dict(launches.by_op)
    with LaunchCounter() as launches:
        x.index_copy_(0, at, row)
        x.t().reshape(-1)  # a reshape that must copy is a kernel
    assert dict(launches.by_op) == {"index_copy_": 1, "clone": 1}


def test_rms_norm_is_one_kernel_where_the_cpu_runs_its_decomposition():
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(32, dtype=torch.bfloat16, device=DEVICE)
    with LaunchCounter() as launches:
        F.rms_norm(x, (32,), w, 1e-6)
    assert dict(launches.by_op) == {"rms_norm": 1}
    with LaunchCounter() as launches:  # transformers' module: cast, pow, mean, add, rsqrt, mul, cast, mul
        xf = x.float()
        (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))
    assert launches.kernels == 8


def test_a_masked_grouped_query_sdpa_counts_cudas_math_path_and_the_fold_one_kernel():
    q, k, v, mask = _qkv()
    with LaunchCounter() as launches:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert launches.math_sdpa == 1 and launches.by_op["sdpa_math"] >= 8, dict(launches.by_op)
    folded_mask = fold_gqa_mask(mask, 4)
    with LaunchCounter() as launches:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # no mask: flash attention takes the groups
        F.scaled_dot_product_attention(fold_gqa(q, 4), k, v, attn_mask=folded_mask)
    assert launches.math_sdpa == 0 and dict(launches.by_op) == {"sdpa": 2}


def test_the_fold_gives_grouped_query_attention():
    """Query head h reads KV head h // group (transformers' ``repeat_kv``), row by row under the mask."""
    for heads, kv_heads, n in ((8, 2, 5), (6, 3, 1), (4, 4, 3), (14, 2, 7)):
        q, k, v, mask = _qkv(heads, kv_heads, n)
        group = heads // kv_heads
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              attn_mask=mask)  # [1, H, n, d]
        got = unfold_gqa(F.scaled_dot_product_attention(fold_gqa(q, group), k, v, attn_mask=fold_gqa_mask(mask, group)),
                         group)  # [1, n, H, d]
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
