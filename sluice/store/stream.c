/* A streaming store's decode-time acquire and guessed reads in one C call each (store/stream_native.py NativeStream):
 * the slot table's placement (slots.c), the reads of the experts placed, planned once per expert (io/templates.py
 * ReadTemplate: this table holds each one's descriptor), queued to the direct reader's pool (io/preader.c
 * sluice_io_submit_templates, called through the pointer the reader hands over), and the guessed reads still in flight
 * kept here per (layer, expert), not as Python futures.
 *
 * Why: around the same C calls, the store's Python (the futures, the template lookups, the read descriptors, the
 * evicted and landed checks) took ~170 us of the model's thread a layer of a streamed decode token of the issue-32
 * UD file, 40 layers a token (Intel Xeon VM: benchmarks/results/hybrid/stream-native.txt).
 *
 * A layer whose experts are all in memory (the guesses landed: ~87% of the UD file's decode layers) goes further in one
 * call (sluice_stream_layer): its acquire, its experts (moe_decode.c, through the pointers its Python object hands
 * over), the next layer's guess made (got_guess) and its reads queued while the compute pool's workers start on them,
 * the release: a ~36-37 ms token 0.39 ms faster than with the store's Python around separate calls, and 0.97 ms more
 * with the guess made here rather than before the layer (paired medians, 9 of 12 rounds each, Intel Xeon VM:
 * benchmarks/results/hybrid/fused-layer.txt).
 *
 * Ownership of a guessed read's batch: this table's until an acquire finds its expert (landed: released here; still in
 * flight, or failed: handed to the caller, who wraps it as the reader's future and releases it), its expert is evicted
 * or forgotten (waited for, then released here), or the table closes (each waited for and released). */
#define _POSIX_C_SOURCE 200809L /* struct stat's st_mtim */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "slots.h"

typedef int (*submit_fn)(void *pool, const int64_t *desc, int64_t n, void **out);
typedef int (*done_fn)(void *batch);
typedef int (*wait_fn)(void *batch, int64_t timeout_ns);
typedef void (*release_fn)(void *batch);
typedef int (*experts_fn)(void *state, const void *args, int run); /* quant/native moe_decode.c's */
typedef void (*finish_fn)(void *state);
typedef int (*guess_fn)(const int64_t *args, const void *x); /* quant/native decode.c sluice_guess_packed */

#define TMPL 5   /* a template's descriptor: ops, dests, dests' count, ends, ends' count (ReadTemplate.desc) */
#define COUNTS 6 /* its plan's counters (ReadPlan.counts) */

typedef struct {
    slots_t *t;
    int32_t experts, keys;
    const int64_t *tmpl;   /* [keys][TMPL], the caller's (kept alive by it); ops == 0: not planned */
    const int64_t *counts; /* [keys][COUNTS] */
    void **pending;        /* [keys] a guessed read's batch in flight (or over, not looked at yet), NULL */
    void *pool;
    submit_fn submit;
    done_fn done;
    wait_fn wait;
    release_fn release;
    int64_t raw0, stride; /* slot s starts at raw0 + s * stride */
    int64_t *desc;        /* [experts][TMPL + 1] scratch: one call's batches (descriptor and base each) */
    int32_t *e, *s;       /* [experts] scratch: an acquire's misses and their slots */
    void **got;           /* [experts] scratch: the batches of one call's reads */
    /* the caller's arrays each call reads and writes (sluice_stream_bind): its ids in, the placement out */
    const int32_t *in;
    int32_t *e_out, *slot_out, *evicted, *n_evicted;
    uint8_t *missed;
    void **handles;
    int64_t *sums;
    int32_t *in2; /* sluice_stream_layer's guess (the caller's, or computed there) */
    /* the files each layer's experts are read from (sluice_stream_files): FILE_FIELDS values each, and per layer the
     * indices of its files, -1 after the last */
    const int64_t *files;
    const int32_t *layer_files;
    int32_t max_files;
} stream_t;

#define FILE_FIELDS 5 /* fd, st_dev, st_ino, st_size, st_mtime in ns: io/base.py FileGuard's stamp of the version read */

/* The caller's arrays each call uses (capacity max(slots, experts) each; sums COUNTS; n_evicted 1): the ids of a call
 * in `in`; the rest as sluice_stream_prefetch / sluice_stream_acquire say. Bound once: a call then passes 3-4
 * arguments, not 11 (ctypes converts each Python argument, on the model's thread). */
void sluice_stream_bind(stream_t *st, const int32_t *in, int32_t *e_out, int32_t *slot_out, int32_t *evicted,
                        int32_t *n_evicted, uint8_t *missed, void **handles, int64_t *sums) {
    st->in = in;
    st->e_out = e_out;
    st->slot_out = slot_out;
    st->evicted = evicted;
    st->n_evicted = n_evicted;
    st->missed = missed;
    st->handles = handles;
    st->sums = sums;
}

