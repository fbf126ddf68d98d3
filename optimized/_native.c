/* The block pool's per-block loops in C (D-PERF-26): pagedkv.optimized._native.
 *
 * Optional: a build without a C compiler leaves this module out and optimized/block_pool.py runs its own
 * Python loops, which stay the definition. Each function here is one of those loops, step for step, over the
 * same plain lists (ref counts, group ids, free-queue links indexed by block id) and storing the same
 * objects, so the two builds cannot be told apart from Python (the lockstep tests run against both).
 *
 * Memory safety first: every function checks, before its first store, that it was given exact lists and that
 * every id it will index is an exact int inside every list it indexes. Anything unexpected (a subclass, a
 * stray type, an id out of range) makes it return None untouched, and the caller runs the Python loop, which
 * raises whatever the pure build raises. */
#include "_native.h"

/* A small count (ref count, group id) held in a list slot, or LONG_MIN. */
static inline long
small_int(PyObject *item)
{
    int ok = PyLong_CheckExact(item);
    long value = ok ? compact_value(item, &ok) : 0;
    return ok ? value : LONG_MIN;
}

/* The value of an int the checks above have accepted. */
static inline Py_ssize_t
checked_value(PyObject *item)
{
    int ok = 1;
    return (Py_ssize_t)compact_value(item, &ok);
}

/* list[i] = value (a new reference, stolen). */
static inline void
store(PyObject *list, Py_ssize_t i, PyObject *value)
{
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, value);
    Py_DECREF(old);
}

static int
store_int(PyObject *list, Py_ssize_t i, long value)
{
    PyObject *obj = PyLong_FromLong(value);
    if (obj == NULL) {
        return -1;
    }
    store(list, i, obj);
    return 0;
}

static int
all_lists(PyObject *const *args, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyList_CheckExact(args[i])) {
            return 0;
        }
    }
    return 1;
}

/* The shortest of the per-block lists: every id indexed must lie below it. */
static Py_ssize_t
common_bound(PyObject *const *args, Py_ssize_t n)
{
    Py_ssize_t bound = PY_SSIZE_T_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t size = PyList_GET_SIZE(args[i]);
        if (size < bound) {
            bound = size;
        }
    }
    return bound;
}

/* BlockPool.free_held's loop (FREE-4, FREE-5): native.NativeLoops.release says what it does. */

PyObject *
pk_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !all_lists(args, 4) || !PyList_CheckExact(args[5])) {
        Py_RETURN_NONE;
    }
    PyObject *ref = args[0], *gids = args[1], *prev = args[2], *next = args[3];
    PyObject *blocks = args[5];
    Py_ssize_t links = common_bound(args + 2, 2);
    Py_ssize_t bound = common_bound(args, 2);
    Py_ssize_t sentinel = index_in(args[4], links);
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    if (sentinel < 0 || bound > links) {
        Py_RETURN_NONE;
    }
    /* Checks: ids in range, their counts and group ids small ints, the tail a link. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t block = index_in(PyList_GET_ITEM(blocks, i), bound);
        if (block < 0 || block == sentinel
                || small_int(PyList_GET_ITEM(ref, block)) == LONG_MIN
                || small_int(PyList_GET_ITEM(gids, block)) == LONG_MIN) {
            Py_RETURN_NONE;
        }
    }
    PyObject *tail_obj = PyList_GET_ITEM(prev, sentinel);
    Py_ssize_t tail = index_in(tail_obj, links);
    if (tail < 0 || index_in(PyList_GET_ITEM(next, sentinel), links) < 0) {
        Py_RETURN_NONE;
    }
    /* The loop: FREE-4 (counts drop), FREE-5 (keyed to the back, unkeyed to the front). */
    PyObject *front = NULL; /* unkeyed releases, rare: built lazily */
    Py_ssize_t released = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = checked_value(item);
        if (block == 0) {
            continue; /* the null block is never released (POOL-1) */
        }
        long count = small_int(PyList_GET_ITEM(ref, block));
        if (count != 1) {
            if (store_int(ref, block, count - 1) < 0) {
                goto error;
            }
            continue;
        }
        if (store_int(ref, block, 0) < 0) {
            goto error;
        }
        released++;
        if (small_int(PyList_GET_ITEM(gids, block)) >= 0) {
            store(next, tail, Py_NewRef(item));
            store(prev, block, Py_NewRef(tail_obj));
            tail = block;
            tail_obj = item;
        }
        else {
            if (front == NULL && (front = PyList_New(0)) == NULL) {
                goto error;
            }
            if (PyList_Append(front, item) < 0) {
                goto error;
            }
        }
    }
    if (released) {
        PyObject *sentinel_obj = args[4];
        store(next, tail, Py_NewRef(sentinel_obj));
        store(prev, sentinel, Py_NewRef(tail_obj));
        if (front != NULL) {
            /* Splice the unkeyed batch before the (possibly new) front. */
            PyObject *old_front = PyList_GET_ITEM(next, sentinel);
            Py_INCREF(old_front);
            Py_ssize_t old_front_index = checked_value(old_front);
            PyObject *last = sentinel_obj;
            Py_ssize_t last_index = sentinel;
            Py_ssize_t m = PyList_GET_SIZE(front);
            for (Py_ssize_t i = 0; i < m; i++) {
                PyObject *item = PyList_GET_ITEM(front, i);
                Py_ssize_t block = checked_value(item);
                store(next, last_index, Py_NewRef(item));
                store(prev, block, Py_NewRef(last));
                last = item;
                last_index = block;
            }
            /* old_front is the checked front or a checked id of blocks. */
            store(next, last_index, old_front); /* the reference taken above */
            store(prev, old_front_index, Py_NewRef(last));
        }
    }
    Py_XDECREF(front);
    return PyLong_FromSsize_t(released);
