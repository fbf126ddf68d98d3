/* The several-group decode step's no-op test in C (D-PERF-39):
 * pagedkv.optimized._decode.
 *
 * Optional, like _native.c: without a C compiler the module is left out and
 * optimized/decode_path.py runs the same test in Python (decode.is_noop_decode,
 * inlined there), which stays the definition. The test runs on most
 * allocate_slots calls of a hybrid model and reads a few dict and list
 * entries per group; in the interpreter each group costs a tuple unpacking,
 * a bound-method call for its skip rule and a dozen bytecodes.
 *
 * noop(rules, request_id, num_computed, total, cache_tokens) answers True
 * (no group needs a block, fills one or releases one), False (some group
 * does: the step's filling branch runs) or None: anything it was not built
 * for (a request id that is not an exact str, a request some group does not
 * know, a value that is not an exact int of the range the tables hold), and
 * the caller then runs the Python test, which answers or raises as before.
 * It reads only: dict and list lookups of exact str keys and ints run no
 * Python code, so nothing can change under it.
 */
#include "_native_int.h"

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
    if (item == NULL || !PyLong_CheckExact(item)) {
        *ok = 0;
        return 0;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    return value;
}

PyDoc_STRVAR(noop_doc,
"noop(rules, request_id, num_computed, total, cache_tokens, /) -> bool | None\n\n"
"decode.is_noop_decode over rules: per group a tuple (req_to_blocks,\n"
"num_cached_blocks, block_size, extra, cache_size, skip, param, align) where\n"
"skip is 0 (releases nothing), 1 (a window: num_computed - param + 1\n"
"tokens skipped, at least 0), 2 (chunks of param tokens) or 3 (a Mamba\n"
"state: num_computed - 1) and align is a Mamba align group's\n"
"last_state_block or None. None when an argument is not what it covers.");

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
        /* total + extra > held * block_size: a new block (a product past
         * the range, a ring's huge size, holds every count). */
        if ((held == 0 || block_size <= LLONG_MAX / held) && total + extra > held * block_size) {
            Py_RETURN_FALSE;
        }
        long long cached = int_value(PyDict_GetItemWithError(PyTuple_GET_ITEM(rule, 1), request_id), &ok);
        if (!ok) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (floor_div(cache_tokens, cache_size) > cached) {
            Py_RETURN_FALSE;  /* a block filled */
        }
        if (skip == SKIP_NONE) {
            continue;
        }
        long long skipped;
        if (skip == SKIP_WINDOW) {
            skipped = num_computed - param + 1;
            if (skipped < 0) {
                skipped = 0;
            }
        }
        else if (skip == SKIP_CHUNK) {
            skipped = floor_div(num_computed, param) * param;
        }
        else if (skip == SKIP_STATE) {
            skipped = num_computed - 1;
        }
        else {
            Py_RETURN_NONE;
        }
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
                Py_RETURN_FALSE;  /* a block behind the window: released */
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

static PyMethodDef decode_methods[] = {
    {"noop", (PyCFunction)(void (*)(void))noop, METH_FASTCALL, noop_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef decode_module = {
    PyModuleDef_HEAD_INIT,
    "pagedkv.optimized._decode",
    "The several-group decode step's no-op test in C (optional; D-PERF-39).",
    -1,
    decode_methods,
};

PyMODINIT_FUNC
PyInit__decode(void)
{
    return PyModule_Create(&decode_module);
}
