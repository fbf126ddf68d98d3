/* The admission step of a new request in C (D-PERF-49), part of
 * pagedkv.optimized._native (its method table is in _native.c).
 *
 * Why: replaying a large trace one request at a time, allocate_slots spent
 * about as long in admit_path's interpreted step (its checks, the lookup
 * memo's test, the request's bookkeeping, the result object) as in the
 * pool's C work, because the work between requests evicts the lines each
 * of its few dozen bytecodes reads. admit_request runs that step's common
 * case from C, in the step's order: the same attribute reads, checks,
 * demand, bookkeeping and one call of admit (_native_admit.c).
 *
 * It is not a second definition. Whatever the step does not settle by the
 * common case it hands, unchanged, to the Python step (the first item of
 * its context), before anything has changed: a request id that is not an
 * exact str or is known, a count that is not an exact int of its range, a
 * hit that is not one exact list or that the lookup memo does not vouch for
 * (the Python step probes the map), events on, a value of an unexpected
 * type. After the first change, what the pool call left undone (a loop that
 * declined, a key cached already) goes to the step's own tail, finish (the
 * context's), and an exception runs recover before it propagates, as the
 * Python step's try block does. test_admit_path holds the two to the same
 * results, state, events and errors.
 */
#include "_native_int.h"
#include "_native_loops.h"

/* The context single_admit_step builds (native.AdmitContext), in this order. */
enum {
    CTX_STEP, CTX_REQUESTS, CTX_BLOCKS_OF, CTX_CACHED_OF, CTX_POOL, CTX_QUEUE, CTX_REF, CTX_PREV, CTX_NEXT,
    CTX_SENTINEL, CTX_HASHES, CTX_GIDS, CTX_KEY_TOKENS, CTX_TABLE, CTX_EVICT, CTX_MAPS, CTX_BLOCKS_TYPE,
    CTX_BLOCK_SIZE, CTX_MAX_MODEL_LEN, CTX_FINISH, CTX_RECOVER, CTX_SIZE
};
const char *const pk_admit_fields[] = {
    "python_step", "requests", "blocks_of", "cached_of", "pool", "queue", "ref", "prev", "next", "sentinel",
    "hashes", "gids", "key_tokens", "table", "evict", "maps", "blocks_type", "block_size", "max_model_len",
    "finish", "recover"};
const Py_ssize_t pk_admit_nfields = CTX_SIZE;

/* Counts above this go to the Python step: the sums below stay far from overflow. */
#define STEP_MAX_COUNT (1LL << 40)

static PyObject *s_request_id, *s_num_tokens, *s_num_computed_tokens, *s_block_hashes, *s_blocks;
static PyObject *s_last_hit, *s_map_epoch, *s_size, *s_events, *s_block_hashes_slot, *s_raw;
static PyObject *s_zero;  /* CPython's one int 0 (a small int: every 0 is this object) */

int
pk_step_init(void)
{
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_request_id, "request_id"}, {&s_num_tokens, "num_tokens"},
        {&s_num_computed_tokens, "num_computed_tokens"}, {&s_block_hashes, "block_hashes"},
        {&s_blocks, "blocks"}, {&s_last_hit, "last_hit"}, {&s_map_epoch, "map_epoch"}, {&s_size, "size"},
        {&s_events, "enable_kv_cache_events"}, {&s_block_hashes_slot, "_block_hashes"}, {&s_raw, "raw"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].name)) == NULL) {
            return -1;
        }
    }
    if (s_zero == NULL && (s_zero = PyLong_FromLong(0)) == NULL) {
        return -1;
    }
    return 0;
}

/* An exact int in [0, STEP_MAX_COUNT] into *out: 1, else 0. An exact int
 * converts without an error (one too large only sets overflow). */
static int
count_of(PyObject *item, long long *out)
{
    if (item == NULL || !PyLong_CheckExact(item)) {
        return 0;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || value < 0 || value > STEP_MAX_COUNT) {
        return 0;
    }
    *out = value;
    return 1;
}

static inline long long
ceil_div(long long a, long long b)
{
    return a > 0 ? (a + b - 1) / b : -((-a) / b);
}

/* Does the pool's lookup memo (epoch, hashes, hit) vouch for hit and
 * block_hashes (hit_memo.vouches, as the Python step tests it inline)?
 * 1 yes, 0 no, -1 an error (reading the pool's attributes) is set. */
