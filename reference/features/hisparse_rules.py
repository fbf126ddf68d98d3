"""The pure rules of the host tier (spec/host_tier.md): reference's statement.

Each function here reads plain values (rows, counts, page sets, maps) and
returns a decision or raises a typed error; none holds or changes state.
``pagedkv.reference.features.hisparse`` and ``pagedkv.optimized.host_tier.hisparse`` keep only
their own state handling (pools, rows, free queues) and ask these functions
what an operation needs, which pages it touches and whether it is refused
(each side its own copy of these functions).
Both implementations reaching the same answers from different state is what
the lockstep machine (tests/test_hisparse_lockstep.py) checks; the rules
themselves are checked against their definitions in tests/test_hisparse_rules.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    InvalidTokenCountError,
)
from pagedkv.spec.hisparse import (
    FenceHold,
    HostCacheEvent,
    HostTierConfig,
    ResidencyUpdate,
    RowMirror,
)
from pagedkv.spec.types import BlockHash

__all__ = [
    "AllocationCounts",
    "check_token_count",
    "check_block_count",
    "check_held_blocks",
    "check_host_block_ids",
    "fence_hold",
    "check_transfer_ids",
    "count_allocation",
    "full_sequence_need",
    "import_pages",
    "plan_allocation",
    "residency_update",
    "stored_events",
    "row_mirrors",
    "tally_worker_counts",
    "writeback_tokens",
    "wants_hot_region",
    "writeback_window",
]


def check_token_count(name: str, value: object, max_model_len: int | None = None) -> int:
    """``value`` as a token count: an int >= 0, and at most ``max_model_len`` when given.

    Raises:
        InvalidTokenCountError: not an int, or negative.
        ExceedsMaxModelLenError: above ``max_model_len``.
    """
    if type(value) is not int or value < 0:
        raise InvalidTokenCountError(f"{name} must be an int >= 0, got {value!r}")
    if max_model_len is not None and value > max_model_len:
        raise ExceedsMaxModelLenError(f"{name} {value} exceeds max_model_len {max_model_len}")
    return value


@dataclass(frozen=True, slots=True)
class AllocationCounts:
    """What one ``allocate`` needs, decided before anything is taken.

    ``hashes``: the request's block hashes after the call. ``imported``:
    tokens an import covers (the locally computed hit included), 0 without
    one. ``clean_hits``: leading hit pages that are clean at once (the
    others are pages the import fills, HOST-14). ``host_only``: leading new
    pages left without a device block (the hit's and the import's, all but
    the import's last page). ``host_new``: fresh host blocks. ``device_new``:
    fresh device blocks of resident pages (the hot region excluded).
    ``free_hits``: hit blocks now in the host free queue (holding them
    shrinks it too). ``hot_n``: hot blocks to take (0 when the request holds
    its region or needs none). ``cow``: 1 when the computed tokens end inside
    a hit block (only a capacity query counts that; ``allocate`` refuses it).
    """

    hashes: list[BlockHash]
    imported: int
    clean_hits: int
    host_only: int
    host_new: int
    device_new: int
    free_hits: int
    hot_n: int
    cow: int = 0


def plan_allocation(cfg: HostTierConfig, request_id: str, num_tokens: int, hit: Sequence[int],
                    block_hashes: Sequence[BlockHash] | None, num_external_tokens: int, *,
                    held_pages: int, held_hashes: Sequence[BlockHash], has_hot: bool,
                    hot_required: bool, host_hash_of: Mapping[int, BlockHash],
                    host_ref: Sequence[int],
                    num_local_tokens: int | None = None) -> AllocationCounts:
    """Validate an ``allocate`` and count what it needs (spec/host_tier.md, allocate).

    ``held_pages``/``held_hashes``/``has_hot``/``hot_required`` describe the
    request as it stands (0, (), False, False for one holding nothing);
    ``host_hash_of`` maps a cached host block to its hash, ``host_ref`` is the
    host pool's reference counts.

    Raises:
        InvalidTokenCountError, ExceedsMaxModelLenError: a bad token count.
        InvalidArgumentError: as ``count_allocation``; besides, a hit that is
            not the cached blocks of the leading hashes or repeats a block, and
            ``num_local_tokens`` that is not whole pages.
    """
    hashes = list(block_hashes) if block_hashes is not None else list(held_hashes)
    counts = count_allocation(cfg, request_id, num_tokens, hit, num_external_tokens,
                              held_pages=held_pages, has_hot=has_hot, hot_required=hot_required,
                              host_ref=host_ref, num_local_tokens=num_local_tokens)
    for i, b in enumerate(hit):
        if i >= len(hashes) or host_hash_of.get(b) != hashes[i]:
            raise InvalidArgumentError(
                f"hit[{i}] = {b!r} is not the host block cached under block_hashes[{i}]")
    if len(set(hit)) != len(hit):
        raise InvalidArgumentError("hit repeats a block")
    if counts.cow:
        raise InvalidArgumentError(
            f"num_local_tokens {num_local_tokens} must be whole pages of the hit")
    return dataclasses.replace(counts, hashes=hashes)


def count_allocation(cfg: HostTierConfig, request_id: str, num_tokens: int, hit: Sequence[int],
                     num_external_tokens: int, *, held_pages: int, has_hot: bool,
                     hot_required: bool, host_ref: Sequence[int],
                     num_local_tokens: int | None = None) -> AllocationCounts:
    """Count what an allocation of this shape needs, taking the hit as given
    (``capacity_needed``: a capacity query may name host blocks the cache does
    not hold, and computed tokens ending inside a hit block, which is copied
    before it is written: ``cow``). ``hashes`` is left empty.

    Raises:
        InvalidTokenCountError, ExceedsMaxModelLenError: a bad token count.
        InvalidArgumentError: a hit for a request already holding blocks, a
            hit longer than the pages or naming a block outside the host pool;
            an import for a request holding blocks or covering more than
            ``num_tokens``; ``num_local_tokens`` (default: the whole hit) past
            the hit, or short of it while the hit reaches past the import.
    """
    check_token_count("num_tokens", num_tokens, cfg.max_model_len)
    pages = -(-num_tokens // cfg.block_size)
    if hit:
        if held_pages:
            raise InvalidArgumentError(
                f"hit given for request {request_id!r}, which already holds blocks")
        if len(hit) > pages:
            raise InvalidArgumentError(
                f"hit has {len(hit)} blocks, more than the {pages} pages of num_tokens")
        for i, b in enumerate(hit):
            if type(b) is not int or not 0 < b < cfg.host_num_blocks:
                raise InvalidArgumentError(f"hit[{i}] = {b!r} is not a host block")
    check_token_count("num_external_tokens", num_external_tokens)
    local = len(hit) * cfg.block_size if num_local_tokens is None else check_token_count(
        "num_local_tokens", num_local_tokens)
    clean_hits, partial = divmod(local, cfg.block_size)
    if local > len(hit) * cfg.block_size:
        raise InvalidArgumentError(
            f"num_local_tokens {local} reaches past the {len(hit)}-block hit")
    imported = local + num_external_tokens if num_external_tokens else 0
    if num_external_tokens and (held_pages or imported > num_tokens):
        raise InvalidArgumentError(
            f"num_external_tokens {num_external_tokens}: an import needs a request holding "
            f"nothing and hit + external tokens <= num_tokens {num_tokens}")
    import_end = -(-imported // cfg.block_size)  # pages the import writes, hit included
    if len(hit) > max(-(-local // cfg.block_size), import_end):
        raise InvalidArgumentError(
            f"hit has {len(hit)} blocks, past the {clean_hits} computed pages and the "
            f"{import_end} pages the import covers (num_external_tokens {num_external_tokens})")
    # An import leaves its pages host-only except the last (the engine replays
    # into it); hit pages past the computed ones are the import's (HOST-14).
    host_only = import_end - 1 if imported else len(hit)
    host_new = max(pages - held_pages - len(hit), 0)
    device_new = max(pages - held_pages - host_only, 0)
    free_hits = sum(1 for b in hit if host_ref[b] == 0)
    wants_hot = bool(hit) or imported > 0 or hot_required
    hot_n = cfg.hot_blocks_per_request if wants_hot and not has_hot else 0
    return AllocationCounts([], imported, clean_hits, host_only, host_new, device_new,
                            free_hits, hot_n, int(bool(hit) and partial > 0))


def full_sequence_need(cfg: HostTierConfig, full_sequence_tokens: int, *, held_pages: int,
                       hot_missing: bool) -> tuple[int, int]:
    """The (host, device) blocks a request holding ``held_pages`` pages still
    needs to hold ``full_sequence_tokens`` tokens: a host block per page, device
    blocks only up to the admission window (D-HOST-11), plus the hot region
    when it is required and not held (``hot_missing``)."""
    check_token_count("full_sequence_tokens", full_sequence_tokens, cfg.max_model_len)
    pages = -(-full_sequence_tokens // cfg.block_size)
    resident = pages if cfg.admission_window is None else min(pages, cfg.admission_window)
    hot = cfg.hot_blocks_per_request if hot_missing else 0
    return max(pages - held_pages, 0), max(resident - held_pages, 0) + hot


def import_pages(importing: int, block_size: int) -> tuple[int, int]:
    """For an import of ``importing`` tokens that landed: (pages that become
    clean, the last imported page, which gets a restore)."""
    return importing // block_size, (importing - 1) // block_size


def writeback_window(block_size: int, num_computed_tokens: int, row_len: int,
                     importing: int) -> range:
    """Pages a write-back may be planned for: sealed pages (fully computed)
    of the row, after those an import is still writing."""
    check_token_count("num_computed_tokens", num_computed_tokens)
    sealed = min(num_computed_tokens // block_size, row_len)
    return range(-(-importing // block_size), sealed)


def wants_hot_region(cfg: HostTierConfig, free_device_blocks: int, row_len: int) -> bool:
    """``update_residency`` for a request without its hot region: it asks for
    one when the device pool runs below the watermark, or when its row reaches
    the admission window (admission assumed older pages move to host)."""
    return free_device_blocks < cfg.device_watermark or (
        cfg.admission_window is not None and row_len >= cfg.admission_window)


def check_transfer_ids(transfer_ids: Sequence[int], in_flight: Collection[int]) -> None:
    """Raises InvalidArgumentError when ``transfer_ids`` repeats an id or names
    one not in flight (``complete`` then changes nothing)."""
    if len(set(transfer_ids)) != len(transfer_ids) or any(
            t not in in_flight for t in transfer_ids):
        raise InvalidArgumentError(
            f"transfer_ids {list(transfer_ids)!r} name an unknown or repeated transfer")


def residency_update(resident_row: Sequence[int], synced: int,
                     stale: Collection[int]) -> ResidencyUpdate | None:
    """What the worker lacks of one row: its stale pages (ascending), then the
    pages from ``synced`` on, each with its device block (0: host-only);
    ``None`` when it lacks nothing."""
    pages = sorted(stale)
    pages.extend(range(synced, len(resident_row)))
    if not pages:
        return None
    return ResidencyUpdate(tuple(pages), tuple(resident_row[p] for p in pages))


def row_mirrors(block_size: int, resident_row: Sequence[int], host_row: Sequence[int],
                num_computed_tokens: int, num_scheduled_tokens: int) -> list[RowMirror]:
    """Where the rows of tokens ``[num_computed_tokens, +num_scheduled_tokens)``
    go on the device and in the host pool: one mirror per page span. A
    host-only page (nothing is written on the device) is skipped alone; the
    rows stop at the end of the row.

    Raises:
        InvalidTokenCountError: either count is not an int >= 0.
    """
    check_token_count("num_computed_tokens", num_computed_tokens)
    check_token_count("num_scheduled_tokens", num_scheduled_tokens)
    mirrors: list[RowMirror] = []
    token, end = num_computed_tokens, num_computed_tokens + num_scheduled_tokens
    while token < end:
        page, offset = divmod(token, block_size)
        if page >= len(resident_row):
            break
        num_rows = min(block_size - offset, end - token)
        if resident_row[page] != 0:
            mirrors.append(RowMirror(resident_row[page] * block_size + offset,
                                     host_row[page] * block_size + offset, num_rows))
        token += num_rows
    return mirrors


def writeback_tokens(cfg: HostTierConfig, num_tokens: int) -> int:
    """The computed tokens ``advance`` may write back once a step brings the
    request to ``num_tokens``: all but the last ``num_reprefillable_tokens``,
    which the engine prefills again (a write-back of them would be stale)."""
    check_token_count("num_tokens", num_tokens)
    return max(0, num_tokens - cfg.num_reprefillable_tokens)


def tally_worker_counts(counts: Mapping[int, tuple[int, int]], in_flight: Collection[int],
                        enqueued: Mapping[int, int], completed: Mapping[int, int],
                        ) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """Per-worker transfer counts (``report_transfers``, D-HOST-12).

    ``counts`` maps a transfer id to (workers expected, workers done) so far.
    Each in-flight id's first nonzero ``enqueued`` count is how many workers
    must report it; ``completed`` counts add up. Ids not in flight are ignored
    (a late report of a transfer that already landed). Returns the new
    ``counts`` (finished ids left out) and the ids that finished, ascending.

    Raises:
        InvalidArgumentError: a count that is not an int >= 0.
    """
    for name, reports in (("enqueued", enqueued), ("completed", completed)):
        for transfer_id, count in reports.items():
            if type(count) is not int or count < 0:
                raise InvalidArgumentError(
                    f"{name}[{transfer_id!r}] must be an int >= 0, got {count!r}")
    new = {t: c for t, c in counts.items() if t in in_flight}
    for transfer_id in set(enqueued) | set(completed):
        if transfer_id not in in_flight:
            continue
        expected, done = new.get(transfer_id, (0, 0))
        if expected == 0:
            expected = enqueued.get(transfer_id, 0)
        new[transfer_id] = (expected, done + completed.get(transfer_id, 0))
    finished = sorted(t for t, (expected, done) in new.items() if expected and done >= expected)
    for transfer_id in finished:
        del new[transfer_id]
    return new, finished


def check_block_count(num_blocks: object) -> int:
    """``num_blocks`` of ``take_shared``/``take_host``: an int >= 0 (InvalidArgumentError)."""
    if type(num_blocks) is not int or num_blocks < 0:
        raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    return num_blocks


def check_held_blocks(block_ids: Sequence[int], held: Collection[int], holder: str) -> list[int]:
    """The ids a caller gives back (``free_shared``/``free_host``): each one
    ``held`` by that caller, none twice (InvalidArgumentError otherwise)."""
    ids = list(block_ids)
    if len(set(ids)) != len(ids) or any(b not in held for b in ids):
        raise InvalidArgumentError(
            f"block_ids {ids!r} name a block {holder} does not hold, or repeat one")
    return ids


def stored_events(request_id: str, detached: bool, block_hashes: Sequence[BlockHash],
                  stored: Sequence[tuple[int, int]]) -> list[HostCacheEvent]:
    """The ``stored`` events of one publication: ``stored`` lists the (page,
    host block) pairs whose hash entered the cache, ascending; one event per
    run of consecutive pages, its parent the hash of the page before the run."""
    events: list[HostCacheEvent] = []
    start = 0
    for i in range(1, len(stored) + 1):
        if i < len(stored) and stored[i][0] == stored[i - 1][0] + 1:
            continue
        run = stored[start:i]
        first = run[0][0]
        events.append(HostCacheEvent(
            "stored", tuple(block_hashes[page] for page, _ in run), tuple(b for _, b in run),
            request_id, first, block_hashes[first - 1] if first else None, detached))
        start = i
    return events


def check_host_block_ids(block_ids: Iterable[int], host_num_blocks: int) -> list[int]:
    """The ids ``evict_host_blocks`` names: each a host block in ``[1,
    host_num_blocks)`` (InvalidArgumentError otherwise)."""
    ids = list(block_ids)
    for b in ids:
        if type(b) is not int or not 0 < b < host_num_blocks:
            raise InvalidArgumentError(f"block_ids: {b!r} is not a host block in [1, {host_num_blocks})")
    return ids


def fence_hold(fence_id: int, host_row: Sequence[int], resident_row: Sequence[int],
               clean: Collection[int], pending: Collection[int], hot: Sequence[int]) -> FenceHold:
    """What ``pop_for_free`` keeps for a step still in flight (D-HOST-16): the
    host row, the device blocks of pages that are not clean or have a
    transfer pending, and the hot region."""
    resident = tuple(b for page, b in enumerate(resident_row) if b != 0 and (
        page not in clean or page in pending))
    return FenceHold(fence_id, tuple(host_row), resident, tuple(hot))
