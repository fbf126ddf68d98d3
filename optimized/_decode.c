/* The decode step's no-op test in C (D-PERF-39) and its no-op case (D-PERF-50): pagedkv.optimized._decode.
 *
 * Optional, like _native.c: without a C compiler the module is left out and optimized/decode_path.py runs the
 * same test in Python (decode.is_noop_decode, inlined there), which stays the definition. The test runs on
 * most allocate_slots calls of a hybrid model and reads a few dict and list entries per group; in the
 * interpreter each group costs a tuple unpacking, a bound-method call for its skip rule and a dozen
 * bytecodes.
 *
 * noop(rules, request_id, num_computed, total, cache_tokens) answers True (no group needs a block, fills one
 * or releases one), False (some group does: the step's filling branch runs) or None: anything it was not
 * built for (a request id that is not an exact str, a request some group does not know, a value that is not
 * an exact int of the range the tables hold), and the caller then runs the Python test, which answers or
 * raises as before. It reads only: dict and list lookups of exact str keys and ints run no Python code, so
 * nothing can change under it. native.NativeDecode says what each function answers. */
#include "_native.h"

#include <limits.h>

/* Skip rules, one per group, as data rather than a bound method. */
enum { SKIP_NONE = 0, SKIP_WINDOW = 1, SKIP_CHUNK = 2, SKIP_STATE = 3 };

/* Python's floor division for a positive divisor. */
static inline long long
floor_div(long long a, long long b)
{
    long long q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* An exact int's value, or 0 with *ok cleared. */
static inline long long
int_value(PyObject *item, int *ok)
{
    int overflow = 0, exact = item != NULL && PyLong_CheckExact(item);
    long long value = exact ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
    if (!exact || overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    return value;
}

static PyObject *
noop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_CheckExact(args[0]) || !PyUnicode_CheckExact(args[1])) {
        Py_RETURN_NONE;
    }
    PyObject *rules = args[0], *request_id = args[1];
    int ok = 1;
    long long num_computed = int_value(args[2], &ok);
    long long total = int_value(args[3], &ok);
    long long cache_tokens = int_value(args[4], &ok);
    if (!ok) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t g = 0; g < PyTuple_GET_SIZE(rules); g++) {
        PyObject *rule = PyTuple_GET_ITEM(rules, g);
        if (!PyTuple_CheckExact(rule) || PyTuple_GET_SIZE(rule) != 8
                || !PyDict_CheckExact(PyTuple_GET_ITEM(rule, 0)) || !PyDict_CheckExact(PyTuple_GET_ITEM(rule, 1))) {
            Py_RETURN_NONE;
        }
        long long block_size = int_value(PyTuple_GET_ITEM(rule, 2), &ok);
        long long extra = int_value(PyTuple_GET_ITEM(rule, 3), &ok);
        long long cache_size = int_value(PyTuple_GET_ITEM(rule, 4), &ok);
        long long skip = int_value(PyTuple_GET_ITEM(rule, 5), &ok);
        long long param = int_value(PyTuple_GET_ITEM(rule, 6), &ok);
        PyObject *align = PyTuple_GET_ITEM(rule, 7);
        if (!ok || block_size <= 0 || cache_size <= 0 || (skip == SKIP_CHUNK && param <= 0)
                || (align != Py_None && !PyDict_CheckExact(align))) {
            Py_RETURN_NONE;
        }
        /* An exact str key: lookups run no Python code. */
        PyObject *blocks = PyDict_GetItemWithError(PyTuple_GET_ITEM(rule, 0), request_id);
        if (blocks == NULL || !PyList_CheckExact(blocks)) {
            PyErr_Clear();
            Py_RETURN_NONE;  /* an unknown request: the Python test hands it on */
        }
        long long held = PyList_GET_SIZE(blocks);
        /* ALLOC-7 would allocate: total + extra > held * block_size: a new block (a product past the range, a
         * ring's huge size, holds every count). */
        if ((held == 0 || block_size <= LLONG_MAX / held) && total + extra > held * block_size) {
            Py_RETURN_FALSE;
        }
        long long cached = int_value(PyDict_GetItemWithError(PyTuple_GET_ITEM(rule, 1), request_id), &ok);
        if (!ok) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (floor_div(cache_tokens, cache_size) > cached) {
            Py_RETURN_FALSE;  /* a block filled: ALLOC-8 would cache it */
        }
        if (skip == SKIP_NONE) {
            continue;
        }
        if (skip != SKIP_WINDOW && skip != SKIP_CHUNK && skip != SKIP_STATE) {
            Py_RETURN_NONE;
        }
        long long skipped = skip == SKIP_CHUNK ? floor_div(num_computed, param) * param
                            : skip == SKIP_STATE ? num_computed - 1
                            : num_computed - param + 1 > 0 ? num_computed - param + 1 : 0;  /* a window */
        if (skipped >= block_size) {
            long long index = skipped / block_size;
            if (held == 0) {
                Py_RETURN_NONE;
            }
            long long value = int_value(PyList_GET_ITEM(blocks, (index < held ? index : held) - 1), &ok);
            if (!ok) {
                Py_RETURN_NONE;
            }
            if (value != 0) {
                Py_RETURN_FALSE;  /* a block behind the window: ALLOC-3 releases it */
            }
        }
        if (align != Py_None) {
            PyObject *found = PyDict_GetItemWithError(align, request_id);
            if (found == NULL) {
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    Py_RETURN_NONE;
                }
                continue;
            }
            long long last = int_value(found, &ok);
            if (!ok) {
                Py_RETURN_NONE;
            }
            /* last < cdiv(skipped + 1, b) - 1 and (last >= held or blocks[last]) */
            if (last < -floor_div(-(skipped + 1), block_size) - 1) {
                if (last >= held) {
                    Py_RETURN_FALSE;
                }
                if (last < 0) {
                    Py_RETURN_NONE;  /* a negative index: Python's rules, in Python */
                }
                long long value = int_value(PyList_GET_ITEM(blocks, last), &ok);
                if (!ok) {
                    Py_RETURN_NONE;
                }
                if (value != 0) {
                    Py_RETURN_FALSE;  /* last step's state block: released */
                }
            }
        }
    }
    Py_RETURN_TRUE;
}

