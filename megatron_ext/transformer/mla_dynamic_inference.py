# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA self-attention under megatron-core's dynamic batching, with torch and Triton only.

megatron-core's ``MLASelfAttention`` cannot run a dynamic-batching step on either supported
release without FlashMLA and flash-attn (and calls ``flash_decode_and_prefill`` without its
required ``is_decode_only``). :func:`mla_dynamic_attention` is the step megatron_ext runs instead,
for every step kind (prefill, chunked prefill, mixed, decode-only), in the absorbed form (in
eager steps, prefill requests may take the MHA form instead: :mod:`.mla_prefill`):

1. the query and latent projections and norms, as megatron-core computes them;
2. the query's RoPE part rotated in place at each token's position (``token_to_pos_ids``) by the
   contiguous-load kernel (``fused_apply_mla_rope_for_q(..., position_ids=...)``);
3. ``q_nope @ W_UK`` (absorption), so the query is ``[q_nope W_UK | rope(q_pe)]``, passed as
   two operands (the head-major matmul output and the RoPE slice of the projected query: no
   copy joins them);
4. ``k_pe`` rotated and written with its latent row into the paged cache by one kernel
   (:func:`~megatron_ext.fusions.mla_latent.rope_cache_append.fused_mla_rope_cache_append`);
5. attention over the paged latent cache, reading only the rows each token attends to
   (:func:`~megatron_ext.fusions.mla_latent.attention.mla_paged_latent_attention`);
6. ``W_UV`` (reading the head-major attention output, writing the ``[tokens, heads * v]`` rows
   ``linear_proj`` reads) and the output projection.

