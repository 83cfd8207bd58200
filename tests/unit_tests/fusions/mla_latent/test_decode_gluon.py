# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the warp-specialized decode kernel that run without a GPU
(megatron_ext.fusions.mla_latent.decode_gluon and its choice in attention_plan).

Gluon kernels do not run in Triton's interpreter, so CI cannot run this kernel. What it can check
is the code the installed Triton compiles for sm_90a (as ``scripts/mla_latent_attention_code.py``
prints it): each score tile's MMAs issued once, the value columns split over two warpgroups, no
register spills, the shared memory within a Hopper block's, the barrier counts the partitions'
arrivals meet, and the register budget of the three partitions within the register file (an
over-budget ``setmaxnreg.inc`` waits forever). The kernel's results are checked on the GPU
(test_decode_gluon_gpu.py, the sanitizer driver); the choice between it and stage 1, and the
split-count rule it uses, here.
"""

import re
from collections import Counter

import pytest
import torch

from megatron_ext.fusions.mla_latent import attention_plan, decode_gluon, tile_rules
from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    compiled_outside_interpreter,
)

NEEDS_GLUON = pytest.mark.skipif(
    decode_gluon.GLUON_IMPORT_ERROR is not None or tile_rules.TRITON_RELEASE < (3, 7),
    reason=f"the installed Triton has no Gluon Hopper API: {decode_gluon.GLUON_IMPORT_ERROR}",
)
# What an H100 or H200 block may opt into.
HOPPER_SHARED_MEMORY = 232448


# The compile runs in a process of its own: the test session runs Triton in its interpreter
# (TRITON_INTERPRET=1, set before Triton was imported), where Gluon kernels do not compile.
_COMPILE = """
import json, sys, tempfile
from triton import knobs
sys.path.insert(0, "scripts")
import mla_latent_attention_code as code
# Compiled anew (a cached kernel has no ptxas log), into a cache of its own.
knobs.nvidia.dump_ptxas_log = True
knobs.compilation.always_compile = True
knobs.cache.dir = tempfile.mkdtemp()
out = []
for variant in json.loads(sys.argv[1]):
    variant = dict(variant)
    dtype, splits = variant.pop("dtype", "bf16"), variant.pop("splits", 1)
    launch = code.gluon_launch("gluon", dtype, splits, **variant)
    out.append(code.compile_launch(launch, None))
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The kernel compiled for sm_90a in each of VARIANTS (index -> TTGIR, PTX, ptxas log and
    shared memory), by ``scripts/mla_latent_attention_code.py``'s functions."""
    path = tmp_path_factory.mktemp("gluon") / "compiled.json"
    return compiled_outside_interpreter(_COMPILE, VARIANTS, path, timeout=600)


def _instructions(pattern: str, ptx: str) -> Counter:
    return Counter(re.findall(pattern, ptx))


VARIANTS = [
    dict(),
    dict(dtype="fp16"),
    dict(splits=4),
    dict(block_size=1),
    dict(block_size=37),
    dict(block_size=128, two_operands=True),
    dict(large_scale=True, splits=3),
    # The ring's other shapes, consumer 0's other orders and the other program order, as the
    # launcher may choose them.
    dict(order=decode_gluon.ORDER_VALUES_FIRST),
    dict(order=decode_gluon.ORDER_VALUES_LAG, block_size=1),
    dict(order=decode_gluon.ORDER_SCORES_AHEAD, splits=2),
    dict(order=decode_gluon.ORDER_SCORES_AHEAD, p_buffers=2, block_size=37),
    dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_VALUES_FIRST, splits=2),
    dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_VALUES_FIRST, block_size=37),
    dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_VALUES_LAG, block_size=37),
    dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_RELEASE_FIRST, splits=2),
    dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_SCORES_AS_THEY_LAND, splits=2),
    dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_SCORES_AS_THEY_LAND, block_size=37),
    dict(order=decode_gluon.ORDER_SCORES_AHEAD, buffers=3, p_buffers=2),
    dict(p_buffers=3 - decode_gluon.P_BUFFERS, splits=2),
    dict(heads_first=not decode_gluon.HEADS_FIRST),
    # The timeline (scripts/trace_gluon_decode.py) on the launcher's ring.
    dict(
        key_tile=decode_gluon.SHARED_KEY_TILE,
        buffers=decode_gluon.SHARED_BUFFERS,
        order=decode_gluon.SHARED_ORDER,
        trace=True,
    ),
]
# The ring the launcher takes (attention_plan.gluon_ring), as VARIANTS name it.
SHARED_RING = dict(
    key_tile=decode_gluon.SHARED_KEY_TILE,
    buffers=decode_gluon.SHARED_BUFFERS,
    order=decode_gluon.SHARED_ORDER,
)
# Copies of a tile's MMAs in consumer 0's code, by order: the lagged order issues the first
# tile's scores and the last tile's value product outside its loop; scores ahead also the first
# tile's scores and the last tile's softmax and value product.
_MMA_COPIES = {0: (1, 1), 1: (2, 2), 2: (2, 2), 3: (1, 1), 4: (1, 1)}


