"""The benchmark's plumbing without a GPU: the CPU case runs end to end, and
every per-layer case prepares and runs on small shapes (torch CPU tensors,
the library's numba path; the Triton ports need a GPU)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_cupy.bench import layers

SMALL = {"swa": [dict(decodes=6, query_len=2), dict(decodes=0, prefill=40)],
         "global_topk": [dict(tokens=5, width=300)], "short_fill": [dict(tokens=7, top_k=64)],
         "combine": [dict(tokens=20, topk=layers.C128A_WIDTH), dict(tokens=20, topk=64),
                     dict(tokens=20, topk=0)],
         "c4a_layer": [dict(decodes=4, prefill=30)], "c128a_combined": [dict(tokens=20, topk=256)],
         "gather_lens": [dict(prefills=5)], "indexer_prefill": [dict(tokens=30)],
         "indexer_decode": [dict(tokens=9)], "indexer_native": [dict(decodes=5, depth=3)],
         "swa_image": [dict(prefill=200, images=True), dict(prefill=200, images=False)],
         "image_visibility": [dict(prefill=200)]}


def test_cpu_only_bench_runs(tmp_path):
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "bench", "--cpu-only",
                          "--no-progress", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "CPU c128a, 16384 tokens" in run.stdout and (tmp_path / "bench.json").exists()


def test_every_layer_case_prepares_and_runs_on_small_shapes(monkeypatch):
    torch = pytest.importorskip("torch")
    import numpy as np
    monkeypatch.setattr(layers, "MAX_MODEL_LEN", 1 << 14)
    monkeypatch.setattr(layers, "MAX_IMAGE_TOKENS", 8)
    assert {op for op, _, _ in layers.layer_cases(False)} == set(SMALL)
    rng = np.random.default_rng(0)
    for op, cases in SMALL.items():
        for params in cases:
            ours, port, ours_out, _, written_mb = layers._prepare(op, params, torch,
                                                                  torch.device("cpu"), rng, None)
            ours()
            assert port is None and written_mb > 0
            assert any((out != -1).any() for out in ours_out), (op, params)   # it wrote


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_the_load_chain_kernel_compiles(arch):
    from dsv4_cupy import loader
    from dsv4_cupy.bench import latency
    pytest.importorskip("cupy")
    cubin = loader.compile_source(latency.source(), "common.cuh", arch)
    assert cubin[:4] == b"\x7fELF" and b"dependent_loads" in cubin and b"only_writes" in cubin


def test_the_decode_cases_are_set_against_a_chain_of_their_rounds():
    from dsv4_cupy.bench import latency
    bounded = [(op, name) for op, name, params in layers.layer_cases(False)
               if (latency.decode_tokens(op, params) or 1 << 30) <= latency.DECODE_TOKENS]
    assert bounded == [("swa", f"decode {n}x1") for n in (1, 16, 64)] + [
        ("global_topk", f"decode {n} K=512") for n in (1, 16, 64)] + [("short_fill", "64 x 512")]
    floors = {"plain": [0.9, 1.2, 1.5, 1.8], "programmatic": [1.0, 1.1, 1.3, 1.7]}
    assert latency.least_launch_us(floors, 2) == 1.3 and latency.least_launch_us(floors, 0) == 0.9


def test_the_bound_table_says_whether_2x_is_possible(capsys):
    base = {"MB": 0.1, "ours_layer_host_us": 10.0, "host_x_floor": 3.0, "ours_layer_GBps": 1.0,
            "write_ceiling_pct": 0.0, "triton_same_bytes": True, "x_triton": 1.0,
            "x_triton_pdl": 1.3, "triton_host_us": 20.0, "x_triton_host": 2.0,
            "dependent_loads": 2}
    rows = [dict(base, op="swa", case="decode 1x1", ours_layer_graph_us=1.6, ours_pdl_graph_us=1.2,
                 triton_graph_us=1.6, least_launch_us=1.1),
            dict(base, op="global_topk", case="decode 1 K=512", ours_layer_graph_us=1.6,
                 ours_pdl_graph_us=1.2, triton_graph_us=2.4, least_launch_us=1.1)]
    layers.print_layer_rows(rows)
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("2x the port"))) + 2:][:2]
    assert table[0].split()[-5:] == ["0.80", "2", "1.10", "1.20", "no"]
    assert table[1].split()[-5:] == ["1.20", "2", "1.10", "1.20", "yes"]


@pytest.mark.gpu
def test_the_load_chain_runs_each_way_it_can_be_launched():
    torch = pytest.importorskip("torch")
    from dsv4_cupy import launch
    from dsv4_cupy.bench import latency
    from dsv4_cupy.bench.cli import GpuTimer
    floors = latency.dependent_load_floors(torch, GpuTimer(torch), rounds=1)
    modes = {"plain"} | ({"programmatic"} if launch.programmatic_launch_supported(
        torch.cuda.current_device()) else set())
    assert set(floors) == modes
    for per_load in floors.values():
        assert len(per_load) == latency.MAX_LOADS + 1 and all(us > 0 for us in per_load)


def test_the_step_benchs_phases_time_the_builders_own_steps_over_advancing_contexts():
    """The whole-step bench's host phases wrap the builder's own steps (here
    the CPU path: no prepared launches) and put them back afterwards; the
    advancing prefill contexts give each build new plans."""
    import numpy as np

    import dsv4_cupy as d4
    from dsv4_cupy import prepared
    from dsv4_cupy.bench import step as step_bench
    from dsv4_cupy.bench.cli import MAX_MODEL_LEN, make_step

    step = make_step(4, 1, [300, 50], 3)
    seq = step["seq"]
    cms = {}
    for group in ("swa", "c4a", "indexer", "c128a"):
        cms[group] = d4.CommonAttentionMetadata(
            query_start_loc=step["qsl"], query_start_loc_cpu=step["qsl"], seq_lens=seq,
            block_table_tensor=step["table"], slot_mapping=step["slots"],
            positions=step["positions"], num_reqs=6, num_actual_tokens=354,
            max_query_len=step["max_q"], max_seq_len=step["max_seq"], seq_lens_cpu=seq)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, 1024, combined_prefill=True)
    advance = step_bench.advancing(step, 4, MAX_MODEL_LEN)
    plans = set()
    for _ in range(5):
        advance()
        got = builder.build(0, cms)
        plans.add((tuple(got.c128a_prefill_chunks), int(got.indexer_cu_compressed[-1])))
        assert (seq[4:] >= np.diff(step["qsl"])[4:]).all() and (seq <= MAX_MODEL_LEN).all()
    assert len(plans) == 5
    original = prepared.PreparedCall.run
    phases, builds = step_bench.host_phases(builder, cms, advance, reps=5)
    assert set(phases) == {name for name, _ in step_bench.PHASES} | {"other"}
    assert all(phases[name] > 0 for name in ("checks", "planning", "views", "other"))
    assert set(builds) == {"median", "mean", "p99"}
    assert 0 < builds["median"] <= builds["p99"] and builds["mean"] <= builds["p99"]
    assert phases["prepare"] == phases["launch"] == 0
    assert prepared.PreparedCall.run is original
    assert "_plan" not in vars(builder)


def test_the_step_tables_print_every_row(capsys):
    """The whole-step tables (the rows the GPU bench makes) print without a GPU."""
    from dsv4_cupy.bench import step as step_bench

    phases = dict.fromkeys([name for name, _ in step_bench.PHASES] + ["other"], 1.5)
    rows = [{"case": name, "tokens": 3, "launches": 1, "c128a_graph_us": 2.0,
             "step_graph_us": 3.0, "x_c128a_gpu": 1.5, "c128a_host_us": 10.0,
             "step_host_us": 12.0, "floor_us": 3.75, "step_x_floor": 3.4,
             "host_phases_us": phases,
             "host_builds_us": {"median": 11.0, "mean": 12.5, "p99": 30.0},
             "host_x_gpu": 4.0, "upstream_launches": 9, "upstream_graph_us": 9.0,
             "x_upstream_gpu": 3.0, "upstream_host_us": 99.0, "x_upstream_host": 8.25,
             "upstream_same": True, **({"host_x_decode": 1.0} if prefills else {})}
            for name, _, _, prefills in step_bench.STEP_CASES]
    step_bench.print_step_rows(rows)
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, *_ in step_bench.STEP_CASES:       # a row in each of the three tables
        assert sum(line.startswith(f"{name:16} ") for line in lines) == 3, name
    # The phases table's builds: median, mean and 99th percentile, then the step's host
    # us, its paired floor and the ratio, on each case's row.
    assert sum("11.00     12.50     30.00     12.00   3.75    3.40" in line
               for line in lines) == len(step_bench.STEP_CASES)


def test_paired_host_timing_compares_each_round_with_the_floor_timed_before_it(monkeypatch):
    """``GpuTimer.paired_host_us``: rounds of the floor then the call, alternating,
    each from an idle stream; the times are the medians over the rounds and the
    ratio the median of each round's own ratio. Here the host slows down by half
    between the floor's third round and the call's: the ratio stays the one
    speed's (3), where the medians' ratio would be 6."""
    from dsv4_cupy.bench import cli

    log, clock = [], [0.0]
    # Round r of either call takes per_call[r] us per call (the warm-up: round 0's).
    per_call = {"floor": [1.0, 1.0, 1.0, 2.0, 2.0], "build": [3.0, 3.0, 6.0, 6.0, 6.0]}
    rounds = {"floor": -1, "build": -1}

    class FakeTorch:
        class cuda:
            @staticmethod
            def synchronize():
                log.append("sync")

    def timed(name):
        def call():
            log.append(name)
            clock[0] += per_call[name][max(rounds[name], 0)] * 1e-6
        call.__name__ = name
        return call

    original = cli.GpuTimer._round_us

    def counted_round(self, fn, reps):
        rounds[fn.__name__] += 1
        return original(self, fn, reps)

    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(cli.GpuTimer, "_round_us", counted_round)
    host, floor_us, ratio = cli.GpuTimer(FakeTorch).paired_host_us(
        timed("build"), timed("floor"), reps=4, reference_reps=2, rounds=5)
    assert (host, floor_us) == pytest.approx((6.0, 1.0))
    assert ratio == pytest.approx(3.0)     # the rounds' ratios: 3, 3, 6, 3, 3
    assert log[:20] == ["floor", "build"] * 10                  # the warm-up
    assert log[20:] == (["sync", "floor", "floor", "sync"] + ["build"] * 4) * 5 + ["sync"]


@pytest.mark.gpu
def test_the_write_floor_stores_every_vector_and_takes_longer_for_more():
    torch = pytest.importorskip("torch")
    from dsv4_cupy.bench import latency
    from dsv4_cupy.bench.cli import GpuTimer
    timer = GpuTimer(torch)
    small = latency.write_floor_us(torch, timer, 1 << 10, 8, 256)
    large = latency.write_floor_us(torch, timer, 64 << 20, 264, 256)
    assert 0 < small < large


def test_the_sections_tool_counts_the_bytes_a_run_writes_over_whole_allocations():
    torch = pytest.importorskip("torch")
    from dsv4_cupy.bench import sections
    block = torch.zeros(64, dtype=torch.int32)
    views = {"rows": block[:8].view(2, 4), "lens": block[8:10], "other": torch.zeros(4)}

    class Builder:
        def buffers(self):
            return views

    def run():     # 6 bytes, one of them equal to a fill, and a byte outside the views
        block.view(torch.uint8)[[0, 1, 2, 3, 4]] = torch.tensor([0, 1, 0x5A, 0xA5, 7],
                                                                dtype=torch.uint8)
        block.view(torch.uint8)[255] = 9

    assert sections.bytes_written(torch, Builder(), run) == 6
    assert sections.bytes_written(torch, Builder(), lambda: None) == 0


def test_the_sections_tool_builds_the_step_in_the_indexer_layout_it_is_given(monkeypatch):
    """``--indexer-decode-layout`` reaches the step builder the tool times
    (the bench's step is otherwise built as ``bench.step.step_case`` builds it)."""
    pytest.importorskip("torch")
    import dsv4_cupy as d4
    from dsv4_cupy.bench import sections, step

    built = []

    class Stop(Exception):
        pass

    def builder(*args, **kwargs):
        built.append(kwargs["indexer_decode_layout"])
        raise Stop

    monkeypatch.setattr(step, "_group_metadata", lambda *args: {})
    monkeypatch.setattr(d4, "DeepseekV4StepMetadataBuilder", builder)
    monkeypatch.setattr(sections, "set_programmatic_launch", lambda enabled: True)  # global
    for argv, want in (([], "flat"), (["--indexer-decode-layout", "native"], "native")):
        with pytest.raises(Stop):
            sections.main(["--case", "decode 16x1", *argv])
        assert built.pop() == want
    with pytest.raises(SystemExit):
        sections.main(["--indexer-decode-layout", "paged"])


def test_the_sections_tool_runs_each_section_alone_on_its_own_blocks(monkeypatch):
    """``bench.sections`` on a decode step's prepared launch (the GPU path's
    host side, emulated): "all" as built, "none" every section off on the
    whole grid, then each section with blocks alone (the sections before it
    end at block 0, it and the rest at its block count, the grid that count),
    nothing else in the struct changed; each is installed in the launch while
    timed, and the launch is left as built."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from helpers import emulate_gpu_host

    import dsv4_cupy as d4
    from dsv4_cupy.bench import sections
    from dsv4_cupy.bench.cli import MAX_MODEL_LEN, make_step
    from dsv4_cupy.bench.step import prepared_launches
    from dsv4_cupy.step_kernel import PARAMS, SECTION_NAMES

    emulate_gpu_host(monkeypatch)
    step = make_step(16, 1, [], 0)
    shared = {name: torch.from_numpy(step[name]) for name in ("qsl", "seq", "positions")}
    cms = {group: d4.CommonAttentionMetadata(
        query_start_loc=shared["qsl"], query_start_loc_cpu=shared["qsl"],
        seq_lens=shared["seq"], block_table_tensor=torch.from_numpy(step["table"]),
        slot_mapping=torch.from_numpy(step["slots"]), positions=shared["positions"],
        num_reqs=16, num_actual_tokens=16, max_query_len=1, max_seq_len=step["max_seq"])
        for group in ("swa", "c4a", "indexer", "c128a")}
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, 1024, like="torch")
    plan, = prepared_launches(builder, cms)
    built, built_blocks = plan.storage.copy(), plan.blocks
    ends = sections.section_ends(built)
    sizes = dict(zip(SECTION_NAMES, np.diff([0, *ends.values()]).tolist()))
    assert max(ends.values()) == built_blocks and min(sizes.values()) >= 0
    # Emulated, the row sections (C128A, SWA) take the CPU's geometry: no blocks.
    assert all(sizes[name] for name in ("token_map", "group_slots", "indexer_decode"))
    got = sections.variants(built, built_blocks)
    assert [name for name, _, _ in got] == ["all", "none",
                                            *[name for name in SECTION_NAMES if sizes[name]]]
    first = PARAMS.offset_of("sections", SECTION_NAMES[0])
    last = PARAMS.offset_of("sections", SECTION_NAMES[-1]) + np.int64().itemsize
    for name, storage, blocks in got:
        assert (storage[:first] == built[:first]).all() and (storage[last:] == built[last:]).all()
        got_ends = sections.section_ends(storage)
        if name == "all":
            assert blocks == built_blocks and got_ends == ends
        elif name == "none":
            assert blocks == built_blocks and set(got_ends.values()) == {0}
        else:
            place = SECTION_NAMES.index(name)
            assert blocks == sizes[name]
            assert got_ends == {other: 0 if before < place else blocks
                                for before, other in enumerate(SECTION_NAMES)}

    seen = []

    class Recording:
        def graph_us(self, fn):
            seen.append((plan.storage.copy(), plan.blocks))
            return 1.0

    times = sections.time_variants(Recording(), torch, plan)
    assert list(times) == [name for name, _, _ in got]
    assert all((storage == want).all() and blocks == count
               for (storage, blocks), (_, want, count) in zip(seen, got, strict=True))
    assert (plan.storage == built).all() and plan.blocks == built_blocks
    with pytest.raises(SystemExit):          # decode cases only: a step of one launch
        sections.main(["--case", "mixed 64+2048"])
