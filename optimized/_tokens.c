/* Token checking and prompt hashing in C (D-PERF-35): pagedkv.optimized._tokens.
 *
 * Optional, like _native.c: a build without a C compiler leaves it out and the Python definitions run,
 * spec/request.py's pack_token_ids and optimized/hasher.py's per-block pickling. Both functions here either
 * give exactly what those give or return None having computed nothing, and the caller then runs the Python
 * path (tests/test_native_tokens.py compares them on random and hostile input).
 *
 * Why C: creating a request is one pass over its prompt to check the token ids and, with sha256, one
 * pickle.dumps per block (the bytes vLLM hashes). Both are per-token work in the interpreter's general
 * machinery (marshal, the pickler's dispatch), several nanoseconds a token; here each token is a type check,
 * a load and a few stores. */
#include "_native.h"

#include <stdint.h>

/* The value of an exact int in [0, 2**31), or -1: what pack_token_ids accepts. Almost every token id is one
 * digit, read in place. */
static inline long
token_value(PyObject *item)
{
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
    int ok = 1;
    long value = compact_value(item, &ok);
    if (!ok) {
        int overflow = 0;
        value = PyLong_AsLongAndOverflow(item, &overflow);  /* exact int: runs no Python code */
        if (overflow || value == -1) {
            PyErr_Clear();
            return -1;
        }
    }
    return (value >= 0 && value <= 0x7FFFFFFFL) ? value : -1;
}

/* spec.request.pack_token_ids in one C pass (native.NativeTokens.pack). */
static PyObject *
pack(PyObject *self, PyObject *tokens)
{
    if (!PyList_CheckExact(tokens) || PyList_GET_SIZE(tokens) > PY_SSIZE_T_MAX / 4) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(tokens);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *bytes = (unsigned char *)PyBytes_AS_STRING(out);
    /* Nothing in the loop runs Python code, so the list cannot change under it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        long value = token_value(PyList_GET_ITEM(tokens, i));
        if (value < 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        bytes[0] = (unsigned char)value;
        bytes[1] = (unsigned char)(value >> 8);
        bytes[2] = (unsigned char)(value >> 16);
        bytes[3] = (unsigned char)(value >> 24);
        bytes += 4;
    }
    return out;
}

/* pickle.dumps((parent, block, None), protocol=5) for a 32-byte parent and a tuple of n >= 4 ints
 * in [0, 2**31), while it fits one frame:
 *   PROTO 5 | FRAME <8-byte length> | SHORT_BINBYTES 32 <parent> | MEMOIZE |
 *   MARK | <ints> | TUPLE | MEMOIZE | NONE | TUPLE3 | MEMOIZE | STOP
 * each int BININT1 (K, 1 byte), BININT2 (M, 2 bytes) or BININT (J, 4 bytes), little-endian (spec/hashing.md
 * section 6; optimized/hasher.py builds the same bytes with numpy for blocks of at most 128 tokens). */
#define HEAD_BYTES 47  /* PROTO 2 + FRAME 9 + SHORT_BINBYTES 2 + parent 32 + MEMOIZE, MARK 2 */
#define TAIL_BYTES 6
#define PARENT_BYTES 32
/* The pickler starts a new frame once one reaches 64 KiB; stay well inside one. */
#define MAX_BLOCK_TOKENS 8192

static inline uint32_t
load_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* The pickle of one block into a new bytes object; NULL with no error set when a value is 2**31 or more (not
 * what pack() makes). */
static PyObject *
block_pickle(const unsigned char *values, Py_ssize_t n, const char *parent)
{
    Py_ssize_t ints = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t value = load_le32(values + 4 * i);
        if (value > 0x7FFFFFFFu) {
            return NULL;
        }
        ints += value < 256 ? 2 : value < 65536 ? 3 : 5;
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, HEAD_BYTES + ints + TAIL_BYTES);
    if (data == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(data);
    uint64_t frame = (uint64_t)(HEAD_BYTES - 11 + ints + TAIL_BYTES);
    *out++ = 0x80;  /* PROTO */
    *out++ = 5;
    *out++ = 0x95;  /* FRAME */
    for (int shift = 0; shift < 64; shift += 8) {
        *out++ = (unsigned char)(frame >> shift);
    }
    *out++ = 'C';  /* SHORT_BINBYTES */
    *out++ = PARENT_BYTES;
    memcpy(out, parent, PARENT_BYTES);
    out += PARENT_BYTES;
    *out++ = 0x94;  /* MEMOIZE */
    *out++ = '(';   /* MARK */
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = values + 4 * i;
        uint32_t value = load_le32(p);
        if (value < 256) {
            *out++ = 'K';
            *out++ = p[0];
        }
        else if (value < 65536) {
            *out++ = 'M';
            *out++ = p[0];
            *out++ = p[1];
        }
        else {
            *out++ = 'J';
            memcpy(out, p, 4);
            out += 4;
        }
    }
    memcpy(out, "t\x94N\x87\x94.", TAIL_BYTES);  /* TUPLE MEMOIZE NONE TUPLE3 MEMOIZE STOP */
    return data;
}