def _of_order(order: int):
    """Parametrize ``index`` over the VARIANTS compiled with consumer 0's ``order``."""
    indices = [i for i, v in enumerate(VARIANTS) if v.get("order") == order]
    return pytest.mark.parametrize(
        "index",
        indices,
        ids=["-".join(f"{k}={VARIANTS[i][k]}" for k in VARIANTS[i]) for i in indices],
    )


@NEEDS_GLUON
@pytest.mark.parametrize(
    "index", range(len(VARIANTS)), ids=["-".join(f"{k}={v[k]}" for k in v) for v in VARIANTS]
)
def test_each_score_tile_is_computed_once_and_nothing_spills(compiled, index):
    """Per key tile of N keys: (512 + 64) / 16 = 36 m64nNk16 score MMAs (one warpgroup, not two)
    and N / 16 m64n256k16 value MMAs in each warpgroup (its half of the 512 columns); N x 576 /
    (8 x 128) 16-byte copies per producer thread, and the query's 64 x 576 / (8 x 128) once; no
    spills. Where consumer 0 issues a tile's value product behind the next tile's scores, the
    first tile's scores and the last tile's value product are issued outside the loop, so its
    code holds them twice. The spill check
    holds the launcher's own rings and schedules (under Triton 3.9, a few bytes where a page
    splits a key tile); the others (which the sweep script times) may
    spill a few bytes under some ptxas releases, and are compiled to keep them buildable."""
    variant, code = VARIANTS[index], compiled[index]
    key_tile = variant.get("key_tile", decode_gluon.KEY_TILE)
    scores, values = _MMA_COPIES[variant.get("order", decode_gluon.ORDER)]
    ptx = code["ptx"]
    mma = _instructions(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)
    assert mma == {
        f"m64n{key_tile}k16": 36 * scores,
        "m64n256k16": (1 + values) * key_tile // 16,
    }, mma
    copy = r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10"
    # A key tile's rows in the loop and the 64 query rows once before it.
    assert len(re.findall(copy, ptx)) == (key_tile + 64) * 576 // (8 * 128)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", code["log"])
    assert spills is not None, code["log"][-2000:]
    ring = {k: variant[k] for k in ("key_tile", "buffers", "order", "p_buffers") if k in variant}
    if not ring or ring == SHARED_RING:
        stores, loads = (int(n) for n in spills.groups())
        if variant.get("block_size", 64) % key_tile and tile_rules.TRITON_RELEASE >= (3, 9):
            # Pages that split a key tile (per-key block ids) leave consumer 0 at its 256
            # registers; Triton 3.9's code for the handoff's layout conversion spills a few
            # bytes there (none under 3.7).
            assert stores <= 16 and loads <= 64, code["log"][-2000:]
        else:
            assert (stores, loads) == (0, 0), code["log"][-2000:]