error:
    Py_XDECREF(front);
    return NULL;
}

/* BlockPool.touch_held's loop: native.NativeLoops.touch says what it does. */

PyObject *
pk_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !all_lists(args, 4)) {
        Py_RETURN_NONE;
    }
    PyObject *ref = args[0], *prev = args[1], *next = args[2], *blocks = args[3];
    Py_ssize_t links = common_bound(args + 1, 2);
    Py_ssize_t bound = PyList_GET_SIZE(ref);
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    if (bound > links) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t block = index_in(PyList_GET_ITEM(blocks, i), bound);
        if (block < 0 || small_int(PyList_GET_ITEM(ref, block)) == LONG_MIN
                || index_in(PyList_GET_ITEM(prev, block), links) < 0
                || index_in(PyList_GET_ITEM(next, block), links) < 0) {
            Py_RETURN_NONE;
        }
    }
    Py_ssize_t removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t block = checked_value(PyList_GET_ITEM(blocks, i));
        if (block == 0) {
            continue; /* the null block's counters never move (D-POOL-1) */
        }
        long count = small_int(PyList_GET_ITEM(ref, block));
        if (count == 0) {
            PyObject *before = PyList_GET_ITEM(prev, block);
            PyObject *after = PyList_GET_ITEM(next, block);
            /* Re-checked: an earlier unlink in this call may have stored here. */
            Py_ssize_t before_index = index_in(before, links);
            Py_ssize_t after_index = index_in(after, links);
            if (before_index < 0 || after_index < 0) {
                PyErr_SetString(PyExc_SystemError, "pagedkv: free-queue link out of range");
                return NULL;
            }
            Py_INCREF(before);
            Py_INCREF(after);
            store(next, before_index, after);
            store(prev, after_index, before);
            removed++;
        }
        if (store_int(ref, block, count + 1) < 0) {
            return NULL;
        }
    }
    return PyLong_FromSsize_t(removed);
}

/* BlockPool._evict's common case in place (EVICT-3, EVICT-4): the block's key leaves its group's map, no
 * duplicate of it waits, no event. 1: done; 0: not that case (nothing changed, the caller calls evict); -1:
 * an error is set. */
