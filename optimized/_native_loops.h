/* The pool's loops of pagedkv.optimized._native (_native.c), callable from
 * its other files: the fused admission (_native_admit.c) runs them in turn.
 * Each is the METH_FASTCALL function the module exposes under the name
 * without the pk_ prefix; its docstring in _native.c says what it does. */
#ifndef PAGEDKV_NATIVE_LOOPS_H
#define PAGEDKV_NATIVE_LOOPS_H

#include "_native_int.h"

PyObject *pk_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *pk_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *pk_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *pk_key_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

extern const char admit_doc[];
PyObject *pk_admit(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* _native_calls.c: the one-group lookup and release (D-PERF-49). */
extern const char lookup_doc[];
extern const char release_request_doc[];
int pk_calls_init(void);
PyObject *pk_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *pk_release_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The field names of the contexts the two calls read (native.py's NamedTuples). */
extern const char *const pk_lookup_fields[], *const pk_release_fields[];
extern const Py_ssize_t pk_lookup_nfields, pk_release_nfields;

#endif
