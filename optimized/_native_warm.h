/* Prefetching a batch of map probes for the pool's map loops (D-PERF-47),
 * part of pagedkv.optimized._native (_native_map.c).
 *
 * Why: in a large map (a Mooncake replay at block size 512 keys 183k blocks)
 * each probe misses the CPU cache three times, one miss waiting on the
 * other: the index slot, then the entry it names, then the stored key and
 * the value. The probes of different keys do not depend on each other, so
 * pk_warm_map walks a batch of keys in rounds, each round reading what the
 * previous one prefetched and prefetching the next step: the misses of the
 * whole batch overlap, about one memory latency per round instead of three
 * per key, and the loop's own lookups or insertions then find every line
 * cached.
 *
 * A prefetch never faults and changes nothing, so no result depends on this
 * file; only its reads must stay inside live memory. It reads CPython's dict
 * table (index array, entries) through a mirror of that private layout,
 * compiled only for the CPython versions whose layout it mirrors (3.11 to
 * 3.13, not free-threaded) and used only on a combined table of general
 * entries; elsewhere it does nothing. map_probe (_native_map.c) exposes the
 * same walk, run to its end, so the tests can hold it to the dict's own
 * answers: a wrong mirror or probe sequence would warm the wrong lines.
 */
#ifndef PAGEDKV_NATIVE_WARM_H
#define PAGEDKV_NATIVE_WARM_H

#include <stdint.h>

#include "_native_int.h"

#if defined(__GNUC__) || defined(__clang__)
#define PK_WARM(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PK_WARM_W(p) __builtin_prefetch((const void *)(p), 1, 3)
#else
#define PK_WARM(p) ((void)(p))
#define PK_WARM_W(p) ((void)(p))
#endif

/* Keys per batch: enough to overlap many misses, few enough that the
 * first are still cached when the loop reaches them. */
#define PK_WARM_BATCH 32

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define PK_WARM_MAPS 1

/* CPython 3.11-3.13's PyDictKeysObject and its general (non-unicode)
 * entry, mirrored field for field (Objects/dictobject.c,
 * Include/internal/pycore_dict.h). */
typedef struct {
    Py_ssize_t dk_refcnt;
    uint8_t dk_log2_size;
    uint8_t dk_log2_index_bytes;
    uint8_t dk_kind;
    uint32_t dk_version;
    Py_ssize_t dk_usable;
    Py_ssize_t dk_nentries;
    char dk_indices[];
} pk_dict_keys;

typedef struct {
    Py_hash_t me_hash;
    PyObject *me_key;
    PyObject *me_value;
} pk_dict_entry;

static inline Py_ssize_t
pk_dict_index(const pk_dict_keys *keys, size_t slot)
{
    switch (keys->dk_log2_index_bytes - keys->dk_log2_size) {
    case 0: return ((const int8_t *)keys->dk_indices)[slot];
    case 1: return ((const int16_t *)keys->dk_indices)[slot];
    case 2: return ((const int32_t *)keys->dk_indices)[slot];
    default: return (Py_ssize_t)((const int64_t *)keys->dk_indices)[slot];
    }
}
#endif

/* The walk: table's probes of keys[0:n] (n <= PK_WARM_BATCH; exact bytes,
 * others skipped), as CPython's lookup runs them, for at most `rounds`
 * rounds: the index slot each key probes first (prefetched), then the entry
 * it names (prefetched), then, when the entry's hash is the key's, that
 * entry's key and value (prefetched; the key counts as found there); an
 * entry of another hash or a deleted slot moves the probe on, an empty
 * slot ends it (absent). Hashes the keys (bytes cache their hash, so the
 * loop's lookups reuse it). found (or NULL) gets each key's entry index, -1
 * for absent, -2 for not settled (skipped, or out of rounds). Returns 0, or
 * -1 where the table is not one this mirror reads (found untouched). */
