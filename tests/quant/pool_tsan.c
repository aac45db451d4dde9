/* A driver of pool.c's own check for ThreadSanitizer (tests/quant/test_pool.py builds it with pool.c alone):
 * short jobs back to back on 1-8 threads, tasks that outlast the caller's spin, thread-count changes, and two
 * calling threads at once; exits 1 if a count is wrong or a job returned early (TSan reports races itself). */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

void sluice_set_threads(int threads);
int64_t sluice_pool_check(int64_t jobs, const int64_t *ntasks, int64_t nsizes, int64_t *counts, int64_t stride,
                          int64_t spin);

static const int64_t sizes[] = {2, 3, 1, 5, 17, 2, 64, 8, 4};

static int run(int64_t jobs, int64_t spin) { /* 1 when wrong */
    int64_t counts[3 * 64] = {0}, want[3 * 64] = {0};
    int64_t early = sluice_pool_check(jobs, sizes, 9, counts, 64, spin);
    for (int64_t k = 0; k < jobs; k++)
        for (int64_t i = 0; i < sizes[k % 9]; i++) want[(k % 3) * 64 + i] += k % 2 ? (int64_t)1 << 20 : 1;
    return early != 0 || memcmp(counts, want, sizeof want) != 0;
}

static void *other(void *arg) {
    (void)arg;
    return (void *)(intptr_t)run(3000, 0);
}

int main(void) {
    int bad = 0;
    const int threads[] = {2, 3, 4, 8, 1, 2};
    for (int t = 0; t < 6; t++) {
        sluice_set_threads(threads[t]);
        bad += run(5000, 0);
        bad += run(100, 20000);
    }
    sluice_set_threads(3);
    pthread_t th;
    pthread_create(&th, NULL, other, NULL);
    bad += run(3000, 0);
    void *r;
    pthread_join(th, &r);
    bad += (int)(intptr_t)r;
    sluice_set_threads(1);
    printf("wrong runs: %d\n", bad);
    return bad != 0;
}
