#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: the MLA RoPE flag inside megatron.training's own pretraining loop.

Runs ``pretrain_mla_gpt.py`` (beside this file: a Megatron-LM pretraining script with
megatron_ext's flags) twice, ``--mla-rope-contiguous-load`` off and on, each in its own process
(megatron.training keeps process-wide state), from the same seed and mock data. The harness
records each iteration's loss and grad norm as ``train_step`` returns them; the two runs must
agree bit for bit, and with the golden values.

Standalone::

    python tests/functional_tests/test_cases/gpt/mla_rope_contiguous_load_megatron_training/\\
        run_case.py --output-json OUT.json [--train-iters N]

Needs a GPU and ``megatron.training`` (in the megatron-core 0.19 wheel).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[4]

# The run's Megatron-LM command line (less --train-iters and the flag): a small
# DeepSeek-V3-shaped MLA GPT with yarn RoPE and RoPE fusion, bf16, local layers with megatron_ext's
# SDPA core attention (no Transformer Engine needed), mock data, deterministic.
MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "512", "--ffn-hidden-size", "1024",
    "--num-attention-heads", "8", "--multi-latent-attention", "--q-lora-rank", "384",
    "--kv-lora-rank", "256", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
    "--v-head-dim", "128", "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", "40", "--yarn-original-max-position-embeddings", "4096",
    "--mscale", "1.0", "--mscale-all-dim", "1.0", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style",
    "constant", "--clip-grad", "1.0", "--bf16", "--seed", "1234", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--split", "100,0,0",
    "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "10",
    "--transformer-impl", "local", "--spec", "megatron_ext.models.gpt.gpt_layer_specs",
    "get_gpt_layer_local_mla_spec", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
    "--no-persist-layer-norm", "--deterministic-mode", "--distributed-backend", "nccl",
]  # fmt: skip


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-json", type=Path, required=True, help="result file (runner format)")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def skip_built_helpers() -> None:
    """megatron.training runs `make` on megatron-core's dataset helpers at start-up; the wheel
    ships them compiled but without their Makefile, so the build step would fail where nothing
    needs building: skip it where the compiled helpers import."""
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        dataset_utils.compile_helpers = lambda: None


def _child(mode: str, output: Path, train_iters: int) -> None:
    """One pretraining run, recording what ``train_step`` returns."""
    sys.path.insert(0, str(HERE))
    import pretrain_mla_gpt
    from megatron.training import training

    steps: List[Dict[str, Any]] = []
    real_train_step = training.train_step

    def recording_train_step(*args: Any, **kwargs: Any):
        result = real_train_step(*args, **kwargs)
        loss_dict, grad_norm = result[0], result[5]
        loss = float(loss_dict["lm loss"])
        steps.append({"lm loss": loss, "grad norm": float(grad_norm)})
        return result

    built: List[Any] = []
    real_setup = training.setup_model_and_optimizer

    def recording_setup(*args: Any, **kwargs: Any):
        result = real_setup(*args, **kwargs)
        built.extend(result[0])
        return result

    training.train_step = recording_train_step
    training.setup_model_and_optimizer = recording_setup
    skip_built_helpers()
    sys.argv = [
        str(HERE / "pretrain_mla_gpt.py"),
        *MEGATRON_ARGS,
        "--train-iters",
        str(train_iters),
    ]
    if mode == "on":
        sys.argv.append("--mla-rope-contiguous-load")
    pretrain_mla_gpt.main()

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_ext.transformer.multi_latent_attention import ExtMLASelfAttention

    modules = [m for model in built for m in model.modules()]
    run = {
        "mode": mode,
        "lm loss": [s["lm loss"] for s in steps],
        "grad norm": [s["grad norm"] for s in steps],
        "lm loss hex": [s["lm loss"].hex() for s in steps],
        "grad norm hex": [s["grad norm"].hex() for s in steps],
        "ext_mla_modules": sum(isinstance(m, ExtMLASelfAttention) for m in modules),
        "mla_modules": sum(isinstance(m, MLASelfAttention) for m in modules),
    }
    output.write_text(json.dumps(run) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    """Run both modes and compare them; 0 when they agree bit for bit."""
    args = parse_args(argv)
    if args.child:
        _child(args.child, args.output_json, args.train_iters)
        return 0
    runs, problems = [], []
    for index, mode in enumerate(args.modes):
        out = args.output_json.with_suffix(f".{mode}.json")
        env = dict(os.environ)
        env.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(29500 + index), CUDA_DEVICE_MAX_CONNECTIONS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        )  # fmt: skip
        command = [
            sys.executable, __file__, "--child", mode, "--output-json", str(out),
            "--train-iters", str(args.train_iters),
        ]  # fmt: skip
        code = subprocess.call(command, env=env)
        if code != 0 or not out.exists():
            problems.append(f"mode {mode}: pretraining exited with status {code}")
            continue
        runs.append(json.loads(out.read_text()))
    for run in runs:
        expected = 2 if run["mode"] == "on" else 0
        if run["ext_mla_modules"] != expected:
            problems.append(
                f"mode {run['mode']}: {run['ext_mla_modules']} megatron_ext MLA modules, "
                f"expected {expected}"
            )
        if len(run["lm loss"]) != args.train_iters:
            problems.append(f"mode {run['mode']}: {len(run['lm loss'])} steps recorded")
    from megatron_ext.testing.environment import run_environment

    result = {"runs": runs, "environment": run_environment(), "problems": problems}
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    for run in runs:
        print(
            f"[{run['mode']}] {len(run['lm loss'])} iterations through megatron.training.pretrain,"
            f" {run['ext_mla_modules']} megatron_ext MLA modules; lm loss "
            f"{run['lm loss'][0]:.4f} -> {run['lm loss'][-1]:.4f}"
        )
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
