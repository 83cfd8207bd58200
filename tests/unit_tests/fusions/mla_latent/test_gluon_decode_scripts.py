# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The Gluon decode kernel's GPU tools without a GPU: ``scripts/sweep_gluon_decode.py`` and
``scripts/racecheck_mbarrier_handoff.py`` refuse to run, ``scripts/check_gluon_decode.sh`` refuses
a malformed variant before any step, ``scripts/profile_gluon_decode.py`` reads an Nsight Compute
export into its summary, ``scripts/trace_gluon_decode.py`` reads the kernel's timeline into phases
(and, on a GPU, the traced launch keeps the kernel's bits)."""

import csv
import importlib.util
import subprocess

import pytest
import torch

from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    REPO_ROOT,
    compiled_outside_interpreter,
)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_sweep_refuses_without_a_gpu(capsys):
    assert _script("sweep_gluon_decode").main(["--shapes", "2,64,64"]) == 2
    assert "needs a GPU" in capsys.readouterr().out


def test_the_sweep_refuses_a_split_count_below_one_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit):
        _script("sweep_gluon_decode").main(["--splits", "0"])
    assert "--splits must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_racecheck_handoff_probe_refuses_without_a_gpu(capsys):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    probe = _script("racecheck_mbarrier_handoff")
    assert probe.main([]) == 2
    assert probe.main(["--mma-rows", "--fence", "--third-partition"]) == 2
    assert capsys.readouterr().out.count("needs a GPU") == 2
    with pytest.raises(SystemExit):
        probe.main(["--rows"])


