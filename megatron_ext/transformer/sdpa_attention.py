# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` has no ``k_channels``/``v_channels`` and no packed
(thd) input, so without Transformer Engine no multi-latent-attention (MLA) model can be built from
megatron-core's own layer specs. :class:`SDPADotProductAttention` is a drop-in core attention for
those specs: same constructor and forward contract as ``TEDotProductAttention`` for the features
listed below, implemented with PyTorch's SDPA only.
"""

import contextlib
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

from megatron_ext.transformer.context_parallel import all_gather_across_ranks, cp_chunk_positions

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - torch < 2.3 is below this package's floor
    SDPBackend, sdpa_kernel = None, None


_BACKEND_NAMES = {
    "math": "MATH",
    "efficient": "EFFICIENT_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


def resolve_sdpa_backends(
    backends: Optional[Sequence[Union[str, "SDPBackend"]]],
) -> Optional[List["SDPBackend"]]:
    """Turn backend names or ``SDPBackend`` members into a list for ``sdpa_kernel``.

    Args:
        backends: None (let PyTorch choose), or names among ``math``, ``efficient``, ``flash``,
            ``cudnn``, or ``torch.nn.attention.SDPBackend`` members.

    Returns:
        Optional[List[SDPBackend]]: the backends, or None when PyTorch should choose.

    Raises:
        ValueError: on an unknown name or an empty list.
        TypeError: on an entry that is neither a string nor an ``SDPBackend``.
    """
    if backends is None:
        return None
    if isinstance(backends, (str, SDPBackend)):
        backends = [backends]
    resolved = []
    for backend in backends:
        if isinstance(backend, SDPBackend):
            resolved.append(backend)
        elif isinstance(backend, str):
            if backend.lower() not in _BACKEND_NAMES:
                raise ValueError(
                    f"unknown SDPA backend {backend!r}; choose from {sorted(_BACKEND_NAMES)}"
                )
            resolved.append(getattr(SDPBackend, _BACKEND_NAMES[backend.lower()]))
        else:
            raise TypeError(f"SDPA backend must be a str or SDPBackend, got {type(backend)}")
    if not resolved:
        raise ValueError("sdpa_backends must name at least one backend (or be None)")
    return resolved


class SDPADotProductAttention(MegatronModule):
    """Core attention with separate query/key and value head sizes, on PyTorch SDPA.

    Supported: the ``sbhd`` layout ``[s, b, heads, dim]`` and the packed ``thd`` layout
    ``[t, heads, dim]`` with ``cu_seqlens`` (and ``cu_seqlens_*_padded``) from
    :class:`PackedSeqParams`; ``k_channels != v_channels`` (MLA); grouped-query attention; mask
    types ``causal``, ``padding``, ``padding_causal``, ``no_mask``, ``arbitrary`` and
    ``causal_bottom_right``; attention dropout (forked from the model-parallel CUDA RNG tracker as
    megatron-core's local attention does); an explicit ``softmax_scale``.

    Mask conventions follow megatron-core: ``attention_mask`` is boolean and True marks a position
    that must NOT be attended to. With a causal mask type and an ``attention_mask`` given, both are
    applied (megatron-core's local attention would use the given mask alone, Transformer Engine the
    causal mask alone; the two agree whenever the given mask is itself causal). A query row with
    no visible key (fully masked padding) yields zeros, not NaN. In ``thd`` the masks come from
    ``cu_seqlens``, as in Transformer Engine, and ``attention_mask`` is not used; tokens in the
    padding between ``cu_seqlens`` and ``cu_seqlens_*_padded`` give zeros.

    Context parallelism (``context_parallel_size > 1``, self-attention, causal or unmasked, sbhd or
    thd) follows megatron-core's load-balanced layout: the sequence (each packed sequence, for thd)
    is cut into ``2 * cp`` chunks and rank r holds chunks r and ``2 * cp - 1 - r``. Keys and values
    are all-gathered over the context-parallel group (whatever ``cp_comm_type`` says) and the
    causal mask is built from global positions; the backward all-reduces their gradients. This is
    simple, not fast: it materialises the whole sequence's keys and values on every rank.

    Not supported (a clear error): sliding-window attention, softmax types other than ``vanilla``,
    attention bias, and explicit attention masks with context parallelism.

    Args:
        config: the transformer config.
        layer_number: 1-based index of the layer.
        attn_mask_type: the default mask type of this layer.
        attention_type: ``"self"`` or ``"cross"`` (kept for interface parity).
        attention_dropout: dropout probability; ``config.attention_dropout`` when None.
        softmax_scale: scale of ``q @ k^T``; ``1/sqrt(k_channels)`` when None.
        k_channels: query/key head size; ``config.kv_channels`` when None.
        v_channels: value head size; ``config.kv_channels`` when None.
        cp_comm_type: accepted for interface parity; context parallelism always all-gathers.
        pg_collection: process groups (``tp``, and ``cp`` with context parallelism); megatron's
            global groups when None.
        sdpa_backends: SDPA backends to allow (names or ``SDPBackend``); PyTorch chooses when None.
            ``["math"]`` gives a backward that is deterministic on every device.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        sdpa_backends: Optional[Sequence[Union[str, "SDPBackend"]]] = None,
    ) -> None:
        super().__init__(config=config)
        if sdpa_kernel is None:  # pragma: no cover
            raise ImportError("SDPADotProductAttention needs torch.nn.attention (torch >= 2.3)")
        if not isinstance(attn_mask_type, AttnMaskType):
            raise TypeError(f"attn_mask_type must be an AttnMaskType, got {attn_mask_type!r}")
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1 and attention_type != "self":
            raise ValueError(
                "SDPADotProductAttention supports context parallelism for "
                f"self-attention only, got attention_type={attention_type!r}"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"SDPADotProductAttention supports softmax_type='vanilla' only, got "
                f"{config.softmax_type!r}"
            )
        if is_layer_window_attention(
            getattr(config, "window_size", None),
            getattr(config, "window_attn_skip_freq", None),
            layer_number,
        ):
            raise ValueError("SDPADotProductAttention does not implement sliding-window attention")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type

        required = ['tp', 'cp'] if self.cp_size > 1 else ['tp']
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)
        for name in required:
            if getattr(pg_collection, name, None) is None:
                raise ValueError(f"SDPADotProductAttention's pg_collection needs a {name!r} group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp_size = self.tp_group.size()
        self.cp_group = pg_collection.cp if self.cp_size > 1 else None
        if self.cp_group is not None and self.cp_group.size() != self.cp_size:
            raise ValueError(
                f"context_parallel_size is {self.cp_size} but the cp group has "
                f"{self.cp_group.size()} ranks"
            )

        self.k_channels = config.kv_channels if k_channels is None else k_channels
        self.v_channels = config.kv_channels if v_channels is None else v_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # Query layer scaling (apply_query_key_layer_scaling) divides the scale by the layer
        # number and multiplies it back inside an fp32 softmax: the product is the same, and SDPA
        # already accumulates in fp32, so it is left out here.
        self.softmax_scale = (
            self.k_channels**-0.5 if softmax_scale is None else float(softmax_scale)
        )
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        if not 0.0 <= self.dropout_p <= 1.0:
            raise ValueError(f"attention dropout must be in [0, 1], got {self.dropout_p}")
        self.sdpa_backends = resolve_sdpa_backends(sdpa_backends)

    # ------------------------------------------------------------------------------------------
    # helpers

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool):
        """Run SDPA on ``[b, heads, s, dim]`` tensors with this module's backends and dropout."""
        if k.size(1) != q.size(1):
            # Grouped-query attention: repeat each key/value group for its query heads. SDPA's
            # enable_gqa is not available on every backend, the repeat is.
            repeat = q.size(1) // k.size(1)
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        backends = (
            sdpa_kernel(self.sdpa_backends)
            if self.sdpa_backends is not None
            else contextlib.nullcontext()
        )
        # As megatron-core's local attention: dropout draws from the model-parallel RNG stream
        # (different per tensor-parallel rank) unless the sequence is split across ranks.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0.0 and q.is_cuda and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with backends, rng:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
            )

    @staticmethod
    def _causal_keep(sq: int, sk: int, bottom_right: bool, device: torch.device) -> Tensor:
        """Boolean ``[sq, sk]`` matrix, True where query i may see key j."""
        offset = sk - sq if bottom_right else 0
        rows = torch.arange(sq, device=device).unsqueeze(1)
        cols = torch.arange(sk, device=device).unsqueeze(0)
        return cols <= rows + offset

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attention_mask: Optional[Tensor],
        mask_type: AttnMaskType,
    ) -> Tensor:
        """Attention on ``[b, heads, s, dim]`` tensors with megatron mask semantics."""
        sq, sk = q.size(2), k.size(2)
        causal = mask_type in _CAUSAL_TYPES
        use_user_mask = attention_mask is not None and mask_type != AttnMaskType.no_mask
        if mask_type == AttnMaskType.arbitrary and attention_mask is None:
            raise ValueError("attn_mask_type 'arbitrary' needs an attention_mask")
        bottom_right = mask_type == AttnMaskType.causal_bottom_right
        if not use_user_mask:
            if not causal:
                return self._sdpa(q, k, v, None, False)
            # SDPA's is_causal is aligned top-left, where every row sees key 0; bottom-right
            # alignment equals it only for square scores.
            if not bottom_right or sq == sk:
                return self._sdpa(q, k, v, None, True)
            return self._masked_sdpa(q, k, v, self._causal_keep(sq, sk, True, q.device))

        if attention_mask.dtype != torch.bool:
            raise TypeError(
                "attention_mask must be boolean (True = masked out), got " f"{attention_mask.dtype}"
            )
        if attention_mask.dim() != 4:
            raise ValueError(
                "attention_mask must have 4 dims broadcastable to [b, heads, sq, sk], got shape "
                f"{tuple(attention_mask.shape)}"
            )
        keep = ~attention_mask
        if causal:
            keep = keep & self._causal_keep(sq, sk, bottom_right, q.device)
        return self._masked_sdpa(q, k, v, keep)

    def _masked_sdpa(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
        """SDPA with a boolean keep-mask; rows with no visible key give zeros instead of NaN."""
        visible = keep.any(dim=-1, keepdim=True)
        # Unmask fully masked rows so that every backend stays finite, then zero their output;
        # no branch on the data, so nothing here waits for the device.
        keep = keep | ~visible
        out = self._sdpa(q, k, v, keep, False)
        return out.masked_fill(~visible, 0.0)

    # ------------------------------------------------------------------------------------------
    # layouts

    def _forward_sbhd(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask, mask_type
    ) -> Tensor:
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._attend(q, k, v, attention_mask, mask_type)
        # [b, h, s, dv] -> [s, b, h * dv]
        out = out.permute(2, 0, 1, 3).contiguous()
        return out.view(out.size(0), out.size(1), -1)

    def _forward_thd(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        packed_seq_params: PackedSeqParams,
        mask_type: AttnMaskType,
    ) -> Tensor:
        if mask_type == AttnMaskType.arbitrary:
            raise ValueError("attn_mask_type 'arbitrary' is not supported for thd inputs")
        bounds_q, bounds_kv = _packed_bounds(packed_seq_params, query.size(0), key.size(0))
        # Within one packed sequence there is no padding left to mask: padding_causal is causal.
        if mask_type == AttnMaskType.padding_causal:
            seq_mask_type = AttnMaskType.causal
        elif mask_type in _CAUSAL_TYPES:
            seq_mask_type = mask_type
        else:
            seq_mask_type = AttnMaskType.no_mask
        pieces = []
        cursor = 0
        for (q_start, q_len, q_end), (k_start, k_len, _) in zip(bounds_q, bounds_kv):
            if q_start > cursor:
                pieces.append(query.new_zeros(q_start - cursor, query.size(1), value.size(-1)))
            if q_len > 0:
                # [len, h, d] -> [1, h, len, d]
                q = query[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)
                k = key[k_start : k_start + k_len].transpose(0, 1).unsqueeze(0)
                v = value[k_start : k_start + k_len].transpose(0, 1).unsqueeze(0)
                if k_len == 0:
                    out = q.new_zeros(1, q.size(1), q_len, value.size(-1))
                else:
                    out = self._attend(q, k, v, None, seq_mask_type)
                pieces.append(out.squeeze(0).transpose(0, 1))
            if q_end > q_start + q_len:
                pieces.append(
                    query.new_zeros(q_end - q_start - q_len, query.size(1), value.size(-1))
                )
            cursor = q_end
        if cursor < query.size(0):
            pieces.append(query.new_zeros(query.size(0) - cursor, query.size(1), value.size(-1)))
        out = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        # [t, h, dv] -> [t, h * dv], the layout TEDotProductAttention returns for thd.
        return out.reshape(out.size(0), -1)

    # ------------------------------------------------------------------------------------------
    # context parallelism

    def _gather(self, x: Tensor) -> Tensor:
        """``[cp, *x.shape]``: every context-parallel rank's ``x``, in rank order."""
        return all_gather_across_ranks(x, self.cp_group)

    def _forward_sbhd_cp(self, query: Tensor, key: Tensor, value: Tensor, causal: bool):
        s_local, batch = query.size(0), query.size(1)
        rank, cp = self.cp_group.rank(), self.cp_size
        if s_local % 2:
            raise ValueError(f"the local sequence length {s_local} must be even (two chunks)")
        keys, values = self._gather(key), self._gather(value)
        # [cp, s, b, g, d] -> [b, g, cp * s, d], rank-major as the positions below.
        k = keys.permute(2, 3, 0, 1, 4).flatten(2, 3)
        v = values.permute(2, 3, 0, 1, 4).flatten(2, 3)
        q = query.permute(1, 2, 0, 3)
        if causal:
            pos_q = cp_chunk_positions(s_local, cp, rank, query.device)
            pos_k = torch.cat([cp_chunk_positions(s_local, cp, r, query.device) for r in range(cp)])
            out = self._masked_sdpa(q, k, v, pos_k[None, :] <= pos_q[:, None])
        else:
            out = self._sdpa(q, k, v, None, False)
        out = out.permute(2, 0, 1, 3).contiguous()
        return out.view(s_local, batch, -1)

    def _forward_thd_cp(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        packed_seq_params: PackedSeqParams,
        causal: bool,
    ) -> Tensor:
        rank, cp = self.cp_group.rank(), self.cp_size
        # Boundaries of the whole (global) packed batch; this rank holds 1/cp of each sequence.
        cu = packed_seq_params.cu_seqlens_q
        cu_padded = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            raise ValueError("thd attention needs cu_seqlens_q in PackedSeqParams")
        actual = cu.tolist()
        starts = actual if cu_padded is None else cu_padded.tolist()
        if len(starts) != len(actual) or starts[-1] > query.size(0) * cp:
            raise ValueError("cu_seqlens_q(_padded) do not describe this rank's packed input")
        keys, values = self._gather(key), self._gather(value)
        pieces, cursor = [], 0
        for i in range(len(actual) - 1):
            padded_len = starts[i + 1] - starts[i]
            length = actual[i + 1] - actual[i]
            if padded_len % (2 * cp):
                raise ValueError(
                    f"packed sequence {i} has padded length {padded_len}, not a multiple of "
                    f"2 * context_parallel_size = {2 * cp}"
                )
            local_start, local_len = starts[i] // cp, padded_len // cp
            if local_len == 0:
                continue
            if local_start > cursor:
                pieces.append(
                    query.new_zeros(local_start - cursor, *query.shape[1:-1], value.size(-1))
                )
            device = query.device
            pos_q = cp_chunk_positions(local_len, cp, rank, device)
            pos_k = torch.cat([cp_chunk_positions(local_len, cp, r, device) for r in range(cp)])
            keep = (pos_k < length)[None, :].expand(local_len, -1)
            if causal:
                keep = keep & (pos_k[None, :] <= pos_q[:, None])
            sl = slice(local_start, local_start + local_len)
            q = query[sl].transpose(0, 1).unsqueeze(0)
            k = keys[:, sl].flatten(0, 1).transpose(0, 1).unsqueeze(0)
            v = values[:, sl].flatten(0, 1).transpose(0, 1).unsqueeze(0)
            out = self._masked_sdpa(q, k, v, keep).squeeze(0).transpose(0, 1)
            # Padding positions (past the sequence's real length) give zeros, as without CP.
            pieces.append(out.masked_fill((pos_q >= length)[:, None, None], 0.0))
            cursor = local_start + local_len
        if cursor < query.size(0):
            pieces.append(
                query.new_zeros(query.size(0) - cursor, *query.shape[1:-1], value.size(-1))
            )
        out = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        return out.reshape(out.size(0), -1)

    # ------------------------------------------------------------------------------------------

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attention output.

        Args:
            query: ``[sq, b, np, dk]`` (sbhd) or ``[t, np, dk]`` (thd).
            key: ``[sk, b, ng, dk]`` or ``[t, ng, dk]``.
            value: ``[sk, b, ng, dv]`` or ``[t, ng, dv]``.
            attention_mask: boolean, True = masked out, broadcastable to ``[b, np, sq, sk]``;
                None for none. Not used for thd.
            attn_mask_type: overrides the layer's mask type for this call.
            attention_bias: not supported; must be None.
            packed_seq_params: thd parameters (``qkv_format='thd'`` and ``cu_seqlens``).

        Returns:
            Tensor: ``[sq, b, np * dv]`` for sbhd, ``[t, np * dv]`` for thd.
        """
        if attention_bias is not None:
            raise ValueError("SDPADotProductAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if query.size(-1) != key.size(-1):
            raise ValueError(f"query and key head sizes differ: {query.size(-1)} vs {key.size(-1)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree before the "
                "head dimension"
            )
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == 'thd'
        if query.dim() != (3 if thd else 4):
            expected = "thd: [t, heads, dim]" if thd else "sbhd: [s, b, heads, dim]"
            raise ValueError(f"query must be {expected}, got {tuple(query.shape)}")
        self._check_heads(query.size(-2), key.size(-2))
        if self.cp_size > 1:
            if attention_mask is not None and not thd and mask_type != AttnMaskType.no_mask:
                raise ValueError(
                    "explicit attention masks are not supported with context parallelism"
                )
            if mask_type not in (
                AttnMaskType.causal,
                AttnMaskType.padding_causal,
                AttnMaskType.no_mask,
                AttnMaskType.padding,
            ):
                raise ValueError(
                    f"attn_mask_type {mask_type.name} is not supported with " "context parallelism"
                )
            causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
            if thd:
                return self._forward_thd_cp(query, key, value, packed_seq_params, causal)
            return self._forward_sbhd_cp(query, key, value, causal)
        if thd:
            return self._forward_thd(query, key, value, packed_seq_params, mask_type)
        return self._forward_sbhd(query, key, value, attention_mask, mask_type)

    @staticmethod
    def _check_heads(n_q: int, n_kv: int) -> None:
        if n_kv == 0 or n_q % n_kv != 0:
            raise ValueError(f"query heads ({n_q}) must be a multiple of key/value heads ({n_kv})")


def _packed_bounds(
    params: PackedSeqParams, total_q: int, total_kv: int
) -> Tuple[List[Tuple[int, int, int]], List[Tuple[int, int, int]]]:
    """Per-sequence ``(start, length, padded_end)`` for queries and keys of a thd batch.

    One host copy of the boundaries per call: the loop over sequences needs them on the host.
    """
    if params.cu_seqlens_q is None or params.cu_seqlens_kv is None:
        raise ValueError("thd attention needs cu_seqlens_q and cu_seqlens_kv in PackedSeqParams")

    def bounds(cu: Tensor, cu_padded: Optional[Tensor], total: int, name: str):
        lengths = cu.tolist()
        starts = lengths if cu_padded is None else cu_padded.tolist()
        if len(starts) != len(lengths):
            raise ValueError(f"cu_seqlens_{name} and cu_seqlens_{name}_padded differ in length")
        if starts[-1] > total:
            raise ValueError(
                f"cu_seqlens_{name} covers {starts[-1]} tokens but the input has {total}"
            )
        out = []
        for i in range(len(lengths) - 1):
            length = lengths[i + 1] - lengths[i]
            if length < 0 or starts[i + 1] - starts[i] < length:
                raise ValueError(f"cu_seqlens_{name} (or its padded form) is not valid")
            out.append((starts[i], length, starts[i + 1]))
        return out

    b_q = bounds(params.cu_seqlens_q, params.cu_seqlens_q_padded, total_q, "q")
    b_kv = bounds(params.cu_seqlens_kv, params.cu_seqlens_kv_padded, total_kv, "kv")
    if len(b_q) != len(b_kv):
        raise ValueError("cu_seqlens_q and cu_seqlens_kv describe different numbers of sequences")
    return b_q, b_kv