@NEEDS_GLUON
@_of_order(decode_gluon.ORDER_VALUES_FIRST)
def test_values_first_releases_a_key_tile_while_the_next_scores_run(compiled, index):
    """In the values-first order consumer 0 waits for the previous value product with the score
    product's groups still pending and then releases that tile's buffer. The wait is right only if
    the score product is exactly its _SCORE_GROUPS commit groups, issued after the value product:
    with fewer, the buffer would go back while the value product still reads it."""
    key_tile = VARIANTS[index].get("key_tile", decode_gluon.KEY_TILE)
    groups = decode_gluon._SCORE_GROUPS.value
    ptx = compiled[index]["ptx"]
    waits = [m.start() for m in re.finditer(rf"wgmma\.wait_group\.sync\.aligned {groups};", ptx)]
    assert len(waits) == 1, f"{len(waits)} waits with {groups} groups pending"
    before = ptx[: waits[0]]
    # The score product's MMAs and commits since the last value product.
    since = before[before.rindex("m64n256k16") :] if "m64n256k16" in before else before
    start = since.index(f"m64n{key_tile}k16")
    assert since.count("wgmma.commit_group", start) == groups
    assert len(re.findall(rf"m64n{key_tile}k16", since)) == 36
    after = ptx[waits[0] :]
    # The buffer's release comes before any other wait for the MMAs.
    assert after.index("mbarrier.arrive") < after.index("wgmma.wait_group", 1)


def _releases_after_full_waits(ptx: str) -> int:
    """Places where a full MMA wait is directly followed by a barrier arrival (a buffer or P
    released once every product reading it is done)."""
    ops = re.findall(r"wgmma\.wait_group\.sync\.aligned \d+;|mbarrier\.\w+", ptx)
    return sum(a.endswith(" 0;") and b == "mbarrier.arrive" for a, b in zip(ops, ops[1:]))


@NEEDS_GLUON
def test_release_first_frees_a_key_tile_after_a_full_wait_not_behind_the_scores(compiled):
    """Release first against values first, the same ring otherwise: no wait leaves the score
    product pending (values first frees a tile behind the next tile's scores, so after that tile
    has landed), and consumer 0's loop has one more release after a full wait (the previous
    value product alone in flight, before the next tile is waited for)."""
    same = dict(key_tile=64, buffers=2, splits=2)
    first = VARIANTS.index(dict(same, order=decode_gluon.ORDER_VALUES_FIRST))
    release = VARIANTS.index(dict(same, order=decode_gluon.ORDER_RELEASE_FIRST))
    partial = rf"wgmma\.wait_group\.sync\.aligned {decode_gluon._SCORE_GROUPS.value};"
    assert re.search(partial, compiled[first]["ptx"])
    assert not re.search(partial, compiled[release]["ptx"])
    assert _releases_after_full_waits(compiled[release]["ptx"]) == (
        _releases_after_full_waits(compiled[first]["ptx"]) + 1
    )


def _producer_code(ptx: str) -> str:
    """The producer partition's PTX: from its register share (``setmaxnreg.dec``) to the next
    ``setmaxnreg``."""
    share = re.search(
        rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{int(decode_gluon.PRODUCER_REGS)};", ptx
    )
    end = ptx.find("setmaxnreg", share.end())
    return ptx[share.end() : end if end >= 0 else len(ptx)]


_LATE_IDS = [VARIANTS.index(dict()), VARIANTS.index(dict(block_size=37))]
_EARLY_IDS = [
    VARIANTS.index(dict(SHARED_RING, splits=2)),
    VARIANTS.index(
        dict(key_tile=64, buffers=2, order=decode_gluon.ORDER_SCORES_AS_THEY_LAND, block_size=37)
    ),
]


@NEEDS_GLUON
@pytest.mark.parametrize(
    "index",
    _LATE_IDS + _EARLY_IDS,
    ids=["values_lag", "values_lag-block_size=37", "release_first", "as_they_land-block_size=37"],
)
def test_release_first_loads_a_tiles_block_ids_before_waiting_for_its_buffer(compiled, index):
    """Under release first (and scores as they land) each tile's block ids are loaded a tile
    ahead: the producer's wait for a free buffer is followed by the tile's copies with no load
    between them, and the next tile's ids are loaded after its copies are issued, so their
    latency passes while the producer waits; the first tile's are loaded before the query's
    copies, not behind them. The other orders load them after the wait."""
    ops = re.findall(
        r"mbarrier\.try_wait|ld\.global|cp\.async\.cg|cp\.async\.mbarrier\.arrive",
        _producer_code(compiled[index]["ptx"]),
    )
    letter = {"mbarrier.try_wait": "W", "ld.global": "l", "cp.async.cg": "c"}
    text = "".join(letter.get(op, "a") for op in ops)
    # Ahead: the first tile's ids, the query's copies and arrival, then in the loop the wait,
    # the tile's copies and arrivals (as they land: one per 64 columns and the tile's) and the
    # next tile's ids. Otherwise the query's copies and arrival, then in the loop the wait, the
    # tile's ids, its copies and arrival.
    if index in _EARLY_IDS:
        assert re.fullmatch(r"l+c+aW(?:c+a)+a?l+", text), text
    else:
        assert re.fullmatch(r"c+aWl+c+a", text), text


