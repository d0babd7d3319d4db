/* npud host GEMM thread pool: persistent workers that take chunks of a call's output tiles. */
#include "gemm.h"

#define MAX_THREADS 64
#define CHUNK_BYTES (256 << 10) /* weight bytes a pool chunk reads at most */
/* pause instructions (tens of microseconds) a worker spins for the next call before it sleeps:
 * enough to bridge the Python between the GEMMs of a layer, short enough not to hold a core
 * that the machine's other processes (or numba's threads) want. A longer spin, twice the
 * recent waits up to 0.5 ms so as to bridge attention's gap too, cut the worker's wakes from
 * sleep in a decode step from 17% of the calls to 1-4%, but did not make the step faster, and
 * the 2-thread lm_head was 15-25% slower in 6 of 7 interleaved runs (bench/kernels_ab.py):
 * a worker that spins more gets less of the CPU when the machine is shared. */
#define SPIN_WAIT 2000

/* ------------------------------------------------------------------ thread pool */
/* Persistent workers and work stealing. A call's output tiles go in chunks, and every thread,
 * the caller included, takes chunks from one counter. A worker computes its chunk into its
 * own scratch and copies it out only if the chunk is still its own (OWNED -> PUBLISHING).
 * The caller, once the counter is spent, waits about two of its own chunk times for the
 * chunks workers hold, then takes them back (OWNED -> CALLER) and computes them itself: a
 * worker descheduled in the middle of a chunk (the core is shared) costs the call one chunk,
 * not a scheduler time slice. Every chunk runs the same tile function on the same job, whole
 * (k is never split), so the bits do not depend on which thread computed it.
 *
 * A worker whose chunk was taken back may still read the job after the call has returned.
 * The job (with the call's own copy of the activations) is freed only once no worker's hazard
 * pointer names it; until then it waits in a retired list, and the npud_gemm* functions
 * return how many jobs are retired so that the caller keeps the weights alive too (native.py). */

enum { FREE = 0, OWNED, PUBLISHING, DONE, CALLER };