``W_UK`` and ``W_UV`` are views of ``linear_kv_up_proj.weight``, taken at every call: the step
writes no state of the module (megatron-core's ``prepare_for_absorption`` replaces submodules
on first use), so threads may share a module. GRAPH-SAFE: no host synchronisation; every size
comes from shapes and host ints of the context (the MHA form runs only in steps megatron-core
runs eagerly, and there reads the step's lengths on the host: a read of device memory on 0.16).
In a step split between the forms, the absorbed requests run on a per-thread side stream beside
the MHA-form ones (:func:`~megatron_ext.fusions.side_stream.side_by_side`).
"""

import operator
from typing import Any, Optional, Tuple

import numpy as np
import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from torch import Tensor

from megatron_ext.fusions.fused_mla_yarn_rope_apply import fused_apply_mla_rope_for_q
from megatron_ext.fusions.mla_latent import fused_mla_rope_cache_append, mla_paged_latent_attention
from megatron_ext.fusions.side_stream import side_by_side
from megatron_ext.transformer.mla_prefill import mha_form_core, mha_form_split
from megatron_ext.transformer.rotary_tables import cos_sin_table

__all__ = [
    "CACHE_DTYPES",
    "absorb_query",
    "absorbed_core",
    "check_mla_dynamic_config",
    "context_token_tensors",
    "mla_dynamic_attention",
    "mla_dynamic_config_problems",
    "project_values",
]

# Cache dtypes the latent-cache kernels take; an FP8 KV cache is not one of them.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _as_int(value: Any) -> Optional[int]:
    """``value`` as an int (Python or numpy integers, through ``operator.index``), or None for
    anything else (a bool, a float, a str, None)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _width_problem(name: str, value: Any, what: str, example: int) -> Optional[str]:
    """Why ``value`` is no width the paged latent-cache kernels take (a power of two >= 16), or
    None; the message says what the value is."""
    width = _as_int(value)
    if width is None:
        return f"{name}={value!r} is not an integer; the paged latent-cache kernels take {what}"
    if width < 16 or width & (width - 1):
        return (
            f"{name}={width}: the paged latent-cache kernels take {what} (DeepSeek-V3: {example})"
        )
    return None


def _size_problem(name: str, value: Any) -> Tuple[Optional[int], Optional[str]]:
    """(``value`` as an int >= 1, or None; why it is not one, or None). None (unset) is 1."""
    if value is None:
        return 1, None
    size = _as_int(value)
    if size is None or size < 1:
        return None, f"{name}={value!r}: must be an integer >= 1"
    return size, None


def mla_dynamic_config_problems(
    config: Any,
    *,
    tensor_parallel_size: Optional[int] = None,
    context_parallel_size: Optional[int] = None,
    cache_dtype: Optional[torch.dtype] = None,
) -> list:
    """What keeps megatron_ext's dynamic-batching MLA path from serving ``config``.

    Args:
        config: an ``MLATransformerConfig`` (or any object with its fields).
        tensor_parallel_size: overrides ``config.tensor_model_parallel_size``.
        context_parallel_size: overrides ``config.context_parallel_size``.
        cache_dtype: the latent cache's dtype (the context's ``params_dtype``); default the
            config's ``params_dtype``.

    Returns:
        list: one message per problem, each naming the option (empty when it can serve it).
    """
    problems = []
    latent = getattr(config, "kv_lora_rank", None)
    rope = getattr(config, "qk_pos_emb_head_dim", None)
    for problem in (
        _width_problem("kv_lora_rank", latent, "a latent width that is a power of two >= 16", 512),
        _width_problem(
            "qk_pos_emb_head_dim", rope, "a RoPE head size that is a power of two >= 16", 64
        ),
    ):
        if problem is not None:
            problems.append(problem)
    rope_type = getattr(config, "rope_type", "yarn")
    if rope_type not in (None, "yarn"):
        problems.append(f"rope_type={rope_type!r}: the dynamic MLA path rotates with yarn RoPE")
    cp = context_parallel_size
    if cp is None:
        cp = getattr(config, "context_parallel_size", None)
    cp, problem = _size_problem("context_parallel_size", cp)
    if problem is not None:
        problems.append(problem)
    elif cp != 1:
        problems.append(
            f"context_parallel_size={cp}: dynamic-batching MLA does not split a step's tokens "
            "across context-parallel ranks"
        )
    tp = tensor_parallel_size
    if tp is None:
        tp = getattr(config, "tensor_model_parallel_size", None)
    tp, problem = _size_problem("tensor_model_parallel_size", tp)
    if problem is not None:
        problems.append(problem)
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None:
        heads, problem = _size_problem("num_attention_heads", heads)
        if problem is not None:
            problems.append(problem)
        elif tp is not None and heads % tp:
            problems.append(
                f"tensor_model_parallel_size={tp} does not divide num_attention_heads={heads}: "
                "each rank must hold whole query heads"
            )
    if getattr(config, "sequence_parallel", False):
        problems.append("sequence_parallel is on: dynamic-batching steps are not sequence-split")
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(config, name, False):
            problems.append(f"{name} is on: an FP8 KV cache is not supported by the latent cache")
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    # megatron-core reads a negative capacity factor as none.
    if capacity is not None and capacity >= 0:
        problems.append(
            f"moe_expert_capacity_factor={capacity}: MoE token dropping depends on the other "
            "requests in a step, so a request's tokens would too; leave it unset in inference"
        )
    dtype = cache_dtype if cache_dtype is not None else getattr(config, "params_dtype", None)
    if dtype is not None and dtype not in CACHE_DTYPES:
        problems.append(
            f"params_dtype={dtype} (the latent cache's dtype): an FP8 or other KV cache dtype is "
            "not supported; use float32, float16 or bfloat16"
        )
    return problems


def check_mla_dynamic_config(config: Any, what: str, **overrides: Any) -> None:
    """Raise ValueError naming every option :func:`mla_dynamic_config_problems` finds.

    Args:
        config: an ``MLATransformerConfig``.
        what: who asks (the start of the message).
        overrides: :func:`mla_dynamic_config_problems`'s keywords.

    Raises:
        ValueError: if the dynamic MLA path cannot serve the configuration.
    """
    problems = mla_dynamic_config_problems(config, **overrides)
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))