# One split of 64-key tiles: the output goes out through a key buffer (the kernel's STAGED).
_STAGED = [
    i
    for i, v in enumerate(VARIANTS)
    if v.get("key_tile") == 64 and v.get("splits", 1) == 1 and v.get("dtype", "bf16") == "bf16"
]


@NEEDS_GLUON
@pytest.mark.parametrize("index", _STAGED + _LATE_IDS)
def test_the_output_goes_out_in_whole_rows_through_a_key_buffer(compiled, index):
    """With one split and 64-key tiles each consumer writes its 64 x 256 bf16 half of the output
    into a key buffer no MMA reads any more and stores it from there in 16-byte pieces of whole
    rows (16 a thread), not in the 4-byte pieces of the accumulator's layout (64 a thread, half a
    sector a quad), which took about 10,000 cycles at the end of a wave on an H200. The 32-key
    ring (buffers of 32 rows) keeps the accumulator's stores."""
    ptx = compiled[index]["ptx"]
    stores = _instructions(r"st\.global(?:\.v\d)?\.b\d+", ptx)
    staged_reads = _instructions(r"ld\.shared\.v4\.b32", ptx)["ld.shared.v4.b32"]
    if index in _STAGED:
        assert stores["st.global.b32"] == 0 and staged_reads == 2 * 16, (stores, staged_reads)
    else:
        assert stores["st.global.b32"] == 2 * 64 and staged_reads == 0, (stores, staged_reads)


@NEEDS_GLUON
@_of_order(decode_gluon.ORDER_SCORES_AS_THEY_LAND)
def test_scores_as_they_land_wait_for_each_64_columns_alone(compiled, index):
    """The producer arrives on a barrier of each 64 columns right after their copies (cp.async's
    arrival fires once the thread's copies so far have landed) and on the whole tile's after
    the last; consumer 0 issues each 64 columns' four k-steps right after waiting for their
    barrier, 36 score MMAs in nine runs. A run before its wait would read columns still in
    flight; one wait for all would be release first."""
    ptx = compiled[index]["ptx"]
    chunks = (512 + 64) // 64
    copies = re.findall(r"cp\.async\.cg\.shared\.global|cp\.async\.mbarrier\.arrive\.noinc", ptx)
    arrivals = [i for i, op in enumerate(copies) if op.endswith("noinc")]
    # The query's 36 copies and its arrival, then per 64 columns 4 copies and an arrival, and
    # the whole tile's arrival after the last.
    assert len(arrivals) == 1 + chunks + 1
    assert arrivals[0] == 36 and all(b - a == 5 for a, b in zip(arrivals[1:-2], arrivals[2:-1]))
    assert arrivals[-1] == arrivals[-2] + 1
    ops = re.findall(r"mbarrier\.try_wait|wgmma\.mma_async\.sync\.aligned\.m64n64k16", ptx)
    runs = re.findall(r"W(S+)", "".join("W" if op.startswith("mbarrier") else "S" for op in ops))
    assert [len(r) for r in runs] == [4] * chunks, runs
    inits = Counter(
        int(n) for n in re.findall(r"mbarrier\.init\.shared[\w:.]*\s+\[[^]]+\],\s*(\d+)", ptx)
    )
    assert inits[decode_gluon.PARTITION_WARPS * 32] == 2 * chunks + 2 + 1  # chunks, tiles, query


@NEEDS_GLUON
def test_the_timeline_is_compiled_out_unless_asked_for(compiled):
    """Only a launch given a timeline reads the SM clock: every ring the plan launches compiles
    the stamps out (the plan passes ``trace_ptr=None``), so tracing costs them nothing. The
    traced kernel stamps each partition's tiles (consumer 0 at six points of the values-first
    loop, consumer 1 at five, the producer at three, each partition's start and end)."""
    for variant, code in zip(VARIANTS, compiled):
        reads = code["ptx"].count("%clock64")
        if variant.get("trace"):
            # Each stamp reads the clock once per element of its operand a thread holds (two
            # rows of the MMA layout in the consumers).
            assert reads >= 6 + 5 + 3 + 3 * 2, reads
        else:
            assert reads == 0, (variant, reads)


