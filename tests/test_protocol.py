"""The tile-protocol headers (csrc/include/gemm_ar), through their bindings (gemm_ar_protocol, which the tests build
from tests/protocol_module), against independent Python formulations on many seeded random configurations; plus
compile checks of the headers themselves (C++17/C++20 cleanliness, every function carrying GEMM_AR_FN, no
exceptions/heap/STL containers)."""
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from protocol_module_build import protocol_module

P = protocol_module()
ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "csrc" / "include"
HEADER_DIR = INCLUDE / "gemm_ar"
# Every header here is read by bisheng for AICore, so every one gets the C++17/qualifier/no-heap checks; the
# protocol headers proper also get the stricter warning set.
HEADERS = sorted(p.name for p in HEADER_DIR.glob("*.hpp"))
PROTOCOL_HEADERS = ["comm_schedule.hpp", "epoch.hpp", "fn.hpp", "layout.hpp", "ownership.hpp", "partition.hpp",
                    "protocol.hpp", "swizzle.hpp", "tile_plan.hpp"]
CONFIGS = 400

PLAN_FIELDS = ("m", "n", "k", "base_m", "base_n", "base_k", "k_step", "m_tiles", "n_tiles", "tiles", "pad_m",
               "pad_n", "pad_k", "sub_m", "stripes")
LAYOUT_PARAM_FIELDS = ("pad_m", "pad_n", "elem_bytes", "partial_elem_bytes", "world", "tiles",
                       "max_owned_subtiles", "compute_blocks", "comm_blocks", "queue_capacity")


# ---------------------------------------------------------------------------------------------------------------
# Independent reference formulations (enumeration where the C++ uses closed forms).