static int
evict_inline(PyObject *maps, PyObject *hashes, Py_ssize_t block)
{
    PyObject *gids = PyTuple_GET_ITEM(maps, 0), *tables = PyTuple_GET_ITEM(maps, 1);
    PyObject *dups = PyTuple_GET_ITEM(maps, 2);
    PyObject *key = PyList_GET_ITEM(hashes, block);
    Py_ssize_t group = index_in(PyList_GET_ITEM(gids, block), PyList_GET_SIZE(tables));
    if (group < 0 || !PyBytes_CheckExact(key) || group >= PyList_GET_SIZE(dups)) {
        return 0;
    }
    PyObject *table = PyList_GET_ITEM(tables, group), *later = PyList_GET_ITEM(dups, group);
    if (!PyDict_CheckExact(table) || !PyDict_CheckExact(later)) {
        return 0;
    }
    /* An exact bytes key: hashing and comparing it run no Python code. */
    if (PyDict_GET_SIZE(later) != 0) {
        PyObject *found = PyDict_GetItemWithError(later, key);
        if (found != NULL) {
            return 0;  /* identical blocks share the key: the Python method */
        }
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    Py_INCREF(key);  /* the list's reference goes below */
    int deleted = PyDict_DelItem(table, key);
    Py_DECREF(key);
    if (deleted < 0) {
        return -1;  /* the KeyError the Python method would raise */
    }
    store(hashes, block, Py_NewRef(Py_None));
    return store_int(gids, block, -1) < 0 ? -1 : 1;
}

/* `result` (a new reference or NULL with an error set), after moving the map epoch of maps' owner (its fourth
 * item, when given) if any key was evicted in place: owner.map_epoch += 1 (D-PERF-44). The epoch moves even
 * on an error path (keys left the map); an error here replaces the result. */
static PyObject *
epoch_moved(PyObject *maps, Py_ssize_t in_place, PyObject *result)
{
    if (in_place == 0 || maps == Py_None || PyTuple_GET_SIZE(maps) != 4) {
        return result;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);  /* set only when result is NULL: that first error wins */
    PyObject *owner = PyTuple_GET_ITEM(maps, 3), *one = PyLong_FromLong(1);
    PyObject *epoch = one == NULL ? NULL : PyObject_GetAttrString(owner, "map_epoch");
    PyObject *moved = epoch == NULL ? NULL : PyNumber_Add(epoch, one);
    int failed = moved == NULL || PyObject_SetAttrString(owner, "map_epoch", moved) < 0;
    Py_XDECREF(one);
    Py_XDECREF(epoch);
    Py_XDECREF(moved);
    if (result == NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
    else if (failed) {
        Py_CLEAR(result);
    }
    return result;
}

/* BlockPool.get_new_blocks's loop: native.NativeLoops.take says what it does. */
PyObject *
pk_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 7 || nargs > 8 || !PyList_CheckExact(args[0]) || !all_lists(args + 2, 2)
            || (args[1] != Py_None && !PyList_CheckExact(args[1]))) {
        Py_RETURN_NONE;
    }
    PyObject *ref = args[0], *hashes = args[1], *prev = args[2], *next = args[3];
    PyObject *evict = args[6];
    PyObject *maps = nargs == 8 ? args[7] : Py_None;
    Py_ssize_t links = common_bound(args + 2, 2);
    Py_ssize_t bound = PyList_GET_SIZE(ref);
    if (hashes != Py_None && PyList_GET_SIZE(hashes) < bound) {
        bound = PyList_GET_SIZE(hashes);
    }
    if (maps != Py_None) {
        if (!PyTuple_CheckExact(maps) || (PyTuple_GET_SIZE(maps) != 3 && PyTuple_GET_SIZE(maps) != 4)
                || hashes == Py_None
                || !all_lists(&PyTuple_GET_ITEM(maps, 0), 3)) {
            Py_RETURN_NONE;
        }
        if (PyList_GET_SIZE(PyTuple_GET_ITEM(maps, 0)) < bound) {
            bound = PyList_GET_SIZE(PyTuple_GET_ITEM(maps, 0));
        }
    }
    Py_ssize_t sentinel = index_in(args[4], links);
    Py_ssize_t n = PyLong_CheckExact(args[5]) ? PyLong_AsSsize_t(args[5]) : -1;
    if (sentinel < 0 || n < 0 || bound > links) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* EVICT-1's bound is the caller's; walk the n links first: every id must be a block of the pool. */
    Py_ssize_t block = index_in(PyList_GET_ITEM(next, sentinel), links);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (block <= 0 || block >= bound || block == sentinel) {
            Py_RETURN_NONE;
        }
        block = index_in(PyList_GET_ITEM(next, block), links);
    }
    if (block < 0) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    PyObject *item = PyList_GET_ITEM(next, sentinel);
    Py_ssize_t in_place = 0;  /* keys evicted here: the owner's epoch moves once (D-PERF-44) */
    for (Py_ssize_t i = 0; i < n; i++) {
        /* Re-checked as we go: the callback below is Python code. */
        block = index_in(item, bound);
        if (block <= 0) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_SystemError, "pagedkv: free-queue link out of range");
            return epoch_moved(maps, in_place, NULL);
        }
        PyList_SET_ITEM(out, i, Py_NewRef(item));  /* EVICT-2: queue order */
        if (hashes != Py_None && PyList_GET_ITEM(hashes, block) != Py_None) {  /* EVICT-3, EVICT-4 */
            int evicted = maps == Py_None ? 0 : evict_inline(maps, hashes, block);
            in_place += evicted == 1;
            if (evicted == 0) {
                /* Eviction drops the key (maps, events): the pool's Python method. */
                PyObject *result = PyObject_CallOneArg(evict, item);
                evicted = result == NULL ? -1 : 1;
                Py_XDECREF(result);
            }
            if (evicted < 0) {
                Py_DECREF(out);
                return epoch_moved(maps, in_place, NULL);
            }
            /* Python code may have run (the method, or a key's comparison). */
            if (PyList_GET_SIZE(ref) < bound || PyList_GET_SIZE(hashes) < bound
                    || PyList_GET_SIZE(next) < links || PyList_GET_SIZE(prev) < links
                    || (maps != Py_None && PyList_GET_SIZE(PyTuple_GET_ITEM(maps, 0)) < bound)) {
                Py_DECREF(out);
                PyErr_SetString(PyExc_SystemError, "pagedkv: a pool list shrank during eviction");
                return epoch_moved(maps, in_place, NULL);
            }
        }
        if (store_int(ref, block, 1) < 0) {  /* EVICT-5 */
            Py_DECREF(out);
            return epoch_moved(maps, in_place, NULL);
        }
        item = PyList_GET_ITEM(next, block);
    }
    block = index_in(item, links);
    if (block < 0) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_SystemError, "pagedkv: free-queue link out of range");
        return epoch_moved(maps, in_place, NULL);
    }
    store(next, sentinel, Py_NewRef(item));
    store(prev, block, Py_NewRef(args[4]));
    return epoch_moved(maps, in_place, out);
}

