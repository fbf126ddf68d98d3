"""The pure rules of the host tier (spec/host_tier.md), as the reference states them.

Each function reads plain values (rows, counts, page sets, maps) and returns
a decision or raises a typed error; none holds or changes state.
``pagedkv.reference.features.hisparse`` asks them what an operation needs,
which pages it touches and whether it is refused.

Written apart from ``pagedkv.optimized.host_tier``'s twin: page counts are
counted page by page, mirrors and event runs are built by walking every page,
so the lockstep machine (tests/test_hisparse_lockstep.py) compares two
versions; tests/test_hisparse_rules.py checks these against their definitions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pagedkv.spec.errors import ExceedsMaxModelLenError, InvalidArgumentError, InvalidTokenCountError
from pagedkv.spec.hisparse import FenceHold, HostCacheEvent, HostTierConfig, ResidencyUpdate, RowMirror
from pagedkv.spec.types import BlockHash

# In the order of the module: argument checks, then allocate, then the step and release rules.
__all__ = ["check_token_count", "AllocationCounts", "plan_allocation", "count_allocation", "full_sequence_need",
           "import_pages", "writeback_window", "wants_hot_region", "check_transfer_ids", "residency_update",
           "row_mirrors", "writeback_tokens", "tally_worker_counts", "check_block_count", "check_held_blocks",
           "stored_events", "check_host_block_ids", "fence_hold"]


def _pages(num_tokens: int, block_size: int) -> int:
    """How many pages the first ``num_tokens`` tokens touch (page ``p`` holds
    tokens ``[p * block_size, (p + 1) * block_size)``), counted page by page."""
    return len(range(0, num_tokens, block_size))


def _whole_pages(num_tokens: int, block_size: int) -> int:
    """How many pages the first ``num_tokens`` tokens fill to the end."""
    return sum(1 for page in range(_pages(num_tokens, block_size)) if (page + 1) * block_size <= num_tokens)


def check_token_count(name: str, value: object, max_model_len: int | None = None) -> int:
    """Return ``value`` if it is a token count: an int >= 0, and no more than
    ``max_model_len`` when one is given.

    Raises:
        InvalidTokenCountError: not an int, or negative.
        ExceedsMaxModelLenError: above ``max_model_len``.
    """
    if not (type(value) is int and value >= 0):
        raise InvalidTokenCountError(f"{name} must be an int >= 0, got {value!r}")
    if max_model_len is None or value <= max_model_len:
        return value
    raise ExceedsMaxModelLenError(f"{name} {value} exceeds max_model_len {max_model_len}")


@dataclass(frozen=True, slots=True)
class AllocationCounts:
    """An ``allocate``'s needs, all counted before any block is taken."""

    # What the two pools give: fresh host blocks, and the hit blocks to
    # take out of the host free queue; fresh device blocks, and the hot region.
    host_new: int
    """The fresh host blocks."""
    free_hits: int
    """The hit blocks sitting in the host free queue (holding them shortens that queue as well)."""
    device_new: int
    """The fresh device blocks of resident pages (the hot region not included)."""
    hot_n: int
    """The hot blocks to take (0 when the region is held or not wanted)."""
    # How the request's pages start out, and the hashes it holds after the call.
    host_only: int
    """The leading new pages with no device block (the hit's, and the import's but its last)."""
    clean_hits: int
    """The leading hit pages clean at once; the rest the import fills (HOST-14)."""
    imported: int
    """The tokens an import covers, the local hit included (0: no import)."""
    hashes: list[BlockHash]
    """The block hashes the request has after the call."""
    cow: int = 0
    """1 when the computed tokens stop inside a hit block: only a capacity
    query counts it, ``allocate`` refuses it."""


