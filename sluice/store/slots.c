/* The streaming store's slot table in C: which (layer, expert) each slot holds, the free slots, the pinned ones, and
 * the eviction policy FairShareLFU (store/policy.py) with the same choices, victim for victim (tests/store compare
 * the two on random acquire / prefetch sequences). store/slot_table.py NativeSlots drives it: one call places an
 * acquire's misses or a guess's reads, one more records the acquire's uses.
 *
 * Why: the placement in Python (the policy's sort of a layer's entries, its `usable` lambda per entry, the
 * OrderedDicts, the free list and the pins): the victims alone took ~80 us of the model's thread a call, 3.2-3.4 ms of
 * a ~54 ms streamed token of the issue-32 UD file on the AMD EPYC VM (benchmarks/results/hybrid/fused-guess.txt); per
 * call here 10-14 us with the Python around it (slot-table.txt).
 *
 * Keys are layer * experts + expert. The policy (store/policy.py FairShareLFU's docstring has the why):
 *   - recency: a tick per cached key, stamped at its first insert and at each hit (touch); smaller is older;
 *   - use counts: score[key] += inc[layer] for each expert an acquire asks for, inc[layer] /= DECAY first;
 *     all of a layer's scores divided by inc (and inc set to 1) once it passes 1e200: the same doubles as Python's;
 *   - victim for a layer holding at least its quota: its first usable entry by (score, tick); else (or none usable)
 *     the oldest usable entry of a layer above its quota; else the oldest usable entry of any layer;
 *   - victims (n at once, where the layer holds its quota and at least n entries): its first n usable entries by
 *     (score, tick), or none at all when fewer are usable (the caller then takes victim n times).
 * Usable: not pinned, and not kept (a guess never evicts the experts it predicted that are in memory, nor the ones it
 * is placing).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "slots.h"

#define DECAY 0.99

struct slots {
    int32_t layers, experts, slots, quota;
    int32_t *slot_of;  /* [layers * experts] the slot holding a key, -1 */
    int64_t *tick;     /* [layers * experts] its place in the recency order (valid while cached) */
    double *score;     /* [layers * experts] decayed use counts */
    double *inc;       /* [layers] each layer's current increment */
    int32_t *count;    /* [layers] keys cached per layer */
    int32_t *owner;    /* [slots] the key a slot holds, -1 */
    uint8_t *pinned;   /* [slots] */
    uint8_t *keep;     /* [layers * experts] a prefetch call's kept keys (set and cleared within the call) */
    int32_t *free_;    /* a stack of free slots: the last one is taken first */
    int32_t n_free;
    int32_t *order;    /* [experts] scratch: a layer's keys sorted */
    int64_t clock;
};

void sluice_slots_close(slots_t *t) {
    if (!t) return;
    free(t->slot_of); free(t->tick); free(t->score); free(t->inc); free(t->count); free(t->owner);
    free(t->pinned); free(t->keep); free(t->free_); free(t->order); free(t);
}

/* `slots` slots, all free ([slots-1 .. 0]: slot 0 taken first, as the Python store's list). NULL without memory. */
slots_t *sluice_slots_open(int32_t layers, int32_t experts, int32_t slots, int32_t quota) {
    if (layers <= 0 || experts <= 0 || slots <= 0) return NULL;
    slots_t *t = (slots_t *)calloc(1, sizeof(slots_t));
    if (!t) return NULL;
    size_t keys = (size_t)layers * (size_t)experts;
    t->layers = layers; t->experts = experts; t->slots = slots; t->quota = quota;
    t->slot_of = (int32_t *)malloc(keys * sizeof(int32_t));
    t->tick = (int64_t *)calloc(keys, sizeof(int64_t));
    t->score = (double *)calloc(keys, sizeof(double));
    t->inc = (double *)malloc((size_t)layers * sizeof(double));
    t->count = (int32_t *)calloc((size_t)layers, sizeof(int32_t));
    t->owner = (int32_t *)malloc((size_t)slots * sizeof(int32_t));
    t->pinned = (uint8_t *)calloc((size_t)slots, 1);
    t->keep = (uint8_t *)calloc(keys, 1);
    t->free_ = (int32_t *)malloc((size_t)slots * sizeof(int32_t));
    t->order = (int32_t *)malloc((size_t)experts * sizeof(int32_t));
    if (!t->slot_of || !t->tick || !t->score || !t->inc || !t->count || !t->owner || !t->pinned || !t->keep ||
        !t->free_ || !t->order) {
        sluice_slots_close(t);
        return NULL;
    }
    for (size_t k = 0; k < keys; k++) t->slot_of[k] = -1;
    for (int32_t L = 0; L < layers; L++) t->inc[L] = 1.0;
    for (int32_t s = 0; s < slots; s++) {
        t->owner[s] = -1;
        t->free_[s] = slots - 1 - s;
    }
    t->n_free = slots;
    return t;
}