def context_token_tensors(context: Any) -> Any:
    """The object holding the per-token device tensors a step's forward reads (``token_to_*``):
    0.19's ``gpu_view``, or the context itself on 0.16."""
    return getattr(context, "gpu_view", None) or context


def _latent_norm(module: Any, kv_compressed: Tensor) -> Tensor:
    """``kv_layernorm`` as megatron-core's latent-caching path applies it, without changing the
    module: Transformer Engine's spec fuses the norm into ``linear_kv_up_proj`` (its
    ``kv_layernorm`` is an identity), and megatron-core splits that module on first use."""
    norm = module.kv_layernorm
    fused_weight = getattr(module.linear_kv_up_proj, "layer_norm_weight", None)
    if not isinstance(norm, IdentityOp) or fused_weight is None:
        return norm(kv_compressed)
    config = module.config
    weight = (
        fused_weight + 1
        if getattr(config, "layernorm_zero_centered_gamma", False)
        else fused_weight
    )
    x = kv_compressed.float()
    if config.normalization == "RMSNorm":
        y = torch.nn.functional.rms_norm(
            x, (x.shape[-1],), weight.float(), config.layernorm_epsilon
        )
    else:
        bias = getattr(module.linear_kv_up_proj, "layer_norm_bias", None)
        y = torch.nn.functional.layer_norm(
            x,
            (x.shape[-1],),
            weight.float(),
            None if bias is None else bias.float(),
            config.layernorm_epsilon,
        )
    return y.to(kv_compressed.dtype)


def _full_width(x: Tensor, width: int) -> Tensor:
    # A column-parallel down projection leaves its output sharded; megatron-core gathers it.
    if x.size(-1) != width:
        x = gather_from_tensor_model_parallel_region(x)
    return x


def absorb_query(q: Tensor, up_k: Tensor) -> Tuple[Tensor, Tensor]:
    """``W_UK`` absorbed into the query, as the latent attention's two query operands, with no
    copy: ``q_nope`` is read in place and the RoPE part is not moved.

    Args:
        q: the projected query after RoPE, [tokens, heads, qk_head_dim + rope_dim], unit last
            stride.
        up_k: ``W_UK``, [heads, qk_head_dim, kv_lora_rank], unit last stride (a view of
            ``linear_kv_up_proj.weight``).

    Returns:
        Tuple[Tensor, Tensor]: ``q_nope @ W_UK`` as a [tokens, heads, kv_lora_rank] view of a
        head-major [heads, tokens, kv_lora_rank] tensor, and ``rope(q_pe)``, the
        [tokens, heads, rope_dim] slice of ``q``.
    """
    qk_dim = up_k.shape[1]
    # A batch per head: q_nope's [heads, tokens, qk] view has a unit last stride and a row stride
    # of heads * (qk + rope), and W_UK's slices a unit last stride, so the batched GEMM reads both
    # where they lie. Its output is head-major; the attention takes it through its strides, and
    # the RoPE part where the projection left it (no cat).
    absorbed = torch.bmm(q[..., :qk_dim].transpose(0, 1), up_k)
    return absorbed.transpose(0, 1), q[..., qk_dim:]


def project_values(attended: Tensor, up_v: Tensor) -> Tensor:
    """``W_UV`` applied to the latent attention's head-major output, written straight into the
    token-major rows the output projection reads.

    Args:
        attended: the attention output, [heads, tokens, kv_lora_rank], unit last stride.
        up_v: ``W_UV``, [heads, v_head_dim, kv_lora_rank], unit last stride.

    Returns:
        Tensor: [tokens, heads * v_head_dim], contiguous.
    """
    heads, tokens, _ = attended.shape
    v_dim = up_v.shape[1]
    if torch.is_grad_enabled() and (attended.requires_grad or up_v.requires_grad):
        # A matmul with out= records no autograd graph; a step with gradients on (never the
        # engine's) gets the product and one reshaping copy instead.
        product = torch.bmm(attended, up_v.transpose(1, 2))
        return product.transpose(0, 1).reshape(tokens, heads * v_dim)
    core = attended.new_empty(tokens, heads * v_dim)
    # Each head's [tokens, v] block of the output is a strided matrix with a unit last stride,
    # as is W_UV transposed: the batched GEMM writes and reads them in place, with no permute
    # of the attention output and no copy of the product.
    torch.bmm(attended, up_v.transpose(1, 2), out=core.view(tokens, heads, v_dim).transpose(0, 1))
    return core