static struct {
    pthread_mutex_t mu, call_mu;
    pthread_cond_t cv;
    atomic_uint call;                      /* increments with every call the workers take part in */
    _Atomic(job_t *) job;                  /* the current call's job; NULL between calls */
    _Atomic(job_t *) hazard[MAX_THREADS];  /* the job each worker is reading, or NULL */
    atomic_int active;                     /* workers that take part in calls (threads - 1) */
    atomic_int hold;                       /* > 0: workers spin between calls instead of sleeping (pool_hold) */
    int started;                           /* workers running */
    job_t *retired;                        /* jobs a worker may still read (caller's side only) */
    atomic_long published, stolen, moved;  /* chunks workers delivered; chunks the caller took back;
                                              workers that moved off the caller's CPU */
    atomic_long offered;                   /* chunks of the calls that went to the pool */
    /* where a call's time goes (bench/gemm_threads.py): calls that went to the pool, calls a
     * worker joined while the caller still ran, the nanoseconds from publishing the job to a
     * worker's seeing it (summed over those calls), wakes from sleep (not a spin), chunks the
     * caller ran, and the caller's nanoseconds in whole calls, in its own chunks, and waiting
     * for (or taking back) the chunks workers held after the counter was spent */
    atomic_long calls, joined, wake_ns, slept, caller_ran, call_ns, own_ns, wait_ns;
    atomic_long stall_us;                  /* tests: workers sleep this long on each chunk they take
                                              (and the caller lets one take the first) */
    atomic_long for_calls, for_units, for_worker_units; /* pool_for: calls that went to the pool, their
                                              units, and the units workers ran */
    atomic_long gemm_calls, gemm_ns;       /* every GEMM entry's call, and its nanoseconds from job_new
                                              to the end of dispatch (its own activation copy included):
                                              what a profile counts as GEMM time (bench/step_calls.py) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* A job with room for `ntiles` chunk states and `extra` bytes of the call's own buffers. */
job_t *job_new(long ntiles, size_t extra) {
    const size_t head = (sizeof(job_t) + (size_t)ntiles + 63) / 64 * 64;
    job_t *j = aligned_alloc(64, (head + extra + 63) / 64 * 64);
    if (!j) return NULL;
    memset(j, 0, sizeof(job_t));
    j->created_ns = now_ns();
    j->state = (_Atomic uint8_t *)((char *)j + sizeof(job_t));
    memset((void *)j->state, FREE, (size_t)ntiles);
    return j;
}

void *job_extra(job_t *j, long ntiles) {
    return (char *)j + (sizeof(job_t) + (size_t)ntiles + 63) / 64 * 64;
}

/* Tiles [c * chunk, ...) of job j into o (row m of tile t0 at o + m * ldo). */
static void run_chunk(const job_t *j, long c, float *o, long ldo) {
    const long t0 = c * j->chunk, t1 = t0 + j->chunk < j->ntiles ? t0 + j->chunk : j->ntiles;
    for (long t = t0; t < t1; t++) j->tile(j, t, o + (t - t0) * TILE, ldo);
}

/* A loaded machine's scheduler tends to wake a worker on its waker's CPU, where it can only
 * take turns with the caller (and its spin and its stolen chunks cost the caller time): a
 * worker that finds itself there moves to the other CPUs it may use, and stays off that one. */
static void move_off(int cpu, const cpu_set_t *allowed) {
    cpu_set_t set = *allowed;
    CPU_CLR(cpu, &set);
    if (CPU_COUNT(&set) > 0 && sched_setaffinity(0, sizeof set, &set) == 0)
        atomic_fetch_add_explicit(&pool.moved, 1, memory_order_relaxed);
}

static void worker_chunks(job_t *j, float **scratch, size_t *cap) {
    const size_t need = (size_t)j->M * j->chunk * TILE * sizeof(float);
    if (need > *cap) {
        free(*scratch);
        *scratch = malloc(need);
        *cap = *scratch ? need : 0;
        if (!*scratch) return; /* the caller does the chunks */
    }
    const long ldo = j->ntiles * TILE, width = j->chunk * TILE;
    for (;;) {
        const long c = atomic_fetch_add(&j->next, 1);
        if (c >= j->nchunks) return;
        uint8_t st = FREE;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, OWNED)) continue;
        const long stall = atomic_load_explicit(&pool.stall_us, memory_order_relaxed);
        if (stall) {
            const struct timespec ts = {stall / 1000000, stall % 1000000 * 1000};
            nanosleep(&ts, NULL);
        }
        run_chunk(j, c, *scratch, width);
        st = OWNED;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, PUBLISHING)) continue; /* taken back */
        const long t0 = c * j->chunk, cols = (t0 + j->chunk < j->ntiles ? j->chunk : j->ntiles - t0) * TILE;
        for (long m = 0; m < j->M; m++) memcpy(j->out + m * ldo + t0 * TILE, *scratch + m * width, cols * sizeof(float));
        atomic_store_explicit(&j->state[c], DONE, memory_order_release);
        atomic_fetch_add_explicit(&pool.published, 1, memory_order_relaxed);
    }
}

/* The caller's part: chunks from the counter, then every chunk not yet done, taking back
 * those a worker has held for longer than about two of the caller's own chunk times. */