void sluice_stream_close(stream_t *st);

/* The files sluice_stream_layer checks (the caller's arrays, kept alive by it): files [n][FILE_FIELDS], layer_files
 * [layers][max_files]; and in2, the guess's ids (capacity experts). */
void sluice_stream_files(stream_t *st, const int64_t *files, const int32_t *layer_files, int32_t max_files,
                         int32_t *in2) {
    st->files = files;
    st->layer_files = layer_files;
    st->max_files = max_files;
    st->in2 = in2;
}

/* Whether each file of `layer` is still the version stamped (one fstat each: FileGuard.check's test, which names the
 * file that changed where this says 0). */
static int files_same(const stream_t *st, int32_t layer) {
    if (!st->files) return 0;
    const int32_t *f = st->layer_files + (int64_t)layer * st->max_files;
    for (int32_t i = 0; i < st->max_files && f[i] >= 0; i++) {
        const int64_t *v = st->files + (int64_t)f[i] * FILE_FIELDS;
        struct stat s;
        if (fstat((int)v[0], &s) || (int64_t)s.st_dev != v[1] || (int64_t)s.st_ino != v[2] ||
            (int64_t)s.st_size != v[3] || (int64_t)s.st_mtim.tv_sec * 1000000000 + s.st_mtim.tv_nsec != v[4])
            return 0;
    }
    return 1;
}

stream_t *sluice_stream_open(slots_t *t, int32_t layers, int32_t experts, const int64_t *tmpl, const int64_t *counts,
                             void *pool, void *submit, void *done, void *wait, void *release, int64_t raw0,
                             int64_t stride) {
    if (!t || layers <= 0 || experts <= 0 || !pool || !submit || !done || !wait || !release) return NULL;
    stream_t *st = (stream_t *)calloc(1, sizeof(stream_t));
    if (!st) return NULL;
    st->t = t;
    st->experts = experts;
    st->keys = layers * experts;
    st->tmpl = tmpl;
    st->counts = counts;
    st->pool = pool;
    st->submit = (submit_fn)submit;
    st->done = (done_fn)done;
    st->wait = (wait_fn)wait;
    st->release = (release_fn)release;
    st->raw0 = raw0;
    st->stride = stride;
    st->pending = (void **)calloc((size_t)st->keys, sizeof(void *));
    st->desc = (int64_t *)malloc((size_t)experts * (TMPL + 1) * sizeof(int64_t));
    st->e = (int32_t *)malloc((size_t)experts * sizeof(int32_t));
    st->s = (int32_t *)malloc((size_t)experts * sizeof(int32_t));
    st->got = (void **)malloc((size_t)experts * sizeof(void *));
    if (!st->pending || !st->desc || !st->e || !st->s || !st->got) {
        sluice_stream_close(st);
        return NULL;
    }
    return st;
}

/* Wait for key's guessed read, if any, and release it: its error kind (0: landed, -1: none was pending). */
int sluice_stream_forget(stream_t *st, int32_t key) {
    if (key < 0 || key >= st->keys || !st->pending[key]) return -1;
    void *h = st->pending[key];
    st->pending[key] = NULL;
    int kind = st->wait(h, -1);
    st->release(h);
    return kind;
}

/* Every guessed read waited for and released; the keys whose read failed into failed (capacity keys): how many. */
int32_t sluice_stream_land_all(stream_t *st, int32_t *failed) {
    int32_t n = 0;
    for (int32_t k = 0; k < st->keys; k++)
        if (st->pending[k] && sluice_stream_forget(st, k) > 0 && failed) failed[n++] = k;
    return n;
}

/* Whether key has a guessed read here (over or not). */
int sluice_stream_pending(const stream_t *st, int32_t key) {
    return key >= 0 && key < st->keys && st->pending[key] != NULL;
}

void sluice_stream_close(stream_t *st) {
    if (!st) return;
    if (st->pending) sluice_stream_land_all(st, NULL);
    free(st->pending);
    free(st->desc);
    free(st->e);
    free(st->s);
    free(st->got);
    free(st);
}

/* The reads of `layer`'s experts e[i] into slots s[i], i < n, queued by one call: handles[i] each; their plans'
 * counters summed into sums (COUNTS). 0, -3 when an expert has no template, -1 when the pool had no memory. */