def mla_dynamic_attention(
    module: Any, hidden_states: Tensor, context: Any
) -> Tuple[Tensor, Optional[Tensor]]:
    """One dynamic-batching step of MLA self-attention over the paged latent cache.
    GRAPH-SAFE (no host synchronisation); writes no state of ``module``.

    Args:
        module: an ``ExtMLASelfAttention`` or ``ExtFusedMLASelfAttention`` (megatron-core's
            ``MLASelfAttention`` fields; the fused class's one q/kv down projection).
        hidden_states: ``[tokens, 1, hidden]``, the step's padded token rows.
        context: a ``DynamicInferenceContext`` with ``cache_mla_latent`` whose attention state
            is initialised for this step.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: ``linear_proj``'s output ``[tokens, 1, hidden]`` and bias.

    Raises:
        ValueError: if the context does not cache MLA latents, or ``hidden_states`` is not
            ``[tokens, 1, hidden]``.
    """
    config = module.config
    if not getattr(context, "cache_mla_latent", False):
        raise ValueError(
            "MLA under dynamic batching needs a DynamicInferenceContext with cache_mla_latent "
            "(0.16: cache_mla_latent=True; 0.19: MLATransformerConfig.cache_mla_latents=True)"
        )
    # The step's token rows: megatron-core pads them to padded_active_token_count, cut to the
    # context's token buffers.
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(
            f"hidden_states must be [tokens, 1, hidden]; got {tuple(hidden_states.shape)}"
        )
    n = hidden_states.shape[0]
    heads = module.num_attention_heads_per_partition
    qk_dim, rope_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
    v_dim, latent_dim = config.v_head_dim, config.kv_lora_rank
    tokens = context_token_tensors(context)

    # Projections and norms: megatron-core's, without its training-only branches.
    if hasattr(module, "linear_qkv_down_proj"):
        # 0.19's FusedMLASelfAttention: one down projection (the input norm fused into it in
        # Transformer Engine's spec), split and the query part gathered by the module's own method.
        q_compressed, kv_combined = module._qkv_down_projection(hidden_states)
    elif config.q_lora_rank is not None:
        q_compressed, _ = module.linear_q_down_proj(hidden_states)
        kv_combined, _ = module.linear_kv_down_proj(hidden_states)
    else:
        q_compressed = None
        kv_combined, _ = module.linear_kv_down_proj(hidden_states)
    if q_compressed is not None:
        q_compressed = module.q_layernorm(_full_width(q_compressed, config.q_lora_rank))
        q, _ = module.linear_q_up_proj(q_compressed)
    else:
        q, _ = module.linear_q_proj(hidden_states)
    kv_combined = _full_width(kv_combined, latent_dim + rope_dim)
    kv_compressed, k_pos_emb = torch.split(kv_combined, [latent_dim, rope_dim], dim=-1)
    kv_latent = _latent_norm(module, kv_compressed)

    # Tables over the context's positions, built once per (embedding, dtype) and never changed.
    cos, sin = cos_sin_table(
        module._modules["rotary_pos_emb"], int(context.max_sequence_length), q.dtype, q.device
    )

    # Query: RoPE in place at each token's position, then W_UK absorbed.
    q = q.view(n, 1, heads, qk_dim + rope_dim)
    fused_apply_mla_rope_for_q(
        q, cos, sin, qk_dim, rope_dim, position_ids=tokens.token_to_pos_ids[:n].view(n, 1)
    )
    q = q.view(n, heads, qk_dim + rope_dim)

    # Key: RoPE and the append in one kernel (before either form of attention reads the cache).
    kv_cache, _, block_table = context.key_value_cache(module.layer_number)
    fused_mla_rope_cache_append(
        kv_latent,
        k_pos_emb,
        cos,
        sin,
        tokens.token_to_position_in_request[:n],
        kv_cache,
        tokens.token_to_block_idx[:n],
        tokens.token_to_local_position_within_kv_block[:n],
    )
    cu_query_lengths, max_query_len = context.cu_query_lengths()
    _, kv_lengths, _ = context.cu_kv_lengths()
    # Prefill requests in the MHA form where the cost model says so (eager steps only), the
    # leading ones (decodes, short chunks) absorbed.
    split = mha_form_split(module, context, q)
    if split is None:
        core = absorbed_core(
            module,
            q,
            kv_cache,
            block_table,
            cu_query_lengths,
            kv_lengths,
            max(1, int(max_query_len)),
        )
    elif not split.absorbed_requests:
        # Every request in the MHA form (a prefill step): its result is the core output, with
        # no buffer to copy it into.
        core = mha_form_core(module, q, kv_cache, block_table, split).reshape(n, heads * v_dim)
    else:
        first, tokens_first = split.absorbed_requests, split.absorbed_tokens
        core = q.new_empty(n, heads * v_dim)

        def leading() -> None:
            core[:tokens_first] = absorbed_core(
                module,
                q[:tokens_first],
                kv_cache,
                block_table[:first],
                cu_query_lengths[: first + 1],
                kv_lengths[:first],
                split.absorbed_max_query_len,
            )

        # The leading decodes on a side stream while the chunk's host work and kernels go on:
        # the parts are independent and neither fills the GPU at few heads.
        _, mha = side_by_side(
            leading,
            lambda: mha_form_core(module, q[tokens_first:], kv_cache, block_table, split),
            q.device,
        )
        core[tokens_first:] = mha.view(n - tokens_first, heads * v_dim)
    return module.linear_proj(core.view(n, 1, heads * v_dim))


