# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Probe and time MLA prefill attention in the absorbed and the MHA form on one GPU.

    python scripts/probe_mla_mha_prefill.py [--quick] [--out FILE.json] [--row-budget ROWS]

For 16 and 128 heads at DeepSeek-V3's widths (latent 512, RoPE 64, qk 128, v 128), bf16, a paged
latent cache of 64-row blocks in shuffled order, and the steps: prefill 2 x 1536, 4096 and 8192
tokens; a 1024-token chunk behind 0, 3072 and 32768 cached rows; 8 decodes (2048 cached rows
each) + a 512-token chunk behind 3072 rows. Per step and form:

* ``absorbed``: W_UK into the query, megatron_ext's paged latent attention, W_UV;
* ``mha:<backend>``: :func:`~megatron_ext.fusions.mla_latent.mha_form.mla_paged_mha_attention`
  (gather, decompression GEMM, keys, dense ragged attention, at most ``--row-budget`` rows at a
  time) for each backend that runs here
  (``cudnn``: torch's ragged cuDNN entry; ``te``: Transformer Engine; ``torch``: plain torch,
  only where its score matrices fit);
* ``split:<backend>`` for the mixed step: the cost model's split (decodes absorbed, the chunk in
  the MHA form).

Each row: the first call's time (cuDNN plans per shape), the median of timed calls, the form's
own FLOPs per second (absorbed: 2176 per pair and head plus the absorption GEMMs; MHA: 640 per
pair and head plus the decompression GEMM), the largest difference from the absorbed output
(relative to its largest value), which split the cost model picks, and the error if the form
failed. Each probe is guarded; a short table is printed last. Takes about 2-3 minutes on an
H200 (``--quick``: the 16-head half).
"""

import argparse
import json
import math
import statistics
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

LATENT, ROPE, QK, V = 512, 64, 128, 128
BLOCK = 64
SCALE = (0.1 * math.log(40) + 1) ** 2 / math.sqrt(QK + ROPE)
# (name, [(cached rows, new tokens) per request])
CASES = [
    ("prefill 2x1536", [(0, 1536), (0, 1536)]),
    ("prefill 4096", [(0, 4096)]),
    ("prefill 8192", [(0, 8192)]),
    ("chunk 1024 / 0", [(0, 1024)]),
    ("chunk 1024 / 3072", [(3072, 1024)]),
    ("chunk 1024 / 32k", [(32768, 1024)]),
    ("8 dec + 512 / 3072", [(2048, 1)] * 8 + [(3072, 512)]),
]


def build(
    requests: List[Tuple[int, int]],
    heads: int,
    seed: int = 0,
    dev: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> Dict:
    """A paged step: cache, block table, device lengths, MHA query, weight, host lengths."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + n) // BLOCK) for c, n in requests]
    order = torch.randperm(sum(blocks) + 2, generator=gen)
    table = torch.full((len(requests), max(blocks)), -1, dtype=torch.int32)
    used = 0
    for r, count in enumerate(blocks):
        table[r, :count] = order[used : used + count].to(torch.int32)
        used += count
    q_lens = np.array([n for _, n in requests])
    kv_lens = np.array([c + n for c, n in requests])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    cache = torch.randn(sum(blocks) + 2, BLOCK, LATENT + ROPE, device=dev, dtype=dtype)
    tokens = int(q_lens.sum())
    query = torch.randn(tokens, heads, QK + ROPE, device=dev, dtype=dtype)
    weight = torch.randn(heads * (QK + V), LATENT, device=dev) / math.sqrt(LATENT)
    return dict(
        cache=cache,
        table=table.to(dev),
        cu=torch.tensor(cu, dtype=torch.int32, device=dev),
        kv=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
        query=query,
        weight=weight.to(dtype),
        q_lens=q_lens,
        kv_lens=kv_lens,
        heads=heads,
    )


def absorbed_call(s: Dict, first: int = 0, last: int = None) -> Callable[[], torch.Tensor]:
    """The absorbed form over requests first..last."""
    from megatron_ext.fusions.mla_latent import mla_paged_latent_attention

    last = len(s["q_lens"]) if last is None else last
    t0, t1 = int(s["q_lens"][:first].sum()), int(s["q_lens"][:last].sum())
    heads = s["heads"]
    w = s["weight"].view(heads, QK + V, LATENT)
    q = s["query"][t0:t1]
    max_q = int(s["q_lens"][first:last].max())
    cu = s["cu"][first : last + 1] - s["cu"][first]

    def call():
        q_abs = torch.einsum("thd,hdc->thc", q[..., :QK], w[:, :QK])
        attended = mla_paged_latent_attention(
            torch.cat([q_abs, q[..., QK:]], -1),
            s["cache"],
            s["table"][first:last],
            cu,
            s["kv"][first:last],
            SCALE,
            rope_dim=ROPE,
            max_query_len=max_q,
        )
        return torch.einsum("thc,hvc->thv", attended, w[:, QK:])

    return call


