# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA with megatron-core's mixture-of-experts layers through the dynamic engine and both flags.

A tiny DeepSeek-V2-Lite-shaped GPT (``megatron_ext.testing.small_mla_moe_gpt``: MLA with and
without a query down-projection, a dense first layer, then MoE layers of 4 routed experts, top-2,
and one shared expert; local layers, tensor and expert parallel 1) generates greedily through
megatron-core's ``DynamicInferenceEngine`` with ``--mla-rope-contiguous-load`` and
``--inference-static-active-slices``; every step's last-token logits are checked against a
teacher-forced forward of a float64 copy, within the MLA tests' bound (2^-14 of the largest
logit), over prefill, chunked prefill and decode batches of requests of different lengths.

What megatron-core's MoE needs in inference (0.16 and 0.19 alike):

* No token dropping: ``moe_expert_capacity_factor`` None. With a capacity, which tokens an
  expert drops depends on the other tokens of the step, so a request's output would depend on
  what it is batched with. megatron-core does not refuse it; with ``cache_mla_latents``
  ``--mla-rope-contiguous-load`` does (megatron_ext's check).
* The router's load-balancing loss (``moe_router_load_balancing_type``, ``moe_aux_loss_coeff``)
  is irrelevant: megatron-core adds it only in training mode; the routing (top-k of the scores)
  is the same whatever the balancing type.
* Under CUDA graphs: megatron-core 0.19's per-layer graphs (``cuda_graph_impl="local"``) need
  ``moe_pad_experts_for_cuda_graph_inference`` when expert parallel > 1 (its controller asserts
  it). With it, in graphed decode steps the controller switches the routers to drop-and-pad at a
  capacity factor of experts / top-k, the most an expert can receive, so nothing is dropped and
  the expert shapes are static (no device-to-host sync); eager steps run unpadded. 0.16 has the
  same switch on its inference wrapper config. Graphed equals eager is checked on a GPU only.
* The flags refuse no MoE field but the capacity factor: the MLA path replaces attention only,
  the MoE layers run as megatron-core's.

On the CPU the model uses the allgather token dispatcher (alltoall asks for CUDA streams), and on
0.16 without Transformer Engine the router's GEMM needs the ``stack`` fixture's binding (below).
"""

import dataclasses
import importlib.util
from types import SimpleNamespace
from typing import Any, Dict

import pytest
import torch
from megatron.core.inference import utils as inference_utils

from megatron_ext import apply_megatron_ext, undo_megatron_ext
from megatron_ext.flags import MegatronExtConfigError
from megatron_ext.testing.small_mla_moe_gpt import (
    TINY_MLA_MOE_SIZES,
    build_dynamic_mla_moe_model,
    tiny_mla_moe_sizes,
)
from megatron_ext.transformer import mla_dynamic_inference
from megatron_ext.utils import is_megatron_core_min_version
from tests.unit_tests.transformer.test_mla_dynamic_inference import (
    DEVICE,
    assert_graphed_as_eager,
    eager_and_graphed_runs,
    generate_and_check,
    requests_for,
    served_errors,
)
from tests.unit_tests.transformer.test_mla_dynamic_inference import stack as mla_stack

# The MLA tests' fixture under another name, wrapped by this module's ``stack`` below.
mla_stack = mla_stack

# megatron-core 0.19 resolves MLA's q/kv norms itself: with qk_layernorm and no query
# down-projection it builds linear_q_proj as Transformer Engine's fused norm + linear, whatever
# the local spec names, so without TE that layout cannot be built.
Q_DIRECT_NEEDS_TE = (
    importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None
    and importlib.util.find_spec("transformer_engine") is None
)

# A prompt over the step's token budget (64: chunked prefill) and shorter ones, generated
# together (decode batches of requests at different lengths).
LENGTHS = [70, 12, 30, 5]
NEW_TOKENS = 8
CACHE = dict(block_size_tokens=16, kv_blocks=48)
# The MLA tests' fp32 bound, relative to the largest logit.
BOUND = 2**-14


@pytest.fixture
def stack(mla_stack, monkeypatch):
    """The MLA tests' stack; without Transformer Engine, megatron-core 0.16's router GEMM reads
    a ``te_general_gemm`` its module never binds (a NameError): bound to None, as 0.19 binds it,
    it takes its torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    yield mla_stack


def _build(sizes: Dict[str, Any]) -> Any:
    return build_dynamic_mla_moe_model(sizes, torch.float32, DEVICE)


def _moe_layers(model: Any) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _expert_token_counts(model: Any) -> Dict[str, int]:
    """Forward hooks that count the tokens each routed and shared expert receives."""
    counts: Dict[str, int] = {}
    for layer_index, layer in enumerate(_moe_layers(model)):
        named = [(f"{layer_index}.shared", layer.shared_experts)]
        named += [
            (f"{layer_index}.{i}", expert) for i, expert in enumerate(layer.experts.local_experts)
        ]
        for name, module in named:
            counts[name] = 0

            def hook(module, args, output, name=name):
                counts[name] += int(args[0].shape[0])

            module.register_forward_hook(hook)
    return counts


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "q_direct"])
def test_engine_generation_matches_float64(stack, q_lora_rank):
    """Chunked prefill, mixed and decode-only steps of 4 requests of different lengths."""
    if q_lora_rank is None and Q_DIRECT_NEEDS_TE:
        pytest.skip(
            "megatron-core 0.19 builds MLA's linear_q_proj (q_lora_rank None, qk_layernorm on) "
            "only as Transformer Engine's fused norm + linear, and TE is not installed"
        )
    sizes = tiny_mla_moe_sizes(q_lora_rank=q_lora_rank)
    model = _build(sizes)
    layers = model.decoder.layers
    assert not _moe_layers(layers[0]), "the first layer should be dense"
    assert all(_moe_layers(layer) for layer in layers[1:])
    attention = layers[0].self_attention
    assert type(attention).__name__ == "ExtMLASelfAttention"
    assert hasattr(attention, "linear_q_down_proj") == (q_lora_rank is not None)
    counts = _expert_token_counts(model)
    requests = requests_for(LENGTHS, NEW_TOKENS, sizes["vocab_size"])
    seen = generate_and_check(model, sizes, requests, BOUND, **CACHE)
    assert seen["kinds"] == {True, False}, "expected prefill/mixed and decode-only steps"
    # The routing is exercised: every routed expert of every MoE layer took tokens (top-2 of
    # 4), the shared expert all of them.
    assert all(counts.values()), counts
    for layer_index in range(len(layers) - 1):
        routed = sum(counts[f"{layer_index}.{i}"] for i in range(4))
        assert routed == 2 * counts[f"{layer_index}.shared"], counts