static void caller_chunks(job_t *j) {
    const long ldo = j->ntiles * TILE;
    uint64_t spent = 0, ran = 0;
    if (atomic_load_explicit(&pool.stall_us, memory_order_relaxed)) /* tests: a worker takes the first chunk */
        for (int i = 0; i < 100000 && atomic_load(&j->next) == 0; i++) sched_yield();
    const long start_ns = now_ns();
    for (;;) {
        const long c = atomic_fetch_add(&j->next, 1);
        if (c >= j->nchunks) break;
        uint8_t st = FREE;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, CALLER)) continue;
        const uint64_t t = __rdtsc();
        run_chunk(j, c, j->out + c * j->chunk * TILE, ldo);
        spent += __rdtsc() - t;
        ran++;
    }
    const long spent_ns = now_ns();
    long taken = 0;
    const uint64_t patience = ran ? 2 * spent / ran : 100000, since = __rdtsc();
    for (long c = 0; c < j->nchunks; c++) {
        long spins = 0;
        for (;;) {
            uint8_t st = atomic_load_explicit(&j->state[c], memory_order_acquire);
            if (st == DONE || st == CALLER) break;
            if (st == FREE || (st == OWNED && __rdtsc() - since > patience)) {
                if (!atomic_compare_exchange_strong(&j->state[c], &st, CALLER)) continue;
                run_chunk(j, c, j->out + c * j->chunk * TILE, ldo);
                taken++;
                if (st == OWNED) atomic_fetch_add_explicit(&pool.stolen, 1, memory_order_relaxed);
                break;
            }
            /* OWNED within patience, or PUBLISHING (a copy of a few KiB) */
            if (++spins < 20000) _mm_pause();
            else sched_yield();
        }
    }
    atomic_fetch_add_explicit(&pool.caller_ran, (long)ran + taken, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.own_ns, spent_ns - start_ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.wait_ns, now_ns() - spent_ns, memory_order_relaxed);
}

/* A worker's part of a pool_for job: units from the counter, each run where the caller wants it. */
static void worker_units(job_t *j) {
    for (;;) {
        const long c = atomic_fetch_add(&j->next, 1);
        if (c >= j->nchunks) return;
        uint8_t st = FREE;
        if (!atomic_compare_exchange_strong(&j->state[c], &st, OWNED)) continue; /* the caller ran it */
        const long stall = atomic_load_explicit(&pool.stall_us, memory_order_relaxed);
        if (stall) { /* tests: a worker descheduled in the middle of a unit, which the caller must wait for */
            const struct timespec ts = {stall / 1000000, stall % 1000000 * 1000};
            nanosleep(&ts, NULL);
        }
        j->unit(j->ctx, c);
        atomic_store_explicit(&j->state[c], DONE, memory_order_release);
        atomic_fetch_add_explicit(&pool.for_worker_units, 1, memory_order_relaxed);
    }
}

static void *worker(void *arg) {
    const int index = (int)((uintptr_t)arg >> 32);
    unsigned seen = (unsigned)(uintptr_t)arg; /* the call number at creation */
    float *scratch = NULL;
    size_t cap = 0;
    cpu_set_t allowed; /* the CPUs the process may use (the caller's mask at creation) */
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) CPU_ZERO(&allowed);
    pthread_setname_np(pthread_self(), "npud-gemm"); /* tests find the workers by it */
    for (;;) {
        unsigned call;
        int spins = 0;
        while ((call = atomic_load_explicit(&pool.call, memory_order_acquire)) == seen) {
            if (spins < SPIN_WAIT) {
                _mm_pause();
                spins++;
            } else if (atomic_load_explicit(&pool.hold, memory_order_relaxed) > 0) {
                /* held (pool_hold) past the spin: stay awake, but hand the core to whatever else is
                 * runnable on it (the caller itself, on a machine with more threads than cores) */
                sched_yield();
            } else {
                break;
            }
        }
        if (call == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((call = atomic_load(&pool.call)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            atomic_fetch_add_explicit(&pool.slept, 1, memory_order_relaxed);
        }
        seen = call;
        if (index >= atomic_load(&pool.active)) continue;
        job_t *j;
        do { /* name the job, then check it is still the current one: the caller frees only unnamed jobs */
            j = atomic_load(&pool.job);
            atomic_store(&pool.hazard[index], j);
        } while (j && atomic_load(&pool.job) != j);
        if (j) {
            long unseen = 0;
            atomic_compare_exchange_strong(&j->seen_ns, &unseen, now_ns());
        }
        if (j && sched_getcpu() == j->caller_cpu) move_off(j->caller_cpu, &allowed);
        if (j && j->unit) worker_units(j);
        else if (j) worker_chunks(j, &scratch, &cap);
        atomic_store(&pool.hazard[index], NULL);
    }
    return NULL;
}

/* Make j the current job for threads - 1 workers and wake the sleeping ones (call_mu held). */
static void publish(job_t *j, int threads) {
    j->caller_cpu = sched_getcpu();
    j->published_ns = now_ns();
    atomic_store(&pool.active, threads - 1);
    atomic_store(&pool.job, j);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.call, 1);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
}

