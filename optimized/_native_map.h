/* The map loops of pagedkv.optimized._native (_native_map.c), for its method table. */
#ifndef PAGEDKV_NATIVE_MAP_H
#define PAGEDKV_NATIVE_MAP_H

#include "_native_int.h"

extern const char map_run_doc[];
PyObject *map_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

extern const char prefix_hits_doc[];
PyObject *prefix_hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

extern const char same_prefix_doc[];
PyObject *same_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
