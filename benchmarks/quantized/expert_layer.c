/* One decode layer's expert call (q8.c sluice_experts_q8: 8 experts of the peers Q4_K_M shape, Q4_K gate / up
 * 512 x 1024, Q6_K down 1024 x 512, 1,019,904 bytes each) on experts picked at random from a 1 GiB block of them,
 * so every call reads its 8 MB cold from memory, as a decode step does; the extension loaded with dlopen.
 * Built and run by expert_layer.py:  expert_layer SO GATE_BIN DOWN_BIN SPREAD HUGE  (HUGE 1: MADV_HUGEPAGE) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef int (*experts_fn)(int64_t, const int64_t *, int64_t, int64_t, const float *, int64_t, int, int);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint8_t *slurp(const char *path, size_t n) {
    uint8_t *p = malloc(n);
    FILE *f = fopen(path, "rb");
    if (!p || !f || fread(p, 1, n, f) != n) {
        fprintf(stderr, "cannot read %zu bytes of %s\n", n, path);
        exit(1);
    }
    fclose(f);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: expert_layer SO GATE_BIN DOWN_BIN SPREAD HUGE\n");
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    experts_fn experts = (experts_fn)dlsym(h, "sluice_experts_q8");
    void (*threads)(int) = (void (*)(int))dlsym(h, "sluice_set_threads");
    void (*spread)(int64_t) = (void (*)(int64_t))dlsym(h, "sluice_set_task_spread");
    if (!experts || !threads || !spread) {
        fprintf(stderr, "%s: not a sluice extension with sluice_set_task_spread (rebuild it)\n", argv[1]);
        return 1;
    }
    spread(atoll(argv[4]));
    const int64_t G = 294912, D = 430080, SLOT = 2 * G + D, GIB = (int64_t)1 << 30, nslots = GIB / SLOT;
    uint8_t *g = slurp(argv[2], 64 * G), *d = slurp(argv[3], 64 * D);
    uint8_t *buf = mmap(NULL, GIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (atoi(argv[5])) madvise(buf, GIB, MADV_HUGEPAGE);
    for (int64_t s = 0; s < nslots; s++) {  /* slot s: gate of expert s % 64, up of (s + 7) % 64, down of s % 64 */
        memcpy(buf + s * SLOT, g + s % 64 * G, G);
        memcpy(buf + s * SLOT + G, g + (s + 7) % 64 * G, G);
        memcpy(buf + s * SLOT + 2 * G, d + s % 64 * D, D);
    }
    float x[1024], y[8 * 1024];
    for (int i = 0; i < 1024; i++) x[i] = (float)((i * 7919) % 200 - 100) / 50.0f;
    uint64_t r = 12345;
    for (int rep = 0; rep < 6; rep++) {
        int th = rep % 2 ? 1 : 2, n = 1500;
        threads(th);
        double t0 = now();
        for (int i = 0; i < n; i++) {
            int64_t e[80];
            for (int k = 0; k < 8; k++) {
                r = r * 6364136223846793005ULL + 1442695040888963407ULL;
                uint8_t *at = buf + (int64_t)((r >> 33) % (uint64_t)nslots) * SLOT;
                int64_t v[10] = {5, (int64_t)(intptr_t)at, 576, 5, (int64_t)(intptr_t)(at + G), 576, 7,
                                 (int64_t)(intptr_t)(at + 2 * G), 420, (int64_t)(intptr_t)(y + 1024 * k)};
                memcpy(e + 10 * k, v, sizeof v);
            }
            experts(8, e, 1024, 512, x, 1, 1, 2);  /* T = 1, one plane (int8), the AVX2 path */
        }
        double t = now() - t0;
        printf("threads %d task spread %s huge pages %s: %.1f us a layer, %.1f GB/s\n", th, argv[4], argv[5],
               t / n * 1e6, (double)n * 8 * SLOT / t / 1e9);
    }
    return 0;
}
