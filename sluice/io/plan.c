/* A batch of requests planned in C into preader.c's op list: what io/ranges.py plan_reads, split_even and
 * io/native_pool.py _ops do together in Python, with the same result op for op (tests/io compare them on random
 * batches). io/templates.py TemplatePlanner uses it to plan a streamed expert's reads, at its first miss.
 *
 * Why: planning an expert in Python took 45-51 us (dataclasses per read and segment, memoryview destinations, the
 * op list built element by element). A streamed decode step of the issue-30 model in the bench's shape (a fresh
 * process: every miss is a first miss) plans ~257 experts a token: 11.7-13.2 ms of a 101-109 ms token on the model's
 * thread (benchmarks/results/hybrid/acquire-fresh.txt); here 6-7 us an expert planned with its layer's
 * (plan-layer.txt).
 *
 * Requests: n x (path rank, offset, nbytes, dest), the path rank being the file's place in the sorted list of paths
 * (plan_reads sorts by path string), dest an address (or an offset from a base: it is only added to). Per path rank:
 * fd and O_DIRECT alignment. The plan:
 *   - zero-length requests dropped; identical (path, offset, nbytes) ranges one segment with every destination;
 *   - parts > 1: max_read = min(max_read, max(min_split, the unique bytes / parts rounded up to a page));
 *   - a range longer than max_read cut at absolute multiples of max_read;
 *   - pieces sorted by (path, offset, nbytes), stable; neighbours within max_gap joined up to max_read bytes and
 *     max_segments segments (overlapping: some segments share bytes);
 *   - the reads cut into at most `parts` chunks of about equal bytes (split_even), one task each;
 *   - ops per read: fd, align, offset, nbytes, overlapping, nseg; per segment: rel, nbytes, ndests, dests...
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PLAN_PAGE 4096

typedef struct {
    int64_t path, offset, nbytes;
    int64_t first_dest, ndests; /* into the unique's destination list */
    int64_t dest_shift;         /* a cut piece's bytes from its range's start: added to each destination */
    int64_t order;              /* creation order: the sort's tie-break (Python's sort is stable) */
} piece_t;