static int submit(stream_t *st, int32_t layer, const int32_t *e, const int32_t *s, int32_t n, void **handles,
                  int64_t *sums) {
    if (!n) return 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t key = layer * st->experts + e[i];
        const int64_t *d = st->tmpl + (int64_t)key * TMPL;
        if (!d[0]) return -3;
        memcpy(st->desc + (int64_t)i * (TMPL + 1), d, TMPL * sizeof(int64_t));
        st->desc[(int64_t)i * (TMPL + 1) + TMPL] = st->raw0 + (int64_t)s[i] * st->stride;
        for (int c = 0; c < COUNTS; c++) sums[c] += st->counts[(int64_t)key * COUNTS + c];
    }
    return st->submit(st->pool, st->desc, n, handles) ? -1 : 0;
}

/* The evicted keys' guessed reads land before their slots are written again (errors dropped with the entries). */
static void land_evicted(stream_t *st, const int32_t *evicted, int32_t n) {
    for (int32_t i = 0; i < n; i++) sluice_stream_forget(st, evicted[i]);
}

/* prefetch of in[0..n): the slot table's placement of a guess (sluice_slots_prefetch: e_out / slot_out the experts
 * placed, evicted / n_evicted the keys evicted), the evicted keys' reads landed, the placed ones' reads queued and kept
 * here. sums (COUNTS): their plans' counters. Returns how many were placed, -2 for an expert id out of range
 * (nothing changed), -3 / -1 as submit (nothing queued: the placed ones taken out of the table again, their slots
 * free; the evicted ones stay evicted). */
static int32_t prefetch(stream_t *st, int32_t layer, const int32_t *experts, int32_t n) {
    int32_t *e_out = st->e_out, *slot_out = st->slot_out, *evicted = st->evicted, *n_evicted = st->n_evicted;
    int64_t *sums = st->sums;
    memset(sums, 0, COUNTS * sizeof(int64_t));
    int32_t m = sluice_slots_prefetch(st->t, layer, experts, n, e_out, slot_out, evicted, n_evicted);
    land_evicted(st, evicted, *n_evicted);
    if (m <= 0) return m;
    int rc = submit(st, layer, e_out, slot_out, m, st->got, sums);
    if (rc) { /* nothing queued: the placed experts out of the table again, their slots free */
        for (int32_t i = 0; i < m; i++)
            sluice_slots_push_free(st->t, sluice_slots_remove(st->t, layer * st->experts + e_out[i]));
        return rc;
    }
    for (int32_t i = 0; i < m; i++) st->pending[layer * st->experts + e_out[i]] = st->got[i];
    return m;
}

int32_t sluice_stream_prefetch(stream_t *st, int32_t layer, int32_t n) { return prefetch(st, layer, st->in, n); }

/* acquire of in[0..n): the slot table's (sluice_slots_acquire: slots_out = slot_out, missed, evicted, n_evicted), the
 * evicted keys' reads landed, the misses' reads queued (handles[j] for miss j), each hit's guessed read looked at:
 * landed, released here; in flight or failed, handed over in handles[j] (the caller owns it); else handles[j] = NULL.
 * Then the uses counted (sluice_slots_used, usage_row as there). sums (COUNTS): the misses' plans' counters. Returns
 * the number of misses; -1 / -2 as sluice_slots_acquire (nothing queued; the keys evicted before a -1 in evicted, their
 * reads landed); -3 / -4 when the misses had no template / the pool no memory (the batch's entries are in the table,
 * pinned, nothing queued: the caller forgets them). */
int32_t sluice_stream_acquire(stream_t *st, int32_t layer, int32_t n, int64_t *usage_row) {
    const int32_t *experts = st->in;
    int32_t *slots_out = st->slot_out, *evicted = st->evicted, *n_evicted = st->n_evicted;
    uint8_t *missed = st->missed;
    void **handles = st->handles;
    int64_t *sums = st->sums;
    memset(sums, 0, COUNTS * sizeof(int64_t));
    int32_t m = sluice_slots_acquire(st->t, layer, experts, n, slots_out, missed, evicted, n_evicted);
    land_evicted(st, evicted, *n_evicted); /* also where a miss found no slot: the ones evicted before it */
    if (m < 0) return m;
    int32_t *e = st->e, *s = st->s; /* n <= experts: the table refused repeats and ids out of range */
    void **got = st->got;
    int32_t k = 0, base = layer * st->experts;
    for (int32_t j = 0; j < n; j++) {
        handles[j] = NULL;
        if (missed[j]) {
            e[k] = experts[j];
            s[k++] = slots_out[j];
            continue;
        }
        void *h = st->pending[base + experts[j]];
        if (!h) continue;
        st->pending[base + experts[j]] = NULL;
        if (st->done(h) == 0) st->release(h); /* landed: nothing to wait for */
        else handles[j] = h;                   /* in flight, or failed: the caller's, to wait for (its error raised) */
    }
    int rc = submit(st, layer, e, s, k, got, sums);
    if (rc) {
        for (int32_t j = 0; j < n; j++) /* the hits' batches handed over stay the caller's: it lands them */
            if (missed[j]) handles[j] = NULL;
        return rc == -3 ? -3 : -4;
    }
    for (int32_t j = 0, i = 0; j < n; j++)
        if (missed[j]) handles[j] = got[i++];
    sluice_slots_used(st->t, layer, experts, n, missed, usage_row);
    return m;
}

