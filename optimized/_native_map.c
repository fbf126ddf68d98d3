/* The block pool's map loops in C (D-PERF-40, D-PERF-41), part of
 * pagedkv.optimized._native (its method table is in _native.c).
 *
 * Both run over one group's map {raw hash: block id} (D-PERF-10) and take
 * only exact bytes keys, whose hashing and comparison run no Python code, so
 * nothing can change under a loop; anything else returns None and the Python
 * code (pool_caching.cache_new_run, single_type.FullAttentionManager) runs.
 */
#include "_native_int.h"
#include "_native_map.h"

const char map_run_doc[] =
"map_run(table, keys, run) -> bool | None\n\n"
"pool_caching.cache_new_run's map step in one pass: table[keys[i]] = run[i]\n"
"for every i when no key is in table already and none repeats in keys\n"
"(True); otherwise table is left as it was (False). One insertion per key\n"
"where the Python code probes each key twice (a disjointness test, then\n"
"dict.update): in a large map every probe is a cache miss. None (nothing\n"
"changed) unless table is an\n"
"exact dict, keys an exact list of exact bytes (their hashing and\n"
"comparison run no Python code) and run an exact list as long.";

PyObject *
map_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])) {
        Py_RETURN_NONE;
    }
    PyObject *table = args[0], *keys = args[1], *run = args[2];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(run) != n) {
        Py_RETURN_NONE;
    }
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

const char prefix_hits_doc[] =
"prefix_hits(table, hashes, limit, owner=None) -> list | None\n\n"
"The cached prefix of hashes[:limit] in one group's map: [table[h] for each\n"
"leading h of hashes[:limit] that table holds], stopping at the first it\n"
"does not. The prefix scan of a full-attention lookup\n"
"(single_type.FullAttentionManager) without an interpreted iteration per\n"
"block, its probes prefetched a batch at a time (D-PERF-47). None unless\n"
"table is an exact dict and hashes an exact list or tuple whose scanned\n"
"items are exact bytes (looked up without running Python code).\n\n"
"owner (the pool): when given and the hit is not empty, its lookup memo is\n"
"left as hit_memo.remember leaves it (D-PERF-44): owner.last_hit =\n"
"(owner.map_epoch, list(hashes[:len(hit)]), a copy of the hit); the\n"
"coordinator's lookup then makes no second call (D-PERF-48).";

/* owner.last_hit = (owner.map_epoch, list(items[:n]), hit[:]): 0, or -1 with an error set. */
static int
remember(PyObject *owner, PyObject *const *items, PyObject *hit)
{
    static PyObject *epoch_name = NULL, *memo_name = NULL;
    if (epoch_name == NULL && (epoch_name = PyUnicode_InternFromString("map_epoch")) == NULL) {
        return -1;
    }
    if (memo_name == NULL && (memo_name = PyUnicode_InternFromString("last_hit")) == NULL) {
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
    if (limit > size) {
        limit = size;
    }
    if (limit < 0) {
        limit = 0;
    }
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
    /* No Python code runs below (exact bytes keys, an exact dict): the
     * sequence cannot change under the loop. */
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

const char same_prefix_doc[] =
"same_prefix(items, prefix) -> bool | None\n\n"
"True when items starts with the very objects of prefix (identity, not\n"
"equality: nothing is read but the pointers, so no item's memory is\n"
"touched); False otherwise, a shorter items included. What the admission\n"
"step compares a hit and its hashes with the last lookup's by (the pool's\n"
"lookup memo, D-PERF-44). None unless both are exact lists or tuples.";

PyObject *
same_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0]))
            || !(PyList_CheckExact(args[1]) || PyTuple_CheckExact(args[1]))) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[1]);
    if (PySequence_Fast_GET_SIZE(args[0]) < n) {
        Py_RETURN_FALSE;
    }
    PyObject **items = PySequence_Fast_ITEMS(args[0]), **prefix = PySequence_Fast_ITEMS(args[1]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] != prefix[i]) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}