@NEEDS_GLUON
def test_shared_memory_fits_a_hopper_block_and_the_plan_bound(compiled):
    """The compiler's figure is within what the plan checks against the device, which is within
    an H100/H200 block's, for every ring the kernel compiles with."""
    for variant, code in zip(VARIANTS, compiled):
        bound = decode_gluon.gluon_shared_memory(
            512,
            64,
            variant.get("key_tile", decode_gluon.KEY_TILE),
            variant.get("buffers", decode_gluon.NUM_BUFFERS),
            variant.get("p_buffers", decode_gluon.P_BUFFERS),
        )
        assert int(code["shared"]) <= bound <= HOPPER_SHARED_MEMORY, (variant, code["shared"])


@NEEDS_GLUON
def test_barrier_counts_match_the_partitions_arrivals(compiled):
    """kv_ready and q_ready expect one asynchronous arrival per producer thread (each thread's
    cp.async.mbarrier.arrive.noinc), kv_free one per consumer warpgroup, P's two (which also
    hand over the final row sums) one; a count that the arrivals never meet hangs the kernel."""
    ptx = compiled[0]["ptx"]
    inits = Counter(
        int(n) for n in re.findall(r"mbarrier\.init\.shared[\w:.]*\s+\[[^]]+\],\s*(\d+)", ptx)
    )
    producer_threads = decode_gluon.PARTITION_WARPS * 32
    buffers, p_buffers = decode_gluon.NUM_BUFFERS, decode_gluon.P_BUFFERS
    assert inits == {producer_threads: buffers + 1, 2: buffers, 1: 2 * p_buffers}, inits
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 2
    # P and the copies are written through the generic proxy and read by wgmma through the
    # asynchronous one: a proxy fence orders them.
    assert "fence.proxy.async" in ptx


@NEEDS_GLUON
def test_partition_registers_fit_the_register_file(compiled):
    """The partitions' register shares were applied (setmaxnreg to each), and the three fit 64 Ki
    registers over 3 x 128 threads: an over-budget ``setmaxnreg.inc`` would wait forever. The
    default partition takes what the workers leave of the kernel's ``.maxnreg`` per warpgroup."""
    ptx = compiled[0]["ptx"]
    values = [
        int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    ]
    assert values and all(v % 8 == 0 and 24 <= v <= 256 for v in values), values
    maxnreg = int(re.search(r"\.maxnreg\s+(\d+)", ptx).group(1))
    consumer, producer = int(decode_gluon.CONSUMER_REGS), int(decode_gluon.PRODUCER_REGS)
    default = (3 * maxnreg - consumer - producer) // 8 * 8
    assert {consumer, producer, default} <= set(values), (values, maxnreg)
    assert (default + consumer + producer) * 128 <= 64 * 1024