def test_float64_check_sees_a_missing_shared_expert(stack):
    """The comparison can fail: the served model's shared experts return zeros (the float64
    copy, built from the weights, keeps them) and it does."""
    model = _build(TINY_MLA_MOE_SIZES)
    for layer in _moe_layers(model):
        layer.shared_experts.register_forward_hook(lambda module, args, output: output * 0)
    requests = requests_for([12, 5], 4, TINY_MLA_MOE_SIZES["vocab_size"])
    with pytest.raises(AssertionError, match="off float64|greedy tokens differ"):
        generate_and_check(model, TINY_MLA_MOE_SIZES, requests, BOUND, **CACHE)


def test_load_balancing_type_does_not_change_inference(stack):
    """Eval mode: no balancing loss is applied, the routing is the same, so the generation is
    too (a model built with ``moe_router_load_balancing_type="none"``, the same weights)."""
    requests = requests_for([12, 5], 4, TINY_MLA_MOE_SIZES["vocab_size"])
    generated = []
    for balancing in ("aux_loss", "none"):
        sizes = tiny_mla_moe_sizes(moe_router_load_balancing_type=balancing)
        model = _build(sizes)
        seen = generate_and_check(model, sizes, requests, BOUND, **CACHE)
        result = seen["result"]
        generated.append((result["rows"], result["max_abs_error"], result["largest_abs_logit"]))
        undo_megatron_ext()
    assert generated[0] == generated[1], generated


def test_flag_refuses_token_dropping_with_the_latent_cache(stack):
    """A capacity factor drops tokens by what else is in the step: refused by the flag."""
    sizes = tiny_mla_moe_sizes(moe_expert_capacity_factor=1.0)
    with pytest.raises(MegatronExtConfigError, match="moe_expert_capacity_factor"):
        _build(sizes)
    undo_megatron_ext()
    # Without the latent cache (training, static batching) the flag has no reason to refuse.
    model = _build(TINY_MLA_MOE_SIZES)
    config = model.config
    config.moe_expert_capacity_factor = 1.0
    config.cache_mla_latents = False
    config.apply_rope_fusion = True
    apply_megatron_ext(mla_rope_contiguous_load=True, config=config)


@pytest.mark.parametrize("capacity", [None, -1.0, 0.0, 1.5])
def test_dynamic_config_problems_name_a_capacity_factor(capacity):
    """A negative factor is megatron-core's "none"; any other one is refused."""
    config = SimpleNamespace(moe_expert_capacity_factor=capacity)
    problems = mla_dynamic_inference.mla_dynamic_config_problems(config)
    refused = [p for p in problems if "moe_expert_capacity_factor" in p]
    assert bool(refused) == (capacity is not None and capacity >= 0), problems