/* key_run's checks (args as key_run takes them): 1 when it stores, else 0 (nothing to change). The fused
 * admission (_native_admit.c) asks before map_run changes the map. */
int
pk_key_run_takes(PyObject *const *args)
{
    if (!all_lists(args, 5) || !PyLong_CheckExact(args[5]) || !PyLong_CheckExact(args[6])
            || !PyLong_CheckExact(args[7])) {
        return 0;
    }
    Py_ssize_t bound = common_bound(args, 3), n = PyList_GET_SIZE(args[3]);
    int ok = 1;
    long first = compact_value(args[6], &ok), step = compact_value(args[7], &ok);
    /* Both counts one-digit ints, the last one fitting a long. */
    if (!ok || PyList_GET_SIZE(args[4]) != n || n > (1L << 20) || first < 0 || step < 0) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (index_in(PyList_GET_ITEM(args[3], i), bound) < 0) {
            return 0;
        }
    }
    return 1;
}

/* pool_caching.cache_new_run's stores for a run of fresh blocks: native.NativeLoops.key_run says what it does. */
PyObject *
pk_key_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !pk_key_run_takes(args)) {
        Py_RETURN_NONE;
    }
    PyObject *hashes = args[0], *gids = args[1], *key_tokens = args[2], *run = args[3], *keys = args[4];
    int ok = 1;
    long first_count = compact_value(args[6], &ok), step = compact_value(args[7], &ok);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(run); i++) {
        Py_ssize_t block = checked_value(PyList_GET_ITEM(run, i));
        if (store_int(key_tokens, block, first_count + (long)i * step) < 0) {
            return NULL;
        }
        store(hashes, block, Py_NewRef(PyList_GET_ITEM(keys, i)));
        store(gids, block, Py_NewRef(args[5]));
    }
    Py_RETURN_TRUE;
}

static PyMethodDef native_methods[] = {
    PK_METHOD("release", pk_release, "(ref, gids, prev, next, sentinel, blocks, /)"),
    PK_METHOD("touch", pk_touch, "(ref, prev, next, blocks, /)"),
    PK_METHOD("take", pk_take, "(ref, hashes, prev, next, sentinel, n, evict, maps=None, /)"),
    PK_METHOD("key_run", pk_key_run, "(hashes, gids, key_tokens, run, keys, group_id, first_count, step, /)"),
    PK_METHOD("map_run", map_run, "(table, keys, run, /)"),
    PK_METHOD("prefix_hits", prefix_hits, "(table, hashes, limit, owner=None, /)"),
    PK_METHOD("admit", pk_admit, "(context, blocks, missing, keys, num_full, /)"),
    PK_METHOD("lookup", pk_lookup, "(context, request, /)"),
    PK_METHOD("release_request", pk_release_request, "(context, request_id, /)"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "pagedkv.optimized._native",
    "The block pool's per-block loops in C (optional; D-PERF-26).",
    -1,
    native_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (pk_calls_init() < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module != NULL && (pk_add_fields(module, "LOOKUP_FIELDS", pk_lookup_fields, pk_lookup_nfields) < 0
                           || pk_add_fields(module, "RELEASE_FIELDS", pk_release_fields, pk_release_nfields) < 0
                           || pk_add_fields(module, "ADMIT_FIELDS", pk_admit_fields, pk_admit_nfields) < 0)) {
        Py_CLEAR(module);
    }
    return module;
}
