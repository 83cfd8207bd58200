# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Test and benchmark scaffolding: never imported by megatron_ext's runtime code.

* :mod:`megatron_ext.testing.network`: :func:`free_port` for single-process distributed set-ups.
* :mod:`megatron_ext.testing.synthetic`: a model-free harness around megatron-core's dynamic
  inference stack (synthetic logits, CPU-only torch shims, engine driver).
* :mod:`megatron_ext.testing.torch_paged_attention`: plain-torch paged-KV attention, so that a
  real GPT runs through megatron-core's dynamic inference engine without flash-attn.
* :mod:`megatron_ext.testing.small_mla_moe_gpt`: a tiny DeepSeek-V2-Lite-shaped GPT (MLA, a
  dense first layer, megatron-core's MoE layers) for the dynamic MLA path's float64 checks.
* :mod:`megatron_ext.testing.small_gpt`: the small GPT and its engine, as the inference
  functional case and the engine benchmark build them.
"""