static int
memo_vouches(PyObject *pool, PyObject *hit, PyObject *block_hashes)
{
    PyObject *memo = PyObject_GetAttr(pool, s_last_hit);
    PyObject *epoch = memo == NULL ? NULL : PyObject_GetAttr(pool, s_map_epoch);
    int vouched = 0;
    if (epoch != NULL && PyTuple_CheckExact(memo) && PyTuple_GET_SIZE(memo) == 3
            && PyLong_CheckExact(epoch) && PyLong_CheckExact(PyTuple_GET_ITEM(memo, 0))
            && PyList_CheckExact(PyTuple_GET_ITEM(memo, 2))) {
        PyObject *keys = PyTuple_GET_ITEM(memo, 1), *blocks = PyTuple_GET_ITEM(memo, 2);
        Py_ssize_t held = PyList_GET_SIZE(hit);
        /* Two exact ints: the comparison runs no Python code. */
        vouched = PyObject_RichCompareBool(PyTuple_GET_ITEM(memo, 0), epoch, Py_EQ) == 1
            && PyList_GET_SIZE(blocks) == held
            && (PyList_CheckExact(keys) || PyTuple_CheckExact(keys))
            && PySequence_Fast_GET_SIZE(keys) <= PySequence_Fast_GET_SIZE(block_hashes);
        for (Py_ssize_t i = 0; vouched && i < held; i++) {
            vouched = PyList_GET_ITEM(hit, i) == PyList_GET_ITEM(blocks, i);
        }
        PyObject **prefix = vouched ? PySequence_Fast_ITEMS(keys) : NULL;
        PyObject **items = vouched ? PySequence_Fast_ITEMS(block_hashes) : NULL;
        for (Py_ssize_t i = 0; vouched && i < PySequence_Fast_GET_SIZE(keys); i++) {
            vouched = items[i] == prefix[i];
        }
    }
    if (epoch == NULL) {
        Py_XDECREF(memo);
        return -1;
    }
    Py_DECREF(memo);
    Py_DECREF(epoch);
    return vouched;
}

/* How many of hit's blocks have ref count 0, or -1 when an id or a count is
 * not what the pool holds (no error set). */
static Py_ssize_t
free_hits(PyObject *ref, PyObject *hit)
{
    Py_ssize_t zeros = 0, bound = PyList_GET_SIZE(ref);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hit); i++) {
        PyObject *item = PyList_GET_ITEM(hit, i);
        int ok = PyLong_CheckExact(item);
        long block = ok ? compact_value(item, &ok) : -1;
        if (!ok || block < 0 || block >= bound) {
            return -1;
        }
        PyObject *count = PyList_GET_ITEM(ref, block);
        ok = PyLong_CheckExact(count);
        long value = ok ? compact_value(count, &ok) : -1;
        if (!ok) {
            return -1;
        }
        zeros += value == 0;
    }
    return zeros;
}

/* KVCacheBlocks((new,), hashes) without its __init__, whose whole work is
 * storing these two slots (blocks.py). */
PyObject *
pk_own_blocks(PyObject *type, PyObject *new, PyObject *hashes)
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

/* result, or, when it is NULL (an error after the first change), the
 * error after recover() has run (the Python step's except clause). */
