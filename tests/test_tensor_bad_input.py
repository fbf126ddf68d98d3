"""A catalogue of bad inputs to the torch tensor path, one row each.

Every public call of ``pagedkv.optimized.tensor`` gets, one argument at a
time, what an engine integrator might pass by mistake: a float tensor where
positions or counts belong, a tensor on another device, lengths that
disagree, a row or position outside the table, a token count that is not the
counts' sum, ids outside a pool, objects of the wrong type. Each row must
raise exactly the typed error it names (from :mod:`pagedkv.spec.errors`,
never torch's ``RuntimeError``/``IndexError``), with a message naming the
argument, and must leave every tensor of the world as it was: block tables
(host and device), the KV cache, its host mirror, the host tier, the ``out``
buffer and the inputs themselves (docs/tensor-path.md, "Errors").

Runs on CPU, and on CUDA where present (marker ``cuda``). "Another device"
is ``meta`` on CPU and the CPU on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

from pagedkv.optimized.tensor import (  # noqa: E402
    BlockTables,
    KVCacheMemory,
    check_block_pairs,
    copy_blocks,
    slot_mapping_flat,
    slot_mapping_padded,
    swap_blocks,
    token_batch,
)
from pagedkv.optimized.tensor.host_tier import HostTierMemory, host_group_memory  # noqa: E402
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from pagedkv.spec.errors import (  # noqa: E402
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTokenCountError,
    PagedKVError,
    UnknownBlockError,
)
from pagedkv.spec.hisparse import PageTransfer, RowMirror  # noqa: E402
from pagedkv.spec.kv_cache_spec import FullAttentionSpec  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]

SPEC = FullAttentionSpec(4, 1, 2, "float32")  # 64-byte pages, key and value views
NUM_BLOCKS = 12
HOST_BLOCKS = 6


def two_group_config(num_groups: int = 2) -> KVCacheConfig:
    """One attention layer per group, each backed by its own tensor."""
    names = [f"g{g}" for g in range(num_groups)]
    return KVCacheConfig(
        NUM_BLOCKS, tuple(KVCacheTensor(SPEC.page_size_bytes * NUM_BLOCKS, (n,)) for n in names),
        tuple(KVCacheGroupSpec((n,), SPEC) for n in names))


def _fill(memory: KVCacheMemory, seed: int) -> None:
    """Distinct bytes in every page, so any write shows."""
    for arena in memory.arenas:
        n = arena.pages.numel()
        values = (torch.arange(n, dtype=torch.int64) * 7 + seed) % 251 - 125
        arena.pages.copy_(values.to(torch.int8).view_as(arena.pages))


class World:
    """The tensor path of one device in a known, valid state.

    Tables: groups of block size 4 and 2, 4 rows, widths 3 and 4 (positions
    below 8 fit every group), 12 blocks; rows 0 and 2 occupied, row 2 with an
    update not yet committed. A batch: rows ``[0, 2]``, starts ``[1, 0]``,
    counts ``[2, 3]`` (5 tokens). The same layout as bare tensors for the
    free slot-mapping functions. A filled two-group KV cache, its host
    mirror (6 blocks) and a host tier over another filled cache.
    """

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.other = torch.device("meta") if self.device.type == "cpu" else torch.device("cpu")
        self.tables = BlockTables([4, 2], 4, [3, 4], NUM_BLOCKS, device=device)
        self.tables.add_request(0, [[1, 2], [3, 4, 5]])
        self.tables.add_request(2, [[6], [7, 8]])
        self.tables.commit()
        self.tables.append_blocks(2, [[9], []])  # pending: host and device differ
        self.rows = self.ints([0, 2])
        self.starts = self.ints([1, 0])
        self.counts = self.ints([2, 3])
        self.token_rows, self.positions = token_batch(self.rows, self.starts, self.counts, 5)
        self.out = torch.full((2, 8), 7, dtype=torch.int64, device=device)
        self.table = (torch.arange(28, device=device).view(4, 7) % NUM_BLOCKS).to(torch.int32)
        self.offsets = self.ints([[0], [3]])
        self.block_sizes = self.ints([[4], [2]])
        self.config = two_group_config()
        self.memory = KVCacheMemory(self.config, device)
        _fill(self.memory, 1)
        self.host = KVCacheMemory.host_mirror(self.memory, HOST_BLOCKS)
        tier_cache = KVCacheMemory(self.config, device)
        _fill(tier_cache, 2)
        self.tier = HostTierMemory(tier_cache, HOST_BLOCKS)

    def ints(self, values: Any) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def snapshot(self) -> list[torch.Tensor]:
        """Every tensor and every table fact of the world, copied to the host."""
        tables = self.tables
        facts = [torch.tensor([[tables.num_blocks_in_row(r, g) for g in range(2)]
                               + [tables.is_occupied(r)] for r in range(4)])]
        for g in range(2):
            facts += [torch.from_numpy(tables.host_table(g).copy()), tables.table(g).cpu()]
        caches = [*self.memory.tensors, *self.host.tensors,
                  *self.tier.device_cache.tensors, *self.tier.host_cache.tensors]
        inputs = [self.rows, self.starts, self.counts, self.token_rows, self.positions,
                  self.out, self.table, self.offsets, self.block_sizes]
        return facts + [t.cpu().clone() for t in caches + inputs]


Call = Callable[[World], object]
Override = Callable[[World], dict[str, Any]]


def _call(fn: Callable[..., object], defaults: Override) -> Callable[[Override], Call]:
    """Rows built from a valid call: ``fn(**defaults(w))`` with one argument replaced."""
    def row(bad: Override) -> Call:
        return lambda w: fn(**{**defaults(w), **bad(w)})
    return row


batch = _call(token_batch, lambda w: {
    "rows": w.rows, "starts": w.starts, "counts": w.counts, "num_tokens": 5})
mapped = _call(lambda w, **kw: w.tables.slot_mapping(**kw), lambda w: {
    "w": w, "token_rows": w.token_rows, "positions": w.positions, "out": None})
padded = _call(lambda w, **kw: w.tables.slot_mapping_padded(**kw), lambda w: {
    "w": w, "token_rows": w.token_rows, "positions": w.positions, "out": w.out, "num_padded": 6})
flat = _call(slot_mapping_flat, lambda w: {
    "table": w.table, "offsets": w.offsets, "block_sizes": w.block_sizes,
    "token_rows": w.token_rows, "positions": w.positions, "out": w.out})
flat_padded = _call(slot_mapping_padded, lambda w: {
    "table": w.table, "offsets": w.offsets, "block_sizes": w.block_sizes,
    "token_rows": w.token_rows, "positions": w.positions, "out": w.out, "num_padded": 6})
tables = _call(BlockTables, lambda w: {
    "block_sizes": [4, 2], "max_num_reqs": 4, "max_blocks_per_req": [3, 4],
    "num_blocks": NUM_BLOCKS, "device": w.device})
memory = _call(KVCacheMemory, lambda w: {"config": w.config, "device": w.device})
buffers = _call(KVCacheMemory, lambda w: {"config": w.config, "device": w.device, "buffers": [
    torch.zeros(t.size, dtype=torch.int8, device=w.device) for t in w.config.kv_cache_tensors]})
mirror = _call(KVCacheMemory.host_mirror, lambda w: {"other": w.memory, "num_blocks": HOST_BLOCKS})
copies = _call(copy_blocks, lambda w: {"cache": w.memory, "pairs": [(1, 3)], "group_id": None})
swaps = _call(swap_blocks, lambda w: {"src_cache": w.memory, "dst_cache": w.host,
                                      "pairs": [(1, 3)]})
pairs = _call(check_block_pairs, lambda w: {"pairs": [(1, 3)], "src_num_blocks": NUM_BLOCKS,
                                            "dst_num_blocks": HOST_BLOCKS})
HOST_GROUPS = (KVCacheGroupSpec(("source",), SPEC, host_resident=True),)
host_groups = _call(host_group_memory, lambda w: {
    "config": KVCacheConfig(64, (), HOST_GROUPS), "host_num_blocks": HOST_BLOCKS})
tier = _call(HostTierMemory, lambda w: {"device_cache": w.memory, "host_num_blocks": HOST_BLOCKS})
WRITEBACK = PageTransfer(0, "a", 0, host_block=1, device_block=2, kind="writeback")
transfers = _call(lambda w, **kw: w.tier.run(**kw), lambda w: {"w": w, "transfers": [WRITEBACK]})
mirrors = _call(lambda w, **kw: w.tier.mirror_rows(**kw), lambda w: {
    "w": w, "mirrors": [RowMirror(4, 4, 2)]})


def method(name: str, *args: object) -> Call:
    """A ``BlockTables`` method on the world's tables."""
    return lambda w: getattr(w.tables, name)(*args)


