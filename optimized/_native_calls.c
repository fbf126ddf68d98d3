/* The one-group manager's lookup and release in C (D-PERF-49), part of pagedkv.optimized._native (its method
 * table is in _native.c).
 *
 * Why: replaying a large trace one request at a time, the interpreted layers around the pool's C loops (a
 * frame, a few attribute reads, a result object built through its __init__) cost about a third of what the
 * loops cost, mostly in lines the work between requests has evicted. These two run those layers for one
 * full-attention group from C:
 *
 * - lookup: KVCacheManager.get_computed_blocks after its checks, without statistics: prefix_hits
 *   (_native_map.c) and the result;
 * - release_request: UnitaryCoordinator.release: the request's bookkeeping and release (_native.c) of its
 *   blocks, tail first.
 *
 * Both read and change nothing before deciding whether they apply, and hand anything else back (None for the
 * lookup, the Python method for the release), which then runs as before. native.NativeLoops says what each
 * answers. */
#include "_native.h"

static PyObject *s_block_hashes, *s_num_tokens, *s_size, *s_blocks, *s_block_hashes_slot;

int
pk_calls_init(void)
{
    PyObject **slots[] = {&s_block_hashes, &s_num_tokens, &s_size, &s_blocks, &s_block_hashes_slot};
    const char *names[] = {"block_hashes", "num_tokens", "size", "blocks", "_block_hashes"};
    return pk_intern(slots, names, 5);
}

/* KVCacheBlocks((new,), hashes) without its __init__, whose whole work is storing these two slots
 * (blocks.py). */
static PyObject *
own_blocks(PyObject *type, PyObject *new, PyObject *hashes)
{
    PyTypeObject *tp = (PyTypeObject *)type;
    PyObject *groups = PyTuple_Pack(1, new);
    PyObject *empty = groups == NULL ? NULL : PyTuple_New(0);
    PyObject *out = empty == NULL ? NULL : tp->tp_new(tp, empty, NULL);
    Py_XDECREF(empty);
    if (out != NULL && (PyObject_SetAttr(out, s_blocks, groups) < 0
                        || PyObject_SetAttr(out, s_block_hashes_slot, hashes) < 0)) {
        Py_CLEAR(out);
    }
    Py_XDECREF(groups);
    return out;
}

/* The lookup's context, as KVCacheManager builds it (native.LookupContext). */
enum { LOOK_TABLE, LOOK_BLOCK_SIZE, LOOK_POOL, LOOK_BLOCKS_TYPE, LOOK_HASHES, LOOK_SIZE };
const char *const pk_lookup_fields[] = {"table", "block_size", "pool", "blocks_type", "hashes"};
const Py_ssize_t pk_lookup_nfields = LOOK_SIZE;

PyObject *
pk_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ctx = pk_context(args, nargs, 2, LOOK_SIZE, "lookup(context, request)");
    if (ctx == NULL) {
        return NULL;
    }
    PyObject *request = args[1];
    /* The method's order: block_hashes, then num_tokens. */
    PyObject *hashes = PyObject_GetAttr(request, s_block_hashes);
    PyObject *num_tokens = hashes == NULL ? NULL : PyObject_GetAttr(request, s_num_tokens);
    if (num_tokens == NULL) {
        Py_XDECREF(hashes);
        return NULL;
    }
    PyObject *block_size = PyTuple_GET_ITEM(ctx, LOOK_BLOCK_SIZE);
    int overflow = 0;
    long long tokens = PyLong_CheckExact(num_tokens) ? PyLong_AsLongLongAndOverflow(num_tokens, &overflow) : 0;
    long long size = PyLong_AsLongLong(block_size);
    Py_DECREF(num_tokens);
    if (tokens < 1 || overflow || size <= 0) {
        Py_DECREF(hashes);
        Py_RETURN_NONE;
    }
    /* LOOKUP-2: the last token is recomputed; LOOKUP-3/4: the group's scan. */
    PyObject *limit = PyLong_FromLongLong((tokens - 1) / size);
    PyObject *scan_args[4] = {PyTuple_GET_ITEM(ctx, LOOK_TABLE), hashes, limit, PyTuple_GET_ITEM(ctx, LOOK_POOL)};
    PyObject *hit = limit == NULL ? NULL : prefix_hits(self, scan_args, 4);
    Py_DECREF(hashes);
    Py_XDECREF(limit);
    if (hit == NULL || hit == Py_None) {
        return hit;
    }
    PyObject *blocks = own_blocks(PyTuple_GET_ITEM(ctx, LOOK_BLOCKS_TYPE), hit, PyTuple_GET_ITEM(ctx, LOOK_HASHES));
    PyObject *tokens_hit = PyLong_FromLongLong((long long)PyList_GET_SIZE(hit) * size);
    Py_DECREF(hit);
    /* LOOKUP-6: the answer; nothing of the pool changed. */
    PyObject *out = blocks == NULL || tokens_hit == NULL ? NULL : PyTuple_Pack(2, blocks, tokens_hit);
    Py_XDECREF(blocks);
    Py_XDECREF(tokens_hit);
    return out;
}

