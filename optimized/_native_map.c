/* The block pool's map loops in C (D-PERF-40, D-PERF-41), part of pagedkv.optimized._native (its method table
 * is in _native.c).
 *
 * Both run over one group's map {raw hash: block id} (D-PERF-10) and take only exact bytes keys, whose
 * hashing and comparison run no Python code, so nothing can change under a loop; anything else returns None
 * and the Python code (pool_caching.cache_new_run, single_type.FullAttentionManager) runs. native.NativeLoops
 * says what each answers. */
#include "_native.h"

/* pool_caching.cache_new_run's map step in one pass: one insertion per key where the Python code probes each
 * key twice (a disjointness test, then dict.update); in a large map every probe misses. */
PyObject *
map_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])
            || PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[2])) {
        Py_RETURN_NONE;
    }
    PyObject *table = args[0], *keys = args[1], *run = args[2];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(keys, i))) {
            Py_RETURN_NONE;
        }
    }
    Py_ssize_t i = 0;
    int clash = 0;
    for (; i < n; i++) {
        Py_ssize_t before = PyDict_GET_SIZE(table);
        if (PyDict_SetDefault(table, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(run, i)) == NULL) {
            break;  /* out of memory: undone below, the error kept */
        }
        if (PyDict_GET_SIZE(table) == before) {
            clash = 1;  /* cached already, or twice in the run: undone below */
            break;
        }
    }
    if (i == n) {
        Py_RETURN_TRUE;
    }
    /* Keys 0..i-1 were all new: removing them restores the map's items and order. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (Py_ssize_t j = 0; j < i; j++) {
        if (PyDict_DelItem(table, PyList_GET_ITEM(keys, j)) < 0) {
            PyErr_Clear();  /* cannot happen: the key was just inserted */
        }
    }
    PyErr_Restore(type, value, traceback);
    if (!clash) {
        return NULL;
    }
    Py_RETURN_FALSE;
}

/* The prefix scan of a full-attention lookup (single_type.FullAttentionManager), no interpreted iteration per
 * block; leaves the pool's lookup memo as hit_memo.remember does (D-PERF-44, -48). */
/* owner.last_hit = (owner.map_epoch, list(items[:n]), hit[:]): 0, or -1 with an error set. */
static int
remember(PyObject *owner, PyObject *const *items, PyObject *hit)
{
    static PyObject *epoch_name, *memo_name;
    if (pk_intern((PyObject **[]){&epoch_name, &memo_name}, (const char *[]){"map_epoch", "last_hit"}, 2) < 0) {
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(hit);
    PyObject *epoch = PyObject_GetAttr(owner, epoch_name);
    PyObject *keys = PyList_New(n);
    PyObject *blocks = PyList_GetSlice(hit, 0, n);
    PyObject *memo = NULL;
    if (epoch != NULL && keys != NULL && blocks != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyList_SET_ITEM(keys, i, Py_NewRef(items[i]));
        }
        memo = PyTuple_Pack(3, epoch, keys, blocks);
    }
    Py_XDECREF(epoch);
    Py_XDECREF(keys);
    Py_XDECREF(blocks);
    if (memo == NULL) {
        return -1;
    }
    int failed = PyObject_SetAttr(owner, memo_name, memo);
    Py_DECREF(memo);
    return failed;
}

PyObject *
prefix_hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 4 || !PyDict_CheckExact(args[0]) || !PyLong_CheckExact(args[2])
            || !(PyList_CheckExact(args[1]) || PyTuple_CheckExact(args[1]))) {
        Py_RETURN_NONE;
    }
    PyObject *owner = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    PyObject *table = args[0], *hashes = args[1];
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(hashes);
    limit = limit > size ? size : limit < 0 ? 0 : limit;
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < limit; i++) {
        if (!PyBytes_CheckExact(items[i])) {
            Py_RETURN_NONE;
        }
    }
    /* LOOKUP-3, LOOKUP-4 for one full-attention group: stop at the first miss. */
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    /* No Python code runs below (exact bytes keys, an exact dict): the sequence cannot change under it. */
    for (Py_ssize_t i = 0; i < limit; i++) {
        PyObject *block = PyDict_GetItemWithError(table, items[i]);
        if (block == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(out);
                return NULL;
            }
            break;
        }
        if (PyList_Append(out, block) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    if (owner != NULL && PyList_GET_SIZE(out) > 0 && remember(owner, items, out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}