/* The decode step's context, as decode_path.probed_decode_step builds it (native.DecodeContext). */
enum { STEP_PYTHON, STEP_RULES, STEP_COUNTED, STEP_MAX_MODEL_LEN, STEP_CACHING, STEP_HASH_BLOCK_SIZE,
       STEP_EMPTY, STEP_SIZE };
static const char *const step_fields[] = {"python_step", "rules", "counted", "max_model_len", "caching",
                                          "hash_block_size", "empty"};

static PyObject *s_num_computed_tokens, *s_num_tokens, *s_block_hashes, *s_request_id;

/* getattr(request, name) into *out: 1 read, 0 an AttributeError (cleared: the Python step's `except
 * AttributeError` answers it), -1 another error. */
static int
read_attr(PyObject *request, PyObject *name, PyObject **out)
{
    *out = PyObject_GetAttr(request, name);
    if (*out != NULL) {
        return 1;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* decode_path.probed_decode_step's step, its no-op case run in C (D-PERF-50); anything else goes to the
 * Python step (context[0]) before any change. */
static PyObject *
decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != STEP_SIZE) {
        PyErr_SetString(PyExc_TypeError, "decode_step: the DecodeContext of probed_decode_step comes first");
        return NULL;
    }
    PyObject *ctx = args[0];
    if (nargs != 4 || (args[3] != Py_True && args[3] != Py_False) || !PyLong_CheckExact(args[2])) {
        goto python_step;
    }
    PyObject *request = args[1];
    PyObject *computed_obj = NULL, *tokens_obj = NULL, *hashes = NULL, *request_id = NULL, *verdict = NULL;
    int caches = PyTuple_GET_ITEM(ctx, STEP_CACHING) == Py_True && args[3] == Py_False;
    int handled = 0, read;
    /* The step's reads, in its order: num_computed_tokens, then num_tokens where the class is not counted (0:
     * not read). */
    if ((read = read_attr(request, s_num_computed_tokens, &computed_obj)) <= 0) {
        goto out;
    }
    int counted = PySet_Contains(PyTuple_GET_ITEM(ctx, STEP_COUNTED), (PyObject *)Py_TYPE(request));
    if (counted < 0) {
        read = -1;
        goto out;
    }
    long long num_tokens = 0;
    int ok = 1;
    if (!counted) {
        if ((read = read_attr(request, s_num_tokens, &tokens_obj)) <= 0) {
            goto out;
        }
        num_tokens = int_value(tokens_obj, &ok);
        if (num_tokens < 1) {
            ok = 0;
        }
    }
    long long num_computed = int_value(computed_obj, &ok);
    long long num_new = int_value(args[2], &ok);
    long long max_model_len = int_value(PyTuple_GET_ITEM(ctx, STEP_MAX_MODEL_LEN), &ok);
    long long hash_block_size = int_value(PyTuple_GET_ITEM(ctx, STEP_HASH_BLOCK_SIZE), &ok);
    /* Counts far from overflow only; anything else is the Python step's. */
    const long long big = 1LL << 50;
    if (!ok || num_computed < 0 || num_computed > big || num_new > big || num_new < 1
            || hash_block_size <= 0) {
        goto out;
    }
    long long total = num_computed + num_new;
    if (total > max_model_len) {
        goto out;
    }
    long long cache_tokens = -1;
    if (caches) {  /* total bounds min(total, num_tokens) where the count is not read */
        cache_tokens = num_tokens == 0 || total < num_tokens ? total : num_tokens;
    }
    /* len(request.block_hashes), then request.request_id, as the step reads them. */
    if ((read = read_attr(request, s_block_hashes, &hashes)) <= 0) {
        goto out;
    }
    if (!PyList_CheckExact(hashes) && !PyTuple_CheckExact(hashes)) {
        goto out;  /* len() of another type may run Python code: the step's */
    }
    if (floor_div(cache_tokens, hash_block_size) > PySequence_Fast_GET_SIZE(hashes)) {
        goto out;
    }
    if ((read = read_attr(request, s_request_id, &request_id)) <= 0) {
        goto out;
    }
    if (!PyUnicode_CheckExact(request_id)) {
        goto out;
    }
    PyObject *total_obj = PyLong_FromLongLong(total);
    PyObject *cache_obj = total_obj == NULL ? NULL : PyLong_FromLongLong(cache_tokens);
    if (cache_obj == NULL) {
        Py_XDECREF(total_obj);
        read = -1;
        goto out;
    }
    PyObject *noop_args[5] = {PyTuple_GET_ITEM(ctx, STEP_RULES), request_id, computed_obj, total_obj, cache_obj};
    verdict = noop(self, noop_args, 5);
    Py_DECREF(total_obj);
    Py_DECREF(cache_obj);
    if (verdict == NULL) {
        read = -1;
        goto out;
    }
    handled = verdict == Py_True;
out:
    Py_XDECREF(computed_obj);
    Py_XDECREF(tokens_obj);
    Py_XDECREF(hashes);
    Py_XDECREF(request_id);
    Py_XDECREF(verdict);
    if (read < 0) {
        return NULL;
    }
    if (handled) {
        return Py_NewRef(PyTuple_GET_ITEM(ctx, STEP_EMPTY));
    }
python_step:
    return PyObject_Vectorcall(PyTuple_GET_ITEM(ctx, STEP_PYTHON), args + 1, nargs - 1, NULL);
}

static PyMethodDef decode_methods[] = {
    PK_METHOD("noop", noop, "(rules, request_id, num_computed, total, cache_tokens, /)"),
    PK_METHOD("decode_step", decode_step, "(context, request, num_new_tokens, delay_cache_blocks, /)"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef decode_module = {
    PyModuleDef_HEAD_INIT,
    "pagedkv.optimized._decode",
    "The decode step's no-op test and no-op case in C (optional; D-PERF-39, D-PERF-50).",
    -1,
    decode_methods,
};

PyMODINIT_FUNC
PyInit__decode(void)
{
    PyObject **slots[] = {&s_num_computed_tokens, &s_num_tokens, &s_block_hashes, &s_request_id};
    const char *names[] = {"num_computed_tokens", "num_tokens", "block_hashes", "request_id"};
    if (pk_intern(slots, names, 4) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&decode_module);
    if (module != NULL && pk_add_fields(module, "STEP_FIELDS", step_fields, STEP_SIZE) < 0) {
        Py_CLEAR(module);
    }
    return module;
}