static inline int
pk_map_walk(PyObject *table, PyObject *const *keys, Py_ssize_t n, int rounds, Py_ssize_t *found)
{
#ifdef PK_WARM_MAPS
    if (!PyDict_CheckExact(table) || ((PyDictObject *)table)->ma_values != NULL) {
        return -1;
    }
    const pk_dict_keys *dk = (const pk_dict_keys *)((PyDictObject *)table)->ma_keys;
    int shift = dk->dk_log2_index_bytes - dk->dk_log2_size;  /* log2 of an index's bytes */
    if (dk->dk_kind != 0 || shift < 0 || shift > 3) {
        return -1;  /* not a general table (kind 0), or not the layout mirrored */
    }
    if (n > PK_WARM_BATCH) {
        n = PK_WARM_BATCH;
    }
    size_t mask = ((size_t)1 << dk->dk_log2_size) - 1;
    const pk_dict_entry *entries =
        (const pk_dict_entry *)(dk->dk_indices + ((size_t)1 << dk->dk_log2_index_bytes));
    Py_ssize_t used = dk->dk_nentries;
    size_t slot[PK_WARM_BATCH], perturb[PK_WARM_BATCH];
    Py_hash_t hash[PK_WARM_BATCH];
    /* -1: read the slot next; >= 0: read that entry next; -2: settled (state[i] kept in result[i]) */
    Py_ssize_t state[PK_WARM_BATCH], result[PK_WARM_BATCH];
    Py_ssize_t active = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        state[i] = result[i] = -2;
        if (!PyBytes_CheckExact(keys[i])) {
            continue;
        }
        hash[i] = PyObject_Hash(keys[i]);  /* exact bytes: cannot fail, runs no Python code */
        slot[i] = (size_t)hash[i] & mask;
        perturb[i] = (size_t)hash[i];
        state[i] = -1;
        active++;
        PK_WARM(dk->dk_indices + (slot[i] << shift));
    }
    for (int round = 0; round < rounds && active > 0; round++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t ix;
            if (state[i] == -1) {
                ix = pk_dict_index(dk, slot[i]);
                if (ix >= 0 && ix < used) {
                    state[i] = ix;
                    PK_WARM(&entries[ix]);
                    continue;
                }
                if (ix == -1) {  /* an empty slot: absent (an insertion lands here) */
                    state[i] = -2;
                    result[i] = -1;
                    active--;
                    continue;
                }
                /* a deleted entry (-2): the probe moves on */
            }
            else if (state[i] >= 0) {
                const pk_dict_entry *entry = &entries[state[i]];
                if (entry->me_hash == hash[i]) {
                    PK_WARM(entry->me_key);
                    PK_WARM_W(entry->me_value);
                    result[i] = state[i];
                    state[i] = -2;
                    active--;
                    continue;
                }
            }
            else {
                continue;
            }
            perturb[i] >>= 5;  /* CPython's PERTURB_SHIFT */
            slot[i] = (slot[i] * 5 + perturb[i] + 1) & mask;
            state[i] = -1;
            PK_WARM(dk->dk_indices + (slot[i] << shift));
        }
    }
    if (found != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            found[i] = result[i];
        }
    }
    return 0;
#else
    (void)table;
    (void)keys;
    (void)n;
    (void)rounds;
    (void)found;
    return -1;
#endif
}

/* Tables with fewer keys are not warmed: their lines mostly stay cached
 * (about 140 bytes a key with its entry, key and value: 32768 keys hold
 * some 4.5 MB), and there the walk is pure overhead (about a tenth of a
 * lookup's time on the standard traces, whose maps hold at most 24k keys). */
#define PK_WARM_MIN_KEYS 32768

/* Warm table's lookups (or insertions) of keys[0:n] when table is large:
 * the walk above for a few rounds (most probes settle in one or two
 * slots), the first PK_WARM_BATCH keys only; the caller calls it once per
 * batch, just before its loop reaches the batch. */
static inline void
pk_warm_map(PyObject *table, PyObject *const *keys, Py_ssize_t n)
{
    if (n > 0 && PyDict_CheckExact(table) && PyDict_GET_SIZE(table) >= PK_WARM_MIN_KEYS) {
        (void)pk_map_walk(table, keys, n, 6, NULL);
    }
}

#endif