static inline int usable(const slots_t *t, int32_t key) {
    return !t->pinned[t->slot_of[key]] && !t->keep[key];
}

/* whether key x is used less than key y (older first among equal scores): the policy's order, a total one (ticks are
 * unique among cached keys) */
static inline int less_used(const slots_t *t, int32_t x, int32_t y) {
    if (t->score[x] != t->score[y]) return t->score[x] < t->score[y];
    return t->tick[x] < t->tick[y];
}

/* The n least used usable cached keys of `layer`, least used first, in t->order; returns how many (< n: fewer are
 * usable). The same keys in the same order as sorting the layer's keys and taking the first n usable ones (the order
 * is total), by insertion into n places: a guess places ~8, where qsort of a layer's ~50 cached keys through a
 * comparison callback took ~10 us of a streamed decode layer (Intel Xeon VM, results/hybrid/stream-native.txt). */
static int32_t least_used(slots_t *t, int32_t layer, int32_t n) {
    int32_t got = 0, base = layer * t->experts;
    for (int32_t e = 0; e < t->experts; e++) {
        int32_t key = base + e;
        if (t->slot_of[key] < 0 || !usable(t, key)) continue;
        if (got == n && !less_used(t, key, t->order[n - 1])) continue;
        int32_t i = got < n ? got++ : n - 1;
        while (i > 0 && less_used(t, key, t->order[i - 1])) {
            t->order[i] = t->order[i - 1];
            i--;
        }
        t->order[i] = key;
    }
    return got;
}

static void stamp(slots_t *t, int32_t key) { t->tick[key] = ++t->clock; }

static void insert(slots_t *t, int32_t key, int32_t slot) {
    if (t->slot_of[key] < 0) { /* a key set again keeps its place (the policy's OrderedDicts) */
        stamp(t, key);
        t->count[key / t->experts]++;
    }
    t->slot_of[key] = slot;
    t->owner[slot] = key;
}

/* Forget `key`; its slot, -1 when not cached. The slot is not made free. */
int32_t sluice_slots_remove(slots_t *t, int32_t key) {
    if (key < 0 || key >= t->layers * t->experts) return -1;
    int32_t slot = t->slot_of[key];
    if (slot < 0) return -1;
    t->slot_of[key] = -1;
    t->owner[slot] = -1;
    t->count[key / t->experts]--;
    return slot;
}

/* policy.victim: the key to evict for a new expert of `layer`, -1 when none is usable */
static int32_t victim_key(slots_t *t, int32_t layer) {
    if (t->count[layer] >= t->quota && least_used(t, layer, 1)) return t->order[0];
    int32_t best = -1, any = -1; /* the oldest usable of a layer above its quota; of any layer */
    for (int32_t s = 0; s < t->slots; s++) {
        int32_t key = t->owner[s];
        if (key < 0 || !usable(t, key)) continue;
        if (any < 0 || t->tick[key] < t->tick[any]) any = key;
        if (t->count[key / t->experts] > t->quota && (best < 0 || t->tick[key] < t->tick[best])) best = key;
    }
    return best >= 0 ? best : any;
}

/* A slot for a new expert of `layer`: a free one, else one evicted (its key appended to evicted); -1 when none. */
static int32_t take_slot(slots_t *t, int32_t layer, int32_t *evicted, int32_t *n_evicted) {
    if (t->n_free > 0) return t->free_[--t->n_free];
    int32_t key = victim_key(t, layer);
    if (key < 0) return -1;
    evicted[(*n_evicted)++] = key;
    return sluice_slots_remove(t, key);
}

/* policy.victims: n slots at once, their keys evicted (appended to evicted), into chosen; 0 when it cannot (a free
 * slot, the layer under its quota or with fewer than n usable entries: nothing changed). */