static void ensure_workers(int n) {
    while (pool.started < n - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = ((uintptr_t)pool.started << 32) | atomic_load(&pool.call);
        const int ok = pthread_create(&th, &attr, worker, (void *)arg) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
}

static int named_by_worker(const job_t *j) {
    for (int i = 0; i < pool.started; i++)
        if (atomic_load(&pool.hazard[i]) == j) return 1;
    return 0;
}

/* Free the retired jobs no worker names any more; returns how many are still named. Under call_mu. */
static long reclaim(void) {
    long held = 0;
    for (job_t **p = &pool.retired; *p;) {
        job_t *j = *p;
        if (named_by_worker(j)) {
            held++;
            p = &j->retired;
        } else {
            *p = j->retired;
            free(j);
        }
    }
    return held;
}

/* The job's end (under call_mu): no longer offered, kept while a worker still names it. */
static void retire(job_t *j) {
    atomic_store(&pool.job, NULL);
    if (named_by_worker(j)) {
        j->retired = pool.retired;
        pool.retired = j;
    } else {
        free(j);
    }
}

/* Run job j (from job_new, its tile function set; this call owns it) on `threads` threads; returns the jobs still retired. */
long dispatch(job_t *j, int threads) {
    const long created_ns = j->created_ns;
    pthread_mutex_lock(&pool.call_mu);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > j->ntiles) threads = (int)j->ntiles;
    if (threads > 1) ensure_workers(threads);
    if (threads <= 1 || pool.started == 0) {
        for (long t = 0; t < j->ntiles; t++) j->tile(j, t, j->out + t * TILE, j->ntiles * TILE);
        free(j);
    } else {
        /* chunks: many per thread, and at most CHUNK_BYTES of weights, so that taking one back
         * costs little (a big one-row GEMM streams a chunk in tens of microseconds) */
        /* a tile's weight bytes (FMT_BD: Kp / 2 words of 4 bytes a column) */
        const size_t tile_bytes = (size_t)j->K * TILE * (j->fmt == FMT_BD ? 2 : elem_size(j->fmt));
        const long most = CHUNK_BYTES / tile_bytes > 1 ? (long)(CHUNK_BYTES / tile_bytes) : 1;
        j->chunk = (j->ntiles + threads * 32 - 1) / (threads * 32);
        if (j->chunk > most) j->chunk = most;
        j->nchunks = (j->ntiles + j->chunk - 1) / j->chunk;
        atomic_fetch_add_explicit(&pool.offered, j->nchunks, memory_order_relaxed);
        publish(j, threads);
        caller_chunks(j);
        const long seen_ns = atomic_load(&j->seen_ns), done_ns = now_ns();
        atomic_fetch_add_explicit(&pool.calls, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.call_ns, done_ns - j->published_ns, memory_order_relaxed);
        if (seen_ns) {
            atomic_fetch_add_explicit(&pool.joined, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&pool.wake_ns, seen_ns - j->published_ns, memory_order_relaxed);
        }
        retire(j);
    }
    const long held = reclaim();
    pthread_mutex_unlock(&pool.call_mu);
    atomic_fetch_add_explicit(&pool.gemm_calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.gemm_ns, now_ns() - created_ns, memory_order_relaxed);
    return held;
}

