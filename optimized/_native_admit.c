/* The one-group admission's pool work as one call (D-PERF-48), part of pagedkv.optimized._native (its method
 * table is in _native.c).
 *
 * Why one call: replaying a large trace, a call into the pool's C loops costs about half a microsecond before
 * its first block, because the work between requests evicts the interpreter's and the pool's hot lines, and
 * the admission step made four of them (touch, take, map_run, key_run) plus the Python around them. admit
 * runs the same four functions, with the same arguments, in the same order, from C: no step is reimplemented
 * here, so each keeps its own checks and its own definition in the Python loops. native.NativeLoops.admit
 * says what it answers. */
#include "_native.h"

/* The admission's context, as admit_path builds it (native.AdmitContext). */
enum { AD_REF, AD_PREV, AD_NEXT, AD_SENTINEL, AD_HASHES, AD_GIDS, AD_KEY_TOKENS, AD_TABLE, AD_EVICT, AD_MAPS,
       AD_BLOCK_SIZE, AD_SIZE };
const char *const pk_admit_fields[] = {"ref", "prev", "next", "sentinel", "hashes", "gids", "key_tokens", "table",
                                       "evict", "maps", "block_size"};
const Py_ssize_t pk_admit_nfields = AD_SIZE;
#define C(i) PyTuple_GET_ITEM(ctx, i)

/* ALLOC-8, step 3: the fresh run new[:num_full - held] keyed with keys[held:num_full] (map_run, then
 * key_run). Py_True, Py_False or Py_None (a new reference), NULL on error. */
static PyObject *
key_fresh_run(PyObject *self, PyObject *ctx, PyObject *new, Py_ssize_t held, PyObject *keys, Py_ssize_t num_full)
{
    Py_ssize_t fresh = num_full - held;
    long block_size = PyLong_AsLong(C(AD_BLOCK_SIZE));
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fresh <= 0 || !PyList_CheckExact(keys) || num_full > PyList_GET_SIZE(keys)
            || fresh > PyList_GET_SIZE(new) || block_size <= 0 || held + 1 > (1L << 30) / block_size) {
        Py_RETURN_NONE;
    }
    PyObject *run = PyList_GetSlice(new, 0, fresh);
    PyObject *run_keys = PyList_GetSlice(keys, held, num_full);
    PyObject *first = PyLong_FromLong((long)(held + 1) * block_size);
    PyObject *group = PyLong_FromLong(0);
    PyObject *keyed = NULL;
    if (run != NULL && run_keys != NULL && first != NULL && group != NULL) {
        PyObject *key_args[8] = {C(AD_HASHES), C(AD_GIDS), C(AD_KEY_TOKENS), run, run_keys, group, first,
                                 C(AD_BLOCK_SIZE)};
        PyObject *map_args[3] = {C(AD_TABLE), run_keys, run};
        /* key_run must not decline once map_run has changed the map: asked first. */
        keyed = !pk_key_run_takes(key_args) ? Py_NewRef(Py_None) : map_run(self, map_args, 3);
        PyObject *stored = keyed == Py_True ? pk_key_run(self, key_args, 8) : NULL;
        if (stored != NULL) {
            Py_DECREF(stored);  /* True: key_run runs the same key_run_takes first */
        }
        else if (keyed == Py_True) {
            Py_CLEAR(keyed);
        }
    }
    Py_XDECREF(run);
    Py_XDECREF(run_keys);
    Py_XDECREF(first);
    Py_XDECREF(group);
    return keyed;
}

PyObject *
pk_admit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ctx = pk_context(args, nargs, 5, AD_SIZE, "admit(context, blocks, missing, keys, num_full)");
    if (ctx == NULL) {
        return NULL;
    }
    PyObject *blocks = args[1];
    Py_ssize_t num_full = PyLong_CheckExact(args[4]) ? PyLong_AsSsize_t(args[4]) : -1;
    if (!PyList_CheckExact(blocks) || !PyLong_CheckExact(C(AD_BLOCK_SIZE)) || num_full < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t held = PyList_GET_SIZE(blocks);
    PyObject *moved;
    if (held > 0) {  /* ALLOC-6: the hit is touched */
        PyObject *touch_args[4] = {C(AD_REF), C(AD_PREV), C(AD_NEXT), blocks};
        moved = pk_touch(self, touch_args, 4);
        if (moved == NULL || moved == Py_None) {
            return moved;
        }
    }
    else if ((moved = PyLong_FromLong(0)) == NULL) {
        return NULL;
    }
    /* ALLOC-7 (EVICT-2..5 in pk_take) */
    PyObject *take_args[8] = {C(AD_REF), C(AD_HASHES), C(AD_PREV), C(AD_NEXT), C(AD_SENTINEL), args[2],
                              C(AD_EVICT), C(AD_MAPS)};
    PyObject *new = pk_take(self, take_args, 8);
    if (new == Py_None) {
        return Py_BuildValue("(NNO)", moved, new, Py_None);
    }
    PyObject *keyed = NULL;
    if (new != NULL && PyList_SetSlice(blocks, held, held, new) == 0) {
        keyed = key_fresh_run(self, ctx, new, held, args[3], num_full);
    }
    if (keyed == NULL) {
        Py_DECREF(moved);
        Py_XDECREF(new);
        return NULL;
    }
    return Py_BuildValue("(NNN)", moved, new, keyed);
}
