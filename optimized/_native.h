/* What the optional C modules share (_native*.c: the pool's loops, D-PERF-26; _tokens.c: token packing and
 * prompt hashing, D-PERF-35; _decode.c: the decode step, D-PERF-39): reading CPython's small ints in place,
 * interned names, the field order of a context, and _native's functions that its other files call. What each
 * function does is in optimized/native.py (NativeLoops). */
#ifndef PAGEDKV_NATIVE_H
#define PAGEDKV_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Every id, ref count and group id the pool stores, and almost every token id, is an int of at most one
 * 30-bit digit: read it in place (one load) rather than through the general conversion. *ok becomes 0 for a
 * longer int; the callers treat that as "not the pool's" or convert. */
#if PY_VERSION_HEX >= 0x030C0000
static inline long
compact_value(PyObject *item, int *ok)
{
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *ok = 0;
        return 0;
    }
    return (long)PyUnstable_Long_CompactValue((PyLongObject *)item);
}
#else
static inline long
compact_value(PyObject *item, int *ok)
{
    Py_ssize_t size = Py_SIZE(item);
    if (size < -1 || size > 1) {
        *ok = 0;
        return 0;
    }
    return size == 0 ? 0 : (long)size * (long)((PyLongObject *)item)->ob_digit[0];
}
/* A method table's METH_FASTCALL entry; its docstring is its signature (native.py documents it). */
#define PK_METHOD(name, fn, sig) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, name sig}

#endif

/* The int value of an exact int in [0, bound), or -1. */
static inline Py_ssize_t
index_in(PyObject *item, Py_ssize_t bound)
{
    int ok = PyLong_CheckExact(item);
    long value = ok ? compact_value(item, &ok) : -1;
    return ok && value >= 0 && value < bound ? (Py_ssize_t)value : -1;
}

/* *slots[i] = the interned names[i] (once): 0, or -1 with an error set. */
static inline int
pk_intern(PyObject **const *slots, const char *const *names, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* args[0] when the call has `arity` arguments, a context tuple of `size` items first, else NULL with a
 * TypeError naming the call's `usage`. */
static inline PyObject *
pk_context(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t arity, Py_ssize_t size, const char *usage)
{
    if (nargs != arity || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != size) {
        PyErr_Format(PyExc_TypeError, "%s: the context tuple its builder makes first", usage);
        return NULL;
    }
    return args[0];
}

/* module.<name> = the tuple of field names: the order in which a C step reads its context (a NamedTuple of
 * optimized/native.py, which checks the two agree at import). 0, or -1. */
static inline int
pk_add_fields(PyObject *module, const char *name, const char *const *fields, Py_ssize_t n)
{
    PyObject *names = PyTuple_New(n);
    for (Py_ssize_t i = 0; names != NULL && i < n; i++) {
        PyObject *field = PyUnicode_FromString(fields[i]);
        if (field == NULL) {
            Py_CLEAR(names);
            break;
        }
        PyTuple_SET_ITEM(names, i, field);
    }
    int added = names == NULL ? -1 : PyModule_AddObjectRef(module, name, names);
    Py_XDECREF(names);
    return added;
}

/* _native's functions, each the METH_FASTCALL function the module exposes under the name without the pk_
 * prefix: the loops (_native.c), the maps (_native_map.c), the fused admission (_native_admit.c), the
 * one-group lookup and release (_native_calls.c). */
#define PK_FASTCALL(name) PyObject *name(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
PK_FASTCALL(pk_release);
PK_FASTCALL(pk_touch);
PK_FASTCALL(pk_take);
PK_FASTCALL(pk_key_run);
int pk_key_run_takes(PyObject *const *args);
PK_FASTCALL(map_run);
PK_FASTCALL(prefix_hits);
PK_FASTCALL(pk_admit);
PK_FASTCALL(pk_lookup);
PK_FASTCALL(pk_release_request);
int pk_calls_init(void);

/* The field names of the contexts admit, lookup and release_request read (native.py's NamedTuples). */
extern const char *const pk_admit_fields[], *const pk_lookup_fields[], *const pk_release_fields[];
extern const Py_ssize_t pk_admit_nfields, pk_lookup_nfields, pk_release_nfields;

/* A method table's METH_FASTCALL entry; its docstring is its signature (native.py documents it). */
#define PK_METHOD(name, fn, sig) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, name sig}

#endif