def mha_call(
    s: Dict, backend: str, first: int = 0, row_budget: Optional[int] = None
) -> Callable[[], torch.Tensor]:
    from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention

    t0 = int(s["q_lens"][:first].sum())

    def call():
        return mla_paged_mha_attention(
            s["query"][t0:],
            s["cache"],
            s["table"][first:],
            s["weight"],
            SCALE,
            query_lengths=s["q_lens"][first:],
            kv_lengths=s["kv_lens"][first:],
            rope_dim=ROPE,
            backend=backend,
            row_budget=row_budget,
        )

    return call


def split_call(
    s: Dict, backend: str, split: int, row_budget: Optional[int] = None
) -> Callable[[], torch.Tensor]:
    head, tail = absorbed_call(s, 0, split), mha_call(s, backend, split, row_budget)
    return lambda: torch.cat([head(), tail()]) if split else tail()


def timed(call: Callable[[], torch.Tensor], repeats: int) -> Tuple[float, float, torch.Tensor]:
    """(first call seconds, median seconds, output)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    call()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return first, statistics.median(times), out


def flops(s: Dict, form: str, split: int = 0) -> float:
    """The form's own FLOPs (absorbed form for requests < split)."""
    q = s["q_lens"].astype(np.float64)
    rows = s["kv_lens"].astype(np.float64)
    pairs = q * (rows - q) + q * (q + 1) / 2
    absorbed = pairs * (2 * (LATENT + ROPE) + 2 * LATENT) + q * (2 * QK * LATENT + 2 * LATENT * V)
    mha = pairs * (2 * (QK + ROPE) + 2 * V) + rows * (2 * LATENT * (QK + V))
    if form == "absorbed":
        split = len(q)
    return s["heads"] * float(absorbed[:split].sum() + mha[split:].sum())


def backends() -> List[str]:
    from megatron_ext.fusions.mla_latent.mha_backends import present_backends

    return list(present_backends()) + ["torch"]


def _fmt(row: Dict, key: str, scale: float = 1.0, spec: str = "9.3f") -> str:
    return format(row[key] * scale, spec) if key in row else " " * int(spec[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 heads only")
    parser.add_argument("--out", default="mla_mha_prefill.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--budget", type=float, default=220, help="seconds of probing before the rest is skipped"
    )
    parser.add_argument(
        "--row-budget",
        type=int,
        default=None,
        help="rows the MHA form decompresses at once (default: mha_form.ROW_BUDGET)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    from megatron_ext.transformer.mla_prefill import absorbed_request_count

    rows: List[Dict] = []
    found = backends()
    print(f"torch {torch.version.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}, backends {found}", flush=True)  # fmt: skip
    deadline = time.perf_counter() + args.budget
    for heads in (16,) if args.quick else (16, 128):
        for name, requests in CASES:
            if time.perf_counter() > deadline:
                rows.append(dict(case=name, heads=heads, form="-", error="skipped: time budget"))
                continue
            try:
                s = build(requests, heads)
            except Exception as error:  # noqa: BLE001
                rows.append(dict(case=name, heads=heads, form="build", error=repr(error)))
                continue
            split = absorbed_request_count(s["q_lens"], s["kv_lens"], heads, (LATENT, ROPE, QK, V))
            reference = None
            forms = [("absorbed", absorbed_call(s), "absorbed", 0)]
            for backend in found:
                pairs = float((s["q_lens"] * s["kv_lens"]).sum())
                if backend == "torch" and pairs * heads * 4 > 8 * 2**30:
                    continue  # its score matrices would not fit
                mha = mha_call(s, backend, row_budget=args.row_budget)
                forms.append((f"mha:{backend}", mha, "mha", 0))
                if 0 < split < len(requests):
                    tail = split_call(s, backend, split, args.row_budget)
                    forms.append((f"split:{backend}", tail, "mha", split))
            for form, call, kind, form_split in forms:
                row = dict(case=name, heads=heads, form=form, model_split=split)
                try:
                    first, median, out = timed(call, args.repeats)
                    row.update(first_s=first, median_s=median)
                    row["tflops"] = flops(s, kind, form_split) / median / 1e12
                    if reference is None:
                        reference = out.float()
                    else:
                        scale = float(reference.abs().max())
                        row["max_rel_diff"] = float((out.float() - reference).abs().max()) / scale
                except Exception as error:  # noqa: BLE001 (report and go on)
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    row["trace"] = traceback.format_exc(limit=4)[-1500:]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            del s, reference, forms
            torch.cuda.empty_cache()
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)
    print(f"\n{'case':20} {'heads':>5} {'form':14} {'split':>5} {'first ms':>9} {'ms':>9} "
          f"{'TFLOP/s':>8} {'rel diff':>9}  error")  # fmt: skip
    for row in rows:
        print(f"{row['case']:20} {row['heads']:>5} {row['form']:14} "
              f"{row.get('model_split', ''):>5} {_fmt(row, 'first_s', 1e3)} "
              f"{_fmt(row, 'median_s', 1e3)} {_fmt(row, 'tflops', 1, '8.1f')} "
              f"{_fmt(row, 'max_rel_diff', 1, '9.2e')}  {row.get('error', '')[:80]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
