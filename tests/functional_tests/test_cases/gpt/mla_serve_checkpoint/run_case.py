#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: train a DeepSeek-shaped MoE + MLA GPT, save it, serve it with one command.

1. The checkpoint. On a GPU, ``pretrain`` (the script of
   ``mla_rope_contiguous_load_megatron_training``, with this case's command line in float32)
   trains a tiny DeepSeek-V2-Lite-shaped GPT (MLA; a dense first layer, then MoE layers of routed
   top-2 experts and a shared expert) for a few iterations and saves a ``torch_dist`` checkpoint.
   On the CPU, where ``pretrain`` cannot run (megatron.training's ``initialize_megatron`` asserts
   CUDA and its loop allocates on ``cuda``), the model is built by megatron.training's
   ``GPTModelBuilder`` from the same command line, trained for as many steps on the same mock data
   with ``torch.optim.Adam`` and saved by megatron.training's ``save_checkpoint``.
2. ``python -m megatron_ext.serve --load CKPT`` with the same command line starts as a separate
   process; the case waits for its "serving on" line.
3. While it runs: a second ``megatron_ext.serve`` on the same port, and one whose
   ``--kv-lora-rank`` differs from the checkpoint's, must each exit with status 2 naming the
   problem, before building a model.
4. Requests over HTTP (the ``openai`` client where installed, urllib otherwise), several in flight,
   completions and chat completions, greedy; the served tokens must equal the tokens megatron-core's
   engine generates for the same prompts from the same checkpoint (``MegatronLLM`` in direct mode,
   in another process, the model built and loaded by ``megatron_ext.serve``'s own functions).
5. SIGTERM: the server must exit 0 after printing "stopped", leave no process it started, and close
   the port.

With ``--tensor-parallel N`` (the case ``mla_serve_checkpoint_tp2``), the server and the direct
engine run as N ranks under torchrun with ``--tensor-model-parallel-size N`` (the checkpoint is
still trained by one process); SIGTERM goes to torchrun, and every rank must stop on its own.

Standalone::

    python tests/functional_tests/test_cases/gpt/mla_serve_checkpoint/run_case.py --output-json OUT

Needs megatron-core 0.19 with megatron.training, the ``server`` extra's quart, hypercorn, pyzmq and
msgpack, and psutil (megatron-core's checkpoint writer). Without CUDA it runs on the CPU, with
megatron_ext's Triton kernels in the Triton interpreter (``TRITON_INTERPRET=1`` is set for the
processes that serve).
"""

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[4]
TRAINING_CASE = HERE.parent / "mla_rope_contiguous_load_megatron_training"
SERVER_CASE = HERE.parent / "mla_dynamic_server"
HOST = "127.0.0.1"
# The training run's command line, which the server takes unchanged (a training command line's
# model flags carry over): a tiny DeepSeek-V2-Lite-shaped GPT, MLA with yarn RoPE (the training
# case's MLA widths: 256-wide latent, 64-wide RoPE) and MoE from the second layer on (4 routed
# experts, top-2, and a shared expert). Local layers through megatron_ext's MoE block spec, whose
# MLA core attention is SDPA (no Transformer Engine). The allgather dispatcher needs no CUDA
# streams (alltoall does); no capacity factor (megatron_ext refuses it with cache_mla_latents: a
# dropped token would depend on the other requests of a step). float32, not the training case's
# bf16, keeps the greedy choices of the served and the direct run (batched differently) away from
# ties.
MODEL_ARGS = [
    "--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--multi-latent-attention", "--q-lora-rank", "32",
    "--kv-lora-rank", "256", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "64",
    "--v-head-dim", "32", "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", "40", "--yarn-original-max-position-embeddings", "4096",
    "--mscale", "1.0", "--mscale-all-dim", "1.0", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1,1]",
    "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2",
    "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
    "constant", "--clip-grad", "1.0", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--split", "100,0,0",
    "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1",
    "--transformer-impl", "local", "--spec", "megatron_ext.testing.small_mla_moe_gpt",
    "mla_moe_block_spec", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
    "--no-persist-layer-norm", "--deterministic-mode",
]  # fmt: skip
# What the CPU's training run adds: weights allocated on the CPU, megatron-core's RoPE unfused
# (its fused RoPE is a Triton kernel: the interpreter would take minutes at 512 tokens), and no
# optimizer or RNG state (a torch optimizer, and megatron.training reads the RNG state from CUDA).
CPU_TRAIN_ARGS = [
    "--use-cpu-initialization", "--no-rope-fusion", "--no-save-optim", "--no-save-rng",
]  # fmt: skip


def on_cpu() -> bool:
    """Whether this machine runs the case on the CPU (torch sees no CUDA device)."""
    import torch

    return not torch.cuda.is_available()


def _load(path: Path, name: str) -> Any:
    """Import a case's script by path under ``name`` (each case's script is run_case.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-json", type=Path, required=True, help="result file (runner format)")
    p.add_argument("--work-dir", type=Path, default=None, help="checkpoint and logs")
    p.add_argument("--train-iters", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chat-every", type=int, default=3)
    p.add_argument("--prompt-length", type=int, nargs=2, default=[4, 96])
    p.add_argument("--generate-length", type=int, nargs=2, default=[4, 24])
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--extra-model-args", nargs="*", default=[], help="appended to the model flags")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="serve (and run the direct engine) with this tensor-parallel size, one process per "
        "rank under torchrun (the checkpoint is trained with 1)",
    )
    p.add_argument("--child", choices=["train", "train_cpu", "reference"], help=argparse.SUPPRESS)
    p.add_argument("--child-args", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_args(args: argparse.Namespace) -> List[str]:
    """The training run's command line (:data:`MODEL_ARGS`), which the server takes unchanged."""
    return MODEL_ARGS + ["--seed", str(args.seed)] + list(args.extra_model_args)


def serve_args(args: argparse.Namespace, ckpt: Path, port: int, tp: int = 1) -> List[str]:
    """``megatron_ext.serve``'s command line for the case (explicit cache sizes, so that the
    direct run builds the same context), with tensor-parallel size ``tp``."""
    return model_args(args) + [
        "--load", str(ckpt), "--port", str(port), "--max-requests", "16",
        "--max-sequence-length", "256", "--max-tokens", "256", "--block-size-tokens", "16",
        "--buffer-size-gb", "0.25", "--frontend-replicas", "2",
        "--tensor-model-parallel-size", str(tp),
    ]  # fmt: skip


def launcher(nproc: int) -> List[str]:
    """The command prefix that starts ``nproc`` ranks: this Python, under torchrun when > 1
    (local rendezvous on a free port).

    Args:
        nproc: processes (tensor-parallel ranks).

    Returns:
        List[str]: the prefix, to be followed by ``-m MODULE`` or a script and its arguments.
    """
    if nproc == 1:
        return [sys.executable]
    from megatron_ext.testing.network import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", HOST, "--master-port", str(free_port())]  # fmt: skip


def child_env(port: Optional[int] = None) -> Dict[str, str]:
    """One process's torch.distributed environment, the repository first on PYTHONPATH; on the
    CPU, Triton's interpreter for megatron_ext's kernels (read when Python starts)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if on_cpu():
        env["TRITON_INTERPRET"] = "1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the server starts its own one-process group
    if port is not None:
        env.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR=HOST, MASTER_PORT=str(port)
        )
    return env


def _child_train(argv: List[str]) -> None:
    """pretrain with the training case's script, saving the checkpoint."""
    sys.path.insert(0, str(TRAINING_CASE))
    import pretrain_mla_gpt

    _load(TRAINING_CASE / "run_case.py", "mla_training_case").skip_built_helpers()
    sys.argv = [str(TRAINING_CASE / "pretrain_mla_gpt.py"), *argv]
    pretrain_mla_gpt.main()


def _child_train_cpu(argv: List[str]) -> None:
    """The CPU's training run: the model megatron.training builds from ``argv``, trained for
    ``--train-iters`` steps on megatron-core's mock data (the pretraining script's datasets) with
    ``torch.optim.Adam``, saved by megatron.training's ``save_checkpoint``."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import checkpointing
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_args as parse_megatron_args
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.training.models import GPTModelBuilder

    from megatron_ext.arguments import add_megatron_ext_args, apply_megatron_ext
    from megatron_ext.serve import init_distributed
    from megatron_ext.testing.synthetic import cpu_torch_compat

    sys.path.insert(0, str(TRAINING_CASE))
    import pretrain_mla_gpt

    _load(TRAINING_CASE / "run_case.py", "mla_training_case").skip_built_helpers()
    sys.argv = [str(TRAINING_CASE / "pretrain_mla_gpt.py"), *argv]
    args = parse_megatron_args(extra_args_provider=add_megatron_ext_args)
    validate_args(args, {"tokenizer_type": "NullTokenizer"})
    set_global_variables(args, build_tokenizer=True)
    init_distributed(args)  # gloo, one process
    apply_megatron_ext(args)  # as the pretraining script (no flag given: nothing is patched)
    batch_size = args.global_batch_size
    train, _, _ = pretrain_mla_gpt.datasets_provider([args.train_iters * batch_size, 0, 0])
    with cpu_torch_compat():
        builder = GPTModelBuilder(gpt_config_from_args(args))
        (model,) = builder.build_distributed_models(
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False
        )
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        for step in range(args.train_iters):
            samples = [train[step * batch_size + i] for i in range(batch_size)]
            batch = {
                k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                for k, v in samples[0].items()
                if v is not None
            }
            losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"].float()
            loss = (losses.float() * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()  # the routers' load-balancing loss joins here (megatron-core)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            print(f"CPU training step {step + 1}: lm loss {loss.item():.4f}", flush=True)
        # --no-save-rng leaves the RNG state out of the checkpoint, but megatron.training still
        # collects it, CUDA's among it: skipped here.
        with mock.patch.object(checkpointing, "get_rng_state", lambda *a, **k: None):
            checkpointing.save_checkpoint(args.train_iters, [model], None, None, 0)


def _child_reference(spec: Dict[str, Any], output: Path) -> None:
    """The engine's own tokens for the requests: the model built and loaded as the server builds
    it, run by megatron-core's ``MegatronLLM`` in direct mode (no coordinator, no server)."""
    from megatron.core.inference.apis import MegatronLLM
    from megatron.training.global_vars import get_tokenizer

    from megatron_ext import serve
    from megatron_ext.testing.synthetic import run_engine

    server_case = _load(SERVER_CASE / "run_case.py", "mla_server_case")
    from megatron_ext.testing.cpu_serve import cpu_only_torch

    with cpu_only_torch():  # as the server runs (nothing on a GPU)
        # As the server is started (the CPU launcher adds --use-cpu-initialization).
        cpu_args = ["--use-cpu-initialization"] if on_cpu() else []
        args = serve.parse_serve_args(spec["argv"] + cpu_args)
        serve.init_distributed(args)
        model = serve.build_model(args)
        llm = MegatronLLM(
            model=model,
            tokenizer=get_tokenizer(),
            inference_config=serve.inference_config(args, model),
            use_coordinator=False,
        )
        work = [
            (r["prompt"], server_case.engine_sampling_params(r["max_tokens"]))
            for r in spec["requests"]
        ]
        outputs, _ = run_engine(llm.engine, work)
    result = {
        "outputs": {str(k): v for k, v in outputs.items()},
        "layers": [layer_kind(layer) for layer in model.decoder.layers],
    }
    import torch

    if torch.distributed.get_rank() == 0:  # every rank ran the same steps (tensor parallel)
        output.write_text(json.dumps(result, default=float))


def layer_kind(layer: Any) -> str:
    """What a decoder layer's MLP is: ``dense``, or ``moe E top-K + shared`` for megatron-core's
    ``MoELayer`` (routed experts, top-k, and a shared expert where it has one)."""
    mlp = layer.mlp
    if not hasattr(mlp, "router"):
        return "dense"
    shared = " + shared" if getattr(mlp, "shared_experts", None) is not None else ""
    return f"moe {mlp.config.num_moe_experts} top-{mlp.config.moe_router_topk}{shared}"


def run_child(
    kind: str, payload: Any, work: Path, timeout: float, nproc: int = 1
) -> Tuple[int, str]:
    """Run this script as ``--child kind`` with ``payload`` (JSON), in its own process (``nproc``
    ranks under torchrun when > 1)."""
    spec = work / f"{kind}.args.json"
    spec.write_text(json.dumps(payload))
    out = work / f"{kind}.out.json"
    from megatron_ext.testing.network import free_port

    command = launcher(nproc) + [__file__, "--child", kind, "--child-args", str(spec),
                                 "--output-json", str(out)]  # fmt: skip
    env = child_env(free_port() if nproc == 1 else None)
    log = work / f"{kind}.log"
    with log.open("w") as sink:
        code = subprocess.call(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout
        )
    return code, log.read_text()[-3000:]


def start_server(argv: List[str], log: Path, nproc: int = 1) -> subprocess.Popen:
    """``python -m megatron_ext.serve ARGV`` in its own process (its output to ``log``), under
    torchrun with ``nproc`` ranks when > 1; on a machine without a GPU through the tests' CPU
    launcher ``megatron_ext.testing.cpu_serve``."""
    sink = log.open("w")
    module = "megatron_ext.testing.cpu_serve" if on_cpu() else "megatron_ext.serve"
    return subprocess.Popen(
        launcher(nproc) + ["-m", module, *argv],
        cwd=REPO_ROOT, env=child_env(), stdout=sink, stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_for_line(process: subprocess.Popen, log: Path, text: str, timeout: float) -> bool:
    """Whether ``text`` appeared in ``log`` before ``process`` exited or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return True
        if process.poll() is not None:
            return text in log.read_text(errors="replace")
        time.sleep(1)
    return False


def descendants(pid: int) -> List[int]:
    """Process ids whose parent chain leads to ``pid`` (from /proc)."""
    parents: Dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def command_line(pid: int) -> str:
    """A process's command line (from /proc; empty once it has gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def request(port: int, item: Dict[str, Any]) -> List[int]:
    """One greedy request (``openai`` where installed, else urllib); the generated token ids."""
    body = dict(model="m", max_tokens=item["max_tokens"], temperature=0.0, ignore_eos=True)
    chat = item["endpoint"] == "chat"
    if chat:
        # The null tokenizer reads a message's text as space-separated token ids.
        body["messages"] = [{"role": "user", "content": " ".join(map(str, item["prompt"]))}]
    else:
        body["prompt"] = item["prompt"]
    try:
        from openai import OpenAI
    except ImportError:
        path = "chat/completions" if chat else "completions"
        data = json.dumps(body).encode()
        http = urllib.request.Request(
            f"http://{HOST}:{port}/v1/{path}", data=data,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(http, timeout=600) as reply:
            choice = json.loads(reply.read())["choices"][0]
        tokens = (choice["message"] if chat else choice)["generation_token_ids"]
        return [int(t) for t in tokens]
    client = OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="unused", max_retries=0,
                    timeout=600)  # fmt: skip
    extra = {"ignore_eos": True}
    common = dict(model="m", max_tokens=item["max_tokens"], temperature=0.0, extra_body=extra)
    if chat:
        reply = client.chat.completions.create(messages=body["messages"], **common)
        return [int(t) for t in reply.choices[0].message.generation_token_ids]
    reply = client.completions.create(prompt=item["prompt"], **common)
    return [int(t) for t in reply.choices[0].generation_token_ids]


def refused(argv: List[str], log: Path, expect: str, timeout: float = 300) -> Optional[str]:
    """Run a serve command that must exit 2 saying ``expect``; the problem, or None."""
    process = start_server(argv, log)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return f"{log.name}: still running after {timeout} s, expected a refusal"
    text = log.read_text(errors="replace")
    if code != 2 or expect not in text:
        return f"{log.name}: exit {code}, expected 2 saying {expect!r}: {text[-800:]}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Run the case; 0 when every check passed."""
    args = parse_args(argv)
    if args.child:
        payload = json.loads(args.child_args.read_text())
        if args.child == "train":
            _child_train(payload)
        elif args.child == "train_cpu":
            _child_train_cpu(payload)
        else:
            _child_reference(payload, args.output_json)
        return 0
    from megatron_ext.testing.environment import run_environment
    from megatron_ext.testing.network import free_port

    server_case = _load(SERVER_CASE / "run_case.py", "mla_server_case")
    work = args.work_dir or args.output_json.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoint"
    problems: List[str] = []
    train_argv = model_args(args) + [
        "--train-iters", str(args.train_iters), "--save", str(ckpt), "--save-interval",
        str(args.train_iters), "--ckpt-format", "torch_dist",
    ]  # fmt: skip
    cpu = on_cpu()
    kind = "train_cpu" if cpu else "train"
    code, tail = run_child(kind, train_argv + (CPU_TRAIN_ARGS if cpu else []), work, timeout=900)
    if code != 0 or not (ckpt / "latest_checkpointed_iteration.txt").is_file():
        problems.append(f"training ({kind}) exited {code} without a checkpoint: {tail}")
        return finish(args, [], problems, run_environment())

    vocab = int(model_args(args)[model_args(args).index("--vocab-size") + 1])
    requests = server_case.make_requests(
        argparse.Namespace(
            seed=args.seed, num_requests=args.num_requests, vocab_size=vocab,
            prompt_length=args.prompt_length, generate_length=args.generate_length,
            chat_every=args.chat_every,
        )
    )  # fmt: skip
    port = args.port or free_port()
    tp = args.tensor_parallel
    argv_serve = serve_args(args, ckpt, port, tp)
    payload = {"argv": argv_serve, "requests": requests}
    code, tail = run_child("reference", payload, work, 900, nproc=tp)
    reference_path = work / "reference.out.json"
    if code != 0 or not reference_path.is_file():
        problems.append(f"the direct engine run exited {code}: {tail}")
        return finish(args, [], problems, run_environment())
    reference = json.loads(reference_path.read_text())
    direct = {int(k): v for k, v in reference["outputs"].items()}
    # The served model is DeepSeek-shaped: a dense first layer, then routed + shared experts.
    expected_layers = ["dense"] + ["moe 4 top-2 + shared"] * 2
    if reference["layers"] != expected_layers:
        problems.append(f"layers {reference['layers']}, expected {expected_layers}")

    log = work / "server.log"
    server = start_server(argv_serve, log, nproc=tp)
    served: Dict[int, Dict[str, Any]] = {}
    children: List[int] = []
    run: Dict[str, Any] = {
        "mode": "served", "device": "cpu" if cpu else "cuda", "tensor_parallel": tp,
    }  # fmt: skip
    try:
        start = time.monotonic()
        if not wait_for_line(server, log, "serving on", args.startup_timeout):
            problems.append(f"the server did not report ready: {log.read_text()[-3000:]}")
            return finish(args, [], problems, run_environment())
        run["startup_seconds"] = time.monotonic() - start
        children = {pid: command_line(pid) for pid in descendants(server.pid)}
        # Bad input while it runs: the same port, and a model that is not the checkpoint's.
        for name, extra, expect in (
            ("port_in_use", [], f"--port {port}"),
            ("mismatch", ["--kv-lora-rank", "128"], "--kv-lora-rank: checkpoint 256"),
        ):
            # One process: both are found before torch.distributed starts, whatever the size.
            bad = serve_args(args, ckpt, port if name == "port_in_use" else free_port()) + extra
            problem = refused(bad, work / f"refused_{name}.log", expect)
            if problem:
                problems.append(problem)
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            tokens = list(pool.map(lambda item: request(port, item), requests))
        run["seconds"] = time.monotonic() - start
        served = {i: dict(generated_tokens=t, generated_log_probs=[]) for i, t in enumerate(tokens)}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=300)
        except subprocess.TimeoutExpired:
            code = None
            problems.append("the server did not exit within 300 s of SIGTERM")
            server.kill()
    found, _ = server_case.compare(requests, served, direct)
    problems += found
    text = log.read_text(errors="replace")
    stopped = text.count("megatron_ext.serve: stopped")
    # torchrun forwards SIGTERM to every rank and then exits 1 itself (its SignalException);
    # each rank must stop on its own, before torchrun's grace period ends in SIGKILL.
    clean = code == 0 if tp == 1 else "forcefully exiting" not in text
    if not clean or stopped != tp:
        problems.append(
            f"the server exited {code} after SIGTERM, {stopped} of {tp} ranks stopped: "
            f"{text[-1500:]}"
        )
    # A child that sees its parent gone (multiprocessing's resource tracker, say) takes a moment.
    deadline = time.monotonic() + 10.0
    left = [pid for pid in children if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pid for pid in left if alive(pid)]
    if left:
        named = "; ".join(f"{pid}: {children[pid]}" for pid in left)
        problems.append(f"processes the server started are still running 10 s after it: {named}")
    if not server_case.port_is_closed(port):
        problems.append(f"port {port} still accepts connections after the server stopped")
    order = sorted(served)
    run["generated tokens"] = [t for i in order for t in served[i]["generated_tokens"]]
    run["generated lengths"] = [len(served[i]["generated_tokens"]) for i in order]
    run.update(
        layers=reference["layers"],
        requests=len(requests),
        chat_requests=sum(r["endpoint"] == "chat" for r in requests),
        tokens_equal_engine=not found,
        server_processes=len(children),
        processes_left=len(left),
        exit_status=code,
    )
    return finish(args, [run], problems, run_environment())


def finish(
    args: argparse.Namespace, runs: List[Dict[str, Any]], problems: List[str], env: Dict[str, Any]
) -> int:
    """Write the runner's result file and print the verdict."""
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    result = {"runs": runs, "environment": env, "problems": problems}
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    for run in runs:
        print(
            f"[served, {run['device']}] layers {', '.join(run.get('layers', []))}; "
            f"{run['requests']} requests ({run['chat_requests']} chat), "
            f"{len(run['generated tokens'])} tokens in {run.get('seconds', 0):.1f} s; equal to the "
            f"engine's: {run['tokens_equal_engine']}; start-up {run.get('startup_seconds', 0):.1f}"
            f" s; exit {run['exit_status']}, {run['processes_left']} processes left"
        )
    for problem in problems:
        print("PROBLEM: " + problem)
    print("PASSED" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