def absorbed_core(
    module: Any,
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    cu_query_lengths: Tensor,
    kv_lengths: Tensor,
    max_query_len: int,
) -> Tensor:
    """The absorbed form's core attention output: ``W_UK`` into the query, the latent attention
    over the paged cache, ``W_UV``. GRAPH-SAFE; no copy on the query or output path.

    Args:
        module: the MLA self-attention module (its config, heads, ``linear_kv_up_proj``).
        q: [tokens, heads, qk + rope], the rotated, un-absorbed query.
        kv_cache, block_table, cu_query_lengths, kv_lengths: the attention's cache and metadata
            (:func:`~megatron_ext.fusions.mla_latent.attention.mla_paged_latent_attention`).
        max_query_len: a static bound on the new tokens per request.

    Returns:
        Tensor: [tokens, heads * v_head_dim], contiguous.
    """
    config = module.config
    heads = module.num_attention_heads_per_partition
    qk_dim, v_dim, latent_dim = config.qk_head_dim, config.v_head_dim, config.kv_lora_rank
    kv_up = module.linear_kv_up_proj.weight.view(heads, qk_dim + v_dim, latent_dim)
    up_k, up_v = kv_up[:, :qk_dim], kv_up[:, qk_dim:]
    query, query_rope = absorb_query(q, up_k)
    # Head-major, so that W_UV's batched GEMM reads it in place; the attention writes it through
    # its transposed view. (Its head stride, and the absorbed query's, vary with the token count:
    # a new count's first call launches through Triton's JIT, without compiling.)
    attended = torch.empty((heads, q.shape[0], latent_dim), dtype=query.dtype, device=query.device)
    mla_paged_latent_attention(
        query,
        kv_cache,
        block_table,
        cu_query_lengths,
        kv_lengths,
        module.softmax_scale,
        rope_dim=config.qk_pos_emb_head_dim,
        max_query_len=max_query_len,
        out=attended.transpose(0, 1),
        query_rope=query_rope,
    )
    return project_values(attended, up_v)