def ref_plan(m, n, k, base_m, base_n, base_k, k_slices, sub_m):
    k_step = base_k * k_slices
    m_tiles = len(range(0, m, base_m))
    n_tiles = len(range(0, n, base_n))
    pad_k = 0
    while pad_k < k:
        pad_k += k_step
    return dict(m=m, n=n, k=k, base_m=base_m, base_n=base_n, base_k=base_k, k_step=k_step, m_tiles=m_tiles,
                n_tiles=n_tiles, tiles=m_tiles * n_tiles, pad_m=m_tiles * base_m, pad_n=n_tiles * base_n,
                pad_k=pad_k, sub_m=sub_m, stripes=base_m // sub_m)


def ref_valid_rows(limit, start, length):
    """How many of the indices start .. start+length-1 are below limit."""
    return sum(1 for r in range(start, start + length) if r < limit)


def ref_block_ranges(items, blocks):
    """Deal items out one by one to the blocks in turn, then lay the per-block counts out contiguously."""
    counts = [0] * blocks
    for i in range(items):
        counts[i % blocks] += 1
    ranges, at = [], 0
    for c in counts:
        ranges.append((at, at + c))
        at += c
    return ranges


def ref_zigzag_walk(rows, n_tiles):
    """The tile ids in the order a single block would visit the whole grid."""
    walk = []
    for r in range(rows):
        cols = range(n_tiles) if r % 2 == 0 else reversed(range(n_tiles))
        walk.extend(r * n_tiles + c for c in cols)
    return walk


def ref_owned_subtiles(tiles, world, stripes):
    """For each rank: its owner-local subtile list, in local-id order, as (tile, stripe) pairs."""
    owned = {r: [] for r in range(world)}
    for t in range(tiles):
        for s in range(stripes):
            owned[t % world].append((t, s))
    return owned


def random_plan_args(rng):
    base_m = rng.choice([1, 2, 3, 8, 16, 48, 64, 128])
    divisors = [d for d in range(1, base_m + 1) if base_m % d == 0]
    sub_m = rng.choice(divisors)
    base_n = rng.choice([1, 3, 16, 64, 256])
    base_k = rng.choice([1, 5, 16, 64])
    k_slices = rng.choice([1, 2, 4])
    m = rng.choice([0, 1, base_m - 1 if base_m > 1 else 1, base_m, base_m + 1, rng.randint(0, 700)])
    n = rng.choice([0, 1, base_n, base_n + 1, rng.randint(0, 900)])
    k = rng.choice([0, 1, base_k * k_slices, base_k * k_slices + 3, rng.randint(0, 1000)])
    return m, n, k, base_m, base_n, base_k, k_slices, sub_m


def plan_dict(plan):
    return {f: getattr(plan, f) for f in PLAN_FIELDS}


# ---------------------------------------------------------------------------------------------------------------
# tile_plan.hpp

def test_tile_plan_fields_and_accessors_match_reference():
    rng = random.Random(1234)
    for _ in range(CONFIGS):
        args = random_plan_args(rng)
        plan = P.make_tile_plan(*args)
        assert plan is not None, args
        ref = ref_plan(*args)
        assert plan_dict(plan) == ref, args
        m, n, _, base_m, base_n, _, _, sub_m = args
        for t in range(ref["tiles"]):
            assert P.tile_row(plan, t) == t // ref["n_tiles"]
            assert P.tile_col(plan, t) == t - (t // ref["n_tiles"]) * ref["n_tiles"]
        for mi in range(ref["m_tiles"] + 2):
            rows = P.tile_rows(plan, mi)
            assert rows == ref_valid_rows(m, mi * base_m, base_m), (args, mi)
            stripe_total = 0
            for s in range(ref["stripes"] + 1):
                expect = ref_valid_rows(m, mi * base_m + s * sub_m, sub_m) if s < ref["stripes"] else 0
                got = P.stripe_rows(plan, mi, s)
                assert got == expect, (args, mi, s)
                stripe_total += got
            assert stripe_total == rows
        for ni in range(ref["n_tiles"] + 2):
            assert P.tile_cols(plan, ni) == ref_valid_rows(n, ni * base_n, base_n), (args, ni)
        assert sum(P.tile_rows(plan, mi) for mi in range(ref["m_tiles"])) == m
        assert sum(P.tile_cols(plan, ni) for ni in range(ref["n_tiles"])) == n


def test_tile_plan_defaults_of_the_npu_kernel():
    # 128 x 256 tiles, base_k 64 with 4 K-slices: K padded to a multiple of 256 (docs/architecture.md §3.1).
    plan = P.make_tile_plan(1000, 3000, 4100, 128, 256, 64, 4, 32)
    assert (plan.m_tiles, plan.n_tiles, plan.tiles) == (8, 12, 96)
    assert (plan.pad_m, plan.pad_n, plan.pad_k, plan.k_step, plan.stripes) == (1024, 3072, 4352, 256, 4)
    assert P.tile_rows(plan, 7) == 1000 - 7 * 128
    assert [P.stripe_rows(plan, 7, s) for s in range(4)] == [32, 32, 32, 8]


def test_empty_problem_has_no_tiles():
    for m, n in [(0, 5), (5, 0), (0, 0)]:
        plan = P.make_tile_plan(m, n, 7, 4, 4, 2, 2, 2)
        assert plan is not None and plan.tiles == 0
    assert P.make_tile_plan(0, 5, 7, 4, 4, 2, 2, 2).n_tiles == 2


def test_make_tile_plan_rejects_bad_input():
    good = dict(m=10, n=10, k=10, base_m=4, base_n=4, base_k=2, k_slices=2, sub_m=2)
    assert P.make_tile_plan(**good) is not None
    bad = []
    for field in ("base_m", "base_n", "base_k", "k_slices", "sub_m"):
        bad += [dict(good, **{field: 0}), dict(good, **{field: -3})]
    for field in ("m", "n", "k"):
        bad.append(dict(good, **{field: -1}))
    bad += [dict(good, sub_m=3), dict(good, base_m=6, sub_m=4), dict(good, sub_m=8)]
    big = 2 ** 62
    bad += [dict(good, m=big, n=big), dict(good, m=2 ** 63 - 1), dict(good, base_k=big, k_slices=4),
            dict(good, m=2 ** 40, k=2 ** 40)]
    for kwargs in bad:
        assert P.make_tile_plan(**kwargs) is None, kwargs


def test_ceil_div():
    rng = random.Random(7)
    for _ in range(CONFIGS):
        a, b = rng.randint(0, 10 ** 6), rng.randint(1, 5000)
        assert P.ceil_div(a, b) == -(-a // b)


# ---------------------------------------------------------------------------------------------------------------
# partition.hpp and swizzle.hpp

def test_block_range_balanced_contiguous():
    rng = random.Random(99)
    cases = [(0, 1), (1, 1), (1, 8), (7, 8), (8, 8), (9, 8), (100, 3), (5, 40)]
    cases += [(rng.randint(0, 3000), rng.randint(1, 64)) for _ in range(CONFIGS)]
    for items, blocks in cases:
        ranges = [P.block_range(items, blocks, b) for b in range(blocks)]
        assert ranges == ref_block_ranges(items, blocks), (items, blocks)
        # Every item in exactly one block, blocks in order, sizes within one of each other.
        covered = [i for begin, end in ranges for i in range(begin, end)]
        assert covered == list(range(items))
        sizes = [end - begin for begin, end in ranges]
        assert max(sizes) - min(sizes) <= 1
        assert all(s == items // blocks + 1 for s in sizes[: items % blocks])
        assert P.max_block_items(items, blocks) == max(sizes)
        for outside in (-1, blocks):
            begin, end = P.block_range(items, blocks, outside)
            assert begin == end
    assert P.max_block_items(5, 0) == 0 and P.max_block_items(0, 3) == 0


def test_zigzag_is_a_bijection_with_correct_inverse():
    rng = random.Random(5)
    cases = [(1, 1), (1, 7), (7, 1), (2, 2), (3, 5)]
    cases += [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(CONFIGS)]
    for rows, n_tiles in cases:
        total = rows * n_tiles
        walk = [P.zigzag_tile(i, n_tiles) for i in range(total)]
        assert walk == ref_zigzag_walk(rows, n_tiles)
        assert sorted(walk) == list(range(total))
        for i, t in enumerate(walk):
            assert P.zigzag_linear(t, n_tiles) == i
        # B reuse: consecutive tiles of the walk are grid neighbours (same row, or same column at a row turn).
        for a, b in zip(walk, walk[1:]):
            ra, ca, rb, cb = a // n_tiles, a % n_tiles, b // n_tiles, b % n_tiles
            assert (ra == rb and abs(ca - cb) == 1) or (ca == cb and rb == ra + 1)


def test_compute_blocks_cover_each_tile_exactly_once():
    rng = random.Random(11)
    for _ in range(CONFIGS):
        plan = P.make_tile_plan(*random_plan_args(rng))
        blocks = rng.choice([1, 2, 3, 20, 24, plan.tiles + 5])
        computed_by = {}
        for b in range(blocks):
            begin, end = P.block_range(plan.tiles, blocks, b)
            for linear in range(begin, end):
                t = P.zigzag_tile(linear, plan.n_tiles)
                assert t not in computed_by
                computed_by[t] = b
        assert sorted(computed_by) == list(range(plan.tiles))


# ---------------------------------------------------------------------------------------------------------------
# ownership.hpp

def test_ownership_and_local_subtile_ids():
    rng = random.Random(21)
    cases = [(1, 1, 1), (1, 4, 2), (3, 8, 4), (16, 1, 4), (0, 3, 2)]
    cases += [(rng.randint(0, 300), rng.randint(1, 9), rng.choice([1, 2, 3, 4, 8])) for _ in range(CONFIGS)]
    for tiles, world, stripes in cases:
        owned = ref_owned_subtiles(tiles, world, stripes)
        for t in range(tiles):
            assert P.owner_of(t, world) == t % world
        total = 0
        for rank in range(world):
            expect = owned[rank]
            assert P.owned_tile_count(tiles, world, rank) == len(expect) // stripes
            assert P.owned_subtile_count(tiles, world, rank, stripes) == len(expect)
            total += len(expect)
            for local_id, (t, s) in enumerate(expect):
                # Encode gives consecutive local ids 0..count-1; decode gives the tile and stripe back.
                assert P.local_subtile(t, s, world, stripes) == local_id
                assert P.subtile_tile(local_id, rank, world, stripes) == t
                assert P.subtile_stripe(local_id, stripes) == s
        assert total == tiles * stripes
        biggest = max(len(v) for v in owned.values())
        assert P.max_owned_subtile_count(tiles, world, stripes) == biggest
        assert P.max_owned_tile_count(tiles, world) == biggest // stripes
        assert P.owned_tile_count(tiles, world, world) == 0 and P.owned_tile_count(tiles, world, -1) == 0


def test_ownership_in_runs():
    """Runs of `run` tiles dealt round-robin: run 1 is the round-robin rule; owner-local ids number each owner's tiles
    in tile order, consecutively, and decode back."""
    rng = random.Random(22)
    cases = [(0, 2, 1, 3), (7, 3, 2, 1), (12, 2, 3, 6), (5, 4, 1, 7)]
    cases += [(rng.randint(0, 200), rng.randint(1, 6), rng.choice([1, 2, 4]), rng.randint(1, 20))
              for _ in range(CONFIGS)]
    for tiles, world, stripes, run in cases:
        owned = {r: [] for r in range(world)}
        for t in range(tiles):
            for s in range(stripes):
                owned[(t // run) % world].append((t, s))
        for t in range(tiles):
            assert P.run_owner_of(t, world, run) == (t // run) % world
            if run == 1:
                assert P.run_owner_of(t, world, 1) == P.owner_of(t, world)
                assert P.run_local_subtile(t, 0, world, stripes, 1) == P.local_subtile(t, 0, world, stripes)
        for rank in range(world):
            assert P.run_owned_tile_count(tiles, world, rank, run) == len(owned[rank]) // stripes
            for local_id, (t, s) in enumerate(owned[rank]):
                assert P.run_local_subtile(t, s, world, stripes, run) == local_id
                assert P.run_subtile_tile(local_id, rank, world, stripes, run) == t
        assert P.run_max_owned_subtile_count(tiles, world, stripes, run) == max(len(v) for v in owned.values())
        assert P.run_owned_tile_count(tiles, world, world, run) == 0


def _check_chunk_numbering(plan, chunks, one, world):
    """Tile t of chunk g is the plan's tile g * (tiles of one chunk) + t, with the per-chunk plan's row and column;
    chunk g's rank holds its chunks one after another, padded buffers keeping each chunk's padding."""
    per_chunk = one.m_tiles * one.n_tiles
    assert P.chunk_tile_count(plan, chunks) == per_chunk
    run = P.chunk_ownership_run(plan, chunks)
    seen = []
    for g in range(chunks.count):
        owner = g % world
        assert P.owner_of(g, world) == owner  # chunk g's rank
        for i in range(chunks.m_tiles):
            mi = P.chunk_tile_row(chunks, g, i)
            assert mi == g * one.m_tiles + i and P.chunk_of_tile_row(chunks, mi) == g
            assert P.chunked_owner_padded_row0(plan, chunks, mi, world) == ((g // world) * one.m_tiles + i) * one.base_m
        for t in range(per_chunk):
            tile = P.chunk_tile(plan, chunks, g, t)
            seen.append(tile)
            assert P.chunk_of_tile_row(chunks, P.tile_row(plan, tile)) == g
            assert P.tile_row(plan, tile) == g * one.m_tiles + P.tile_row(one, t)
            assert P.tile_col(plan, tile) == P.tile_col(one, t)
            assert P.run_owner_of(tile, world, run) == owner
            # The owner-local tile id (run ownership) sits where the padded owner row says.
            local_tile = P.run_local_subtile(tile, 0, world, 1, run)
            assert local_tile // one.n_tiles * one.base_m == P.chunked_owner_padded_row0(plan, chunks,
                                                                                         P.tile_row(plan, tile), world)
    assert seen == list(range(plan.tiles))  # the chunks' tiles are consecutive runs, in chunk order
    for rank in range(world + 1):
        owned = sum(1 for g in range(chunks.count) if g % world == rank)
        assert P.chunked_owner_rows(chunks, world, rank) == owned * chunks.rows


def test_row_chunked_plans():
    """Every chunk gets its own tile rows (no tile straddles two chunks), the rows of a tile row are where the plain
    per-chunk plan puts them, chunk g belongs to rank g % world and its rows sit at (g // world) * rows there, and
    the ownership run gives each chunk's tiles to that rank."""
    rng = random.Random(23)
    cases = [(2, 7, 5, 16, 32, 8, 2), (3, 0, 5, 16, 32, 8, 3), (1, 300, 9, 256, 512, 64, 2)]
    cases += [(rng.randint(1, 8), rng.randint(0, 70), rng.randint(0, 70), rng.choice([4, 8, 16]),
               rng.choice([4, 16]), rng.choice([1, 2, 4]), rng.randint(1, 4)) for _ in range(CONFIGS)]
    for count, rows, n, base_m, base_n, sub_m, world in cases:
        plan, chunks = P.make_row_chunked_plan(count, rows, n, 3, base_m, base_n, 1, 1, sub_m)
        one = P.make_tile_plan(rows, n, 3, base_m, base_n, 1, 1, sub_m)
        assert (chunks.count, chunks.rows, chunks.m_tiles) == (count, rows, one.m_tiles)
        assert (plan.m, plan.m_tiles, plan.pad_m) == (count * rows, count * one.m_tiles, count * one.pad_m)
        assert plan.tiles == plan.m_tiles * plan.n_tiles and plan.n_tiles == one.n_tiles
        covered = []
        for mi in range(plan.m_tiles):
            g, li = divmod(mi, one.m_tiles)
            assert P.chunk_of_tile_row(chunks, mi) == g
            got = P.chunked_tile_rows(plan, chunks, mi)
            assert got == P.tile_rows(one, li)
            assert sum(P.chunked_stripe_rows(plan, chunks, mi, s) for s in range(plan.stripes)) == got
            row0 = P.chunked_tile_row0(plan, chunks, mi)
            assert row0 == g * rows + li * base_m
            assert g * rows <= row0 and row0 + got <= (g + 1) * rows  # inside its chunk
            assert P.chunked_owner_row0(plan, chunks, mi, world) == (g // world) * rows + li * base_m
            covered += range(row0, row0 + got)
        assert covered == list(range(count * rows))  # every row exactly once, in order
        assert P.chunked_tile_rows(plan, chunks, plan.m_tiles) == 0 and P.chunked_tile_rows(plan, chunks, -1) == 0
        run = P.chunk_ownership_run(plan, chunks)
        for t in range(plan.tiles):
            assert P.run_owner_of(t, world, run) == P.chunk_of_tile_row(chunks, P.tile_row(plan, t)) % world
        _check_chunk_numbering(plan, chunks, one, world)
    plain = P.make_tile_plan(100, 50, 3, 16, 16, 1, 1, 4)
    _, single = P.make_row_chunked_plan(1, 100, 50, 3, 16, 16, 1, 1, 4)  # one chunk: the plain plan's rows
    assert (single.count, single.rows, single.m_tiles) == (1, 100, plain.m_tiles)
    assert all(P.chunked_tile_rows(plain, single, mi) == P.tile_rows(plain, mi) for mi in range(plain.m_tiles + 1))
    assert P.make_row_chunked_plan(0, 5, 5, 5, 4, 4, 1, 1, 2) is None
    assert P.make_row_chunked_plan(2, -1, 5, 5, 4, 4, 1, 1, 2) is None
    assert P.make_row_chunked_plan(2, 5, 5, 5, 4, 4, 1, 1, 3) is None  # sub_m must divide base_m
    assert P.make_row_chunked_plan(1 << 40, 1 << 30, 5, 5, 4, 4, 1, 1, 2) is None  # overflow


# ---------------------------------------------------------------------------------------------------------------
# comm_schedule.hpp

def test_every_queue_drained_by_exactly_one_comm_block():
    rng = random.Random(31)
    cases = [(1, 1), (1, 4), (4, 1), (24, 4), (20, 20), (3, 7)]
    cases += [(rng.randint(1, 48), rng.randint(1, 24)) for _ in range(CONFIGS)]
    for compute_blocks, comm_blocks in cases:
        drained_by = {}
        for c in range(comm_blocks):
            count = P.comm_block_queue_count(c, compute_blocks, comm_blocks)
            assert count == len(range(c, compute_blocks, comm_blocks))
            for j in range(count):
                q = P.comm_block_queue(c, j, comm_blocks)
                assert 0 <= q < compute_blocks and q not in drained_by
                drained_by[q] = c
        assert sorted(drained_by) == list(range(compute_blocks))
        for q, c in drained_by.items():
            assert P.queue_comm_block(q, comm_blocks) == c
        counts = [P.comm_block_queue_count(c, compute_blocks, comm_blocks) for c in range(comm_blocks)]
        assert counts == sorted(counts, reverse=True)  # low comm blocks drain the most queues


def test_sequence_parallel_walk():
    """The NPU sequence-parallel kernels' compute order over a row-chunked plan of one chunk per rank: every tile
    exactly once, chunk by chunk (reduce-scatter: from the next rank's chunk on, its own last; allgather: its own
    first), each chunk's tiles in zig-zag order; compute block b takes items b, b + P, ..."""
    rng = random.Random(24)
    cases = [(1, 5, 7, 1), (2, 300, 520, 3), (4, 1, 1, 5)]
    cases += [(rng.randint(1, 6), rng.randint(1, 60), rng.randint(1, 60), rng.randint(1, 7)) for _ in range(40)]
    for world, rows, n, blocks in cases:
        plan, chunks = P.make_row_chunked_plan(world, rows, n, 3, 16, 16, 1, 1, 4)
        assert P.sp_chunks_usable(chunks, world) and not P.sp_chunks_usable(chunks, world + 1)
        per_chunk = P.chunk_tile_count(plan, chunks)
        for op in (P.kOpGemmReduceScatter, P.kOpAllgatherGemm):
            for me in range(world):
                first = me + 1 if op == P.kOpGemmReduceScatter else me
                want = [((first + step) % world) * per_chunk + P.zigzag_tile(i, plan.n_tiles)
                        for step in range(world) for i in range(per_chunk)]
                order = [P.sp_item_tile(plan, chunks, me, op, item) for item in range(plan.tiles)]
                assert order == want and sorted(order) == list(range(plan.tiles))
                last = order[-1 if op == P.kOpGemmReduceScatter else 0]
                assert P.chunk_of_tile_row(chunks, P.tile_row(plan, last)) == me
                for b in range(blocks + 1):
                    count = P.sp_block_item_count(plan, blocks, b)
                    walked = [P.sp_block_item(plan, chunks, me, op, blocks, b, j) for j in range(count)]
                    assert walked == (order[b::blocks] if b < blocks else [])



def test_every_owned_subtile_gathered_by_exactly_one_comm_block():
    rng = random.Random(41)
    cases = [(0, 1), (1, 1), (1, 4), (4, 1), (5, 8), (64, 4)]
    cases += [(rng.randint(0, 400), rng.randint(1, 24)) for _ in range(CONFIGS)]
    for owned, comm_blocks in cases:
        gathered_by = {}
        for c in range(comm_blocks):
            count = P.ag_subtile_count(c, owned, comm_blocks)
            for j in range(count):
                l = P.ag_subtile(c, j, comm_blocks)
                assert 0 <= l < owned and l not in gathered_by
                gathered_by[l] = c
            # The next one would fall outside the owned subtiles.
            assert P.ag_subtile(c, count, comm_blocks) >= owned
        assert sorted(gathered_by) == list(range(owned))
        for l, c in gathered_by.items():
            # Reversed stripes: subtile l goes to block Q-1-(l mod Q); its doorbell is that block's.
            assert c == comm_blocks - 1 - l % comm_blocks
            assert P.ag_block_of(l, comm_blocks) == c
        counts = [P.ag_subtile_count(c, owned, comm_blocks) for c in range(comm_blocks)]
        assert counts == sorted(counts)  # the RS-heavy low blocks gather the fewest subtiles
        assert P.ag_subtile_count(comm_blocks, owned, comm_blocks) == 0


def test_rotated_peer_is_a_bijection_on_the_other_ranks():
    rng = random.Random(51)
    for world in range(1, 10):
        for me in range(world):
            for l in list(range(3 * world)) + [rng.randint(0, 10 ** 6) for _ in range(20)]:
                peers = [P.rotated_peer(me, l, i, world) for i in range(world - 1)]
                assert sorted(peers) == sorted(set(range(world)) - {me}), (world, me, l)
                assert P.rotated_peer(me, l, world - 1, world) == -1
                assert P.rotated_peer(me, l, -1, world) == -1
        # Rotation: over world-1 consecutive subtiles, each rank's first destination takes every other rank once.
        if world > 2:
            for me in range(world):
                firsts = [P.rotated_peer(me, l, 0, world) for l in range(world - 1)]
                assert sorted(firsts) == sorted(set(range(world)) - {me})
    assert P.rotated_peer(0, 5, 0, 1) == -1


# ---------------------------------------------------------------------------------------------------------------
# layout.hpp

def random_layout_params(rng):
    world = rng.choice([1, 2, 3, 4, 8])
    plan = P.make_tile_plan(*random_plan_args(rng))
    compute_blocks = rng.choice([1, 2, 20, 24, 40])
    comm_blocks = rng.choice([1, 2, 4, 20])
    elem_bytes = rng.choice([2, 4])
    partial_elem_bytes = rng.choice([0, 2, 4])
    return plan, world, compute_blocks, comm_blocks, elem_bytes, partial_elem_bytes


def layout_regions(w, compute_blocks):
    return {
        "partial": (w.partial_offset, w.partial_bytes),
        "reduced0": (w.reduced_offset[0], w.reduced_bytes),
        "reduced1": (w.reduced_offset[1], w.reduced_bytes),
        "tile_flag": (w.tile_flag_offset, w.tile_flag_bytes),
        "final": (w.final_offset, w.final_bytes),
        "queues": (w.queue_offset, compute_blocks * w.queue_stride),
    }


def test_window_layout_regions_aligned_disjoint_and_sized():
    rng = random.Random(61)
    align, line = P.kWindowAlign, P.kCacheLine
    assert (align, line) == (512, 64)
    for _ in range(CONFIGS):
        plan, world, compute_blocks, comm_blocks, elem_bytes, partial_elem_bytes = random_layout_params(rng)
        params = P.make_layout_params(plan, elem_bytes, partial_elem_bytes, world, compute_blocks, comm_blocks)
        owned_max = max(len(v) for v in ref_owned_subtiles(plan.tiles, world, plan.stripes).values())
        queue_capacity = max(e - b for b, e in ref_block_ranges(plan.tiles, compute_blocks))
        assert (params.pad_m, params.pad_n, params.tiles) == (plan.pad_m, plan.pad_n, plan.tiles)
        assert params.max_owned_subtiles == owned_max and params.queue_capacity == queue_capacity
        assert P.layout_params_valid(params)
        w = P.make_window_layout(params)

        elems = plan.pad_m * plan.pad_n
        assert w.partial_offset == 0
        assert w.partial_bytes == elems * partial_elem_bytes
        assert w.reduced_bytes == elems * elem_bytes
        assert w.tile_flag_bytes == 4 * plan.tiles
        assert w.final_bytes == 4 * owned_max
        assert w.queue_stride % line == 0 and w.queue_stride >= 4 * (1 + queue_capacity)
        assert w.queue_stride < 4 * (1 + queue_capacity) + line  # no more than one line of slack

        regions = layout_regions(w, compute_blocks)
        for name, (offset, size) in regions.items():
            assert offset % align == 0, name
            assert size >= 0 and offset + size <= w.total_bytes, name
        assert w.total_bytes % align == 0
        nonempty = sorted((o, o + s, name) for name, (o, s) in regions.items() if s > 0)
        for (_, end_a, a), (start_b, _, b) in zip(nonempty, nonempty[1:]):
            assert end_a <= start_b, (a, b)
        # The same parameters give the same offsets (every rank computes its own copy).
        again = P.make_window_layout(P.LayoutParams(**{f: getattr(params, f) for f in LAYOUT_PARAM_FIELDS}))
        assert layout_regions(again, compute_blocks) == regions and again.total_bytes == w.total_bytes


def test_layout_entry_offsets_stay_in_their_regions():
    rng = random.Random(71)
    for _ in range(CONFIGS // 4):
        plan, world, compute_blocks, comm_blocks, elem_bytes, partial_elem_bytes = random_layout_params(rng)
        if plan.tiles == 0:
            continue
        params = P.make_layout_params(plan, elem_bytes, partial_elem_bytes, world, compute_blocks, comm_blocks)
        w = P.make_window_layout(params)
        for bank in (0, 1):
            last = P.reduced_entry_offset(w, bank, plan.pad_m - 1, plan.pad_n - 1, plan.pad_n, elem_bytes)
            assert P.reduced_entry_offset(w, bank, 0, 0, plan.pad_n, elem_bytes) == w.reduced_offset[bank]
            assert last + elem_bytes == w.reduced_offset[bank] + w.reduced_bytes
        if partial_elem_bytes:
            last = P.partial_entry_offset(w, plan.pad_m - 1, plan.pad_n - 1, plan.pad_n, partial_elem_bytes)
            assert last + partial_elem_bytes == w.partial_offset + w.partial_bytes
        assert P.tile_flag_entry_offset(w, plan.tiles - 1) + 4 == w.tile_flag_offset + w.tile_flag_bytes
        for l in range(params.max_owned_subtiles):
            assert P.final_entry_offset(w, l) == w.final_offset + 4 * l
        for b in range(compute_blocks):
            count_at = P.queue_count_offset(w, b)
            assert count_at == w.queue_offset + b * w.queue_stride and count_at % P.kCacheLine == 0
            end = P.queue_entry_offset(w, b, params.queue_capacity - 1) + 4 if params.queue_capacity else count_at + 4
            assert end <= count_at + w.queue_stride


def test_layout_params_validation_and_align_up():
    good = dict(pad_m=128, pad_n=256, elem_bytes=2, partial_elem_bytes=0, world=2, tiles=1, max_owned_subtiles=4,
                compute_blocks=2, comm_blocks=2, queue_capacity=1)
    assert P.layout_params_valid(P.LayoutParams(**good))
    for field, value in [("pad_m", -1), ("elem_bytes", 0), ("partial_elem_bytes", -2), ("world", 0),
                         ("tiles", -1), ("max_owned_subtiles", -1), ("compute_blocks", 0), ("comm_blocks", 0),
                         ("queue_capacity", -1)]:
        assert not P.layout_params_valid(P.LayoutParams(**dict(good, **{field: value}))), field
    rng = random.Random(81)
    for _ in range(CONFIGS):
        x, a = rng.randint(0, 10 ** 7), rng.choice([1, 4, 64, 512, 1000])
        got = P.align_up(x, a)
        assert got % a == 0 and x <= got < x + a
    # No partial region (the all-gather keeps its shard there, sized by its own parameters): it takes no bytes.
    w = P.make_window_layout(P.LayoutParams(**good))
    assert w.partial_bytes == 0 and w.reduced_offset[0] % 512 == 0


# ---------------------------------------------------------------------------------------------------------------
# epoch.hpp

def test_epoch_counters_wrap_safely():
    rng = random.Random(91)
    for _ in range(CONFIGS):
        epoch, per_call = rng.randint(0, 2 ** 40), rng.randint(1, 64)
        target = (epoch * per_call) % 2 ** 32  # a counter of per_call increments per call, after `epoch` calls
        behind, ahead = rng.randint(1, 2 ** 31 - 1), rng.randint(0, 2 ** 31 - 1)
        assert P.counter_reached((target + ahead) % 2 ** 32, target)
        assert not P.counter_reached((target - behind) % 2 ** 32, target)
    assert P.counter_reached(3, 2 ** 32 - 2)  # wrapped past the target
    assert [P.call_bank(c) for c in range(5)] == [0, 1, 0, 1, 0]


# ---------------------------------------------------------------------------------------------------------------
# The headers themselves

def _gxx():
    gxx = shutil.which(os.environ.get("CXX", "g++"))
    if gxx is None:
        pytest.skip("no C++ compiler (g++) on PATH to compile the protocol headers")
    return gxx


def _compile(args, source, tmp_path, name="tu.cpp"):
    tu = tmp_path / name
    tu.write_text(source)
    result = subprocess.run(args + [str(tu)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(args)}\n{result.stderr}"
    return result


@pytest.mark.parametrize("std", ["c++17", "c++20"])
def test_headers_compile_cleanly(std, tmp_path):
    gxx = _gxx()
    base = [gxx, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-fno-exceptions", "-fno-rtti",
            f"-I{INCLUDE}"]
    strict = ["-Wpedantic", "-Wshadow", "-Wconversion", "-Wsign-conversion"]
    assert set(PROTOCOL_HEADERS) <= set(HEADERS)
    _compile(base, "".join(f'#include "gemm_ar/{h}"\n' for h in HEADERS), tmp_path)
    _compile(base + strict, "".join(f'#include "gemm_ar/{h}"\n' for h in PROTOCOL_HEADERS), tmp_path, "strict.cpp")
    # Each header on its own (twice) too: none relies on another having been included first.
    for h in HEADERS:
        _compile(base, f'#include "gemm_ar/{h}"\n#include "gemm_ar/{h}"\n', tmp_path, f"{h}.cpp")


def test_every_function_carries_the_qualifier(tmp_path):
    """With __aicore__ defined as a section attribute, every gemm_ar function (all emitted, thanks to
    -fkeep-inline-functions) must land in that section; one without GEMM_AR_FN lands in .text."""
    gxx = _gxx()
    obj = tmp_path / "tagged.o"
    _compile([gxx, "-std=c++17", "-O0", "-c", "-fkeep-inline-functions",
              "-D__aicore__=__attribute__((section(\".text.gemm_ar_fn\")))", f"-I{INCLUDE}", "-o", str(obj)],
             "".join(f'#include "gemm_ar/{h}"\n' for h in HEADERS), tmp_path)
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) missing: cannot list the sections of the compiled functions")
    table = subprocess.run([objdump, "-t", "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    tagged, untagged = [], []
    for line in table.splitlines():
        fields = line.split()
        if " F " not in line or len(fields) < 6:
            continue
        symbol = line.split(None, 5)[-1]
        section = next(f for f in fields if f.startswith("."))
        if "gemm_ar::" in symbol:
            (tagged if section == ".text.gemm_ar_fn" else untagged).append(symbol)
    assert not untagged, untagged
    assert len(tagged) >= 40  # the whole API was seen


def test_headers_avoid_exceptions_heap_and_containers():
    allowed = {"cstdint", "cstddef"}
    for h in HEADERS:
        text = (HEADER_DIR / h).read_text()
        code = re.sub(r"//[^\n]*", "", text)
        for inc in re.findall(r"#include\s*<([^>]+)>", code):
            assert inc in allowed, (h, inc)
        for inc in re.findall(r'#include\s*"([^"]+)"', code):
            assert inc in HEADERS, (h, inc)
        for word in ("throw", "try", "new", "delete", "malloc", "std::", "vector", "string", "virtual"):
            assert not re.search(rf"\b{re.escape(word)}\b", code), (h, word)
        assert "#pragma once" in code, h


def _pto_isa_root():
    root = os.environ.get("PTO_ISA_ROOT")
    if not root:
        pytest.skip("PTO_ISA_ROOT unset: pto-isa checkout needed for the CPU-simulator compile check")
    if not (Path(root) / "include" / "pto" / "pto-inst.hpp").is_file():
        pytest.skip(f"PTO_ISA_ROOT={root} has no include/pto/pto-inst.hpp")
    return Path(root)


def _patched_pto_include(root, tmp_path):
    """g++ 12 rejects one `static_assert(false)` in pto/cpu/TReduceIdx.hpp (pto-isa wants g++ >= 13); shadow that
    file with a copy whose assertion depends on the template argument (build-time only, never in the repo)."""
    src = root / "include" / "pto" / "cpu" / "TReduceIdx.hpp"
    shadow = tmp_path / "pto_patch"
    if src.is_file():
        target = shadow / "pto" / "cpu" / "TReduceIdx.hpp"
        target.parent.mkdir(parents=True)
        target.write_text(src.read_text().replace("static_assert(false,", "static_assert(sizeof(DType) == 0,"))
    return shadow


@pytest.mark.simulator  # needs PTO_ISA_ROOT, as the kernel simulator tests
@pytest.mark.parametrize("order", ["headers_first", "pto_first"])
def test_headers_compile_in_pto_simulator(order, tmp_path):
    gxx = _gxx()
    root = _pto_isa_root()
    shadow = _patched_pto_include(root, tmp_path)
    ours = "".join(f'#include "gemm_ar/{h}"\n' for h in HEADERS)
    pto = '#include "pto/pto-inst.hpp"\n'
    includes = ours + pto if order == "headers_first" else pto + ours
    # A few values the Python side checks in depth, recomputed by the simulator build (exit code = first miss).
    body = """
#ifndef __aicore__
#error pto-inst.hpp should have defined __aicore__
#endif
int main() {
  gemm_ar::TilePlan plan;
  if (!gemm_ar::make_tile_plan(&plan, 300, 500, 100, 128, 256, 64, 4, 32)) return 1;
  if (plan.tiles != 6 || plan.pad_k != 256 || gemm_ar::stripe_rows(plan, 2, 1) != 12) return 2;
  if (gemm_ar::zigzag_tile(2, 2) != 3 || gemm_ar::block_range(10, 4, 1).begin != 3) return 3;
  if (gemm_ar::rotated_peer(1, 5, 0, 4) == 1 || gemm_ar::ag_subtile(0, 1, 4) != 7) return 4;
  const gemm_ar::WindowLayout w = gemm_ar::make_window_layout(gemm_ar::make_layout_params(plan, 2, 0, 4, 20, 4));
  if (w.total_bytes % gemm_ar::kWindowAlign != 0 || w.reduced_offset[1] <= w.reduced_offset[0]) return 5;
  return 0;
}
"""
    exe = tmp_path / "sim_probe"
    _compile([gxx, "-std=c++20", "-O0", "-Wall", "-Wextra", "-D__CPU_SIM", "-include", "stdint.h", "-include",
              "stddef.h", f"-I{INCLUDE}", f"-I{shadow}", f"-I{root / 'include'}", "-o", str(exe)],
             includes + body, tmp_path)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"simulator build returned {run.returncode}\n{run.stderr}"


def test_qualifier_macro_follows_the_compiler(tmp_path):
    """GEMM_AR_FN is `__aicore__ inline` where __aicore__ exists, `[aicore] inline` under bisheng without it,
    plain `inline` on the host (checked by preprocessing only: g++ cannot parse [aicore])."""
    gxx = _gxx()
    tu = tmp_path / "probe.cpp"
    tu.write_text('#include "gemm_ar/fn.hpp"\nQUALIFIER: GEMM_AR_FN\n')

    def expand(*defines):
        out = subprocess.run([gxx, "-E", "-P", f"-I{INCLUDE}", *defines, str(tu)], capture_output=True, text=True,
                             check=True).stdout
        return " ".join(re.search(r"QUALIFIER:(.*)", out).group(1).split())

    assert expand() == "inline"
    assert expand("-D__CPU_SIM") == "inline"
    assert expand("-D__aicore__=AICORE_ATTR") == "AICORE_ATTR inline"
    assert expand("-D__CCE_AICORE__=220") == "[aicore] inline"
    assert expand("-D__CCE_AICORE__=220", "-D__aicore__=AICORE_ATTR") == "AICORE_ATTR inline"
