#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Functional case: train an MLA GPT with megatron.training, save it, serve it with one command.

1. ``pretrain`` (the script of ``mla_rope_contiguous_load_megatron_training``, its command line in
   float32) trains a small DeepSeek-shaped MLA GPT for a few iterations and saves a ``torch_dist``
   checkpoint.
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

Standalone::

    python tests/functional_tests/test_cases/gpt/mla_serve_checkpoint/run_case.py --output-json OUT

Needs a GPU (megatron.training's ``pretrain`` requires CUDA), megatron-core 0.19 with
megatron.training, and the ``server`` extra's quart, hypercorn, pyzmq and msgpack.
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

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[4]
TRAINING_CASE = HERE.parent / "mla_rope_contiguous_load_megatron_training"
SERVER_CASE = HERE.parent / "mla_dynamic_server"
HOST = "127.0.0.1"
# Training-only flags of the training case's command line left out here: float32 keeps the
# greedy choices of the served and the direct run (batched differently) away from ties.
DROPPED = {"--bf16"}


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
    p.add_argument("--child", choices=["train", "reference"], help=argparse.SUPPRESS)
    p.add_argument("--child-args", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_args(args: argparse.Namespace) -> List[str]:
    """The training run's command line (the training case's, in float32), which the server takes
    unchanged: a training command line's model flags carry over."""
    training = _load(TRAINING_CASE / "run_case.py", "mla_training_case")
    flags = [a for a in training.MEGATRON_ARGS if a not in DROPPED]
    return flags + ["--seed", str(args.seed)] + list(args.extra_model_args)


def serve_args(args: argparse.Namespace, ckpt: Path, port: int) -> List[str]:
    """``megatron_ext.serve``'s command line for the case (explicit cache sizes, so that the
    direct run builds the same context)."""
    return model_args(args) + [
        "--load", str(ckpt), "--port", str(port), "--max-requests", "16",
        "--max-sequence-length", "256", "--max-tokens", "256", "--block-size-tokens", "16",
        "--buffer-size-gb", "0.25", "--frontend-replicas", "2",
    ]  # fmt: skip


def child_env(port: Optional[int] = None) -> Dict[str, str]:
    """One process's torch.distributed environment, the repository first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
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


def _child_reference(spec: Dict[str, Any], output: Path) -> None:
    """The engine's own tokens for the requests: the model built and loaded as the server builds
    it, run by megatron-core's ``MegatronLLM`` in direct mode (no coordinator, no server)."""
    from megatron.core.inference.apis import MegatronLLM
    from megatron.training.global_vars import get_tokenizer

    from megatron_ext import serve
    from megatron_ext.testing.synthetic import run_engine

    server_case = _load(SERVER_CASE / "run_case.py", "mla_server_case")
    args = serve.parse_serve_args(spec["argv"])
    serve.init_distributed(args)
    model = serve.build_model(args)
    llm = MegatronLLM(
        model=model,
        tokenizer=get_tokenizer(),
        inference_config=serve.inference_config(args, model),
        use_coordinator=False,
    )
    work = [
        (r["prompt"], server_case.engine_sampling_params(r["max_tokens"])) for r in spec["requests"]
    ]
    outputs, _ = run_engine(llm.engine, work)
    output.write_text(json.dumps({str(k): v for k, v in outputs.items()}, default=float))


def run_child(kind: str, payload: Any, work: Path, timeout: float) -> Tuple[int, str]:
    """Run this script as ``--child kind`` with ``payload`` (JSON), in its own process."""
    spec = work / f"{kind}.args.json"
    spec.write_text(json.dumps(payload))
    out = work / f"{kind}.out.json"
    from megatron_ext.testing.network import free_port

    command = [sys.executable, __file__, "--child", kind, "--child-args", str(spec),
               "--output-json", str(out)]  # fmt: skip
    log = work / f"{kind}.log"
    with log.open("w") as sink:
        code = subprocess.call(
            command, env=child_env(free_port()), stdout=sink, stderr=subprocess.STDOUT,
            timeout=timeout,
        )  # fmt: skip
    return code, log.read_text()[-3000:]


def start_server(argv: List[str], log: Path) -> subprocess.Popen:
    """``python -m megatron_ext.serve ARGV`` in its own process (its output to ``log``)."""
    sink = log.open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_ext.serve", *argv],
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
    code, tail = run_child("train", train_argv, work, timeout=900)
    if code != 0 or not (ckpt / "latest_checkpointed_iteration.txt").is_file():
        problems.append(f"pretraining exited {code} without a checkpoint: {tail}")
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
    argv_serve = serve_args(args, ckpt, port)
    code, tail = run_child("reference", {"argv": argv_serve, "requests": requests}, work, 900)
    reference_path = work / "reference.out.json"
    if code != 0 or not reference_path.is_file():
        problems.append(f"the direct engine run exited {code}: {tail}")
        return finish(args, [], problems, run_environment())
    direct = {int(k): v for k, v in json.loads(reference_path.read_text()).items()}

    log = work / "server.log"
    server = start_server(argv_serve, log)
    served: Dict[int, Dict[str, Any]] = {}
    children: List[int] = []
    run: Dict[str, Any] = {"mode": "served"}
    try:
        start = time.monotonic()
        if not wait_for_line(server, log, "serving on", args.startup_timeout):
            problems.append(f"the server did not report ready: {log.read_text()[-3000:]}")
            return finish(args, [], problems, run_environment())
        run["startup_seconds"] = time.monotonic() - start
        children = descendants(server.pid)
        # Bad input while it runs: the same port, and a model that is not the checkpoint's.
        for name, extra, expect in (
            ("port_in_use", [], f"--port {port}"),
            ("mismatch", ["--kv-lora-rank", "128"], "--kv-lora-rank: checkpoint 256"),
        ):
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
    if code != 0 or "megatron_ext.serve: stopped" not in text:
        problems.append(f"the server exited {code} after SIGTERM: {text[-1500:]}")
    left = [pid for pid in children if alive(pid)]
    if left:
        problems.append(f"processes the server started are still running: {left}")
    if not server_case.port_is_closed(port):
        problems.append(f"port {port} still accepts connections after the server stopped")
    order = sorted(served)
    run["generated tokens"] = [t for i in order for t in served[i]["generated_tokens"]]
    run["generated lengths"] = [len(served[i]["generated_tokens"]) for i in order]
    run.update(
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
            f"[served] {run['requests']} requests ({run['chat_requests']} chat), "
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