def _floats(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


@dataclass(frozen=True)
class Case:
    """One bad input: ``run`` is the call with ``argument`` replaced by
    ``bad``; it must raise exactly ``error`` with ``message`` in its text."""

    call: str
    argument: str
    bad: str
    run: Call
    error: type[PagedKVError]
    message: str

    @property
    def id(self) -> str:
        return f"{self.call}-{self.argument}-{self.bad}".replace(" ", "_")


IAE, ITCE, UBE, ICE = InvalidArgumentError, InvalidTokenCountError, UnknownBlockError, InvalidConfigError

CASES = [
    # -- token_batch ------------------------------------------------------------------
    Case("token_batch", "rows", "float", batch(lambda w: {"rows": _floats(w.rows)}),
         IAE, "rows must have an integer dtype, got torch.float32"),
    Case("token_batch", "rows", "bool", batch(lambda w: {"rows": w.rows.bool()}),
         IAE, "rows must have an integer dtype, got torch.bool"),
    Case("token_batch", "rows", "2-D", batch(lambda w: {"rows": w.rows.view(1, 2)}),
         IAE, "rows must be 1-D, got shape (1, 2)"),
    Case("token_batch", "rows", "negative", batch(lambda w: {"rows": w.ints([0, -2])}),
         IAE, "rows[1] is -2, expected >= 0"),
    Case("token_batch", "starts", "float", batch(lambda w: {"starts": _floats(w.starts)}),
         IAE, "starts must have an integer dtype"),
    Case("token_batch", "starts", "list", batch(lambda w: {"starts": [1, 0]}),
         IAE, "starts must be a torch.Tensor, got list"),
    Case("token_batch", "starts", "other device", batch(lambda w: {"starts": w.starts.to(w.other)}),
         IAE, "starts is on"),
    Case("token_batch", "starts", "negative", batch(lambda w: {"starts": w.ints([-1, 0])}),
         IAE, "starts[0] is -1, expected >= 0"),
    Case("token_batch", "counts", "float", batch(lambda w: {"counts": _floats(w.counts)}),
         IAE, "counts must have an integer dtype, got torch.float32"),
    Case("token_batch", "counts", "longer", batch(lambda w: {"counts": w.ints([2, 3, 0])}),
         IAE, "counts has 3 entries, rows has 2"),
    Case("token_batch", "counts", "other device", batch(lambda w: {"counts": w.counts.to(w.other)}),
         IAE, "counts is on"),
    Case("token_batch", "counts", "negative", batch(lambda w: {"counts": w.ints([6, -1])}),
         ITCE, "counts[1] is -1, expected >= 0"),
    Case("token_batch", "num_tokens", "disagrees", batch(lambda w: {"num_tokens": 6}),
         ITCE, "num_tokens is 6 but counts sum to 5"),
    Case("token_batch", "num_tokens", "negative", batch(lambda w: {"num_tokens": -1}),
         ITCE, "num_tokens must be an int >= 0, got -1"),
    Case("token_batch", "num_tokens", "float", batch(lambda w: {"num_tokens": 5.0}),
         IAE, "num_tokens must be an int >= 0, got 5.0"),
    Case("token_batch", "num_tokens", "tensor", batch(lambda w: {"num_tokens": w.ints(5)}),
         IAE, "num_tokens must be an int"),
    # -- BlockTables.slot_mapping ---------------------------------------------------------
    Case("slot_mapping", "token_rows", "float", mapped(lambda w: {"token_rows": _floats(w.token_rows)}),
         IAE, "token_rows must have an integer dtype"),
    Case("slot_mapping", "token_rows", "list", mapped(lambda w: {"token_rows": [0, 0, 2, 2, 2]}),
         IAE, "token_rows must be a torch.Tensor, got list"),
    Case("slot_mapping", "token_rows", "other device",
         mapped(lambda w: {"token_rows": w.token_rows.to(w.other)}), IAE, "token_rows is on"),
    Case("slot_mapping", "token_rows", "past the table",
         mapped(lambda w: {"token_rows": w.ints([0, 0, 2, 2, 4])}),
         IAE, "token_rows[4] is 4, outside the table's rows [0, 4)"),
    Case("slot_mapping", "token_rows", "negative",
         mapped(lambda w: {"token_rows": w.ints([0, -1, 2, 2, 2])}), IAE, "token_rows[1] is -1"),
    Case("slot_mapping", "positions", "float", mapped(lambda w: {"positions": _floats(w.positions)}),
         IAE, "positions must have an integer dtype, got torch.float32"),
    Case("slot_mapping", "positions", "2-D", mapped(lambda w: {"positions": w.positions.view(5, 1)}),
         IAE, "positions must be 1-D"),
    Case("slot_mapping", "positions", "shorter", mapped(lambda w: {"positions": w.positions[:3]}),
         IAE, "positions has 3 entries, token_rows has 5"),
    Case("slot_mapping", "positions", "other device",
         mapped(lambda w: {"positions": w.positions.to(w.other)}), IAE, "positions is on"),
    Case("slot_mapping", "positions", "negative",
         mapped(lambda w: {"positions": w.ints([1, 2, -1, 1, 2])}), IAE, "positions[2] is -1"),
    Case("slot_mapping", "positions", "past a group's width",
         mapped(lambda w: {"positions": w.ints([1, 2, 0, 1, 8])}),
         IAE, "positions[4] is 8, outside [0, 8) (group 1: max_blocks_per_req 4 * block size 2)"),
    Case("slot_mapping", "out", "int32", mapped(lambda w: {"out": w.out.to(torch.int32)}),
         IAE, "out must have dtype torch.int64, got torch.int32"),
    Case("slot_mapping", "out", "too narrow", mapped(lambda w: {"out": w.out[:, :3]}),
         IAE, "out must have shape [2, >= 5]"),
    Case("slot_mapping", "out", "three groups", mapped(lambda w: {"out": w.out.repeat(2, 1)[:3]}),
         IAE, "out must have shape [2, >= 5] (groups, tokens), got (3, 8)"),
    Case("slot_mapping", "out", "other device", mapped(lambda w: {"out": w.out.to(w.other)}),
         IAE, "out is on"),
    # -- BlockTables.slot_mapping_padded ---------------------------------------------------
    Case("slot_mapping_padded", "num_padded", "below the tokens", padded(lambda w: {"num_padded": 4}),
         IAE, "num_padded must be an int in [5, 8]"),
    Case("slot_mapping_padded", "num_padded", "past out", padded(lambda w: {"num_padded": 9}),
         IAE, "num_padded must be an int in [5, 8]"),
    Case("slot_mapping_padded", "num_padded", "float", padded(lambda w: {"num_padded": 6.0}),
         IAE, "got 6.0"),
    Case("slot_mapping_padded", "out", "None", padded(lambda w: {"out": None}),
         IAE, "out must be a torch.Tensor, got NoneType"),
    Case("slot_mapping_padded", "positions", "float", padded(lambda w: {"positions": _floats(w.positions)}),
         IAE, "positions must have an integer dtype"),
    Case("slot_mapping_padded", "token_rows", "past the table",
         padded(lambda w: {"token_rows": w.ints([0, 0, 2, 2, 9])}), IAE, "token_rows[4] is 9"),
    Case("slot_mapping_padded", "positions", "past a group's width",
         padded(lambda w: {"positions": w.ints([1, 2, 0, 1, 11])}), IAE, "positions[4] is 11"),
    # -- slot_mapping_flat, slot_mapping_padded (free functions) ---------------------------
    Case("slot_mapping_flat", "table", "float", flat(lambda w: {"table": _floats(w.table)}),
         IAE, "table must have an integer dtype"),
    Case("slot_mapping_flat", "table", "1-D", flat(lambda w: {"table": w.table.view(-1)}),
         IAE, "table must be 2-D"),
    Case("slot_mapping_flat", "offsets", "1-D", flat(lambda w: {"offsets": w.offsets.view(-1)}),
         IAE, "offsets must be 2-D"),
    Case("slot_mapping_flat", "offsets", "other device", flat(lambda w: {"offsets": w.offsets.to(w.other)}),
         IAE, "offsets is on"),
    Case("slot_mapping_flat", "offsets", "past the table", flat(lambda w: {"offsets": w.ints([[0], [7]])}),
         IAE, "offsets [0, 7] must increase from >= 0 and stay below the table's width 7"),
    Case("slot_mapping_flat", "offsets", "decreasing", flat(lambda w: {"offsets": w.ints([[3], [0]])}),
         IAE, "offsets [3, 0] must increase"),
    Case("slot_mapping_flat", "offsets", "three groups", flat(lambda w: {"offsets": w.ints([[0], [2], [4]])}),
         IAE, "offsets and block_sizes must both have shape"),
    Case("slot_mapping_flat", "block_sizes", "float", flat(lambda w: {"block_sizes": _floats(w.block_sizes)}),
         IAE, "block_sizes must have an integer dtype"),
    Case("slot_mapping_flat", "block_sizes", "zero", flat(lambda w: {"block_sizes": w.ints([[4], [0]])}),
         IAE, "block_sizes [4, 0] must all be >= 1"),
    Case("slot_mapping_flat", "token_rows", "past the table",
         flat(lambda w: {"token_rows": w.ints([0, 0, 2, 2, 4])}), IAE, "token_rows[4] is 4"),
    Case("slot_mapping_flat", "positions", "past a group's width",
         flat(lambda w: {"positions": w.ints([1, 2, 0, 1, 8])}), IAE, "positions[4] is 8, outside [0, 8)"),
    Case("slot_mapping_flat", "out", "float", flat(lambda w: {"out": _floats(w.out)}),
         IAE, "out must have dtype torch.int64"),
    Case("slot_mapping_padded (free)", "num_padded", "past out", flat_padded(lambda w: {"num_padded": 9}),
         IAE, "num_padded must be an int in [5, 8]"),
    Case("slot_mapping_padded (free)", "out", "None", flat_padded(lambda w: {"out": None}),
         IAE, "out must be a torch.Tensor, got None"),
    Case("slot_mapping_padded (free)", "positions", "negative",
         flat_padded(lambda w: {"positions": w.ints([1, 2, 0, -1, 2])}), IAE, "positions[3] is -1"),
    # -- BlockTables(...) ----------------------------------------------------------------
    Case("BlockTables", "block_sizes", "float", tables(lambda w: {"block_sizes": [4.0, 2]}),
         IAE, "block_sizes must be a positive int, got 4.0"),
    Case("BlockTables", "block_sizes", "an int", tables(lambda w: {"block_sizes": 4}),
         IAE, "block_sizes must be a sequence of ints"),
    Case("BlockTables", "max_num_reqs", "zero", tables(lambda w: {"max_num_reqs": 0}),
         IAE, "max_num_reqs must be a positive int, got 0"),
    Case("BlockTables", "max_blocks_per_req", "one group", tables(lambda w: {"max_blocks_per_req": [3]}),
         IAE, "one max_blocks_per_req per group"),
    Case("BlockTables", "num_blocks", "a string", tables(lambda w: {"num_blocks": "12"}),
         IAE, "num_blocks must be a positive int, got '12'"),
    Case("BlockTables", "device", "malformed", tables(lambda w: {"device": "nope"}),
         IAE, "device 'nope' is not a torch device"),
    Case("BlockTables", "device", "absent", tables(lambda w: {"device": "cuda:99"}),
         IAE, "device 'cuda:99' is not present"),
    Case("BlockTables", "pin_memory", "a string", tables(lambda w: {"pin_memory": "yes"}),
         IAE, "pin_memory must be a bool, got 'yes'"),
    # -- BlockTables methods ---------------------------------------------------------------
    Case("add_request", "row", "past the table", method("add_request", 4, [[1], [2]]),
         IAE, "row 4 outside [0, 4)"),
    Case("add_request", "row", "a string", method("add_request", "1", [[1], [2]]),
         IAE, "row '1' outside [0, 4)"),
    Case("add_request", "row", "occupied", method("add_request", 0, [[1], [2]]),
         IAE, "row 0 is already occupied"),
    Case("add_request", "block_ids", "one group", method("add_request", 1, [[1]]),
         IAE, "block_ids must have one list per group (2), got 1"),
    Case("add_request", "block_ids", "id past the pool", method("add_request", 1, [[1], [12]]),
         UBE, "block_ids[1]: block id 12 outside [0, 12)"),
    Case("add_request", "block_ids", "negative id", method("add_request", 1, [[-1], [2]]),
         UBE, "block_ids[0]: block id -1 outside [0, 12)"),
    Case("add_request", "block_ids", "float ids", method("add_request", 1, [[1.5], [2]]),
         IAE, "block_ids[0] must be a list of ints"),
    Case("add_request", "block_ids", "ragged", method("add_request", 1, [[1, [2]], []]),
         IAE, "block_ids[0] must be a list of ints"),
    Case("add_request", "block_ids", "None", method("add_request", 1, None),
         IAE, "block_ids must be one list of ints per group, got None"),
    Case("add_request", "block_ids", "wider than the table", method("add_request", 1, [[1, 2, 3, 4], []]),
         IAE, "block_ids[0]: 4 blocks exceed max_blocks_per_req[0] 3"),
    Case("append_blocks", "row", "free", method("append_blocks", 1, [[1], [2]]),
         IAE, "row 1 is free"),
    Case("append_blocks", "block_ids", "wider than the table", method("append_blocks", 0, [[], [6, 7]]),
         IAE, "block_ids[1]: 5 blocks exceed max_blocks_per_req[1] 4"),
    Case("set_null", "group_id", "past the groups", method("set_null", 0, 2, 0, 1),
         IAE, "group_id 2 outside [0, 2)"),
    Case("set_null", "stop", "past the row", method("set_null", 0, 0, 0, 3),
         IAE, "start, stop [0, 3) must be ints within the row's 2 blocks"),
    Case("set_null", "start", "float", method("set_null", 0, 0, 0.0, 1),
         IAE, "start, stop [0.0, 1)"),
    Case("remove_request", "row", "free", method("remove_request", 3), IAE, "row 3 is free"),
    Case("move_row", "dst", "occupied", method("move_row", 0, 2), IAE, "destination row 2 is occupied"),
    Case("move_row", "src", "free", method("move_row", 1, 3), IAE, "source row 1 is free"),
    Case("swap_rows", "a", "negative", method("swap_rows", -1, 0), IAE, "row -1 outside [0, 4)"),
    Case("table", "group_id", "past the groups", method("table", 2), IAE, "group_id 2 outside [0, 2)"),
    Case("table", "group_id", "negative", method("table", -1), IAE, "group_id -1 outside [0, 2)"),
    Case("host_table", "group_id", "past the groups", method("host_table", 2),
         IAE, "group_id 2 outside [0, 2)"),
    Case("num_blocks_in_row", "group_id", "past the groups", method("num_blocks_in_row", 0, 5),
         IAE, "group_id 5 outside [0, 2)"),
    Case("is_occupied", "row", "past the table", method("is_occupied", 9), IAE, "row 9 outside [0, 4)"),
    Case("check_batch", "positions", "float", method("check_batch", [0], [0.5]),
         IAE, "positions must be a 1-D list of ints"),
    Case("check_batch", "positions", "shorter", method("check_batch", [0, 0], [0]),
         IAE, "positions has 1 entries, token_rows has 2"),
    Case("check_batch", "token_rows", "free row", method("check_batch", [0, 1], [0, 0]),
         IAE, "token_rows[1] is 1: out of range [0, 4) or free"),
    Case("check_batch", "positions", "past the row's blocks", method("check_batch", [0], [8]),
         IAE, "positions[0] is 8, past the 2 blocks of row 0 in group 0"),
    # -- copy_blocks, swap_blocks, check_block_pairs ---------------------------------------
    Case("copy_blocks", "cache", "None", copies(lambda w: {"cache": None}),
         IAE, "cache must be a KVCacheMemory, got NoneType"),
    Case("copy_blocks", "pairs", "float", copies(lambda w: {"pairs": [(1.0, 3.0)]}),
         IAE, "pairs must be (src, dst) int pairs"),
    Case("copy_blocks", "pairs", "ragged", copies(lambda w: {"pairs": [(1, 3), (2,)]}),
         IAE, "pairs must be (src, dst) int pairs"),
    Case("copy_blocks", "pairs", "a tensor", copies(lambda w: {"pairs": w.ints([[1, 3]])}),
         IAE, "pairs must be a sequence of (src, dst) int pairs or a numpy array"),
    Case("copy_blocks", "pairs", "null destination after a good pair",
         copies(lambda w: {"pairs": [(1, 3), (2, 0)]}),
         IAE, "pairs[1]: the null block 0 cannot be a destination"),
    Case("copy_blocks", "pairs", "destination past the pool", copies(lambda w: {"pairs": [(1, 12)]}),
         UBE, "pairs[0]: destination block 12 outside [0, 12)"),
    Case("copy_blocks", "pairs", "destination twice", copies(lambda w: {"pairs": [(1, 3), (2, 3)]}),
         IAE, "pairs[1]: destination block 3 appears twice"),
    Case("copy_blocks", "group_id", "past the groups", copies(lambda w: {"group_id": 2}),
         IAE, "group_id 2 outside [0, 2)"),
    Case("swap_blocks", "dst_cache", "a string", swaps(lambda w: {"dst_cache": "host"}),
         IAE, "dst_cache must be a KVCacheMemory, got str"),
    Case("swap_blocks", "dst_cache", "other layers",
         swaps(lambda w: {"dst_cache": KVCacheMemory(two_group_config(1), "cpu")}),
         IAE, "src_cache and dst_cache do not hold the same layers and specs"),
    Case("swap_blocks", "pairs", "source past the pool", swaps(lambda w: {"pairs": [(12, 1)]}),
         UBE, "pairs[0]: source block 12 outside [0, 12)"),
    Case("swap_blocks", "pairs", "destination past the host pool", swaps(lambda w: {"pairs": [(1, 6)]}),
         UBE, "pairs[0]: destination block 6 outside [0, 6)"),
    Case("check_block_pairs", "src_num_blocks", "a string", pairs(lambda w: {"src_num_blocks": "12"}),
         IAE, "src_num_blocks must be an int >= 1, got '12'"),
    Case("check_block_pairs", "dst_num_blocks", "zero", pairs(lambda w: {"dst_num_blocks": 0}),
         IAE, "dst_num_blocks must be an int >= 1, got 0"),
    # -- KVCacheMemory ---------------------------------------------------------------------
    Case("KVCacheMemory", "config", "a string", memory(lambda w: {"config": "config"}),
         IAE, "config must be a KVCacheConfig, got str"),
    Case("KVCacheMemory", "device", "malformed", memory(lambda w: {"device": "nope"}),
         IAE, "device 'nope' is not a torch device"),
    Case("KVCacheMemory", "pin_memory", "a string", memory(lambda w: {"pin_memory": "yes"}),
         IAE, "pin_memory must be a bool, got 'yes'"),
    Case("KVCacheMemory", "buffers", "too few", buffers(lambda w: {"buffers": []}),
         ICE, "expected 2 buffers"),
    Case("KVCacheMemory", "buffers", "not tensors", buffers(lambda w: {"buffers": [b"x", b"y"]}),
         ICE, "buffers[0] must be a torch.Tensor, got bytes"),
    Case("KVCacheMemory", "buffers", "float", buffers(lambda w: {"buffers": [
        torch.zeros(t.size, device=w.device) for t in w.config.kv_cache_tensors]}),
         ICE, "buffers[0] must be a contiguous 1-D int8 tensor, got dtype torch.float32"),
    Case("KVCacheMemory", "buffers", "too small", buffers(lambda w: {"buffers": [
        torch.zeros(t.size - 1, dtype=torch.int8, device=w.device) for t in w.config.kv_cache_tensors]}),
         ICE, "buffers[0] has 767 bytes, kv_cache_tensors[0].size is 768"),
    Case("KVCacheMemory", "buffers", "other device", buffers(lambda w: {"buffers": [
        torch.zeros(t.size, dtype=torch.int8, device=w.other) for t in w.config.kv_cache_tensors]}),
         ICE, "buffers[0] is on"),
    Case("host_mirror", "num_blocks", "zero", mirror(lambda w: {"num_blocks": 0}),
         ICE, "num_blocks must be an int >= 1, got 0"),
    Case("host_mirror", "num_blocks", "float", mirror(lambda w: {"num_blocks": 2.5}),
         ICE, "num_blocks must be an int >= 1, got 2.5"),
    Case("host_mirror", "other", "None", mirror(lambda w: {"other": None}),
         IAE, "other must be a KVCacheMemory, got NoneType"),
    Case("layer", "name", "unknown", lambda w: w.memory.layer("nope"),
         IAE, "name 'nope' is not a layer of this cache"),
    # -- host tier -------------------------------------------------------------------------
    Case("host_group_memory", "config", "no host-resident group", host_groups(
        lambda w: {"config": w.config}), ICE, "no host_resident group"),
    Case("host_group_memory", "config", "a string", host_groups(lambda w: {"config": "config"}),
         IAE, "config must be a KVCacheConfig, got str"),
    Case("host_group_memory", "host_num_blocks", "one", host_groups(lambda w: {"host_num_blocks": 1}),
         ICE, "host_num_blocks must be an int >= 2, got 1"),
    Case("host_group_memory", "pin_memory", "a string", host_groups(lambda w: {"pin_memory": "yes"}),
         IAE, "pin_memory must be a bool or None, got 'yes'"),
    Case("HostTierMemory", "device_cache", "None", tier(lambda w: {"device_cache": None}),
         IAE, "device_cache must be a KVCacheMemory, got NoneType"),
    Case("HostTierMemory", "host_num_blocks", "float", tier(lambda w: {"host_num_blocks": 1.5}),
         ICE, "host_num_blocks must be an int >= 2, got 1.5"),
    Case("HostTierMemory.run", "transfers", "restore past the host pool after a writeback",
         transfers(lambda w: {"transfers": [
             WRITEBACK, PageTransfer(1, "a", 1, host_block=6, device_block=3, kind="restore")]}),
         UBE, "transfers[1].host_block is 6, outside its pool [0, 6)"),
    Case("HostTierMemory.run", "transfers", "restore onto the null block after a writeback",
         transfers(lambda w: {"transfers": [
             WRITEBACK, PageTransfer(1, "a", 1, host_block=3, device_block=0, kind="restore")]}),
         IAE, "the null block 0 cannot be a destination"),
    Case("HostTierMemory.run", "transfers", "unknown kind", transfers(lambda w: {"transfers": [
        PageTransfer(0, "a", 0, 1, 2, kind="teleport")]}),  # type: ignore[arg-type]
         IAE, "has kind 'teleport', expected writeback or restore"),
    Case("HostTierMemory.run", "transfers", "a tuple", transfers(lambda w: {"transfers": [(1, 2)]}),
         IAE, "transfers[0] must be a PageTransfer, got tuple"),
    Case("HostTierMemory.mirror_rows", "mirrors", "bad after a good one", mirrors(lambda w: {"mirrors": [
        RowMirror(4, 4, 2), RowMirror(4, 4, 5)]}), IAE, "mirrors[1] RowMirror"),
    Case("HostTierMemory.mirror_rows", "mirrors", "a tuple", mirrors(lambda w: {"mirrors": [(4, 4, 2)]}),
         IAE, "mirrors[0] must be a RowMirror, got tuple"),
    Case("HostTierMemory.mirror_rows", "mirrors", "float slot", mirrors(lambda w: {"mirrors": [
        RowMirror(4.0, 4, 1)]}), IAE, "mirrors[0].device_slot must be an int >= 0, got 4.0"),  # type: ignore[arg-type]
]

VALID_CALLS: dict[str, Call] = {
    "token_batch": batch(lambda w: {}), "slot_mapping": mapped(lambda w: {}),
    "slot_mapping_padded": padded(lambda w: {}), "slot_mapping_flat": flat(lambda w: {}),
    "slot_mapping_padded (free)": flat_padded(lambda w: {}), "BlockTables": tables(lambda w: {}),
    "KVCacheMemory": memory(lambda w: {}), "KVCacheMemory buffers": buffers(lambda w: {}),
    "host_mirror": mirror(lambda w: {}), "copy_blocks": copies(lambda w: {}),
    "swap_blocks": swaps(lambda w: {}), "check_block_pairs": pairs(lambda w: {}),
    "host_group_memory": host_groups(lambda w: {}), "HostTierMemory": tier(lambda w: {}),
    "HostTierMemory.run": transfers(lambda w: {}), "HostTierMemory.mirror_rows": mirrors(lambda w: {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_typed_and_changes_nothing(device: str, case: Case) -> None:
    world = World(device)
    before = world.snapshot()
    with pytest.raises(PagedKVError) as raised:
        case.run(world)
    assert type(raised.value) is case.error, (type(raised.value), raised.value)
    assert case.message in str(raised.value), str(raised.value)
    after = world.snapshot()
    assert len(after) == len(before)
    for i, (old, new) in enumerate(zip(before, after)):
        assert torch.equal(old, new), f"tensor {i} of the world changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(VALID_CALLS))
def test_the_valid_call_each_row_departs_from_is_accepted(device: str, name: str) -> None:
    """Each row changes one argument of a call that succeeds: the refusal is
    the bad argument's doing."""
    VALID_CALLS[name](World(device))


def test_the_table_covers_every_public_call() -> None:
    calls = {case.call for case in CASES}
    assert len(CASES) >= 34
    assert {"token_batch", "slot_mapping", "slot_mapping_padded", "slot_mapping_flat",
            "BlockTables", "add_request", "append_blocks", "set_null", "remove_request",
            "move_row", "swap_rows", "table", "host_table", "num_blocks_in_row", "is_occupied",
            "check_batch", "copy_blocks", "swap_blocks", "check_block_pairs", "KVCacheMemory",
            "host_mirror", "layer", "host_group_memory", "HostTierMemory", "HostTierMemory.run",
            "HostTierMemory.mirror_rows"} <= calls