def plan_allocation(cfg: HostTierConfig, request_id: str, num_tokens: int, hit: Sequence[int],
                    block_hashes: Sequence[BlockHash] | None, num_external_tokens: int, *, held_pages: int,
                    held_hashes: Sequence[BlockHash], has_hot: bool, hot_required: bool,
                    host_hash_of: Mapping[int, BlockHash], host_ref: Sequence[int],
                    num_local_tokens: int | None = None) -> AllocationCounts:
    """Check an ``allocate`` and count its needs (spec/host_tier.md, allocate):
    :func:`count_allocation`, then the hit against the cache.

    The request as it stands: ``held_pages``, ``held_hashes``, ``has_hot``,
    ``hot_required`` (0, (), False, False when it holds nothing). The host
    pool: ``host_hash_of`` (cached block -> its hash) and ``host_ref``
    (reference counts).

    Raises:
        InvalidTokenCountError, ExceedsMaxModelLenError: a bad token count.
        InvalidArgumentError: as ``count_allocation``; also a hit block that
            is not the one cached under the hash at its place, a block given
            twice, or ``num_local_tokens`` ending inside a hit page.
    """
    counts = count_allocation(cfg, request_id, num_tokens, hit, num_external_tokens,
                              held_pages=held_pages, has_hot=has_hot, hot_required=hot_required,
                              host_ref=host_ref, num_local_tokens=num_local_tokens)
    hashes = list(held_hashes) if block_hashes is None else list(block_hashes)
    for place, block in enumerate(hit):
        cached_here = place < len(hashes) and host_hash_of.get(block) == hashes[place]
        if not cached_here:
            raise InvalidArgumentError(
                f"hit[{place}] = {block!r} is not the host block cached under block_hashes[{place}]")
    if any(block in hit[:place] for place, block in enumerate(hit)):
        raise InvalidArgumentError("hit repeats a block")
    if counts.cow:  # the computed tokens must end on a page end of the hit
        raise InvalidArgumentError(f"num_local_tokens {num_local_tokens} must be whole pages of the hit")
    return dataclasses.replace(counts, hashes=hashes)


def count_allocation(cfg: HostTierConfig, request_id: str, num_tokens: int, hit: Sequence[int],
                     num_external_tokens: int, *, held_pages: int, has_hot: bool, hot_required: bool,
                     host_ref: Sequence[int], num_local_tokens: int | None = None) -> AllocationCounts:
    """Count what an allocation of this shape needs, the hit taken as given
    (so ``capacity_needed`` may name blocks the cache does not hold, and
    computed tokens stopping inside a hit block, copied before it is
    written: ``cow``). ``hashes`` stays empty.

    Raises:
        InvalidTokenCountError, ExceedsMaxModelLenError: a bad token count.
        InvalidArgumentError: a hit for a request already holding blocks,
            longer than the pages, or naming a block outside the host pool;
            an import for a request holding blocks or covering more than
            ``num_tokens``; ``num_local_tokens`` (default: the whole hit)
            past the hit, or short of it while the hit reaches past the import.
    """
    bs = cfg.block_size
    check_token_count("num_tokens", num_tokens, cfg.max_model_len)
    pages = _pages(num_tokens, bs)
    if hit and held_pages:
        raise InvalidArgumentError(f"hit given for request {request_id!r}, which already holds blocks")
    if hit and len(hit) > pages:
        raise InvalidArgumentError(f"hit has {len(hit)} blocks, more than the {pages} pages of num_tokens")
    for place, block in enumerate(hit):
        if not (type(block) is int and 0 < block < cfg.host_num_blocks):
            raise InvalidArgumentError(f"hit[{place}] = {block!r} is not a host block")
    check_token_count("num_external_tokens", num_external_tokens)
    hit_tokens = len(hit) * bs
    local = hit_tokens if num_local_tokens is None else check_token_count("num_local_tokens", num_local_tokens)
    if local > hit_tokens:
        raise InvalidArgumentError(f"num_local_tokens {local} reaches past the {len(hit)}-block hit")
    clean_hits = _whole_pages(local, bs)
    imported = 0 if num_external_tokens == 0 else local + num_external_tokens
    if num_external_tokens and (held_pages or imported > num_tokens):
        raise InvalidArgumentError(
            f"num_external_tokens {num_external_tokens}: an import needs a request holding "
            f"nothing and hit + external tokens <= num_tokens {num_tokens}")
    import_pages_written = _pages(imported, bs)  # the hit's pages included
    if len(hit) > _pages(local, bs) and len(hit) > import_pages_written:
        raise InvalidArgumentError(
            f"hit has {len(hit)} blocks, past the {clean_hits} computed pages and the "
            f"{import_pages_written} pages the import covers (num_external_tokens {num_external_tokens})")
    # HOST-14: an import's pages stay host-only but its last, which the engine
    # replays into; without an import, every hit page is host-only.
    host_only = import_pages_written - 1 if imported else len(hit)
    wants_hot = hot_required or imported > 0 or len(hit) > 0
    return AllocationCounts(
        hashes=[], imported=imported, clean_hits=clean_hits, host_only=host_only,
        host_new=max(0, pages - held_pages - len(hit)),
        device_new=max(0, pages - held_pages - host_only),
        free_hits=len([block for block in hit if host_ref[block] == 0]),
        hot_n=cfg.hot_blocks_per_request if wants_hot and not has_hot else 0,
        cow=1 if hit and local % bs != 0 else 0)