void pool_for(int threads, long n, void (*unit)(void *, long), void *ctx) {
    if (n <= 0) return;
    pthread_mutex_lock(&pool.call_mu);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)n;
    if (threads > 1) ensure_workers(threads);
    job_t *j = threads > 1 && pool.started > 0 ? job_new(n, 0) : NULL;
    if (!j) { /* one thread (or no memory for the job's states): the units in order */
        for (long i = 0; i < n; i++) unit(ctx, i);
        pthread_mutex_unlock(&pool.call_mu);
        return;
    }
    j->unit = unit, j->ctx = ctx, j->ntiles = j->nchunks = n, j->chunk = 1;
    publish(j, threads);
    if (atomic_load_explicit(&pool.stall_us, memory_order_relaxed)) /* tests: a worker takes the first unit */
        for (int i = 0; i < 100000 && atomic_load(&j->next) == 0; i++) sched_yield();
    for (;;) {
        const long c = atomic_fetch_add(&j->next, 1);
        if (c >= n) break;
        uint8_t st = FREE;
        if (atomic_compare_exchange_strong(&j->state[c], &st, CALLER)) unit(ctx, c);
    }
    /* then every unit not yet done: one a worker counted but has not claimed is the caller's; one a
     * worker runs is waited for (it writes the caller's buffers, so it cannot be taken back) */
    for (long c = 0; c < n; c++) {
        long spins = 0;
        for (;;) {
            uint8_t st = atomic_load_explicit(&j->state[c], memory_order_acquire);
            if (st == DONE || st == CALLER) break;
            if (st == FREE) {
                if (atomic_compare_exchange_strong(&j->state[c], &st, CALLER)) {
                    unit(ctx, c);
                    break;
                }
                continue;
            }
            if (++spins < 20000) _mm_pause();
            else sched_yield();
        }
    }
    retire(j);
    reclaim();
    atomic_fetch_add_explicit(&pool.for_calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.for_units, n, memory_order_relaxed);
    pthread_mutex_unlock(&pool.call_mu);
}

/* While on (calls nest), the workers spin between calls rather than sleep: a layer call of many
 * rows (layer.c) holds them from its first GEMM to its last, whose gaps (per-row kernels, the
 * activations' quantization, a GEMM's activation copy) last longer than SPIN_WAIT (some 20 us
 * here), after which a sleeping worker took 100-150 us to wake for each next GEMM of a prefill
 * chunk (pool_trace's wake_ns), a fifth of an average one. */
void pool_hold(int on) { atomic_fetch_add(&pool.hold, on ? 1 : -1); }

/* counts[0]: pool_for calls that went to the pool, [1]: their units, [2]: the units workers ran. */
void npud_pool_for_stats(long *counts) {
    counts[0] = atomic_load(&pool.for_calls);
    counts[1] = atomic_load(&pool.for_units);
    counts[2] = atomic_load(&pool.for_worker_units);
}

/* clock[0]: GEMM calls so far, [1]: their nanoseconds (each from its entry's job_new to its return). */
void npud_gemm_clock(long *clock) {
    clock[0] = atomic_load(&pool.gemm_calls);
    clock[1] = atomic_load(&pool.gemm_ns);
}

/* How many finished calls a worker may still read (freeing those no worker reads now). */
long npud_pool_held(void) {
    pthread_mutex_lock(&pool.call_mu);
    const long held = reclaim();
    pthread_mutex_unlock(&pool.call_mu);
    return held;
}

/* stats[0]: chunks workers delivered, [1]: chunks the caller took back from a worker,
 * [2]: times a worker moved off the caller's CPU, [3]: chunks of the calls that went to the pool,
 * [4..11]: the trace (the pool's fields calls .. wait_ns, in that order). */
void npud_pool_stats(long *stats) {
    stats[0] = atomic_load(&pool.published);
    stats[1] = atomic_load(&pool.stolen);
    stats[2] = atomic_load(&pool.moved);
    stats[3] = atomic_load(&pool.offered);
    stats[4] = atomic_load(&pool.calls);
    stats[5] = atomic_load(&pool.joined);
    stats[6] = atomic_load(&pool.wake_ns);
    stats[7] = atomic_load(&pool.slept);
    stats[8] = atomic_load(&pool.caller_ran);
    stats[9] = atomic_load(&pool.call_ns);
    stats[10] = atomic_load(&pool.own_ns);
    stats[11] = atomic_load(&pool.wait_ns);
}

/* Tests: workers sleep `us` microseconds on every chunk they take (a descheduled worker), and
 * the caller waits for a worker to take the first chunk (0: back to normal). */
void npud_pool_stall(long us) { atomic_store(&pool.stall_us, us); }