/* The release's context, as UnitaryCoordinator builds it. */
enum {
    REL_METHOD, REL_REQUESTS, REL_BLOCKS_OF, REL_CACHED_OF, REL_REF, REL_GIDS, REL_PREV, REL_NEXT, REL_SENTINEL,
    REL_QUEUE, REL_FREE_HELD, REL_SIZE
};
const char *const pk_release_fields[] = {"python_release", "requests", "blocks_of", "cached_of", "ref", "gids",
                                         "prev", "next", "sentinel", "queue", "free_held"};
const Py_ssize_t pk_release_nfields = REL_SIZE;

PyObject *
pk_release_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ctx = pk_context(args, nargs, 2, REL_SIZE, "release_request(context, request_id)");
    if (ctx == NULL) {
        return NULL;
    }
    PyObject *request_id = args[1];
#define C(i) PyTuple_GET_ITEM(ctx, i)
    PyObject *blocks_of = C(REL_BLOCKS_OF), *cached_of = C(REL_CACHED_OF), *requests = C(REL_REQUESTS);
    /* Exact str keys in exact containers: the probes run no Python code. */
    PyObject *blocks = NULL;
    if (!PyUnicode_CheckExact(request_id) || !PySet_CheckExact(requests) || !PyDict_CheckExact(blocks_of)
            || !PyDict_CheckExact(cached_of) || PySet_Contains(requests, request_id) != 1
            || (blocks = PyDict_GetItemWithError(blocks_of, request_id)) == NULL || !PyList_CheckExact(blocks)
            || PyDict_GetItemWithError(cached_of, request_id) == NULL) {
        return PyErr_Occurred() ? NULL : PyObject_CallOneArg(C(REL_METHOD), request_id);
    }
    Py_INCREF(blocks);  /* the table's reference goes below */
    /* FREE-6 (the request is forgotten), then FREE-2: its list tail first. */
    if (PySet_Discard(requests, request_id) < 0 || PyDict_DelItem(blocks_of, request_id) < 0
            || PyDict_DelItem(cached_of, request_id) < 0 || PyList_Reverse(blocks) < 0) {
        Py_DECREF(blocks);
        return NULL;
    }
    /* FREE-4, FREE-5 in pk_release. */
    PyObject *release_args[6] = {C(REL_REF), C(REL_GIDS), C(REL_PREV), C(REL_NEXT), C(REL_SENTINEL), blocks};
    PyObject *released = pk_release(self, release_args, 6);
    PyObject *result = NULL;
    if (released == Py_None) {
        result = PyObject_CallOneArg(C(REL_FREE_HELD), blocks);
    }
    else if (released != NULL) {
        PyObject *size = PyObject_GetAttr(C(REL_QUEUE), s_size);
        PyObject *grown = size == NULL ? NULL : PyNumber_Add(size, released);
        if (grown != NULL && PyObject_SetAttr(C(REL_QUEUE), s_size, grown) == 0) {
            result = Py_NewRef(Py_None);
        }
        Py_XDECREF(size);
        Py_XDECREF(grown);
    }
    Py_XDECREF(released);
    Py_DECREF(blocks);
    if (result != NULL) {
        Py_SETREF(result, Py_NewRef(Py_None));  /* what free_held answered is not the method's */
    }
    return result;
#undef C
}
