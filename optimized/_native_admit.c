/* The one-group admission's pool work as one call (D-PERF-48), part of
 * pagedkv.optimized._native (its method table is in _native.c).
 *
 * Why one call: replaying a large trace, a call into the pool's C loops
 * costs about half a microsecond before its first block, because the work
 * between requests evicts the interpreter's and the pool's hot lines, and
 * the admission step made four of them (touch, take, map_run, key_run) plus
 * the Python around them. admit runs the same four functions, with the
 * same arguments, in the same order, from C: no step is reimplemented here,
 * so each keeps its own checks and its own definition in the Python loops.
 */
#include "_native_loops.h"
#include "_native_map.h"

const char admit_doc[] =
"admit(ref, prev, next, sentinel, hashes, gids, key_tokens, table, evict, maps,\n"
"      blocks, missing, keys, num_full, block_size) -> tuple | None\n\n"
"admit_path's pool work for a new request of one full-attention group\n"
"(group 0), which holds its hit in blocks (an exact list, len(blocks) =\n"
"held blocks):\n"
"  1. touch(ref, prev, next, blocks) when held > 0 -> moved;\n"
"  2. take(ref, hashes, prev, next, sentinel, missing, evict, maps) -> new;\n"
"     new is appended to blocks;\n"
"  3. when num_full > held: the fresh run new[:num_full - held] keyed with\n"
"     keys[held:num_full] (token counts (held + 1) * block_size onward,\n"
"     step block_size): map_run(table, ...) -> mapped, then, when mapped is\n"
"     True, key_run(hashes, gids, key_tokens, ...).\n"
"Returns None when step 1 declines (nothing changed: the caller runs the\n"
"steps itself), else (moved, new, keyed): new is None when step 2 declined\n"
"(nothing taken, keyed None); keyed is True when step 3 keyed the run,\n"
"False when map_run found a key cached already (nothing keyed), None when\n"
"step 3 did not run or its lists are not the ones key_run takes (nothing\n"
"keyed). The caller moves the queue's size (moved + len(new)), as after the\n"
"separate calls. An error after step 1 leaves the earlier steps done, as\n"
"an error between the separate calls did (the caller recovers).";

/* Would key_run take run (fresh ids from take), keys and the counts
 * first, first + step, ...? Then step 3 may change the map first. */
static int
key_run_takes(PyObject *hashes, PyObject *gids, PyObject *key_tokens, PyObject *run, long first, long step)
{
    if (!PyList_CheckExact(hashes) || !PyList_CheckExact(gids) || !PyList_CheckExact(key_tokens)) {
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(run);
    /* key_run reads both counts as one-digit ints, and the last count must fit its long. */
    if (n > (1L << 20) || first < 0 || first >= (1L << 30) || step < 0 || step >= (1L << 30)) {
        return 0;
    }
    Py_ssize_t bound = PyList_GET_SIZE(hashes);
    if (PyList_GET_SIZE(gids) < bound) {
        bound = PyList_GET_SIZE(gids);
    }
    if (PyList_GET_SIZE(key_tokens) < bound) {
        bound = PyList_GET_SIZE(key_tokens);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(run, i);
        int ok = PyLong_CheckExact(item);
        long block = ok ? compact_value(item, &ok) : -1;
        if (!ok || block < 0 || block >= bound) {
            return 0;
        }
    }
    return 1;
}

/* Step 3: Py_True, Py_False or Py_None (a new reference), NULL on error. */
static PyObject *
key_fresh_run(PyObject *self, PyObject *const *args, PyObject *new, Py_ssize_t held)
{
    PyObject *hashes = args[4], *gids = args[5], *key_tokens = args[6], *table = args[7];
    PyObject *keys = args[12];
    Py_ssize_t num_full = PyLong_AsSsize_t(args[13]);
    long block_size = PyLong_AsLong(args[14]);
    if ((num_full == -1 || block_size == -1) && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t fresh = num_full - held;
    if (fresh <= 0 || !PyList_CheckExact(keys) || num_full > PyList_GET_SIZE(keys)
            || fresh > PyList_GET_SIZE(new) || block_size <= 0 || held + 1 > (1L << 30) / block_size) {
        Py_RETURN_NONE;
    }
    PyObject *run = PyList_GetSlice(new, 0, fresh);
    if (run == NULL) {
        return NULL;
    }
    long first = (long)(held + 1) * block_size;
    if (!key_run_takes(hashes, gids, key_tokens, run, first, block_size)) {
        Py_DECREF(run);
        Py_RETURN_NONE;
    }
    PyObject *run_keys = PyList_GetSlice(keys, held, num_full);
    PyObject *first_obj = PyLong_FromLong(first);
    PyObject *group = PyLong_FromLong(0);
    PyObject *keyed = NULL;
    if (run_keys != NULL && first_obj != NULL && group != NULL) {
        PyObject *map_args[3] = {table, run_keys, run};
        keyed = map_run(self, map_args, 3);
        if (keyed == Py_True) {
            PyObject *key_args[8] = {hashes, gids, key_tokens, run, run_keys, group, first_obj, args[14]};
            PyObject *stored = pk_key_run(self, key_args, 8);
            if (stored != Py_True) {
                Py_DECREF(keyed);
                keyed = NULL;
                if (stored != NULL) {  /* cannot happen: key_run_takes said it would */
                    Py_DECREF(stored);
                    PyErr_SetString(PyExc_SystemError, "pagedkv: key_run declined a checked run");
                }
            }
            else {
                Py_DECREF(stored);
            }
        }
    }
    Py_DECREF(run);
    Py_XDECREF(run_keys);
    Py_XDECREF(first_obj);
    Py_XDECREF(group);
    return keyed;
}

PyObject *
pk_admit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 15 || !PyList_CheckExact(args[10]) || !PyLong_CheckExact(args[13])
            || !PyLong_CheckExact(args[14])) {
        Py_RETURN_NONE;
    }
    PyObject *blocks = args[10];
    Py_ssize_t held = PyList_GET_SIZE(blocks);
    PyObject *moved;
    if (held > 0) {  /* ALLOC-6: the hit is touched */
        PyObject *touch_args[4] = {args[0], args[1], args[2], blocks};
        moved = pk_touch(self, touch_args, 4);
        if (moved == NULL || moved == Py_None) {
            return moved;
        }
    }
    else {
        moved = PyLong_FromLong(0);
        if (moved == NULL) {
            return NULL;
        }
    }
    /* ALLOC-7 (EVICT-2..5 in pk_take): take(ref, hashes, prev, next, sentinel, missing, evict, maps) */
    PyObject *take_args[8] = {args[0], args[4], args[1], args[2], args[3], args[11], args[8], args[9]};
    PyObject *new = pk_take(self, take_args, 8);
    if (new == NULL) {
        Py_DECREF(moved);
        return NULL;
    }
    if (new == Py_None) {
        return Py_BuildValue("(NNO)", moved, new, Py_None);
    }
    PyObject *keyed = NULL;
    if (PyList_SetSlice(blocks, held, held, new) == 0) {
        keyed = key_fresh_run(self, args, new, held);  /* ALLOC-8 */
    }
    if (keyed == NULL) {
        Py_DECREF(moved);
        Py_DECREF(new);
        return NULL;
    }
    return Py_BuildValue("(NNN)", moved, new, keyed);
}