static PyObject *
recovered(PyObject *ctx, PyObject *result)
{
    if (result != NULL) {
        return result;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *done = PyObject_CallNoArgs(PyTuple_GET_ITEM(ctx, CTX_RECOVER));
    if (done == NULL) {  /* recover's own error propagates, as from the except clause */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    Py_DECREF(done);
    PyErr_Restore(type, value, traceback);
    return NULL;
}

/* Steps 6 to 9 once step 1 to 5 have passed: the changes. */
static PyObject *
admit_changes(PyObject *self, PyObject *ctx, PyObject *facts, PyObject *request_id, PyObject *hit,
              Py_ssize_t held, long long main, long long num_tokens, long long missing, PyObject *block_hashes,
              int delay, int raw)
{
#define C(i) PyTuple_GET_ITEM(ctx, i)
    long long block_size = PyLong_AsLongLong(C(CTX_BLOCK_SIZE));
    PyObject *blocks = NULL, *held_obj = NULL, *missing_obj = NULL, *full_obj = NULL, *done = NULL;
    PyObject *result = NULL;
    /* ALLOC-6: the request becomes known, holding its hit. */
    if (PySet_Add(C(CTX_REQUESTS), request_id) < 0) {
        return recovered(ctx, NULL);
    }
    blocks = hit == NULL ? PyList_New(0) : PyList_GetSlice(hit, 0, held);
    held_obj = PyLong_FromSsize_t(held);
    if (blocks == NULL || held_obj == NULL || PyDict_SetItem(C(CTX_BLOCKS_OF), request_id, blocks) < 0
            || PyDict_SetItem(C(CTX_CACHED_OF), request_id, held_obj) < 0) {
        goto done;
    }
    /* ALLOC-8's extent: the blocks the computed tokens fill, as far as there are hashes (D-API-11). */
    long long num_full = 0;
    if (!delay) {
        num_full = (main < num_tokens ? main : num_tokens) / block_size;
        if (num_full > PySequence_Fast_GET_SIZE(block_hashes)) {
            num_full = PySequence_Fast_GET_SIZE(block_hashes);
        }
    }
    missing_obj = PyLong_FromLongLong(missing);
    full_obj = PyLong_FromLongLong(num_full);
    if (missing_obj == NULL || full_obj == NULL) {
        goto done;
    }
    PyObject *admit_args[15] = {C(CTX_REF), C(CTX_PREV), C(CTX_NEXT), C(CTX_SENTINEL), C(CTX_HASHES),
                                C(CTX_GIDS), C(CTX_KEY_TOKENS), C(CTX_TABLE), C(CTX_EVICT), C(CTX_MAPS),
                                blocks, missing_obj, block_hashes, full_obj, C(CTX_BLOCK_SIZE)};
    done = pk_admit(self, admit_args, 15);
    if (done == NULL) {
        goto done;
    }
    int common = PyTuple_CheckExact(done) && PyTuple_GET_SIZE(done) == 3
        && PyLong_CheckExact(PyTuple_GET_ITEM(done, 0)) && PyList_CheckExact(PyTuple_GET_ITEM(done, 1))
        && (num_full <= held || PyTuple_GET_ITEM(done, 2) == Py_True);
    if (!common) {
        /* A loop declined, or a key was cached already: the step's own tail. */
        PyObject *finish_args[9] = {facts, blocks, done, held_obj, missing_obj, full_obj, block_hashes,
                                    request_id, raw ? Py_True : Py_False};
        result = PyObject_Vectorcall(C(CTX_FINISH), finish_args, 9, NULL);
        goto done;
    }
    PyObject *new = PyTuple_GET_ITEM(done, 1);
    /* queue.size -= moved + missing, read after the call (eviction runs Python code). */
    PyObject *size = PyObject_GetAttr(C(CTX_QUEUE), s_size);
    PyObject *taken = size == NULL ? NULL : PyNumber_Add(PyTuple_GET_ITEM(done, 0), missing_obj);
    PyObject *left = taken == NULL ? NULL : PyNumber_Subtract(size, taken);
    int stored = left == NULL ? -1 : PyObject_SetAttr(C(CTX_QUEUE), s_size, left);
    Py_XDECREF(size);
    Py_XDECREF(taken);
    Py_XDECREF(left);
    if (stored < 0 || (num_full > held && PyDict_SetItem(C(CTX_CACHED_OF), request_id, full_obj) < 0)) {
        goto done;
    }
    result = raw ? Py_NewRef(new) : pk_own_blocks(C(CTX_BLOCKS_TYPE), new, C(CTX_HASHES));  /* ALLOC-9 */
done:
    Py_XDECREF(blocks);
    Py_XDECREF(held_obj);
    Py_XDECREF(missing_obj);
    Py_XDECREF(full_obj);
    Py_XDECREF(done);
    return recovered(ctx, result);
#undef C
}

const char admit_request_doc[] =
"admit_request(context, facts, num_new_tokens, num_new_computed_tokens,\n"
"              new_computed_blocks, delay_cache_blocks, reserved_blocks,\n"
"              watermark_blocks, num_in_flight_tokens, full_sequence_must_fit,\n"
"              raw=False)\n\n"
"admit_path's step (context[0]) for a new request, its common case run in\n"
"C (D-PERF-49): the same result, state and errors. context is the tuple\n"
"single_admit_step builds (the step, its tables, finish and recover).\n"
"Anything but the common case is handed to the step before any change.";

PyObject *
pk_admit_request(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != CTX_SIZE) {
        PyErr_SetString(PyExc_TypeError, "admit_request: the AdmitContext of single_admit_step comes first");
        return NULL;
    }
    PyObject *ctx = args[0];
#define C(i) PyTuple_GET_ITEM(ctx, i)
    Py_ssize_t given = nargs - 1;
    PyObject *raw = Py_False;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, 0);  /* a str: comparing it cannot fail */
        if (given != 9 || PyTuple_GET_SIZE(kwnames) != 1
                || (name != s_raw && PyUnicode_Compare(name, s_raw) != 0)) {
            goto python_step;
        }
        raw = args[nargs];
    }
    else if (given == 10) {
        raw = args[10];
    }
    else if (given != 9) {
        goto python_step;
    }
    PyObject *facts = args[1], *hit_arg = args[4], *delay = args[5], *must_fit = args[9];
    if ((raw != Py_True && raw != Py_False) || (delay != Py_True && delay != Py_False)
            || (must_fit != Py_True && must_fit != Py_False)) {
        goto python_step;
    }
    PyObject *request_id = NULL, *num_tokens_obj = NULL, *computed = NULL, *group_lists = NULL;
    PyObject *block_hashes = NULL, *events = NULL, *size = NULL;
    PyObject *result = NULL;
    int decline = 1;
    /* ALLOC-1, checks 1a-1b'': the Python step's reads and tests, in its order. */
    request_id = PyObject_GetAttr(facts, s_request_id);
    num_tokens_obj = request_id == NULL ? NULL : PyObject_GetAttr(facts, s_num_tokens);
    if (num_tokens_obj == NULL || !PyUnicode_CheckExact(request_id)
            || PySet_Contains(C(CTX_REQUESTS), request_id) != 0) {
        goto out;
    }
    computed = PyObject_GetAttr(facts, s_num_computed_tokens);
    long long num_new, num_new_computed, reserved, watermark, in_flight, num_tokens;
    if (computed == NULL) {
        goto out;
    }
    if (computed != s_zero  /* the step's `is not zero`: CPython's one int 0 */
            || !count_of(args[2], &num_new) || num_new < 1 || !count_of(args[3], &num_new_computed)
            || !count_of(args[6], &reserved) || !count_of(args[7], &watermark)
            || !count_of(args[8], &in_flight) || !count_of(num_tokens_obj, &num_tokens) || num_tokens < 1) {
        goto out;
    }
    /* 1c-1f: one exact list of this manager's ids covering the hit. */
    PyObject *hit = NULL;
    if (hit_arg == Py_None) {
        hit = NULL;
    }
    else if (raw == Py_True) {
        hit = hit_arg;
    }
    else if (Py_TYPE(hit_arg) == (PyTypeObject *)C(CTX_BLOCKS_TYPE)) {
        group_lists = PyObject_GetAttr(hit_arg, s_blocks);
        if (group_lists == NULL || !PyTuple_CheckExact(group_lists) || PyTuple_GET_SIZE(group_lists) != 1) {
            goto out;
        }
        hit = PyTuple_GET_ITEM(group_lists, 0);
    }
    else {
        goto out;
    }
    if (hit != NULL && !PyList_CheckExact(hit)) {
        goto out;
    }
    Py_ssize_t held = hit == NULL ? 0 : PyList_GET_SIZE(hit);
    long long block_size = PyLong_AsLongLong(C(CTX_BLOCK_SIZE));
    long long max_model_len = PyLong_AsLongLong(C(CTX_MAX_MODEL_LEN));
    long long main = num_new_computed + num_new;
    if (PyErr_Occurred() || block_size <= 0 || num_new_computed != (long long)held * block_size
            || main > max_model_len) {
        goto out;
    }
    block_hashes = PyObject_GetAttr(facts, s_block_hashes);
    if (block_hashes == NULL || !(PyList_CheckExact(block_hashes) || PyTuple_CheckExact(block_hashes))) {
        goto out;
    }
    /* 1h, 1h', 1i: the hit the last lookup found (else the Python step probes the map). */
    if (held > 0 && memo_vouches(C(CTX_POOL), hit, block_hashes) != 1) {
        goto out;
    }
    /* ALLOC-5: the demand against the free queue. */
    long long missing = ceil_div(main, block_size) - held;
    long long demand = missing + reserved;
    if (must_fit == Py_True) {
        long long whole = ceil_div(num_tokens < max_model_len ? num_tokens : max_model_len, block_size) - held;
        if (whole > demand) {
            demand = whole;
        }
    }
    demand += watermark;
    events = PyObject_GetAttr(C(CTX_POOL), s_events);
    size = events == NULL ? NULL : PyObject_GetAttr(C(CTX_QUEUE), s_size);
    long long queue_size;
    if (events != Py_False || !count_of(size, &queue_size)) {
        goto out;  /* events on: the step's methods announce each change */
    }
    if (demand + held > queue_size) {
        Py_ssize_t zeros = hit == NULL ? 0 : free_hits(C(CTX_REF), hit);
        if (zeros < 0) {
            goto out;
        }
        if (demand + zeros > queue_size) {
            decline = 0;
            result = Py_NewRef(Py_None);  /* D-API-13, D-API-48: nothing changed */
            goto out;
        }
    }
    decline = 0;
    result = admit_changes(self, ctx, facts, request_id, hit, held, main, num_tokens, missing, block_hashes,
                           delay == Py_True, raw == Py_True);
out:
    Py_XDECREF(request_id);
    Py_XDECREF(num_tokens_obj);
    Py_XDECREF(computed);
    Py_XDECREF(group_lists);
    Py_XDECREF(block_hashes);
    Py_XDECREF(events);
    Py_XDECREF(size);
    if (!decline || PyErr_Occurred()) {
        /* An error while reading (an engine's property, an interrupt) propagates as from
         * the same read in the Python step; nothing has changed. */
        return decline ? NULL : result;
    }
python_step:
    /* Nothing changed and nothing failed: the Python step reads and decides again. */
    return PyObject_Vectorcall(C(CTX_STEP), args + 1, given, kwnames);
#undef C
}
