/* The support check in one pass, where numpy needs several (spread the
 * tokens over the ids, compare, count hits per support): for each sampled
 * token, whether its support (a row of a CSR mask) holds it. And a batch
 * of messages' content rules in one call, one pass over each array, where
 * numpy joins the batch's arrays and reduces each join. And a delivery's
 * turns merged into its frame in one pass, where Python builds a list of
 * pieces per array, turn by turn, for numpy to join.
 *
 * Optional: `common/validation.py` and `common/trajectory.py` fall back to
 * numpy when this module is not built. Inputs come from peers, so every offset is bounds-checked
 * before it indexes anything; arrays of the wrong kind or length raise
 * ValueError naming the rule.
 * Buffers only (no numpy headers): the module builds with a C compiler and
 * Python's own headers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

/* The checks' loops are written for any vector width. The compiler's
 * default x86-64 target stops at SSE2's 128-bit vectors, so on x86-64 with
 * glibc the functions that run them are also built for AVX2, and the build
 * the CPU can run is picked at load time. Elsewhere, or built with
 * WIDE_VECTORS defined empty, they are built once, for the target. */
#if !defined(WIDE_VECTORS) && defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WIDE_VECTORS __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef WIDE_VECTORS
#define WIDE_VECTORS
#endif

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

/* An array's expected items (`itemsize` bytes of one of the struct `kinds`) and its name in messages. */
typedef struct { Py_ssize_t itemsize; const char *kinds; const char *name; } kind_t;

/* The items of `outs` (a tuple of `n`, of `kinds`) that are not None, as
 * writable vectors of exactly `need[r]` entries each; -1 with ValueError
 * naming the rule otherwise. `held[r]` marks those taken, for
 * `release_views` either way. */
static int
get_outputs(PyObject *outs, int n, const kind_t *kinds, const Py_ssize_t *need, Py_buffer *out, int *held)
{
    for (int r = 0; r < n; r++) {
        PyObject *item = PyTuple_GET_ITEM(outs, r);
        if (item == Py_None)
            continue;
        if (get_vector(item, &out[r], kinds[r].itemsize, kinds[r].kinds, 1, kinds[r].name) < 0)
            return -1;
        held[r] = 1;
        if (out[r].shape[0] != need[r]) {
            PyErr_Format(PyExc_ValueError, "rule 'each output is exactly the size of what is written into it' not met: "
                         "%s has %zd entries, expected %zd", kinds[r].name, out[r].shape[0], need[r]);
            return -1;
        }
    }
    return 0;
}

/* Release the views of `view` (`n` of them) that `held` marks, and unmark them. */
static void
release_views(int n, Py_buffer *view, int *held)
{
    for (int r = 0; r < n; r++) {
        if (held[r])
            PyBuffer_Release(&view[r]);
        held[r] = 0;
    }
}

#if defined(__GNUC__) || defined(__clang__)
/* Ids are compared four to a vector (a width every 64-bit CPU has: SSE2,
 * NEON). Most supports are short, and where in its support the token lies
 * is random, so a scan that stops at the token mispredicts: the first
 * FIRST_IDS ids of a support are compared whatever the support's size, the
 * lanes past its end masked off, with no branch until the answer. Only a
 * longer support goes on, LANES ids a step. */
#define FOUR 4
#define LANES 8
#define FIRST_IDS 16
typedef int32_t four_ids_t __attribute__((vector_size(FOUR * sizeof(int32_t))));

/* Whether `want` is among the `count` ids from `id` (count <= width), read
 * as `width` ids, all of which lie inside the array. */
static inline int
window_holds(const int32_t *id, int32_t count, int32_t width, int32_t want)
{
    const four_ids_t wanted = {want, want, want, want}, within = {count, count, count, count}, step = {FOUR, FOUR, FOUR, FOUR};
    four_ids_t lane = {0, 1, 2, 3}, hit = {0, 0, 0, 0};
    for (int32_t k = 0; k < width; k += FOUR) {
        four_ids_t ids;
        memcpy(&ids, id + k, sizeof ids);
        hit |= (ids == wanted) & (lane < within);
        lane += step;
    }
    uint64_t folded[2];
    memcpy(folded, &hit, sizeof folded);
    return (folded[0] | folded[1]) != 0;
}
#endif

/* Whether `want` is among id[start:end] (bounds checked by the caller: 0 <=
 * start <= end <= n_ids). A window reads ids only where all of them lie
 * inside the n_ids ids; its lanes past `end` are masked off. */
