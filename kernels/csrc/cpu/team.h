/* A team of threads sharing one op's work (kernels/cpu.py's _parallel): the work is `total` units, taken `chunk`
 * at a time from a shared counter, so a thread that starts late finds less left rather than holding the others
 * up. The calling thread is the owner: when the work is taken it closes the team and waits for the helpers still
 * on a chunk; a helper that arrives after that returns without touching anything. Errors (an op's negative
 * status) are kept in `status`, the first one winning, and the owner returns it. */
#ifndef MII_TEAM_H
#define MII_TEAM_H
#include <stdint.h>

int sched_yield(void);        /* POSIX; declared here as -std=c11 hides <sched.h>'s */

typedef struct { int64_t next, total, chunk, active, closed, status; } Team;

/* A helper's first step, before it reads anything else of the op's: 0 when the owner has closed the team. */
static inline int team_join(Team* t) {
    __atomic_add_fetch(&t->active, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&t->closed, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&t->active, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

/* The next units [a, b) for this thread; 0 when all are taken. */
static inline int team_take(Team* t, int64_t* a, int64_t* b) {
    int64_t s = __atomic_fetch_add(&t->next, t->chunk, __ATOMIC_RELAXED);
    if (s >= t->total) return 0;
    *a = s;
    *b = s + t->chunk < t->total ? s + t->chunk : t->total;
    return 1;
}

/* A thread's last step with its own status: a helper leaves; the owner closes, waits, and returns the team's. */
static inline int team_end(Team* t, int owner, int rc) {
    if (rc) {
        int64_t none = 0;
        __atomic_compare_exchange_n(&t->status, &none, (int64_t)rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    if (!owner) {
        __atomic_sub_fetch(&t->active, 1, __ATOMIC_SEQ_CST);
        return rc;
    }
    __atomic_store_n(&t->closed, 1, __ATOMIC_SEQ_CST);
    for (int spins = 0; __atomic_load_n(&t->active, __ATOMIC_SEQ_CST); spins++) {
        if (spins > 2000) sched_yield();       /* a helper descheduled mid-chunk: let it run */
#if defined(__x86_64__) || defined(__i386__)
        else __builtin_ia32_pause();
#endif
    }
    return (int)__atomic_load_n(&t->status, __ATOMIC_SEQ_CST);
}
#endif