def full_sequence_need(cfg: HostTierConfig, full_sequence_tokens: int, *, held_pages: int,
                       hot_missing: bool) -> tuple[int, int]:
    """(host, device) blocks a request holding ``held_pages`` pages still
    needs for ``full_sequence_tokens`` tokens: one host block a page; device
    blocks for the pages inside the admission window (D-HOST-11), and the
    hot region when it is required but not held (``hot_missing``)."""
    check_token_count("full_sequence_tokens", full_sequence_tokens, cfg.max_model_len)
    pages = _pages(full_sequence_tokens, cfg.block_size)
    window = cfg.admission_window
    resident = len([page for page in range(pages) if window is None or page < window])
    host_blocks = max(0, pages - held_pages)
    device_blocks = max(0, resident - held_pages) + (cfg.hot_blocks_per_request if hot_missing else 0)
    return host_blocks, device_blocks


def import_pages(importing: int, block_size: int) -> tuple[int, int]:
    """For a landed import of ``importing`` tokens: (how many pages it fills,
    which become clean; the page holding its last token, which gets a restore)."""
    last_token = importing - 1
    return _whole_pages(importing, block_size), last_token // block_size


def writeback_window(block_size: int, num_computed_tokens: int, row_len: int,
                     importing: int) -> range:
    """The pages a write-back may be planned for: the row's sealed pages
    (computed to their end), past the pages an import is still writing."""
    check_token_count("num_computed_tokens", num_computed_tokens)
    sealed = [page for page in range(row_len) if (page + 1) * block_size <= num_computed_tokens]
    return range(_pages(importing, block_size), len(sealed))


def wants_hot_region(cfg: HostTierConfig, free_device_blocks: int, row_len: int) -> bool:
    """Whether ``update_residency`` asks a request without a hot region for
    one: the device pool is below the watermark, or the row has reached the
    admission window (older pages are taken to move to host)."""
    below_watermark = free_device_blocks < cfg.device_watermark
    reached_window = cfg.admission_window is not None and row_len >= cfg.admission_window
    return below_watermark or reached_window


def check_transfer_ids(transfer_ids: Sequence[int], in_flight: Collection[int]) -> None:
    """Refuse ``transfer_ids`` naming an id twice or one not in flight
    (InvalidArgumentError; ``complete`` then changes nothing)."""
    repeated = any(tid in transfer_ids[:place] for place, tid in enumerate(transfer_ids))
    unknown = any(tid not in in_flight for tid in transfer_ids)
    if repeated or unknown:
        raise InvalidArgumentError(f"transfer_ids {list(transfer_ids)!r} name an unknown or repeated transfer")


def residency_update(resident_row: Sequence[int], synced: int,
                     stale: Collection[int]) -> ResidencyUpdate | None:
    """What the worker lacks of one row, or ``None``: the stale pages in
    ascending order, then every page from ``synced`` to the row's end, each
    with its device block (0: host-only)."""
    lacking = [page for page in sorted(stale)] + [page for page in range(len(resident_row)) if page >= synced]
    if lacking:
        return ResidencyUpdate(tuple(lacking), tuple(resident_row[page] for page in lacking))
    return None


def row_mirrors(block_size: int, resident_row: Sequence[int], host_row: Sequence[int],
                num_computed_tokens: int, num_scheduled_tokens: int) -> list[RowMirror]:
    """Where the rows of tokens ``[num_computed_tokens, +num_scheduled_tokens)``
    go on the device and in the host pool, page by page: one mirror per page
    of the row those tokens touch, except host-only pages (no device block).

    Raises:
        InvalidTokenCountError: either count is not an int >= 0.
    """
    check_token_count("num_computed_tokens", num_computed_tokens)
    check_token_count("num_scheduled_tokens", num_scheduled_tokens)
    start, end = num_computed_tokens, num_computed_tokens + num_scheduled_tokens
    mirrors: list[RowMirror] = []
    for page, device_block in enumerate(resident_row):
        first = max(start, page * block_size)
        stop = min(end, (page + 1) * block_size)
        if first >= stop or device_block == 0:
            continue  # no scheduled token on this page, or nothing on the device
        offset = first - page * block_size
        mirrors.append(RowMirror(device_block * block_size + offset, host_row[page] * block_size + offset,
                                 stop - first))
    return mirrors


def writeback_tokens(cfg: HostTierConfig, num_tokens: int) -> int:
    """The computed tokens ``advance`` may write back once a step brings the
    request to ``num_tokens``: all but the last ``num_reprefillable_tokens``,
    which the engine prefills again (a write-back of them would be stale)."""
    check_token_count("num_tokens", num_tokens)
    reprefilled = min(num_tokens, cfg.num_reprefillable_tokens)
    return num_tokens - reprefilled


