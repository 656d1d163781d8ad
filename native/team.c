/*
 * The team: workers that sleep on a condition variable between calls (the engine's
 * matmuls run in between, on the same cores: a worker spinning through them would take
 * a core from them), after watching for the next call for TEAM_WATCH_NS. torch's
 * OpenMP workers are asked for the same courtesy (kvtier/openmp.py). One task is on
 * offer at a time; a caller that finds another task in flight runs its own alone. A
 * task's work function claims units from a counter of its own until none are left, so a
 * worker that joins late only takes fewer. Decode attention (decode_attention.c),
 * prefill attention (prefill_attention.c) and the quantized matrix-vector products
 * (quant_matvec.c) share it.
 */
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "team.h"

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake, idle;
    void (*work)(void *);
    void *ctx;
    unsigned long gen; /* bumped per task, so a worker joins each one once */
    int seats;         /* workers the task still takes */
    int busy;          /* workers inside the task */
    int workers;
} team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0, 0};

/*
 * How long a worker that just finished a task watches for the next before it sleeps.
 * A decode step calls the team ~150 times (four matrices and one attention per layer)
 * with little torch work between calls, no longer than a sleeping worker takes to
 * wake, so without the watch the second thread joined too late to pay for itself.
 * The watch ends long before a prefill's matmuls could miss the core.
 */
#define TEAM_WATCH_NS 200000

static inline void team_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static uint64_t team_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Spins, without the lock, until a task newer than `seen` is posted or the watch ends. */
static void team_watch(unsigned long seen) {
    const uint64_t end = team_now_ns() + TEAM_WATCH_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(&team.gen, __ATOMIC_ACQUIRE) != seen) return;
            team_pause();
        }
        if (team_now_ns() >= end) return;
    }
}

static void *team_worker(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&team.mu);
    for (;;) {
        if (team.gen == seen) { /* just finished one: watch for the next before sleeping */
            pthread_mutex_unlock(&team.mu);
            team_watch(seen);
            pthread_mutex_lock(&team.mu);
        }
        while (team.work == NULL || team.gen == seen || team.seats == 0) pthread_cond_wait(&team.wake, &team.mu);
        void (*work)(void *) = team.work;
        void *ctx = team.ctx;
        seen = team.gen;
        team.seats--;
        team.busy++;
        pthread_mutex_unlock(&team.mu);
        work(ctx);
        pthread_mutex_lock(&team.mu);
        if (--team.busy == 0) pthread_cond_broadcast(&team.idle);
    }
    return NULL;
}

static void team_atfork_prepare(void) { pthread_mutex_lock(&team.mu); }
static void team_atfork_parent(void) { pthread_mutex_unlock(&team.mu); }
static void team_atfork_child(void) { /* the child has no workers and no task */
    team.work = NULL;
    team.seats = team.busy = team.workers = 0;
    pthread_cond_init(&team.wake, NULL);
    pthread_cond_init(&team.idle, NULL);
    pthread_mutex_unlock(&team.mu);
}

static pthread_once_t team_once = PTHREAD_ONCE_INIT;
static void team_init(void) {
    pthread_atfork(team_atfork_prepare, team_atfork_parent, team_atfork_child);
}

/* Runs without the GIL: work(ctx) on the caller and on up to threads - 1 workers;
 * returns once all of them have left it. */
void kvt_team_run(void (*work)(void *), void *ctx, int threads) {
    pthread_once(&team_once, team_init);
    int shared = 0;
    if (threads > 1) {
        pthread_mutex_lock(&team.mu);
        if (team.work == NULL) {
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            while (team.workers < threads - 1) {
                pthread_t t;
                if (pthread_create(&t, &attr, team_worker, NULL) != 0) break; /* the caller still does the work */
                team.workers++;
            }
            pthread_attr_destroy(&attr);
            team.work = work;
            team.ctx = ctx;
            team.seats = threads - 1;
            __atomic_add_fetch(&team.gen, 1, __ATOMIC_RELEASE); /* after the task: a watching worker then finds it whole */
            shared = 1;
            pthread_cond_broadcast(&team.wake);
        }
        pthread_mutex_unlock(&team.mu);
    }
    work(ctx);
    if (shared) {
        pthread_mutex_lock(&team.mu);
        team.work = NULL; /* a worker not yet in stays out: every unit is claimed */
        while (team.busy > 0) pthread_cond_wait(&team.idle, &team.mu);
        pthread_mutex_unlock(&team.mu);
    }
}