static PyObject *digest_name;  /* "digest", interned at import */

/* The chained sha256 hashes of a prompt's blocks (native.NativeTokens.sha256_blocks). */
static PyObject *
sha256_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyBytes_CheckExact(args[0]) || !PyLong_CheckExact(args[1])
            || !PyLong_CheckExact(args[2]) || !PyLong_CheckExact(args[3]) || !PyBytes_CheckExact(args[4])
            || PyBytes_GET_SIZE(args[4]) != PARENT_BYTES) {
        Py_RETURN_NONE;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    Py_ssize_t size = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t tokens = PyBytes_GET_SIZE(args[0]) / 4;
    if (size < 4 || size > MAX_BLOCK_TOKENS || start < 0 || end < start || end > tokens
            || (end - start) % size != 0) {
        Py_RETURN_NONE;
    }
    const unsigned char *values = (const unsigned char *)PyBytes_AS_STRING(args[0]) + 4 * start;
    PyObject *sha256 = args[5];
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    PyObject *parent = Py_NewRef(args[4]);
    for (Py_ssize_t block = 0; block < (end - start) / size; block++) {
        PyObject *data = block_pickle(values + 4 * size * block, size, PyBytes_AS_STRING(parent));
        Py_DECREF(parent);
        if (data == NULL) {
            Py_DECREF(out);
            if (PyErr_Occurred()) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
        PyObject *hasher = PyObject_CallOneArg(sha256, data);
        Py_DECREF(data);
        parent = hasher == NULL ? NULL : PyObject_CallMethodNoArgs(hasher, digest_name);
        Py_XDECREF(hasher);
        if (parent != NULL && (!PyBytes_CheckExact(parent) || PyBytes_GET_SIZE(parent) != PARENT_BYTES)) {
            Py_CLEAR(parent);
            PyErr_SetString(PyExc_TypeError, "sha256_blocks: sha256(...).digest() must give 32 bytes");
        }
        if (parent == NULL || PyList_Append(out, parent) < 0) {
            Py_XDECREF(parent);
            Py_DECREF(out);
            return NULL;
        }
    }
    Py_DECREF(parent);
    return out;
}

static PyMethodDef tokens_methods[] = {
    {"pack", (PyCFunction)pack, METH_O, "pack(tokens, /)"},
    PK_METHOD("sha256_blocks", sha256_blocks, "(packed, start, end, size, parent, sha256, /)"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef tokens_module = {
    PyModuleDef_HEAD_INIT,
    "pagedkv.optimized._tokens",
    "Token checking and prompt hashing in C (optional; D-PERF-35).",
    -1,
    tokens_methods,
};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    if (digest_name == NULL) {
        digest_name = PyUnicode_InternFromString("digest");
        if (digest_name == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&tokens_module);
}
