# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A small MLA GPT generating greedily under megatron-core's static-batching inference.

Built as the static-inference functional case (``gpt/mla_rope_contiguous_load_static_inference``)
and the inference benchmark's static section use it: megatron-core's local GPT layer spec with
multi-latent attention and yarn RoPE, megatron_ext's SDPA core attention (megatron-core's local
attention cannot take MLA's head sizes), and a ``StaticInferenceContext`` that the model's forward
fills and reads, one prefill and then one token per step, as megatron-core's static text
generation drives it.

Modes: ``"off"`` is what megatron-core runs in inference today (``apply_rope_fusion=False``: its
refusal of fused MLA RoPE under an inference context leaves only the unfused RoPE);
``"on"`` is the ``--mla-rope-contiguous-load`` flag (fused RoPE, megatron_ext's kernels). The
weights do not depend on the mode.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = [
    "MODES",
    "Generation",
    "build_small_mla_gpt",
    "float64_copy",
    "float64_step_logits",
    "greedy_generate",
    "prompts_for",
    "summarise",
]

MODES = ("off", "on")


@dataclass
class Generation:
    """What :func:`greedy_generate` produced.

    Attributes:
        tokens: ``[batch, prompt + new]`` prompt and generated token ids.
        step_logits: ``[new, batch, vocab]`` float32 logits that chose each generated token.
        prefill_seconds: wall time of the prefill forward (synchronised).
        decode_seconds: wall time of each decode forward (synchronised).
    """

    tokens: torch.Tensor
    step_logits: torch.Tensor
    prefill_seconds: float
    decode_seconds: List[float] = field(default_factory=list)


def build_small_mla_gpt(
    mode: str,
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    num_attention_heads: int = 8,
    vocab_size: int = 1024,
    max_sequence_length: int = 256,
    init_method_std: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
    device: Any = "cuda",
    seed: int = 1234,
    q_lora_rank: Optional[int] = None,
    kv_lora_rank: Optional[int] = None,
    qk_head_dim: int = 128,
    qk_pos_emb_head_dim: int = 64,
    v_head_dim: int = 128,
    cache_mla_latents: bool = False,
    config_overrides: Optional[Dict[str, Any]] = None,
    block_spec: Optional[Callable[[Any], Any]] = None,
) -> Any:
    """A GPT of MLA layers, flag off or on, in eval mode on ``device``.

    Args:
        mode: ``"off"`` (megatron-core's unfused RoPE) or ``"on"`` (megatron_ext's fused RoPE,
            applied through ``apply_megatron_ext``; ``"off"`` undoes it).
        num_layers, hidden_size, num_attention_heads, vocab_size, max_sequence_length,
            init_method_std: model sizes.
        dtype: parameter dtype.
        device: where the model lives.
        seed: weight initialisation seed (the same weights in both modes).
        q_lora_rank: the query's down-projection width (None: ``hidden_size // 2``).
        kv_lora_rank: latent width (None: ``hidden_size // 4``).
        qk_head_dim, qk_pos_emb_head_dim, v_head_dim: head sizes (default DeepSeek-V3's,
            128 + 64 RoPE and 128).
        cache_mla_latents: build for megatron-core's dynamic batching with a latent cache
            (megatron-core's config then needs ``apply_rope_fusion`` off). Such a model runs
            dynamic-batching steps only: through megatron_ext's path in mode ``"on"``; in mode
            ``"off"`` it is megatron-core's own MLA, which fails on such steps.
        config_overrides: further ``MLATransformerConfig`` fields (e.g. ``cuda_graph_impl``), or
            replacements of those set here (e.g. ``q_lora_rank=None``).
        block_spec: builds the decoder's spec from the config, called after the flag is applied
            or undone (None: every layer megatron_ext's local MLA spec with a dense MLP).

    Returns:
        GPTModel: the model.

    Raises:
        ValueError: on an unknown mode.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_ext import apply_megatron_ext, undo_megatron_ext
    from megatron_ext.models.gpt.gpt_layer_specs import get_gpt_layer_local_mla_spec
    from megatron_ext.testing.local_block_spec import local_block_spec

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fields = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=4 * hidden_size,
        num_attention_heads=num_attention_heads,
        q_lora_rank=hidden_size // 2 if q_lora_rank is None else q_lora_rank,
        kv_lora_rank=hidden_size // 4 if kv_lora_rank is None else kv_lora_rank,
        qk_head_dim=qk_head_dim,
        qk_pos_emb_head_dim=qk_pos_emb_head_dim,
        v_head_dim=v_head_dim,
        qk_layernorm=True,
        normalization="RMSNorm",
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        original_max_position_embeddings=max(8, max_sequence_length // 4),
        mscale=1.0,
        mscale_all_dim=1.0,
        apply_rope_fusion=mode == "on" and not cache_mla_latents,
        cache_mla_latents=cache_mla_latents,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
    )
    # Overrides may replace a field above (e.g. q_lora_rank None: no query down-projection).
    fields.update(config_overrides or {})
    config = MLATransformerConfig(**fields)
    if mode == "on":
        apply_megatron_ext(mla_rope_contiguous_load=True, config=config)
    else:
        undo_megatron_ext()
    torch.manual_seed(seed)
    # The MLA class follows the flag applied (or undone) above.
    if block_spec is None:
        spec = local_block_spec(get_gpt_layer_local_mla_spec(config), num_layers)
    else:
        spec = block_spec(config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",  # MLA applies its own yarn RoPE
        share_embeddings_and_output_weights=False,
    )
    return model.to(device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_generate(model: Any, prompts: torch.Tensor, new_tokens: int) -> Generation:
    """Greedy generation: one prefill forward, then one forward per token.

    Every row shares the prompt length (static batching advances all rows together).

    Args:
        model: a GPT model.
        prompts: ``[batch, prompt]`` token ids on the model's device.
        new_tokens: tokens to generate per row.

    Returns:
        Generation: tokens, the logits of each choice, and the timings.

    Raises:
        ValueError: for an empty prompt or more tokens than the model's positions.
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    batch, prompt = prompts.shape
    total = prompt + new_tokens
    if prompt < 1 or new_tokens < 1:
        raise ValueError(f"need a prompt and at least one new token, got {prompt}, {new_tokens}")
    if total > model.max_sequence_length:
        raise ValueError(f"{total} tokens exceed max_sequence_length {model.max_sequence_length}")
    device = prompts.device
    context = StaticInferenceContext(batch, total)
    tokens = torch.empty(batch, total, dtype=prompts.dtype, device=device)
    tokens[:, :prompt] = prompts
    positions = torch.arange(total, device=device).expand(batch, total)
    causal = torch.ones(prompt, prompt, dtype=torch.bool, device=device).triu(1)
    chosen, decode_seconds = [], []
    start = prompt
    _sync(device)
    began = time.perf_counter()
    logits = model(
        prompts,
        positions[:, :prompt],
        causal.expand(batch, 1, prompt, prompt),
        inference_context=context,
        runtime_gather_output=True,
    )
    _sync(device)
    prefill_seconds = time.perf_counter() - began
    while True:
        last = logits[:, -1].float()
        chosen.append(last)
        tokens[:, start] = last.argmax(-1)
        context.sequence_len_offset = start
        start += 1
        if start == total:
            break
        context.enable_decode_mode()
        began = time.perf_counter()
        logits = model(
            tokens[:, start - 1 : start],
            positions[:, start - 1 : start],
            None,
            inference_context=context,
            runtime_gather_output=True,
        )
        _sync(device)
        decode_seconds.append(time.perf_counter() - began)
    return Generation(tokens, torch.stack(chosen), prefill_seconds, decode_seconds)


def float64_copy(model: Any, **build_kwargs: Any) -> Any:
    """The same model in float64, RoPE unfused: the reference the generations are checked against.

    Args:
        model: a model from :func:`build_small_mla_gpt`.
        build_kwargs: the sizes and seed ``model`` was built with (not ``mode``/``dtype``).

    Returns:
        GPTModel: a float64 model holding ``model``'s weights (upcast exactly). The flags in
        effect before the call are in effect after it.
    """
    from megatron_ext import patches

    build_kwargs = dict(build_kwargs, dtype=torch.float32, cache_mla_latents=False)
    applied = list(patches.applied_extensions())
    try:
        reference = build_small_mla_gpt("off", **build_kwargs)
    finally:
        # Building the "off" model undoes the flags: put back what was in effect, so that an
        # engine built after the reference still runs megatron_ext's context and controller.
        for name in applied:
            patches.apply_patches(name)
    reference.load_state_dict(model.state_dict())
    reference = reference.double()
    reference.config.params_dtype = torch.float64
    return reference


@torch.no_grad()
def float64_step_logits(reference: Any, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """The logits that chose each generated token, from one full-sequence forward of
    :func:`float64_copy`, teacher-forced on ``tokens``.

    Args:
        reference: the float64 model.
        tokens: ``[batch, prompt + new]`` from :func:`greedy_generate`.
        prompt: the prompt length.

    Returns:
        torch.Tensor: ``[new, batch, vocab]`` float64 logits.
    """
    batch, total = tokens.shape
    positions = torch.arange(total, device=tokens.device).expand(batch, total)
    causal = torch.ones(total, total, dtype=torch.bool, device=tokens.device).triu(1)
    logits = reference(
        tokens, positions, causal.expand(batch, 1, total, total), runtime_gather_output=True
    )
    return logits[:, prompt - 1 : total - 1].transpose(0, 1)


def summarise(generations: Dict[str, Generation], references: Dict[str, torch.Tensor]) -> dict:
    """Token agreement and each mode's logit error against its float64 reference.

    Args:
        generations: mode -> its generation.
        references: mode -> :func:`float64_step_logits` of that mode's own tokens.

    Returns:
        dict: ``tokens_equal``; per mode the max abs logit error; the largest reference logit
        magnitude; and the smallest top-2 margin of the references (how close greedy came to a
        tie).
    """
    errors = {
        mode: float((gen.step_logits.double() - references[mode]).abs().max())
        for mode, gen in generations.items()
    }
    margins = []
    for reference in references.values():
        top2 = reference.topk(2, dim=-1).values
        margins.append(float((top2[..., 0] - top2[..., 1]).min()))
    tokens = [gen.tokens for gen in generations.values()]
    return {
        "tokens_equal": all(torch.equal(tokens[0], t) for t in tokens[1:]),
        "max_abs_logit_error": errors,
        "largest_abs_logit": max(float(r.abs().max()) for r in references.values()),
        "min_top2_margin": min(margins),
    }


def prompts_for(batch: int, prompt: int, vocab_size: int, seed: int, device: Any) -> torch.Tensor:
    """A fixed prompt set.

    Args:
        batch: rows.
        prompt: tokens per row.
        vocab_size: token ids are below this.
        seed: generator seed.
        device: where the prompts go.

    Returns:
        torch.Tensor: ``[batch, prompt]`` int64 token ids.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt), generator=gen).to(device)
