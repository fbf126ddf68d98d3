/* Reading CPython's small ints in place, shared by the optional C modules
 * (_native.c: the pool's loops, D-PERF-26; _tokens.c: token packing and
 * prompt hashing, D-PERF-35). */
#ifndef PAGEDKV_NATIVE_INT_H
#define PAGEDKV_NATIVE_INT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Every id, ref count and group id the pool stores, and almost every token
 * id, is an int of at most one 30-bit digit, which CPython lays out as a sign
 * and one digit: read it in place (one load) rather than through the general
 * conversion. compact_value sets *ok to 0 for a longer int; the callers treat
 * that as "not the pool's" or take the general conversion. */
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
    if (size == 0) {
        return 0;
    }
    if (size == 1) {
        return (long)((PyLongObject *)item)->ob_digit[0];
    }
    if (size == -1) {
        return -(long)((PyLongObject *)item)->ob_digit[0];
    }
    *ok = 0;
    return 0;
}
#endif

/* module.<name> = the tuple of field names: the order in which a C step
 * reads its context (a NamedTuple of optimized/native.py, which checks the
 * two agree when the module loads). 0, or -1 with an error set. */
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

#endif
