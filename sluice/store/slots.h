/* slots.c's slot table, as stream.c calls it (store/slot_table.py drives both from Python). */
#pragma once
#include <stdint.h>

typedef struct slots slots_t;

int32_t sluice_slots_acquire(slots_t *t, int32_t layer, const int32_t *experts, int32_t n, int32_t *slots_out,
                             uint8_t *missed, int32_t *evicted, int32_t *n_evicted);
void sluice_slots_used(slots_t *t, int32_t layer, const int32_t *experts, int32_t n, const uint8_t *missed,
                       int64_t *usage_row);
int32_t sluice_slots_prefetch(slots_t *t, int32_t layer, const int32_t *experts, int32_t n, int32_t *e_out,
                              int32_t *slot_out, int32_t *evicted, int32_t *n_evicted);
int32_t sluice_slots_remove(slots_t *t, int32_t key);
int32_t sluice_slots_push_free(slots_t *t, int32_t slot);
void sluice_slots_unpin_all(slots_t *t);