static int piece_cmp(const void *a, const void *b) {
    const piece_t *x = (const piece_t *)a, *y = (const piece_t *)b;
    if (x->path != y->path) return x->path < y->path ? -1 : 1;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* req: n x 4 int64 (path rank, offset, nbytes, dest); fds: per path rank (fd, align).
 * Out: ops (cap_ops), ends (cap_ends: one per chunk), dests (cap_dests: index in ops of each destination address),
 * counts[0..5] = requests, bytes_requested, bytes_read, reads, coalesced, dedup_saved; sizes[0..2] = ops, ends,
 * dests written. Returns 0; -1 for a negative offset or length (the caller raises plan_reads' error); -2 without
 * memory; -3 when an output array is too small (sizes then hold what it needs). */
static int plan(const int64_t *req, int64_t n, const int64_t *fds, int64_t max_gap, int64_t max_read,
                int64_t min_split, int64_t max_segments, int64_t parts, int64_t *ops, int64_t cap_ops, int64_t *ends,
                int64_t cap_ends, int64_t *dests, int64_t cap_dests, int64_t *counts, int64_t *sizes) {
    for (int64_t i = 0; i < n; i++)
        if (req[4 * i + 1] < 0 || req[4 * i + 2] < 0) return -1;
    /* unique ranges in first-seen order, each with its destinations (dest_list, grouped by unique) */
    int64_t *uniq = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));    /* request index of each */
    int64_t *owner = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));   /* unique of each request */
    int64_t *dest_list = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    int64_t *first = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));   /* per unique */
    int64_t *count = (int64_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    piece_t *pieces = NULL;
    int rc = -2;
    if (!uniq || !owner || !dest_list || !first || !count) goto out;
    int64_t nu = 0, requests = 0, requested = 0, saved = 0, unique_bytes = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *r = req + 4 * i;
        owner[i] = -1;
        if (r[2] == 0) continue;
        requests++;
        requested += r[2];
        int64_t u = -1;
        for (int64_t k = 0; k < nu; k++) { /* a few requests per batch: a scan is cheaper than a hash */
            const int64_t *q = req + 4 * uniq[k];
            if (q[0] == r[0] && q[1] == r[1] && q[2] == r[2]) {
                u = k;
                break;
            }
        }
        if (u < 0) {
            u = nu++;
            uniq[u] = i;
            unique_bytes += r[2];
        } else {
            saved += r[2];
        }
        owner[i] = u;
        count[u]++;
    }
    int64_t at = 0;
    for (int64_t u = 0; u < nu; u++) {
        first[u] = at;
        at += count[u];
        count[u] = 0;
    }
    for (int64_t i = 0; i < n; i++)
        if (owner[i] >= 0) dest_list[first[owner[i]] + count[owner[i]]++] = req[4 * i + 3];
    if (parts > 1 && nu > 0) {
        int64_t share = (unique_bytes + parts - 1) / parts;
        int64_t cap = (share + PLAN_PAGE - 1) / PLAN_PAGE * PLAN_PAGE;
        if (cap < min_split) cap = min_split;
        if (cap < max_read) max_read = cap;
    }
    int64_t np = 0;
    for (int64_t u = 0; u < nu; u++) {
        const int64_t *q = req + 4 * uniq[u];
        np += q[2] <= max_read ? 1 : (q[1] + q[2] - 1) / max_read - q[1] / max_read + 1;
    }
    pieces = (piece_t *)malloc((size_t)(np > 0 ? np : 1) * sizeof(piece_t));
    if (!pieces) goto out;
    np = 0;
    for (int64_t u = 0; u < nu; u++) {
        const int64_t *q = req + 4 * uniq[u];
        if (q[2] <= max_read) {
            pieces[np] = (piece_t){q[0], q[1], q[2], first[u], count[u], 0, np};
            np++;
            continue;
        }
        for (int64_t pos = q[1], end = q[1] + q[2]; pos < end;) {
            int64_t cut = (pos / max_read + 1) * max_read;
            if (cut > end) cut = end;
            pieces[np] = (piece_t){q[0], pos, cut - pos, first[u], count[u], pos - q[1], np};
            np++;
            pos = cut;
        }
    }
    qsort(pieces, (size_t)np, sizeof(piece_t), piece_cmp);
    /* reads: runs of pieces [rs[k], rs[k+1]) with their window; coalescing as plan_reads */
    int64_t nreads = 0, coalesced = 0, bytes_read = 0;
    int64_t *rs = (int64_t *)malloc((size_t)(np + 1) * sizeof(int64_t));
    int64_t *wo = (int64_t *)malloc((size_t)(np > 0 ? np : 1) * sizeof(int64_t)); /* window offset, nbytes */
    int64_t *wn = (int64_t *)malloc((size_t)(np > 0 ? np : 1) * sizeof(int64_t));
    uint8_t *ov = (uint8_t *)calloc((size_t)(np > 0 ? np : 1), 1);
    if (!rs || !wo || !wn || !ov) {
        free(rs), free(wo), free(wn), free(ov);
        goto out;
    }
    for (int64_t i = 0; i < np; i++) {
        const piece_t *p = pieces + i;
        int64_t end = p->offset + p->nbytes;
        if (nreads > 0) {
            int64_t k = nreads - 1, cur_end = wo[k] + wn[k], far = end > cur_end ? end : cur_end;
            if (pieces[rs[k]].path == p->path && p->offset <= cur_end + max_gap && far - wo[k] <= max_read &&
                i - rs[k] < max_segments) {
                if (p->offset < cur_end) ov[k] = 1;
                wn[k] = far - wo[k];
                coalesced++;
                continue;
            }
        }
        rs[nreads] = i;
        wo[nreads] = p->offset;
        wn[nreads] = p->nbytes;
        nreads++;
    }
    rs[nreads] = np;
    for (int64_t k = 0; k < nreads; k++) bytes_read += wn[k];
    /* split_even: chunk boundary after the read that brings the bytes to (chunks + 1) / parts of the total */
    int64_t no = 0, ne = 0, nd = 0, done = 0, chunks = 0;
    int too_small = 0;
    for (int64_t k = 0; k < nreads; k++) {
        const int64_t *fa = fds + 2 * pieces[rs[k]].path;
        int64_t head[6] = {fa[0], fa[1], wo[k], wn[k], ov[k], rs[k + 1] - rs[k]};
        for (int j = 0; j < 6; j++, no++)
            if (no < cap_ops) ops[no] = head[j];
        for (int64_t i = rs[k]; i < rs[k + 1]; i++) {
            const piece_t *p = pieces + i;
            int64_t seg[3] = {p->offset - wo[k], p->nbytes, p->ndests};
            for (int j = 0; j < 3; j++, no++)
                if (no < cap_ops) ops[no] = seg[j];
            for (int64_t d = 0; d < p->ndests; d++, no++, nd++) {
                if (no < cap_ops) ops[no] = dest_list[p->first_dest + d] + p->dest_shift;
                if (nd < cap_dests) dests[nd] = no;
            }
        }
        done += wn[k];
        int last = k == nreads - 1;
        if (parts <= 1 || nreads <= 1) {
            if (last) {
                if (ne < cap_ends) ends[ne] = no;
                ne++;
            }
        } else if ((done * parts >= (chunks + 1) * bytes_read && chunks < parts - 1) || last) {
            if (ne < cap_ends) ends[ne] = no;
            ne++;
            chunks++;
        }
    }
    too_small = no > cap_ops || ne > cap_ends || nd > cap_dests;
    counts[0] = requests, counts[1] = requested, counts[2] = bytes_read, counts[3] = nreads, counts[4] = coalesced,
    counts[5] = saved;
    sizes[0] = no, sizes[1] = ne, sizes[2] = nd;
    free(rs), free(wo), free(wn), free(ov);
    rc = too_small ? -3 : 0;