static int take_slots(slots_t *t, int32_t layer, int32_t n, int32_t *chosen, int32_t *evicted, int32_t *n_evicted) {
    if (t->n_free > 0 || t->count[layer] < t->quota || n > t->count[layer]) return 0;
    if (least_used(t, layer, n) < n) return 0;
    for (int32_t i = 0; i < n; i++) {
        evicted[(*n_evicted)++] = t->order[i];
        chosen[i] = sluice_slots_remove(t, t->order[i]);
    }
    return 1;
}

/* An acquire of experts[0..n) of `layer`: hits pinned, then each miss placed in a free or evicted slot and pinned.
 * slots_out[j]: expert j's slot; missed[j]: 1 for a miss; evicted (capacity n): the keys evicted, in order.
 * Returns the number of misses; -1 when a miss found no usable slot (every slot pinned), -2 for an expert id out of
 * range or repeated (nothing changed then). */
int32_t sluice_slots_acquire(slots_t *t, int32_t layer, const int32_t *experts, int32_t n, int32_t *slots_out,
                             uint8_t *missed, int32_t *evicted, int32_t *n_evicted) {
    *n_evicted = 0;
    if (layer < 0 || layer >= t->layers) return -2;
    int32_t base = layer * t->experts, m = 0;
    for (int32_t j = 0; j < n; j++) {
        if (experts[j] < 0 || experts[j] >= t->experts || t->keep[base + experts[j]]) {
            for (int32_t i = 0; i < j; i++) t->keep[base + experts[i]] = 0;
            return -2;
        }
        t->keep[base + experts[j]] = 1; /* marks repeats; cleared before any victim is chosen */
    }
    for (int32_t j = 0; j < n; j++) t->keep[base + experts[j]] = 0;
    for (int32_t j = 0; j < n; j++) { /* pass 1: pin every hit, so no miss below can evict it */
        int32_t s = t->slot_of[base + experts[j]];
        slots_out[j] = s;
        missed[j] = s < 0;
        if (s >= 0) t->pinned[s] = 1;
        else m++;
    }
    if (!m) return 0;
    int32_t *chosen = (int32_t *)malloc((size_t)m * sizeof(int32_t));
    if (!chosen) return -1;
    int batch = take_slots(t, layer, m, chosen, evicted, n_evicted);
    int32_t i = 0, rc = m;
    for (int32_t j = 0; j < n; j++) {
        if (!missed[j]) continue;
        int32_t slot = batch ? chosen[i] : take_slot(t, layer, evicted, n_evicted);
        i++;
        if (slot < 0) { rc = -1; break; }
        insert(t, base + experts[j], slot);
        t->pinned[slot] = 1;
        slots_out[j] = slot;
    }
    free(chosen);
    return rc;
}

/* After an acquire's reads are queued: each expert's use counted (usage_row[e] += 1 where usage_row is not NULL, and
 * the policy's decayed count), then each hit made the most recent, in order. */
void sluice_slots_used(slots_t *t, int32_t layer, const int32_t *experts, int32_t n, const uint8_t *missed,
                       int64_t *usage_row) {
    if (layer < 0 || layer >= t->layers) return;
    int32_t base = layer * t->experts;
    double inc = t->inc[layer] = t->inc[layer] / DECAY;
    for (int32_t j = 0; j < n; j++) {
        if (experts[j] < 0 || experts[j] >= t->experts) continue;
        if (usage_row) usage_row[experts[j]] += 1;
        t->score[base + experts[j]] += inc;
    }
    if (inc > 1e200) { /* rescale: same order, no overflow */
        for (int32_t e = 0; e < t->experts; e++) t->score[base + e] = t->score[base + e] / inc;
        t->inc[layer] = 1.0;
    }
    for (int32_t j = 0; j < n; j++)
        if (!missed[j] && experts[j] >= 0 && experts[j] < t->experts && t->slot_of[base + experts[j]] >= 0)
            stamp(t, base + experts[j]);
}

/* A guess's reads: experts[0..n) of `layer` not in memory (first occurrence of each) placed in free or evicted slots,
 * never evicting a pinned slot, a predicted expert in memory, nor one placed by this call; stops when no slot is
 * left. Out: e_out / slot_out the placed (expert, slot) pairs (capacity n), evicted (capacity n) the keys evicted.
 * Returns how many were placed, -2 for an expert id out of range. */