/* The guess of layer guess[6] computed here (guess: sluice_guess_packed, its arguments, x, its ids (int64 [k]), k,
 * whether its reads may be queued, the layer): its ids into in2 ascending (the order the store's prefetch is given
 * them in); 1, or 2 where the guess leaves the choice to torch.topk (its probabilities written). */
static int64_t got_guess(stream_t *st, const int64_t *guess) {
    if (!((guess_fn)(intptr_t)guess[0])((const int64_t *)(intptr_t)guess[1], (const void *)(intptr_t)guess[2]))
        return 2;
    const int64_t *ids = (const int64_t *)(intptr_t)guess[3];
    int32_t *out = st->in2;
    for (int64_t i = 0; i < guess[4]; i++) { /* insertion: k <= 64 */
        int32_t v = (int32_t)ids[i];
        int64_t j = i;
        for (; j > 0 && out[j - 1] > v; j--) out[j] = out[j - 1];
        out[j] = v;
    }
    return 1;
}

/* A decode token's MoE layer where its experts are in memory, in one call: the acquire of in[0..n) as
 * sluice_stream_acquire; then, where no expert missed and no guessed read of one is still in flight or failed, the
 * experts run (ctx: moe_decode.c's sluice_moe_experts and sluice_moe_finish, its state and prepared arguments, and
 * the address of their slots array, int64 [n]: filled here), the pool's workers starting alone while this thread
 * queues the guess of layer `next` (in2[0..m), m 0: none; sluice_stream_prefetch's), and the layer's pins dropped.
 * Each file of `layer` (and of `next`, with a guess) is checked first (files_same). With `guess` (got_guess's), the
 * guess of layer guess[6] is computed here while the workers start, instead of taken from in2 (m ignored), and its
 * reads queued where guess[5] says so; res[3]: 1 its ids in in2, 2 left to torch.topk (nothing queued), 0 not
 * computed (a file changed, the acquire failed, the experts' call was refused). Returning 1 for an expert not in
 * memory, the call still makes the guess (res[3]) but queues none of its reads: the caller does.
 *
 * res[0]: the misses (as sluice_stream_acquire returns), res[1]: the guess's sluice_stream_prefetch result, res[2]
 * sluice_moe_experts' (0, or its error: nothing ran). Returns 0: done (the layer's output written, its experts unpinned,
 * the guess queued: e_out / slot_out / evicted as its prefetch's; a prefetch error in res[1], the experts run all the
 * same); 1: the acquire done, an expert not in memory or the experts' call refused (res[2]): the caller goes on as
 * after sluice_stream_acquire (its outputs, the experts pinned, the guess not queued); 2: a file changed (nothing
 * done: the caller's checks name it); < 0: as sluice_stream_acquire. */
int32_t sluice_stream_layer(stream_t *st, int32_t layer, int32_t n, int64_t *usage_row, const int64_t *ctx,
                            int32_t next, int32_t m, int64_t *res, const int64_t *guess) {
    res[0] = res[1] = res[2] = res[3] = 0;
    if (guess) next = (int32_t)guess[6];
    if (!files_same(st, layer) || ((m > 0 || guess) && !files_same(st, next))) return 2;
    int32_t got = sluice_stream_acquire(st, layer, n, usage_row);
    res[0] = got;
    if (got < 0) return got;
    int late = got > 0;
    for (int32_t j = 0; j < n && !late; j++) late = st->handles[j] != NULL;
    if (late) { /* the guess made all the same (its reads queued by the caller: the acquire's outputs stand) */
        if (guess) res[3] = got_guess(st, guess);
        return 1;
    }
    int64_t *slots = (int64_t *)(intptr_t)ctx[4];
    for (int32_t j = 0; j < n; j++) slots[j] = st->slot_out[j];
    void *state = (void *)(intptr_t)ctx[2];
    int rc = ((experts_fn)(intptr_t)ctx[0])(state, (const void *)(intptr_t)ctx[3], 0);
    if (rc) {
        res[2] = rc;
        return 1;
    }
    if (guess) {
        res[3] = got_guess(st, guess);
        m = res[3] == 1 && guess[5] ? (int32_t)guess[4] : 0;
    }
    if (m > 0) res[1] = prefetch(st, next, st->in2, m);
    ((finish_fn)(intptr_t)ctx[1])(state);
    sluice_slots_unpin_all(st->t);
    return 0;
}