static inline int
holds_token(const int32_t *id, int64_t start, int64_t end, int64_t n_ids, int32_t want)
{
    int64_t i = start;
#ifdef LANES
    if (i + FIRST_IDS <= n_ids) {
        int64_t size = end - i;
        int found = window_holds(id + i, size < FIRST_IDS ? (int32_t)size : FIRST_IDS, FIRST_IDS, want);
        if (found || size <= FIRST_IDS)
            return found;
        i += FIRST_IDS;
    }
    for (; i < end && i + LANES <= n_ids; i += LANES) {
        if (window_holds(id + i, end - i < LANES ? (int32_t)(end - i) : LANES, LANES, want))
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

WIDE_VECTORS
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

/* Whether each of `n` ids, read as unsigned (a negative one as at least
 * 2**31), is below `bound`. Up to a bound of 2**31 that is two signed
 * compares an id with no early exit, which compile to vector compares. */
static int
ids_below(const int32_t *id, Py_ssize_t n, long long bound)
{
    if (bound <= 0)
        return n == 0;
    if (bound > (long long)INT32_MAX + 1) {  /* some negative ids are below it too */
        for (Py_ssize_t i = 0; i < n; i++) {
            if ((long long)(uint32_t)id[i] >= bound)
                return 0;
        }
        return 1;
    }
    const int32_t last = (int32_t)(bound - 1);
    int outside = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        outside |= (id[i] < 0) | (id[i] > last);
    return !outside;
}

static int
buffer_ids_below(const Py_buffer *ids, long long bound)
{
    return ids_below((const int32_t *)ids->buf, ids->shape[0], bound);
}

/* Whether CSR supports frame `n_ids` ids (offsets from 0 to the ids' end,
 * strictly increasing: no support empty) and each holds its token; with
 * `loss` and `log_prob` given, also whether each token marked forced (loss
 * mask 0, log-prob exactly 0) has a singleton support. That test is a pass
 * of its own once the supports hold, accumulated with no branch (one on
 * each of its three parts mispredicts): it compiles to vector compares,
 * where inside the scan's loop it cost more than the scan. */
static inline int
supports_hold(const int32_t *token, Py_ssize_t n, const int32_t *id, Py_ssize_t n_ids, const int64_t *offset,
              const uint8_t *loss, const float *log_prob)
{
    if (offset[0] != 0 || offset[n] != (int64_t)n_ids)
        return 0;
    for (Py_ssize_t t = 0; t < n; t++) {
        int64_t start = offset[t], end = offset[t + 1];
        if (end <= start || end > (int64_t)n_ids)  /* start >= 0: offset[0] is, and each end was checked */
            return 0;
        if (!holds_token(id, start, end, n_ids, token[t]))
            return 0;
    }
    if (loss == NULL)
        return 1;
    int unforced = 1;
    for (Py_ssize_t t = 0; t < n; t++)
        unforced &= !((loss[t] == 0) & (log_prob[t] == 0.0f) & (offset[t + 1] - offset[t] != 1));
    return unforced;
}

/* Whether a message's CSR supports frame its ids and hold its tokens, and
 * every id is in [0, bound). */
static int
message_supports_hold(const Py_buffer *tokens, const Py_buffer *ids, const Py_buffer *offsets, long long bound)
{
    Py_ssize_t n = tokens->shape[0];
    return offsets->shape[0] == n + 1 && ids_below((const int32_t *)ids->buf, ids->shape[0], bound)
        && supports_hold((const int32_t *)tokens->buf, n, (const int32_t *)ids->buf, ids->shape[0],
                         (const int64_t *)offsets->buf, NULL, NULL);
}

/* Whether every log-prob is at most `tolerance` and above -inf (a NaN is
 * neither). No early exit: the loop compiles to vector compares. */
static int
log_probs_hold(const Py_buffer *values, double tolerance)
{
    const float *value = (const float *)values->buf;
    float most = (float)tolerance;  /* the largest float at most `tolerance`: the same test as in double */
    if ((double)most > tolerance)
        most = nextafterf(most, -INFINITY);
    int held = 1;
    for (Py_ssize_t i = 0; i < values->shape[0]; i++)
        held &= (value[i] <= most) & (value[i] > -INFINITY);
    return held;
}

/* Whether every loss-mask flag is 0 or 1 (vector compares, as above). */
static int
flags_hold(const Py_buffer *flags)
{
    const uint8_t *flag = (const uint8_t *)flags->buf;
    uint8_t high = 0;
    for (Py_ssize_t i = 0; i < flags->shape[0]; i++)
        high |= flag[i];
    return high <= 1;
}

/* A message's arrays by role, in the order `messages_content_valid` is given their names. */
enum { TOKENS, LOG_PROBS, LOSS_MASK, FULL_LOG_PROBS, MASK_IDS, MASK_OFFSETS, MASK_LOG_PROBS, PROMPT_TOKENS,
       FORCED_TOKENS, ROLES };
static const struct { Py_ssize_t itemsize; const char *kinds; } role_kinds[ROLES] = {
    {4, "ilq"}, {4, "f"}, {1, "B"}, {4, "f"}, {4, "ilq"}, {8, "ilq"}, {4, "f"}, {4, "ilq"}, {4, "ilq"},
};

/* The content rules of one message whose arrays are `held` (the others absent). */
WIDE_VECTORS
static int
message_valid(const Py_buffer *view, const int *held, long long bound, double tolerance)
{
    Py_ssize_t n = view[TOKENS].shape[0];
    if ((held[LOG_PROBS] && view[LOG_PROBS].shape[0] != n) || (held[LOSS_MASK] && view[LOSS_MASK].shape[0] != n)
            || (held[FULL_LOG_PROBS] && view[FULL_LOG_PROBS].shape[0] != n))
        return 0;
    if (held[MASK_LOG_PROBS] && (!held[MASK_IDS] || view[MASK_LOG_PROBS].shape[0] != view[MASK_IDS].shape[0]))
        return 0;
    if (held[MASK_OFFSETS]) {  /* sampled tokens lie in their supports, so the support ids stand for them */
        if (!held[MASK_IDS] || !message_supports_hold(&view[TOKENS], &view[MASK_IDS], &view[MASK_OFFSETS], bound))
            return 0;
    } else if (!buffer_ids_below(&view[TOKENS], bound)) {
        return 0;
    }
    if ((held[PROMPT_TOKENS] && !buffer_ids_below(&view[PROMPT_TOKENS], bound))
            || (held[FORCED_TOKENS] && !buffer_ids_below(&view[FORCED_TOKENS], bound)))
        return 0;
    if (held[LOSS_MASK] && !flags_hold(&view[LOSS_MASK]))
        return 0;
    return !(held[LOG_PROBS] && !log_probs_hold(&view[LOG_PROBS], tolerance))
        && !(held[FULL_LOG_PROBS] && !log_probs_hold(&view[FULL_LOG_PROBS], tolerance))
        && !(held[MASK_LOG_PROBS] && !log_probs_hold(&view[MASK_LOG_PROBS], tolerance));
}

PyDoc_STRVAR(messages_content_valid_doc,
"messages_content_valid(batch, names, bound, tolerance) -> bool\n\n"
"Whether every message of `batch` (a list of dicts of arrays) keeps the\n"
"content rules: its per-token arrays as long as its tokens, its supports\n"
"framing their ids and holding its tokens, every id in [0, bound), loss-mask\n"
"flags 0 or 1, log-probs at most `tolerance` and above -inf. `names` are\n"
"the dict keys of tokens, log_probs, loss_mask, full_log_probs, mask_ids,\n"
"mask_offsets, mask_log_probs, prompt_tokens and forced_tokens, in that\n"
"order; a key absent (or None) is an array the message does not carry.\n"
"One pass over each array, none joined. An array not of its contract's\n"
"dtype raises ValueError naming it (numpy's check takes those).");

static PyObject *
messages_content_valid(PyObject *self, PyObject *args)
{
    PyObject *batch, *names;
    long long bound;
    double tolerance;

    if (!PyArg_ParseTuple(args, "O!O!Ld:messages_content_valid", &PyList_Type, &batch, &PyTuple_Type, &names, &bound,
                          &tolerance))
        return NULL;
    if (PyTuple_GET_SIZE(names) != ROLES) {
        PyErr_Format(PyExc_ValueError, "rule 'one name per array role' not met: expected %d names, got %zd", ROLES,
                     PyTuple_GET_SIZE(names));
        return NULL;
    }
    int valid = 1;
    for (Py_ssize_t m = 0; m < PyList_GET_SIZE(batch) && valid; m++) {
        PyObject *arrays = PyList_GET_ITEM(batch, m);
        if (!PyDict_Check(arrays)) {
            PyErr_Format(PyExc_ValueError, "rule 'a message's arrays are a dict' not met: got %s",
                         Py_TYPE(arrays)->tp_name);
            return NULL;
        }
        Py_buffer view[ROLES];
        int held[ROLES] = {0}, failed = 0;
        for (int r = 0; r < ROLES && !failed; r++) {
            PyObject *name = PyTuple_GET_ITEM(names, r);
            PyObject *value = PyDict_GetItemWithError(arrays, name);
            if (value == NULL && PyErr_Occurred()) {
                failed = 1;
            } else if (value == NULL || value == Py_None) {
                if (r == TOKENS) {
                    PyErr_Format(PyExc_ValueError, "rule 'every message has tokens' not met: message %zd has none", m);
                    failed = 1;
                }
            } else if (get_vector(value, &view[r], role_kinds[r].itemsize, role_kinds[r].kinds, 0,
                                  PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : "an array") < 0) {
                failed = 1;
            } else {
                held[r] = 1;
            }
        }
        if (!failed)
            valid = message_valid(view, held, bound, tolerance);
        for (int r = 0; r < ROLES; r++) {
            if (held[r])
                PyBuffer_Release(&view[r]);
        }
        if (failed)
            return NULL;
    }
    return PyBool_FromLong(valid);
}

/* The arrays `pack_checked` reads from each sample, by role, in the order it is given their names: the last
 * two (log-probs over the whole vocabulary, one per token; the support's, one per id) only when it writes them. */
enum { SAMPLE_TOKENS, SAMPLE_LOG_PROBS, SAMPLE_LOSS_MASK, SAMPLE_IDS, SAMPLE_OFFSETS, SAMPLE_PROMPT, SAMPLE_FULL_LOG_PROBS,
       SAMPLE_MASK_LOG_PROBS, SAMPLE_ROLES };
static const struct { Py_ssize_t itemsize; const char *kinds; } sample_kinds[SAMPLE_ROLES] = {
    {4, "ilq"}, {4, "f"}, {1, "B"}, {4, "ilq"}, {8, "ilq"}, {4, "ilq"}, {4, "f"}, {4, "f"},
};
/* And what it writes, in the order it is given them. */
enum { OUT_SEQUENCES, OUT_TOKENS, OUT_LOG_PROBS, OUT_LOSS_MASK, OUT_IDS, OUT_OFFSETS, OUT_FULL_LOG_PROBS,
       OUT_MASK_LOG_PROBS, OUTS };
static const kind_t out_kinds[OUTS] = {
    {4, "ilq", "sequences out"}, {4, "ilq", "tokens out"}, {4, "f", "log_probs out"}, {1, "B", "loss_mask out"},
    {4, "ilq", "mask_ids out"}, {8, "ilq", "mask_offsets out"}, {4, "f", "full_log_probs out"},
    {4, "f", "mask_log_probs out"},
};

/* One sample's views, those of the roles `wanted` held. */
typedef struct { Py_buffer view[SAMPLE_ROLES]; int held[SAMPLE_ROLES]; } sample_t;

/* Sample `m`'s arrays of the `wanted` roles, its aligned lengths checked
 * (what packing needs to stay inside `outs`); -1 with ValueError naming the
 * rule otherwise. */
static int
get_sample(PyObject *arrays, PyObject *names, const int *wanted, Py_ssize_t m, sample_t *sample)
{
    memset(sample->held, 0, sizeof sample->held);
    if (!PyDict_Check(arrays)) {
        PyErr_Format(PyExc_ValueError, "rule 'a sample's arrays are a dict' not met: got %s", Py_TYPE(arrays)->tp_name);
        return -1;
    }
    for (int r = 0; r < SAMPLE_ROLES; r++) {
        if (!wanted[r])
            continue;
        PyObject *name = PyTuple_GET_ITEM(names, r);
        PyObject *value = PyDict_GetItemWithError(arrays, name);
        if (value == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "rule 'every sample carries the arrays packed' not met: sample %zd has no %S",
                             m, name);
            release_views(SAMPLE_ROLES, sample->view, sample->held);
            return -1;
        }
        if (get_vector(value, &sample->view[r], sample_kinds[r].itemsize, sample_kinds[r].kinds, 0,
                       PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : "an array") < 0) {
            release_views(SAMPLE_ROLES, sample->view, sample->held);
            return -1;
        }
        sample->held[r] = 1;
    }
    const Py_buffer *v = sample->view;
    Py_ssize_t n = v[SAMPLE_TOKENS].shape[0];
    if (v[SAMPLE_LOG_PROBS].shape[0] != n || v[SAMPLE_LOSS_MASK].shape[0] != n
            || (wanted[SAMPLE_OFFSETS] && v[SAMPLE_OFFSETS].shape[0] != n + 1)
            || (wanted[SAMPLE_FULL_LOG_PROBS] && v[SAMPLE_FULL_LOG_PROBS].shape[0] != n)
            || (wanted[SAMPLE_MASK_LOG_PROBS] && v[SAMPLE_MASK_LOG_PROBS].shape[0] != v[SAMPLE_IDS].shape[0])) {
        PyErr_Format(PyExc_ValueError, "rule 'a sample's per-token and per-id arrays align with its tokens and ids' not "
                     "met: sample %zd has %zd tokens", m, n);
        release_views(SAMPLE_ROLES, sample->view, sample->held);
        return -1;
    }
    return 0;
}

/* Copy one sample into the outputs at `at` (sequence, token and id
 * positions), its offsets moved past the ids before it, then check it while
 * its bytes are in cache. */
WIDE_VECTORS
static int
pack_sample(const sample_t *sample, char **out, Py_ssize_t at[3], long long bound, double tolerance)
{
    const Py_buffer *v = sample->view;
    Py_ssize_t n = v[SAMPLE_TOKENS].shape[0], prompt = v[SAMPLE_PROMPT].shape[0];
    int32_t *sequences = (int32_t *)out[OUT_SEQUENCES] + at[0];
    memcpy(sequences, v[SAMPLE_PROMPT].buf, 4 * prompt);
    memcpy(sequences + prompt, v[SAMPLE_TOKENS].buf, 4 * n);
    memcpy((int32_t *)out[OUT_TOKENS] + at[1], v[SAMPLE_TOKENS].buf, 4 * n);
    memcpy((float *)out[OUT_LOG_PROBS] + at[1], v[SAMPLE_LOG_PROBS].buf, 4 * n);
    memcpy((uint8_t *)out[OUT_LOSS_MASK] + at[1], v[SAMPLE_LOSS_MASK].buf, n);
    int valid = buffer_ids_below(&v[SAMPLE_PROMPT], bound) && flags_hold(&v[SAMPLE_LOSS_MASK])
        && log_probs_hold(&v[SAMPLE_LOG_PROBS], tolerance);
    if (sample->held[SAMPLE_FULL_LOG_PROBS]) {
        memcpy((float *)out[OUT_FULL_LOG_PROBS] + at[1], v[SAMPLE_FULL_LOG_PROBS].buf, 4 * n);
        valid = valid && log_probs_hold(&v[SAMPLE_FULL_LOG_PROBS], tolerance);
    }
    if (sample->held[SAMPLE_IDS]) {
        Py_ssize_t n_ids = v[SAMPLE_IDS].shape[0];
        memcpy((int32_t *)out[OUT_IDS] + at[2], v[SAMPLE_IDS].buf, 4 * n_ids);
        if (sample->held[SAMPLE_MASK_LOG_PROBS]) {
            memcpy((float *)out[OUT_MASK_LOG_PROBS] + at[2], v[SAMPLE_MASK_LOG_PROBS].buf, 4 * n_ids);
            valid = valid && log_probs_hold(&v[SAMPLE_MASK_LOG_PROBS], tolerance);
        }
        const int64_t *offset = (const int64_t *)v[SAMPLE_OFFSETS].buf;
        int64_t *offsets = (int64_t *)out[OUT_OFFSETS] + at[1] + 1, base = (int64_t)at[2];
        for (Py_ssize_t t = 0; t < n; t++)
            offsets[t] = offset[t + 1] + base;
        /* tokens inside supports of ids below the bound are below it too */
        valid = valid && buffer_ids_below(&v[SAMPLE_IDS], bound)
            && supports_hold((const int32_t *)v[SAMPLE_TOKENS].buf, n, (const int32_t *)v[SAMPLE_IDS].buf, n_ids, offset,
                             (const uint8_t *)v[SAMPLE_LOSS_MASK].buf, (const float *)v[SAMPLE_LOG_PROBS].buf);
        at[2] += n_ids;
    } else {
        valid = valid && buffer_ids_below(&v[SAMPLE_TOKENS], bound);
    }
    at[0] += prompt + n;
    at[1] += n;
    return valid;
}

PyDoc_STRVAR(pack_checked_doc,
"pack_checked(samples, names, outs, bound, tolerance) -> bool\n\n"
"Lay `samples` (a list of dicts of arrays) end to end into `outs`, a tuple of\n"
"writable arrays: every sample's prompt and response tokens, its response\n"
"tokens, log-probs, loss mask, support ids, and offsets after a leading 0,\n"
"each moved past the ids before it (both None when the samples carry no\n"
"sampling mask), its full_log_probs and mask_log_probs (each None when the\n"
"samples carry none). `names` are the keys of tokens, log_probs, loss_mask,\n"
"mask_ids, mask_offsets, prompt_tokens, full_log_probs and mask_log_probs,\n"
"in that order. Returns\n"
"whether every sample keeps the per-token rules, checked as each is copied:\n"
"supports framing their ids, strictly increasing, holding their tokens and\n"
"singletons at forced tokens (loss mask 0, log-prob 0); ids and prompt tokens\n"
"in [0, bound); loss-mask flags 0 or 1; every log-prob at most `tolerance`\n"
"and above -inf. ValueError names the rule when an array is of another kind,\n"
"a sample's arrays do not align or the outputs are not exactly their size;\n"
"nothing is then written.");

static PyObject *
pack_checked(PyObject *self, PyObject *args)
{
    PyObject *samples, *names, *outs;
    long long bound;
    double tolerance;

    if (!PyArg_ParseTuple(args, "O!O!O!Ld:pack_checked", &PyList_Type, &samples, &PyTuple_Type, &names, &PyTuple_Type,
                          &outs, &bound, &tolerance))
        return NULL;
    if (PyTuple_GET_SIZE(names) != SAMPLE_ROLES || PyTuple_GET_SIZE(outs) != OUTS) {
        PyErr_Format(PyExc_ValueError, "rule 'one name per array role, one output per packed array' not met: expected %d "
                     "names and %d outputs, got %zd and %zd", SAMPLE_ROLES, OUTS, PyTuple_GET_SIZE(names),
                     PyTuple_GET_SIZE(outs));
        return NULL;
    }
    int wanted_out[OUTS], wanted[SAMPLE_ROLES];
    for (int r = 0; r < OUTS; r++)
        wanted_out[r] = PyTuple_GET_ITEM(outs, r) != Py_None;
    if (wanted_out[OUT_IDS] != wanted_out[OUT_OFFSETS] || (wanted_out[OUT_MASK_LOG_PROBS] && !wanted_out[OUT_IDS])) {
        PyErr_SetString(PyExc_ValueError, "rule 'support ids, offsets and support log-probs are packed together' not met: "
                        "mask_ids out and mask_offsets out must both be given or both None, and mask_log_probs out only "
                        "with them");
        return NULL;
    }
    wanted[SAMPLE_TOKENS] = wanted[SAMPLE_LOG_PROBS] = wanted[SAMPLE_LOSS_MASK] = wanted[SAMPLE_PROMPT] = 1;
    wanted[SAMPLE_IDS] = wanted[SAMPLE_OFFSETS] = wanted_out[OUT_IDS];
    wanted[SAMPLE_FULL_LOG_PROBS] = wanted_out[OUT_FULL_LOG_PROBS];
    wanted[SAMPLE_MASK_LOG_PROBS] = wanted_out[OUT_MASK_LOG_PROBS];
    Py_ssize_t count = PyList_GET_SIZE(samples);
    sample_t *sample = PyMem_Calloc(count ? count : 1, sizeof(sample_t));
    Py_buffer out[OUTS];
    int held_out[OUTS] = {0}, failed = 0, valid = 1;
    Py_ssize_t got = 0, need[OUTS] = {0};
    if (sample == NULL)
        return PyErr_NoMemory();
    for (; got < count && !failed; got++) {
        if (get_sample(PyList_GET_ITEM(samples, got), names, wanted, got, &sample[got]) < 0) {
            failed = 1;
            break;
        }
        Py_ssize_t n = sample[got].view[SAMPLE_TOKENS].shape[0];
        need[OUT_SEQUENCES] += sample[got].view[SAMPLE_PROMPT].shape[0] + n;
        need[OUT_TOKENS] += n;
        need[OUT_IDS] += wanted[SAMPLE_IDS] ? sample[got].view[SAMPLE_IDS].shape[0] : 0;
    }
    need[OUT_LOG_PROBS] = need[OUT_LOSS_MASK] = need[OUT_FULL_LOG_PROBS] = need[OUT_TOKENS];
    need[OUT_OFFSETS] = need[OUT_TOKENS] + 1;
    need[OUT_MASK_LOG_PROBS] = need[OUT_IDS];
    if (!failed)
        failed = get_outputs(outs, OUTS, out_kinds, need, out, held_out) < 0;
    if (!failed) {
        char *buf[OUTS] = {0};
        for (int r = 0; r < OUTS; r++)
            buf[r] = held_out[r] ? (char *)out[r].buf : NULL;
        Py_ssize_t at[3] = {0, 0, 0};
        Py_BEGIN_ALLOW_THREADS
        if (wanted_out[OUT_OFFSETS])
            ((int64_t *)buf[OUT_OFFSETS])[0] = 0;
        for (Py_ssize_t m = 0; m < count; m++)
            valid &= pack_sample(&sample[m], buf, at, bound, tolerance);
        Py_END_ALLOW_THREADS
    }
    release_views(OUTS, out, held_out);
    for (Py_ssize_t m = 0; m < got; m++)
        release_views(SAMPLE_ROLES, sample[m].view, sample[m].held);
    PyMem_Free(sample);
    if (failed)
        return NULL;
    return PyBool_FromLong(valid);
}

/* What `merge_turns` reads from each turn, by role. */
enum { TURN_TOKENS, TURN_LOG_PROBS, TURN_LOSS_MASK, TURN_FORCED, TURN_IDS, TURN_OFFSETS, TURN_ROLES };
static const kind_t turn_kinds[TURN_ROLES] = {
    {4, "ilq", "tokens"}, {4, "f", "log_probs"}, {1, "B", "loss_mask"}, {4, "ilq", "forced_tokens"},
    {4, "ilq", "mask.ids"}, {8, "ilq", "mask.offsets"},
};
/* And what it writes, in the order it is given them. */
enum { MERGED_TOKENS, MERGED_LOG_PROBS, MERGED_LOSS_MASK, MERGED_IDS, MERGED_OFFSETS, MERGED };
static const kind_t merged_kinds[MERGED] = {
    {4, "ilq", "tokens out"}, {4, "f", "log_probs out"}, {1, "B", "loss_mask out"}, {4, "ilq", "mask_ids out"},
    {8, "ilq", "mask_offsets out"},
};

typedef struct { Py_buffer view[TURN_ROLES]; int held[TURN_ROLES]; } turn_t;

/* Role `r` of a turn from `value` (borrowed); None leaves it unheld. */
static int
get_turn_role(PyObject *value, turn_t *turn, int r)
{
    if (value == Py_None)
        return 0;
    if (get_vector(value, &turn->view[r], turn_kinds[r].itemsize, turn_kinds[r].kinds, 0, turn_kinds[r].name) < 0)
        return -1;
    turn->held[r] = 1;
    return 0;
}

/* Turn `m`'s arrays (`fields`: the tuple positions of its tokens, log_probs,
 * loss_mask, mask and forced_tokens, none past `last_field`; its mask's ids
 * and offsets read by `mask_names` when `supports`), their lengths checked
 * against each other; -1 with ValueError naming the rule otherwise, nothing
 * held. */
static int
get_turn(PyObject *item, const Py_ssize_t *fields, Py_ssize_t last_field, PyObject *mask_names, int supports,
         Py_ssize_t m, turn_t *turn)
{
    memset(turn->held, 0, sizeof turn->held);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) <= last_field) {
        PyErr_Format(PyExc_ValueError, "rule 'a turn is a tuple holding every field merged' not met: turn %zd is %s", m,
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    static const int roles[4] = {TURN_TOKENS, TURN_LOG_PROBS, TURN_LOSS_MASK, TURN_FORCED};
    static const int at[4] = {0, 1, 2, 4};
    for (int k = 0; k < 4; k++) {
        PyObject *value = PyTuple_GET_ITEM(item, fields[at[k]]);
        if (roles[k] != TURN_LOSS_MASK && value == Py_None) {
            PyErr_Format(PyExc_ValueError, "rule 'a turn has its %s' not met: turn %zd has None", turn_kinds[roles[k]].name, m);
            release_views(TURN_ROLES, turn->view, turn->held);
            return -1;
        }
        if (get_turn_role(value, turn, roles[k]) < 0) {
            release_views(TURN_ROLES, turn->view, turn->held);
            return -1;
        }
    }
    PyObject *mask = PyTuple_GET_ITEM(item, fields[3]);
    if (mask != Py_None && !supports) {
        PyErr_Format(PyExc_ValueError, "rule 'turns carry supports as their trajectory does' not met: turn %zd has a mask, "
                     "the trajectory none", m);
        release_views(TURN_ROLES, turn->view, turn->held);
        return -1;
    }
    for (int k = 0; k < 2 && mask != Py_None; k++) {  /* its ids, then its offsets */
        PyObject *value = PyObject_GetAttr(mask, PyTuple_GET_ITEM(mask_names, k));
        int failed = value == NULL || get_turn_role(value, turn, TURN_IDS + k) < 0;
        Py_XDECREF(value);
        if (failed) {
            release_views(TURN_ROLES, turn->view, turn->held);
            return -1;
        }
    }
    const Py_buffer *v = turn->view;
    Py_ssize_t n = v[TURN_TOKENS].shape[0];
    if (v[TURN_LOG_PROBS].shape[0] != n || (turn->held[TURN_LOSS_MASK] && v[TURN_LOSS_MASK].shape[0] != n)
            || (mask != Py_None && (!turn->held[TURN_IDS] || !turn->held[TURN_OFFSETS] || v[TURN_OFFSETS].shape[0] != n + 1))
            || (mask == Py_None && supports && n != 0)) {
        PyErr_Format(PyExc_ValueError, "rule 'a turn's per-token arrays and supports align with its tokens' not met: "
                     "turn %zd has %zd tokens", m, n);
        release_views(TURN_ROLES, turn->view, turn->held);
        return -1;
    }
    return 0;
}

/* Append one turn at `at` (token and id positions): its sampled tokens,
 * then its forced ones, each a singleton support. */
static void
merge_turn(const turn_t *turn, char **out, Py_ssize_t at[2], int first)
{
    const Py_buffer *v = turn->view;
    Py_ssize_t n = v[TURN_TOKENS].shape[0], forced = v[TURN_FORCED].shape[0], t = at[0];
    memcpy((int32_t *)out[MERGED_TOKENS] + t, v[TURN_TOKENS].buf, 4 * n);
    memcpy((int32_t *)out[MERGED_TOKENS] + t + n, v[TURN_FORCED].buf, 4 * forced);
    memcpy((float *)out[MERGED_LOG_PROBS] + t, v[TURN_LOG_PROBS].buf, 4 * n);
    memset((float *)out[MERGED_LOG_PROBS] + t + n, 0, 4 * forced);  /* all-zero bits: 0.0f */
    if (turn->held[TURN_LOSS_MASK])
        memcpy((uint8_t *)out[MERGED_LOSS_MASK] + t, v[TURN_LOSS_MASK].buf, n);
    else
        memset((uint8_t *)out[MERGED_LOSS_MASK] + t, 1, n);
    memset((uint8_t *)out[MERGED_LOSS_MASK] + t + n, 0, forced);
    if (out[MERGED_IDS] != NULL) {
        int64_t base = (int64_t)at[1], *offsets = (int64_t *)out[MERGED_OFFSETS] + t + 1;
        if (turn->held[TURN_IDS]) {
            Py_ssize_t n_ids = v[TURN_IDS].shape[0];
            const int64_t *offset = (const int64_t *)v[TURN_OFFSETS].buf;
            memcpy((int32_t *)out[MERGED_IDS] + at[1], v[TURN_IDS].buf, 4 * n_ids);
            if (first)
                offsets[-1] = offset[0];
            for (Py_ssize_t k = 0; k < n; k++)
                offsets[k] = offset[k + 1] + base;
            base += n_ids;
        }
        memcpy((int32_t *)out[MERGED_IDS] + base, v[TURN_FORCED].buf, 4 * forced);
        for (Py_ssize_t k = 0; k < forced; k++)
            offsets[n + k] = base + k + 1;
        at[1] = (Py_ssize_t)base + forced;
    }
    at[0] = t + n + forced;
}

PyDoc_STRVAR(merge_turns_doc,
"merge_turns(turns, fields, mask_names, outs)\n\n"
"Write the response arrays of `turns` (tuples; `fields`: the positions of\n"
"their tokens, log_probs, loss_mask, mask and forced_tokens) end to end\n"
"into `outs`, a tuple of writable arrays: tokens, log-probs, loss mask,\n"
"support ids and offsets (both None for turns without supports). Each\n"
"turn's sampled tokens come first, then its forced ones, which have log-prob\n"
"0, loss 0 and a singleton support; a turn without a loss mask trains every\n"
"sampled token. Offsets continue from the ids before, after a leading 0 (the\n"
"first turn's own first offset where it has a mask); a mask's ids and\n"
"offsets are its attributes named by `mask_names`. ValueError names the rule\n"
"when an array is of another kind, a turn's arrays do not align or an output\n"
"is not exactly its size; nothing is then written.");

static PyObject *
merge_turns(PyObject *self, PyObject *args)
{
    PyObject *turns, *field_tuple, *mask_names, *outs;

    if (!PyArg_ParseTuple(args, "O!O!O!O!:merge_turns", &PyList_Type, &turns, &PyTuple_Type, &field_tuple, &PyTuple_Type,
                          &mask_names, &PyTuple_Type, &outs))
        return NULL;
    Py_ssize_t fields[5];
    if (PyTuple_GET_SIZE(field_tuple) != 5 || PyTuple_GET_SIZE(mask_names) != 2 || PyTuple_GET_SIZE(outs) != MERGED) {
        PyErr_Format(PyExc_ValueError, "rule 'five field positions, two mask attribute names, %d outputs' not met: got "
                     "%zd, %zd and %zd", MERGED, PyTuple_GET_SIZE(field_tuple), PyTuple_GET_SIZE(mask_names),
                     PyTuple_GET_SIZE(outs));
        return NULL;
    }
    Py_ssize_t last_field = 0;
    for (int k = 0; k < 5; k++) {
        fields[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(field_tuple, k));
        if (fields[k] == -1 && PyErr_Occurred())
            return NULL;
        if (fields[k] < 0) {
            PyErr_Format(PyExc_ValueError, "rule 'field positions are at least 0' not met: got %zd", fields[k]);
            return NULL;
        }
        last_field = fields[k] > last_field ? fields[k] : last_field;
    }
    int supports = PyTuple_GET_ITEM(outs, MERGED_IDS) != Py_None;
    if (supports != (PyTuple_GET_ITEM(outs, MERGED_OFFSETS) != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "rule 'support ids and offsets are merged together' not met: mask_ids out and "
                        "mask_offsets out must both be given or both None");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(turns);
    turn_t *turn = PyMem_Calloc(count ? count : 1, sizeof(turn_t));
    if (turn == NULL)
        return PyErr_NoMemory();
    Py_buffer out[MERGED];
    int held_out[MERGED] = {0}, failed = 0;
    Py_ssize_t got = 0, need[MERGED] = {0};
    for (; got < count; got++) {
        if (get_turn(PyList_GET_ITEM(turns, got), fields, last_field, mask_names, supports, got, &turn[got]) < 0) {
            failed = 1;
            break;
        }
        Py_ssize_t forced = turn[got].view[TURN_FORCED].shape[0];
        need[MERGED_TOKENS] += turn[got].view[TURN_TOKENS].shape[0] + forced;
        need[MERGED_IDS] += (turn[got].held[TURN_IDS] ? turn[got].view[TURN_IDS].shape[0] : 0) + forced;
    }
    need[MERGED_LOG_PROBS] = need[MERGED_LOSS_MASK] = need[MERGED_TOKENS];
    need[MERGED_OFFSETS] = need[MERGED_TOKENS] + 1;
    if (!failed)
        failed = get_outputs(outs, MERGED, merged_kinds, need, out, held_out) < 0;
    if (!failed) {
        char *buf[MERGED] = {0};
        for (int r = 0; r < MERGED; r++)
            buf[r] = held_out[r] ? (char *)out[r].buf : NULL;
        Py_ssize_t at[2] = {0, 0};
        Py_BEGIN_ALLOW_THREADS
        if (supports)
            ((int64_t *)buf[MERGED_OFFSETS])[0] = 0;
        for (Py_ssize_t m = 0; m < count; m++)
            merge_turn(&turn[m], buf, at, m == 0);
        Py_END_ALLOW_THREADS
    }
    release_views(MERGED, out, held_out);
    for (Py_ssize_t m = 0; m < got; m++)
        release_views(TURN_ROLES, turn[m].view, turn[m].held);
    PyMem_Free(turn);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"inside_support", inside_support, METH_VARARGS, inside_support_doc},
    {"messages_content_valid", messages_content_valid, METH_VARARGS, messages_content_valid_doc},
    {"pack_checked", pack_checked, METH_VARARGS, pack_checked_doc},
    {"merge_turns", merge_turns, METH_VARARGS, merge_turns_doc},
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
