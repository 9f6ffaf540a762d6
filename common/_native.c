/* The support check in one pass, where numpy needs several (spread the
 * tokens over the ids, compare, count hits per support): for each sampled
 * token, whether its support (a row of a CSR mask) holds it.
 *
 * Optional: `common/validation.py` falls back to numpy when this module is
 * not built. Inputs come from peers, so every offset is bounds-checked
 * before it indexes anything; arrays of the wrong kind or length raise
 * ValueError naming the rule.
 * Buffers only (no numpy headers): the module builds with a C compiler and
 * Python's own headers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A buffer of `itemsize`-byte items of one of the struct `kinds` (signed
 * integers "ilq", bytes "?bB"), native order, in C order, one dimension. */
static int
get_vector(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *kinds, int writable, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *format = view->format ? view->format : "B";
    if (format[0] == '@' || format[0] == '=')
        format++;
    if (view->ndim != 1 || view->itemsize != itemsize || strlen(format) != 1 || !strchr(kinds, format[0])) {
        PyErr_Format(PyExc_ValueError, "rule '%s is a 1-D array of %zd-byte items of kind \"%s\"' not met: got %d "
                     "dimension(s) of %zd-byte items of format \"%s\"", name, itemsize, kinds, view->ndim, view->itemsize,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#if defined(__GNUC__) || defined(__clang__)
/* Eight ids compared per step, as two vectors of four (a width every 64-bit
 * CPU has: SSE2, NEON), with no branch on where in its support the token
 * lies, which is where a scan that stops at the token mispredicts. */
#define LANES 8
typedef int32_t four_ids_t __attribute__((vector_size(4 * sizeof(int32_t))));
static const four_ids_t low_lanes = {0, 1, 2, 3}, high_lanes = {4, 5, 6, 7};
#endif

/* Whether `want` is among id[start:end] (bounds checked by the caller: 0 <=
 * start <= end <= n_ids). A step reads LANES ids only where all of them lie
 * inside the n_ids ids; the lanes past `end` are masked off. */
static inline int
holds_token(const int32_t *id, int64_t start, int64_t end, int64_t n_ids, int32_t want)
{
    int64_t i = start;
#ifdef LANES
    const four_ids_t wanted = {want, want, want, want};
    for (; i < end && i + LANES <= n_ids; i += LANES) {
        four_ids_t low, high;
        memcpy(&low, id + i, sizeof low);
        memcpy(&high, id + i + 4, sizeof high);
        int32_t left = end - i < LANES ? (int32_t)(end - i) : LANES;
        const four_ids_t within = {left, left, left, left};
        four_ids_t hit = ((low == wanted) & (low_lanes < within)) | ((high == wanted) & (high_lanes < within));
        uint64_t folded[2];
        memcpy(folded, &hit, sizeof folded);
        if (folded[0] | folded[1])
            return 1;
    }
#endif
    for (; i < end; i++) {
        if (id[i] == want)
            return 1;
    }
    return 0;
}

PyDoc_STRVAR(inside_support_doc,
"inside_support(tokens, ids, offsets, out)\n\n"
"out[t] = 1 when tokens[t] is among ids[offsets[t]:offsets[t+1]], else 0\n"
"(0 too where that support breaks a CSR rule: it starts below 0, ends\n"
"before it starts or past the ids). tokens and ids: int32; offsets: int64,\n"
"one more than the tokens; out: one byte per token, written.");

static PyObject *
inside_support(PyObject *self, PyObject *args)
{
    PyObject *tokens_obj, *ids_obj, *offsets_obj, *out_obj;
    Py_buffer tokens, ids, offsets, out;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOO:inside_support", &tokens_obj, &ids_obj, &offsets_obj, &out_obj))
        return NULL;
    if (get_vector(tokens_obj, &tokens, 4, "ilq", 0, "tokens") < 0)
        return NULL;
    if (get_vector(ids_obj, &ids, 4, "ilq", 0, "ids") < 0)
        goto release_tokens;
    if (get_vector(offsets_obj, &offsets, 8, "ilq", 0, "offsets") < 0)
        goto release_ids;
    if (get_vector(out_obj, &out, 1, "?bB", 1, "out") < 0)
        goto release_offsets;

    Py_ssize_t n = tokens.shape[0], n_ids = ids.shape[0];
    if (offsets.shape[0] != n + 1 || out.shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "rule 'offsets has one entry more than the tokens, out one per token' not met: "
                     "%zd tokens, %zd offsets, %zd out", n, offsets.shape[0], out.shape[0]);
        goto release_out;
    }
    const int32_t *token = (const int32_t *)tokens.buf, *id = (const int32_t *)ids.buf;
    const int64_t *offset = (const int64_t *)offsets.buf;
    uint8_t *inside = (uint8_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < n; t++) {
        int64_t start = offset[t], end = offset[t + 1];
        /* a support that breaks a CSR rule holds nothing */
        inside[t] = start >= 0 && start <= end && end <= (int64_t)n_ids && holds_token(id, start, end, n_ids, token[t]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
release_out:
    PyBuffer_Release(&out);
release_offsets:
    PyBuffer_Release(&offsets);
release_ids:
    PyBuffer_Release(&ids);
release_tokens:
    PyBuffer_Release(&tokens);
    return result;
}

PyDoc_STRVAR(supports_hold_tokens_doc,
"supports_hold_tokens(tokens, ids, offsets, bound) -> bool\n\n"
"For lists of messages' arrays (tokens and ids int32, offsets int64): whether\n"
"every message's offsets run from 0 to its ids' end, strictly increasing\n"
"(no support empty), each token lies in its support, and every id is in\n"
"[0, bound). One pass over each message's ids, none of them joined.");

static PyObject *
supports_hold_tokens(PyObject *self, PyObject *args)
{
    PyObject *tokens_list, *ids_list, *offsets_list;
    long long bound;

    if (!PyArg_ParseTuple(args, "O!O!O!L:supports_hold_tokens", &PyList_Type, &tokens_list, &PyList_Type, &ids_list,
                          &PyList_Type, &offsets_list, &bound))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(tokens_list);
    if (PyList_GET_SIZE(ids_list) != count || PyList_GET_SIZE(offsets_list) != count) {
        PyErr_Format(PyExc_ValueError, "rule 'one tokens, ids and offsets array per message' not met: got %zd, %zd "
                     "and %zd", count, PyList_GET_SIZE(ids_list), PyList_GET_SIZE(offsets_list));
        return NULL;
    }
    int holds = 1;
    for (Py_ssize_t m = 0; m < count && holds; m++) {
        Py_buffer tokens, ids, offsets;
        if (get_vector(PyList_GET_ITEM(tokens_list, m), &tokens, 4, "ilq", 0, "tokens") < 0)
            return NULL;
        if (get_vector(PyList_GET_ITEM(ids_list, m), &ids, 4, "ilq", 0, "ids") < 0) {
            PyBuffer_Release(&tokens);
            return NULL;
        }
        if (get_vector(PyList_GET_ITEM(offsets_list, m), &offsets, 8, "ilq", 0, "offsets") < 0) {
            PyBuffer_Release(&ids);
            PyBuffer_Release(&tokens);
            return NULL;
        }
        Py_ssize_t n = tokens.shape[0], n_ids = ids.shape[0];
        const int32_t *token = (const int32_t *)tokens.buf, *id = (const int32_t *)ids.buf;
        const int64_t *offset = (const int64_t *)offsets.buf;
        if (offsets.shape[0] != n + 1 || offset[0] != 0 || offset[n] != (int64_t)n_ids)
            holds = 0;
        uint32_t largest = 0;  /* a negative id reads as at least 2**31 */
        for (Py_ssize_t i = 0; i < n_ids; i++)
            largest = (uint32_t)id[i] > largest ? (uint32_t)id[i] : largest;
        if (n_ids && (unsigned long long)largest >= (unsigned long long)bound)
            holds = 0;
        for (Py_ssize_t t = 0; t < n && holds; t++) {
            int64_t start = offset[t], end = offset[t + 1];
            if (end <= start || end > (int64_t)n_ids) {  /* start >= 0: offset[0] is, and each end was checked */
                holds = 0;
                break;
            }
            holds = holds_token(id, start, end, n_ids, token[t]);
        }
        PyBuffer_Release(&offsets);
        PyBuffer_Release(&ids);
        PyBuffer_Release(&tokens);
    }
    return PyBool_FromLong(holds);
}

static PyMethodDef methods[] = {
    {"inside_support", inside_support, METH_VARARGS, inside_support_doc},
    {"supports_hold_tokens", supports_hold_tokens, METH_VARARGS, supports_hold_tokens_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "Compiled passes numpy takes several for (optional).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