@pytest.mark.parametrize("variant", ["32", "32,4", ",4,1"])
def test_the_gpu_check_refuses_a_short_variant_before_running_anything(tmp_path, variant):
    done = subprocess.run(
        ["bash", "scripts/check_gluon_decode.sh", "--variant", variant, "--results", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "KT,B,ORDER" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no step ran


def test_a_variant_takes_its_defaults_sets_the_launch_layer_and_refuses_malformed_text(
    monkeypatch,
):
    from megatron_ext.fusions.mla_latent import attention_plan

    sweep = _script("sweep_gluon_decode")
    assert sweep.parse_variant("32,4,2") == dict(
        KEY_TILE=32, BUFFERS=4, ORDER=2, P_BUFFERS=1, HEADS_FIRST=False
    )
    assert sweep.parse_variant("64,2,0,2,1")["HEADS_FIRST"] is True
    for bad in ("32,4", "32,4,1,1,1,1", "a,b,c", ""):
        with pytest.raises(ValueError, match="KT,B,ORDER"):
            sweep.parse_variant(bad)
    for constant in (*sweep.PLAN_CONSTANTS, "SHARED_KEYS_RING"):  # restored after the test
        monkeypatch.setattr(attention_plan, constant, getattr(attention_plan, constant))
    sweep.apply_variant("32,3,2,2,1")
    assert [getattr(attention_plan, c) for c in sweep.PLAN_CONSTANTS] == [32, 3, 2, 2, True]
    # The variant holds at every head count: 128 heads no longer take the shared-keys ring.
    assert attention_plan.gluon_ring(128) == dict(KEY_TILE=32, BUFFERS=3, ORDER=2, P_BUFFERS=2)


def test_the_profile_summary_reads_the_last_kernel_and_ranks_the_stalls(tmp_path):
    profile = _script("profile_gluon_decode")
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = [
        "gpu__time_duration.sum",
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "launch__grid_size",
        stall.format("barrier"),
        stall.format("long_scoreboard"),
        stall.format("wait"),
    ]
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerow(["us", "%", "", "", "", ""])
        writer.writerow(["1.0", "10", "7", "9", "9", "9"])  # an earlier kernel: not read
        writer.writerow(["117.5", "41.2", "256", "3", "1", "n/a"])
    raw = profile.read_raw(str(path))
    assert raw["gpu__time_duration.sum"] == "117.5 us"
    lines = profile.summary(raw)
    text = "\n".join(lines)
    assert "117.5 us" in text and "41.2 %" in text
    assert "launch__grid_size" not in text  # not among the metrics printed
    stalls = lines[lines.index("  warp stalls (share of stalled cycles):") + 1 :]
    # Shares of the parsed stalls, largest first; a value that is not a number is left out.
    assert [line.split() for line in stalls] == [
        ["barrier", "75.0%"],
        ["long_scoreboard", "25.0%"],
    ]


def test_the_profile_compares_dram_reads_with_the_cache_bytes():
    """The bytes ncu reports read from DRAM over the step's cache bytes, whatever the unit; a
    missing or malformed figure says so instead of a number."""
    profile = _script("profile_gluon_decode")
    assert profile.byte_count("1.5 Gbyte") == 1.5e9
    assert profile.byte_count("2,048 byte") == 2048
    assert profile.byte_count("12 %") is None and profile.byte_count("") is None
    label = "DRAM bytes read / the cache bytes the step attends"
    cache = 128 * 2048 * (512 + 64) * 2  # 302 MB
    raw = {profile.DRAM_READ: f"{2 * cache / 1e6} Mbyte"}
    (line,) = [x for x in profile.summary(raw, cache) if label in x]
    assert line.split()[-1] == "2.00"
    (line,) = [x for x in profile.summary({}, cache) if label in x]
    assert line.endswith("not reported")
    assert not [x for x in profile.summary(raw) if label in x]  # no step given: no ratio


def test_the_profile_ranks_sass_instructions_by_their_stall_samples(tmp_path):
    """The source page's rows by share of all stall samples, largest first; rows whose sample
    cell is not a number are left out; an export without the sample column says so."""
    profile = _script("profile_gluon_decode")
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Address", "Source", profile.SAMPLES, "Instructions Executed"])
        writer.writerow(["", "", "", ""])  # a units row
        writer.writerow(["00a0", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", "10", "5"])
        writer.writerow(["00b0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "60", "5"])
        writer.writerow(["00c0", "MUFU.EX2 R3, R3", "30", "64"])
    lines = profile.hot_instructions(str(path), count=2)
    assert "100 stall samples" in lines[0]
    assert [line.split()[:2] for line in lines[1:]] == [["00b0", "60.0%"], ["00c0", "30.0%"]]
    assert "WARPGROUP.DEPBAR" in lines[1]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerow(["Address", "Source"])
    (line,) = profile.hot_instructions(str(path))
    assert "no 'Warp Stall Sampling (All Samples)' column" in line


# The forms compiled in a process of their own: the test session runs Triton in its interpreter
# (TRITON_INTERPRET=1 without a GPU), where Gluon kernels do not compile.
_PROBE_FORMS = [
    (m, f, t) for m in (False, True) for f, t in ((False, False), (True, False), (False, True))
]
_COMPILE_PROBE = """
import json, re, sys, tempfile
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
sys.path.insert(0, "scripts")
import racecheck_mbarrier_handoff as probe
knobs.cache.dir = tempfile.mkdtemp()
names = ("out_ptr", "ROWS", "ROUNDS", "MMA_ROWS", "FENCE", "THIRD")
patterns = dict(arrive="mbarrier[.]arrive", fence="fence[.]proxy[.]async", setmaxnreg="setmaxnreg")
out = []
for mma_rows, fence, third in json.loads(sys.argv[1]):
    constexprs = dict(
        ROWS=probe.ROWS, ROUNDS=probe.ROUNDS, MMA_ROWS=mma_rows, FENCE=fence, THIRD=third
    )
    signature = {n: "constexpr" if n in constexprs else "*fp32" for n in names}
    source = GluonASTSource(fn=probe._handoff_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out.append({k: len(re.findall(p, kernel.asm["ptx"])) for k, p in patterns.items()})
out.append(probe.ROUNDS)
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def probe_forms(tmp_path_factory):
    """Each racecheck probe form's PTX counts, compiled for sm_90a, and the probe's rounds."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    path = tmp_path_factory.mktemp("probe") / "forms.json"
    *forms, rounds = compiled_outside_interpreter(_COMPILE_PROBE, _PROBE_FORMS, path, timeout=300)
    return forms, rounds


@pytest.mark.parametrize("index", range(len(_PROBE_FORMS)), ids=[str(f) for f in _PROBE_FORMS])
def test_each_form_of_the_racecheck_probe_compiles_with_its_handoff(probe_forms, index):
    """Every form the GPU check runs under racecheck compiles for sm_90a, with one arrival a
    round in each direction and a proxy fence on each side of a round only with ``--fence``: a
    form that did not compile or lost its handoff would tell nothing on the GPU."""
    forms, rounds = probe_forms
    counts, (_, fence, _) = forms[index], _PROBE_FORMS[index]
    assert counts["arrive"] == 2 * rounds, counts
    assert counts["fence"] == (2 * rounds if fence else 0), counts
    assert counts["setmaxnreg"] > 0, counts  # warp-specialized


def _synthetic_trace(programs, tiles, step, lag):
    """A timeline where each partition's event e of tile j is at ``1000 j + step e`` (plus
    ``lag`` per partition index), each partition's own row from 0 to 10,000."""
    from megatron_ext.fusions.mla_latent import decode_gluon

    trace = torch.full(
        (programs, 3, decode_gluon.TRACE_TILES + 1, decode_gluon.TRACE_EVENTS),
        -1,
        dtype=torch.int64,
    )
    for partition in range(3):
        for j in range(tiles):
            for event in range(6):
                trace[:, partition, j, event] = 1000 * j + step * event + lag * partition
        trace[:, partition, decode_gluon.TRACE_TILES, :2] = torch.tensor([0, 10_000])
    return trace


def test_the_trace_reads_phases_and_handoffs_from_the_steady_tiles():
    """Phases are differences between a partition's stamps of one tile (the last against the
    next tile's first), handoffs between partitions at the same tile or a ring's depth later; the
    first two tiles and each program's last period are left out."""
    module = _script("trace_gluon_decode")
    trace = _synthetic_trace(programs=2, tiles=10, step=100, lag=7)
    # A slow first tile must not move the steady figures.
    trace[:, :, 0, 1:6] += 5000
    result = module.analyse(trace, buffers=2)
    phases = result["phases"]
    assert phases[("consumer 0", "softmax")]["median"] == 100
    assert phases[("consumer 0", "softmax")]["n"] == 2 * 8  # tiles 2..9 of two programs
    assert phases[("consumer 0", "rescale, values issued, next")]["median"] == 1000 - 500
    assert phases[("consumer 0", "tile period")]["n"] == 2 * 7  # tile 9 has no next
    assert (
        phases[("producer", "next (release first: the next tile's block ids)")]["median"]
        == 1000 - 200
    )
    handoffs = result["handoffs"]
    # Consumer 1's event 2 (7 cycles later) against consumer 0's event 5 of the same tile.
    assert handoffs["P handed over -> consumer 1 has it"]["median"] == 200 + 7 - 500
    # The producer's event 1 of tile j + 2 against consumer 1's event 4 of tile j.
    ring = handoffs["consumer 1 done -> producer has the buffer"]
    assert ring["median"] == 2000 + 100 + 14 - 400 - 7 and ring["n"] == 2 * 6
    assert result["partition_cycles"].eq(10_000).all()
    # Consumer 0's phases are named by its order; an order it does not stamp has its period only.
    release = module.analyse(trace, buffers=2, order=module.decode_gluon.ORDER_RELEASE_FIRST)
    assert release["phases"][("consumer 0", "key mask's block ids")]["median"] == 100
    lagged = module.analyse(trace, buffers=2, order=module.decode_gluon.ORDER_VALUES_LAG)
    assert [k for k in lagged["phases"] if k[0] == "consumer 0"] == [("consumer 0", "tile period")]


def test_the_trace_reads_a_programs_fill_drain_and_the_gaps_between_programs_on_an_sm():
    """A program's cost beyond its tiles is its span less its tiles times the steady period; the
    gaps are between programs that ran one after another on one SM (not across SMs), from the
    global timer; programs whose tiles overflow the timeline are left out."""
    from megatron_ext.fusions.mla_latent import decode_gluon

    module = _script("trace_gluon_decode")
    tiles = 10
    trace = _synthetic_trace(programs=4, tiles=tiles, step=100, lag=0)
    own = decode_gluon.TRACE_TILES
    # Spans of 10,000 cycles at 2 GHz (5,000 ns); programs 0 and 2 on SM 3, 1 and 3 on SM 5.
    starts = torch.tensor([0, 100, 5_300, 5_900])
    trace[:, :, own, 2] = torch.tensor([3, 5, 3, 5])[:, None]
    trace[:, :, own, 3] = starts[:, None]
    trace[:, :, own, 4] = starts[:, None] + 5_000
    ends = module.program_ends(trace)
    # 10 tiles of a 1,000-cycle period in a 10,000-cycle span: nothing beyond the tiles.
    assert ends["consumer 0: beyond its tiles (cycles)"]["median"] == 0
    assert ends["clock (GHz)"]["median"] == 2
    gaps = ends["gap between programs on an SM (ns)"]
    # 300 ns on SM 3 and 800 on SM 5 (torch's median takes the lower of two).
    assert gaps["n"] == 2 and gaps["median"] == 300 and gaps["p90"] == 750
    assert ends["launch span (us)"]["median"] == (5_900 + 5_000) / 1000
    assert "entry to fork (ns)" not in ends  # a timeline without them
    # Each program entered 200 ns and forked 50 ns before its partitions started (a timer that
    # starts later, so no stamp is negative).
    trace[:, :, own, 3:5] += 1_000
    trace[:, 0, own, 5] = starts + 1_000 - 200
    trace[:, 0, own, 6] = starts + 1_000 - 50
    ends = module.program_ends(trace)
    launch = ends["previous program's end to entry (ns)"]
    assert launch["n"] == 2 and sorted([launch["median"], launch["p90"]])[0] == 100
    assert ends["entry to fork (ns)"]["median"] == 150
    assert ends["fork to the partitions' start (ns)"]["median"] == 50
    # A longer span is what the program costs beyond its tiles.
    trace[:, 1, own, 1] += 2_500
    assert module.program_ends(trace)["consumer 1: beyond its tiles (cycles)"]["median"] == 2_500
    # A program that filled the timeline may have had more tiles: it is not counted.
    trace[0, :, :own, 0] = 1
    assert module.program_ends(trace)["clock (GHz)"]["n"] == 3 * 3  # programs x partitions


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_trace_refuses_without_a_gpu(capsys):
    assert _script("trace_gluon_decode").main(["--shapes", "2,64,128"]) == 2
    assert "needs a GPU" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches the kernel on a GPU")
def test_the_timeline_leaves_the_outputs_alone_and_runs_forward_in_each_partition():
    """The traced launch writes the untraced launch's bits, and within each stamped tile a
    partition's clock reads only grow (a stamp out of order would misname the phases)."""
    from megatron_ext.bench import mla_serving_cases as cases
    from megatron_ext.fusions.mla_latent import attention_plan, decode_gluon

    module = _script("trace_gluon_decode")
    step = cases.build_step(cases.decode_requests(3, 1000), 128, device="cuda")
    refused = attention_plan.gluon_decode_refusal(step.query, step.kv_cache, step.latent, 1)
    if refused is not None:
        pytest.skip(f"the Gluon decode kernel is refused here: {refused}")
    out = torch.empty_like(step.query[..., : step.latent])
    traced, plain, trace, ring = module.traced_launch(step, out)
    reference = torch.empty_like(out)
    plain(step.kv_cache, step.query, reference)
    traced(step.kv_cache, step.query, out)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), reference.view(torch.int16))
    stamps = trace.cpu()
    tiles = stamps[:, :, : decode_gluon.TRACE_TILES]
    # Consumer 0 stamps its tiles in the orders of the launcher's ring.
    stamped = (
        decode_gluon.ORDER_VALUES_FIRST,
        decode_gluon.ORDER_RELEASE_FIRST,
        decode_gluon.ORDER_SCORES_AS_THEY_LAND,
    )
    written = {0: 6, 1: 5, 2: 3} if ring["ORDER"] in stamped else {1: 5, 2: 3}
    for partition, events in written.items():
        rows = tiles[:, partition, :, :events]
        used = rows[..., 0] >= 0
        assert used.any(), f"partition {partition} stamped no tile"
        assert (rows[used] >= 0).all(), f"partition {partition} left a stamp of a tile unwritten"
        assert (rows[used].diff(dim=-1) >= 0).all(), f"partition {partition}'s clock went back"
    own = stamps[:, :, decode_gluon.TRACE_TILES, :5]
    assert (own[..., 1] >= own[..., 0]).all() and (own[..., 0] >= 0).all()
    # The SM's id, and the global timer at the start and end, for the gaps between programs.
    assert (own[..., 2] >= 0).all() and (own[..., 2] < 1024).all()
    assert (own[..., 4] >= own[..., 3]).all() and (own[..., 3] > 0).all()
    # Consumer 0's row: the program's entry, then its fork, then the partitions' starts.
    entry, fork = (
        stamps[:, 0, decode_gluon.TRACE_TILES, 5],
        stamps[:, 0, decode_gluon.TRACE_TILES, 6],
    )
    assert (
        (entry > 0).all() and (fork >= entry).all() and (own[..., 3].min(-1).values >= fork).all()
    )
    assert module.program_ends(stamps)["gap between programs on an SM (ns)"]["n"] >= 0


@pytest.mark.parametrize("name", ["trace_gluon_decode", "profile_gluon_decode"])
def test_the_trace_and_profile_refuse_a_malformed_variant_before_any_gpu_work(capsys, name):
    with pytest.raises(SystemExit):
        _script(name).main(["--variant", "64,2"])
    assert "3 to 5 integers" in capsys.readouterr().err