out:
    free(uniq), free(owner), free(dest_list), free(first), free(count), free(pieces);
    return rc;
}

/* plan() for `nb` batches in one call (a layer's experts, or one batch: io/templates.py TemplatePlanner), each
 * planned on its own, with its arguments in two arrays (sixteen ctypes arguments cost more than planning a batch):
 *   in:  nb, nfiles, max_gap, max_read, min_split, max_segments, parts, cap (per request: a batch of n requests
 *        gets cap * n + 64 ops and destination slots), then nb request counts, then every batch's requests (path
 *        rank, offset, nbytes, dest), then nfiles x (fd, align)
 *   out: per batch 9 (counts[6], sizes[3]), then per batch max(parts, 1) ends, then the batches' ops one after the
 *        other (batch k at the sum of the earlier batches' capacities), then their destination slots likewise
 * Returns 0, or the first batch's error (plan()'s codes; -3: a capacity too small). */
int sluice_io_plan_many(const int64_t *in, int64_t *out) {
    int64_t nb = in[0], parts = in[6], cap = in[7], nends = parts > 1 ? parts : 1;
    const int64_t *counts = in + 8, *req = counts + nb;
    int64_t total = 0, room = 0;
    for (int64_t k = 0; k < nb; k++) {
        total += counts[k];
        room += cap * counts[k] + 64;
    }
    const int64_t *fds = req + 4 * total;
    int64_t *heads = out, *ends = out + 9 * nb, *ops = ends + nends * nb, *dests = ops + room;
    for (int64_t k = 0; k < nb; k++) {
        int64_t n = counts[k], c = cap * n + 64;
        int rc = plan(req, n, fds, in[2], in[3], in[4], in[5], parts, ops, c, ends, nends, dests, c, heads,
                      heads + 6);
        if (rc) return rc;
        req += 4 * n, ops += c, dests += c, ends += nends, heads += 9;
    }
    return 0;
}