def forget_megatron_cores_moe_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty megatron-core's process-wide list of the MoE layers it pads for graphed steps.

    megatron-core makes the list once, from the first model a controller steps (0.19 walks the
    model in every step's set-up, eager ones included), and pads only the layers on it: a second
    model in the same process would keep the first one's list, its dispatchers left unpadded while
    the shared config says padded (0.19 then fails an assertion in the alltoall dispatcher's
    preprocess during capture).

    Args:
        monkeypatch: restores megatron-core's list when the test ends.
    """
    monkeypatch.setattr(inference_utils, "moe_layer_cache", None)
    # 0.19 only: set once per process together with the list.
    monkeypatch.setattr(inference_utils, "_moe_metadata_sync_initialized", False, raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("graph_scope", ["layer", "block"])
def test_gpu_engine_with_megatron_cores_cuda_graphs_generates_as_eager(
    stack, monkeypatch, graph_scope
):
    """megatron-core's CUDA graphs (``cuda_graph_impl="local"``, per layer or, on 0.19, per
    decoder block; captured in the engine's warm-up, replayed in decode-only steps) around MLA
    and MoE layers: the same greedy
    tokens as the eager engine, log-probs within fp32 rounding. megatron-core's allgather token
    dispatcher reads the tokens per expert back to the host in every step, so a captured MoE
    layer needs the alltoall dispatcher with ``moe_pad_experts_for_cuda_graph_inference`` (fixed
    shapes in graphed steps; megatron-core asks for it only with expert parallelism, but a
    capture needs it at expert parallel 1 as well); both runs use that dispatcher."""
    if graph_scope == "block" and not is_megatron_core_min_version("0.19.0"):
        pytest.skip("inference_cuda_graph_scope='block' is megatron-core 0.19's")
    sizes = tiny_mla_moe_sizes(moe_token_dispatcher_type="alltoall")
    requests = requests_for(LENGTHS, NEW_TOKENS, sizes["vocab_size"])
    runs = eager_and_graphed_runs(
        stack,
        sizes=sizes,
        requests=requests,
        cache=CACHE,
        moe=True,
        before=lambda impl: forget_megatron_cores_moe_layers(monkeypatch),
        graph_scope=graph_scope,
    )
    assert_graphed_as_eager(runs)


def _te_moe_model(config: Any, sizes: Dict[str, Any]) -> Any:
    """The MoE + MLA GPT from megatron-core's own Transformer Engine decoder block spec (dense
    first layer, then MoE layers with TE's grouped experts), bf16, seeded; built by megatron-core's
    builder, so the flag's patch decides the attention class."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(1234)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=True),
        vocab_size=sizes["vocab_size"],
        max_sequence_length=sizes["max_sequence_length"],
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return model.to(device=DEVICE, dtype=torch.bfloat16).eval()


@pytest.mark.gpu
def test_gpu_te_moe_generation_matches_its_training_forward(stack):
    """With Transformer Engine's MoE layers (grouped GEMM experts, TE linears and norms) the
    dynamic path's logits match the same weights' training forward (TE, no latent caching, flags
    undone) within the bf16 bound of the dense TE-spec test: a float64 copy cannot be made of TE's
    modules."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine's MoE layers need TE")
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    # Every expert routed (4 of 4): the served path and the reference differ by bf16 rounding,
    # which can flip a near-tied top-2 choice and move a logit by far more than the bound;
    # routing itself is checked against float64 by the local-spec tests above.
    sizes = tiny_mla_moe_sizes(top_k=4)
    # bf16 from the start: megatron-core 0.19's context allocates its cache in the config's
    # params_dtype, which must be the weights' dtype.
    local = build_dynamic_mla_moe_model(sizes, torch.bfloat16, DEVICE)
    config = dataclasses.replace(local.config, moe_grouped_gemm=True)
    model = _te_moe_model(config, sizes)
    assert type(model.decoder.layers[0].self_attention).__name__ == "ExtMLASelfAttention"
    assert all(
        isinstance(layer.experts, TEGroupedMLP) for layer in _moe_layers(model.decoder)
    ), "expected TE's grouped experts"
    undo_megatron_ext()
    reference = _te_moe_model(dataclasses.replace(config, cache_mla_latents=False), sizes)
    reference.load_state_dict(model.state_dict())
    apply_megatron_ext(
        mla_rope_contiguous_load=True, inference_static_active_slices=True, config=config
    )
    requests = requests_for(LENGTHS, NEW_TOKENS, sizes["vocab_size"])
    result, outputs, _ = served_errors(model, reference, sizes, requests, **CACHE)
    assert all(len(outputs[i]["generated_tokens"]) == NEW_TOKENS for i in outputs), outputs
    assert result["max_abs_error"] <= result["largest_abs_logit"] / 16, result