def test_wave_split_rule_fills_the_last_wave():
    rule = tile_rules.wave_num_kv_splits
    assert rule(192, 132, 4096) == 2  # 2 waves of whole programs, 1.5 of halves
    assert rule(64, 132, 4096) == 2  # one wave either way: the fewer splits
    assert rule(32, 132, 8192) == 4
    assert rule(128, 132, 1024) == 1  # the device is full
    # 4 waves of whole programs: 7 of halves save a quarter of a wave's keys, not their fixed
    # costs and partials.
    assert rule(400, 132, 1024) == 1
    assert rule(1, 132, 1024) == 1024 // tile_rules.MIN_KEYS_PER_SPLIT  # rows per split bound
    assert rule(1, 132, 10**6) <= tile_rules.MAX_KV_SPLITS
    for programs in range(1, 400, 7):
        for context in (256, 3000, 32768):
            s = rule(programs, 132, context)
            assert 1 <= s <= max(1, context // tile_rules.MIN_KEYS_PER_SPLIT)


def _call(
    heads=128,
    dtype=torch.bfloat16,
    latent=512,
    rope=64,
    device="cpu",
    misaligned=False,
    query_misaligned=False,
):
    query = torch.empty(4 * heads * (latent + rope) + 8, dtype=dtype, device=device)
    # Eight elements in (16 bytes): aligned; one: a query whose rows cannot be copied 16 bytes at
    # a time.
    query = query[1 if query_misaligned else 8 :][: 4 * heads * (latent + rope)]
    cache = torch.empty(8 * 64 * (latent + rope) + 1, dtype=dtype, device=device)
    # One element in: a cache whose rows cannot be copied 16 bytes at a time.
    cache = cache[1:] if misaligned else cache[:-1]
    return query.view(4, heads, latent + rope), cache.view(8, 64, latent + rope)


def test_the_switch_off_refuses_the_kernel_with_its_name(monkeypatch):
    monkeypatch.setattr(attention_plan, "GLUON_DECODE", False)
    query, cache = _call()
    reason = attention_plan.gluon_decode_refusal(query, cache, 512, 1)
    assert reason == f"off ({attention_plan.GLUON_DECODE_ENV}=off)"


def test_the_kernel_is_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv(attention_plan.GLUON_DECODE_ENV, raising=False)
    assert attention_plan.gluon_decode_enabled() is True
    monkeypatch.setenv(attention_plan.GLUON_DECODE_ENV, "off")
    assert attention_plan.gluon_decode_enabled() is False


def test_the_ring_refuses_a_head_count_that_is_not_a_positive_int():
    with pytest.raises(TypeError, match="heads must be an int, got str"):
        attention_plan.gluon_ring("128")
    with pytest.raises(TypeError, match="heads must be an int, got bool"):
        attention_plan.gluon_ring(True)
    with pytest.raises(ValueError, match="heads"):
        attention_plan.gluon_ring(0)


@pytest.mark.parametrize("heads", [32, 40, 64, 65, 128, 256])
def test_every_head_count_takes_the_ring_of_two_64_key_tiles(heads, monkeypatch):
    """The launcher's ring at every head count: two 64-key tiles, release first (the 32-key ring
    only where a tool turns it off). Both fit a Hopper block at DeepSeek-V3's widths."""
    ring = attention_plan.gluon_ring(heads)
    assert ring == dict(KEY_TILE=64, BUFFERS=2, ORDER=decode_gluon.ORDER_RELEASE_FIRST, P_BUFFERS=1)
    monkeypatch.setattr(attention_plan, "SHARED_KEYS_RING", False)
    small = attention_plan.gluon_ring(heads)
    assert small == dict(
        KEY_TILE=decode_gluon.KEY_TILE,
        BUFFERS=decode_gluon.NUM_BUFFERS,
        ORDER=decode_gluon.ORDER,
        P_BUFFERS=decode_gluon.P_BUFFERS,
    )
    for r in (ring, small):
        memory = decode_gluon.gluon_shared_memory(
            512, 64, r["KEY_TILE"], r["BUFFERS"], r["P_BUFFERS"]
        )
        assert memory <= HOPPER_SHARED_MEMORY


@pytest.mark.parametrize(
    "case, expected",
    [
        (dict(max_query_len=None), "not a decode step"),
        (dict(max_query_len=2), "not a decode step"),
        (dict(dtype=torch.float32), "16-bit"),
        (dict(heads=16), "16 heads"),
        (dict(latent=64), "widths"),
        (dict(rope=32), "widths"),
        (dict(misaligned=True), "a cache at byte 2 of 16"),
        (dict(query_misaligned=True), "a query at byte 2 of 16"),
        (dict(), "device cpu"),
    ],
)
def test_refusal_names_the_reason(monkeypatch, case, expected):
    monkeypatch.setattr(attention_plan, "GLUON_DECODE", True)
    max_query_len = case.pop("max_query_len", 1)
    query, cache = _call(**case)
    reason = attention_plan.gluon_decode_refusal(
        query, cache, case.get("latent", 512), max_query_len
    )
    if decode_gluon.GLUON_IMPORT_ERROR is not None or tile_rules.TRITON_RELEASE < (3, 7):
        assert "Gluon" in reason
    else:
        assert expected in reason, reason


def test_the_switch_takes_on_and_off_only():
    assert attention_plan.gluon_decode_enabled("on") is True
    assert attention_plan.gluon_decode_enabled("off") is False
    with pytest.raises(ValueError, match=attention_plan.GLUON_DECODE_ENV):
        attention_plan.gluon_decode_enabled("1")


def test_a_refused_call_plans_stage_1(monkeypatch):
    """Where the kernel is refused (here: the CPU), the plan is stage 1's, with its own split
    rule, even with the switch on."""
    from megatron_ext.fusions.mla_latent import attention
    from tests.unit_tests.fusions.mla_latent_cache_testlib import build_step, fresh_plan_caches

    monkeypatch.setattr(attention_plan, "GLUON_DECODE", True)
    fresh_plan_caches(monkeypatch)
    step = build_step([(5, 1), (9, 1)], heads=32, latent_dim=32, rope_dim=16)
    attention.mla_paged_latent_attention(
        step.query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        0.1,
        rope_dim=16,
        max_query_len=1,
    )
    plans = attention.ATTENTION_PLANS.plans()
    assert plans and all(plan.kernel == "stage1" for plan in plans)


@pytest.mark.skipif(
    decode_gluon.GLUON_IMPORT_ERROR is not None or tile_rules.TRITON_RELEASE < (3, 7),
    reason="without Gluon every call is refused for the Triton release first",
)
@pytest.mark.parametrize("offset, stride", [(1, 64), (0, 72)])
def test_refusal_names_a_rope_operand_its_rows_cannot_copy(monkeypatch, offset, stride):
    """The query's RoPE part as its own operand is copied as the query is: one at an odd byte
    or with a head stride that is not a multiple of 16 is refused, by name."""
    monkeypatch.setattr(attention_plan, "GLUON_DECODE", True)
    query, cache = _call()
    rope = torch.empty(4 * 128 * stride + offset, dtype=query.dtype)[offset:]
    rope = rope.as_strided((4, 128, 64), (128 * stride, stride, 1))
    reason = attention_plan.gluon_decode_refusal(query, cache, 512, 1, query_rope=rope)
    assert "a query_rope at byte" in reason and "strides" in reason, reason
    aligned = torch.empty(4, 128, 64, dtype=query.dtype)
    reason = attention_plan.gluon_decode_refusal(query, cache, 512, 1, query_rope=aligned)
    assert "device cpu" in reason, reason


def test_refusal_refuses_what_is_not_a_tensor():
    query, cache = _call()
    with pytest.raises(TypeError, match="kv_cache must be a torch.Tensor, got list"):
        attention_plan.gluon_decode_refusal(query, [0], 512, 1)
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got NoneType"):
        attention_plan.gluon_decode_refusal(None, cache, 512, 1)
    with pytest.raises(TypeError, match="query_rope must be a torch.Tensor or None, got tuple"):
        attention_plan.gluon_decode_refusal(query, cache, 512, 1, query_rope=(1, 2))


@NEEDS_GLUON
@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("tokens", [3, 65536])
def test_the_plan_orders_the_grid_as_the_kernel_reads_it(monkeypatch, heads_first, tokens):
    """Head groups on the first axis with HEADS_FIRST, tokens otherwise, and tokens first past
    what the second axis holds; the kernel's constexpr says which (a plan is only built here:
    nothing runs)."""
    monkeypatch.setattr(attention_plan, "HEADS_FIRST", heads_first)
    heads, width = 128, 576
    # A step of many tokens without their memory: every token reads the same query row.
    query = torch.zeros(1, heads, width, dtype=torch.bfloat16).expand(tokens, heads, width)
    cache = torch.zeros(4, 64, width, dtype=torch.bfloat16)
    plan = attention_plan.LatentAttentionPlan(
        query,
        cache,
        torch.zeros(2, 4, dtype=torch.int32),
        torch.tensor([0, 1, tokens], dtype=torch.int32),
        torch.ones(2, dtype=torch.int32),
        0.1,
        torch.zeros(1, heads, 512, dtype=torch.bfloat16).expand(tokens, heads, 512),
        latent_dim=512,
        tile=tile_rules.TileShape(1, 64, 32, 8),
        num_kv_splits=3,
        num_stages=1,
        gluon=True,
    )
    first = heads_first and tokens <= 65535
    assert plan.stage1.args["HEADS_FIRST"] is first
    # 128 heads: the ring of a token's shared key tiles.
    ring = {name: plan.stage1.args[name] for name in ("KEY_TILE", "BUFFERS", "ORDER", "P_BUFFERS")}
    assert ring == attention_plan.gluon_ring(heads) and ring["KEY_TILE"] == 64
    assert plan.stage1.grid == ((2, tokens, 3) if first else (tokens, 2, 3))