def tally_worker_counts(counts: Mapping[int, tuple[int, int]], in_flight: Collection[int],
                        enqueued: Mapping[int, int], completed: Mapping[int, int],
                        ) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """Per-worker transfer counts (``report_transfers``, D-HOST-12), transfer by transfer.

    ``counts``: transfer id -> (workers expected, workers done) so far. An
    in-flight transfer expects as many workers as its first nonzero
    ``enqueued`` count; ``completed`` counts add up; reports of transfers not
    in flight (already landed) are ignored. Returns the new ``counts``
    without the finished transfers, and those, ascending.

    Raises:
        InvalidArgumentError: a count that is not an int >= 0.
    """
    for name, reports in (("enqueued", enqueued), ("completed", completed)):
        for transfer_id, count in reports.items():
            if not (type(count) is int and count >= 0):
                raise InvalidArgumentError(f"{name}[{transfer_id!r}] must be an int >= 0, got {count!r}")
    tallies: dict[int, tuple[int, int]] = {}
    for transfer_id in list(counts) + [t for t in list(enqueued) + list(completed) if t not in counts]:
        if transfer_id not in in_flight or transfer_id in tallies:
            continue
        expected, done = counts.get(transfer_id, (0, 0))
        expected = expected or enqueued.get(transfer_id, 0)
        tallies[transfer_id] = (expected, done + completed.get(transfer_id, 0))
    finished = sorted(t for t, (expected, done) in tallies.items() if expected > 0 and done >= expected)
    return {t: tally for t, tally in tallies.items() if t not in finished}, finished


def check_block_count(num_blocks: object) -> int:
    """Return ``num_blocks`` of ``take_shared``/``take_host`` if it is an int >= 0 (else InvalidArgumentError)."""
    if type(num_blocks) is int and num_blocks >= 0:
        return num_blocks
    raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")


def check_held_blocks(block_ids: Sequence[int], held: Collection[int], holder: str) -> list[int]:
    """The ids a caller gives back (``free_shared``/``free_host``) as a list,
    if each is ``held`` by that caller and none is given twice (else
    InvalidArgumentError)."""
    ids = list(block_ids)
    given_twice = any(block in ids[:place] for place, block in enumerate(ids))
    if given_twice or not all(block in held for block in ids):
        raise InvalidArgumentError(f"block_ids {ids!r} name a block {holder} does not hold, or repeat one")
    return ids


def stored_events(request_id: str, detached: bool, block_hashes: Sequence[BlockHash],
                  stored: Sequence[tuple[int, int]]) -> list[HostCacheEvent]:
    """The ``stored`` events of one publication. ``stored``: the (page, host
    block) pairs whose hash entered the cache, ascending. The pairs are cut
    into runs of consecutive pages; each run is one event, whose parent is
    the hash of the page just before it (``None`` for page 0)."""
    runs: list[list[tuple[int, int]]] = []
    for page, block in stored:
        continues_run = bool(runs) and runs[-1][-1][0] + 1 == page
        if continues_run:
            runs[-1].append((page, block))
        else:
            runs.append([(page, block)])
    events: list[HostCacheEvent] = []
    for run in runs:
        first_page = run[0][0]
        parent = None if first_page == 0 else block_hashes[first_page - 1]
        events.append(HostCacheEvent("stored", tuple(block_hashes[page] for page, _ in run),
                                     tuple(block for _, block in run), request_id, first_page, parent, detached))
    return events


def check_host_block_ids(block_ids: Iterable[int], host_num_blocks: int) -> list[int]:
    """The ids ``evict_host_blocks`` names, as a list, if each is a host block
    in ``[1, host_num_blocks)`` (else InvalidArgumentError naming the first other)."""
    ids = list(block_ids)
    outside = [block for block in ids if not (type(block) is int and 0 < block < host_num_blocks)]
    if outside:
        raise InvalidArgumentError(f"block_ids: {outside[0]!r} is not a host block in [1, {host_num_blocks})")
    return ids


def fence_hold(fence_id: int, host_row: Sequence[int], resident_row: Sequence[int],
               clean: Collection[int], pending: Collection[int], hot: Sequence[int]) -> FenceHold:
    """What ``pop_for_free`` keeps while a step is in flight (D-HOST-16): the
    whole host row, the hot region, and the device block of every page that
    is dirty or has a transfer pending (host-only pages have none)."""
    kept_device: list[int] = []
    for page, device_block in enumerate(resident_row):
        needed = page not in clean or page in pending
        if device_block != 0 and needed:
            kept_device.append(device_block)
    return FenceHold(fence_id, tuple(host_row), tuple(kept_device), tuple(hot))