int32_t sluice_slots_prefetch(slots_t *t, int32_t layer, const int32_t *experts, int32_t n, int32_t *e_out,
                              int32_t *slot_out, int32_t *evicted, int32_t *n_evicted) {
    *n_evicted = 0;
    if (layer < 0 || layer >= t->layers) return -2;
    for (int32_t j = 0; j < n; j++)
        if (experts[j] < 0 || experts[j] >= t->experts) return -2;
    int32_t base = layer * t->experts, m = 0, placed = 0;
    for (int32_t j = 0; j < n; j++) /* the predicted experts in memory: kept */
        if (t->slot_of[base + experts[j]] >= 0) t->keep[base + experts[j]] = 1;
    for (int32_t j = 0; j < n; j++) { /* todo, in e_out: the others, first occurrence of each */
        int32_t key = base + experts[j];
        if (t->keep[key]) continue;
        t->keep[key] = 2; /* seen (not kept by usable() until placed: it is not cached) */
        e_out[m++] = experts[j];
    }
    for (int32_t i = 0; i < m; i++) t->keep[base + e_out[i]] = 0;
    int batch = m > 0 && take_slots(t, layer, m, slot_out, evicted, n_evicted);
    for (int32_t i = 0; i < m; i++) {
        int32_t slot = batch ? slot_out[i] : take_slot(t, layer, evicted, n_evicted);
        if (slot < 0) break;
        insert(t, base + e_out[i], slot);
        t->keep[base + e_out[i]] = 1;
        slot_out[i] = slot;
        placed++;
    }
    for (int32_t j = 0; j < n; j++) t->keep[base + experts[j]] = 0;
    return placed;
}

int32_t sluice_slots_slot(const slots_t *t, int32_t key) {
    return key >= 0 && key < t->layers * t->experts ? t->slot_of[key] : -1;
}

int32_t sluice_slots_owner(const slots_t *t, int32_t slot) {
    return slot >= 0 && slot < t->slots ? t->owner[slot] : -1;
}

/* the keys cached, in recency order (oldest first) into out (capacity slots); returns how many */
static _Thread_local const slots_t *tick_table;
static int by_tick(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return tick_table->tick[x] < tick_table->tick[y] ? -1 : tick_table->tick[x] > tick_table->tick[y];
}
int32_t sluice_slots_keys(const slots_t *t, int32_t *out) {
    int32_t n = 0;
    for (int32_t s = 0; s < t->slots; s++)
        if (t->owner[s] >= 0) out[n++] = t->owner[s];
    tick_table = t;
    qsort(out, (size_t)n, sizeof(int32_t), by_tick);
    return n;
}

/* how many keys are cached */
int32_t sluice_slots_count(const slots_t *t) {
    int32_t n = 0;
    for (int32_t L = 0; L < t->layers; L++) n += t->count[L];
    return n;
}

void sluice_slots_unpin_all(slots_t *t) { memset(t->pinned, 0, (size_t)t->slots); }

/* the pinned slots, ascending, into out (capacity slots); returns how many */
int32_t sluice_slots_pinned(const slots_t *t, int32_t *out) {
    int32_t n = 0;
    for (int32_t s = 0; s < t->slots; s++)
        if (t->pinned[s]) out[n++] = s;
    return n;
}

/* the free stack (bottom first) into out (capacity slots); returns its size */
int32_t sluice_slots_get_free(const slots_t *t, int32_t *out) {
    memcpy(out, t->free_, (size_t)t->n_free * sizeof(int32_t));
    return t->n_free;
}

/* push `slot` on the free stack (taken next); -1 when it is out of range, holds a key or is free already */
int32_t sluice_slots_push_free(slots_t *t, int32_t slot) {
    if (slot < 0 || slot >= t->slots || t->owner[slot] >= 0 || t->n_free >= t->slots) return -1;
    for (int32_t i = 0; i < t->n_free; i++)
        if (t->free_[i] == slot) return -1;
    t->free_[t->n_free++] = slot;
    return 0;
}

/* replace the free stack (bottom first); -1 when n is out of range or a slot repeats or holds a key */
int32_t sluice_slots_set_free(slots_t *t, const int32_t *slots, int32_t n) {
    if (n < 0 || n > t->slots) return -1;
    uint8_t *seen = (uint8_t *)calloc((size_t)t->slots, 1);
    if (!seen) return -1;
    for (int32_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= t->slots || seen[slots[i]] || t->owner[slots[i]] >= 0) {
            free(seen);
            return -1;
        }
        seen[slots[i]] = 1;
    }
    free(seen);
    memcpy(t->free_, slots, (size_t)n * sizeof(int32_t));
    t->n_free = n;
    return 0;
}
