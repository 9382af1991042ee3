/* ftshim.c - ftrun's NCCL shim, loaded into every worker with LD_PRELOAD.
 *
 * What it does (docs/shim.md has the long version):
 *  - defines every NCCL function of ftshim_table.h and forwards it to pncclX of the libnccl
 *    already loaded in the process (dlopen RTLD_NOLOAD: torch loads libnccl RTLD_LOCAL, so
 *    RTLD_NEXT would not find it, and the shim must never load NCCL by itself);
 *  - keeps the registry of communicators in the shared control page (ftshim_abi.h), keyed by
 *    handle address, with a state and a creation serial;
 *  - runs one native thread that bumps a liveness counter, watches the agent process, and on
 *    command stops every communicator made before a comm epoch (ncclCommRevoke when the
 *    loaded NCCL has it, else one group of ncclCommAbort), then writes a report;
 *  - answers later calls on stopped handles itself, so that nothing touches freed memory.
 *
 * All process state is in the one struct `g` below (documented field by field) plus a
 * per-thread group record `t_grp`; every other static is constant (the tables generated from
 * ftshim_table.h and ftshim_abi.h). The per-call path takes no lock and allocates nothing:
 * a hash probe over the page's table, two atomic increments and a decrement.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ftshim_abi.h"
#include "ftshim_nccl_types.h"
#include "ftshim_table.h"

#define FTSHIM_API __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define A_LOAD(p, o) __atomic_load_n((p), __ATOMIC_##o)
#define A_STORE(p, v, o) __atomic_store_n((p), (v), __ATOMIC_##o)
#define A_ADD(p, v, o) __atomic_fetch_add((p), (v), __ATOMIC_##o)
#define A_SUB(p, v, o) __atomic_fetch_sub((p), (v), __ATOMIC_##o)
#define A_CAS(p, e, d) \
  __atomic_compare_exchange_n((p), (e), (d), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)

/* ---- function ids, pointer types ------------------------------------------------------ */
enum {
#define X(kind, name, since, params, args, c, a1, a2) FTSHIM_ID_##name,
  FTSHIM_NCCL_TABLE(X)
#undef X
  FTSHIM_FN_COUNT
};
#define FTSHIM_RET_PASS ncclResult_t
#define FTSHIM_RET_PASS_STR const char*
#define FTSHIM_RET_GSTART ncclResult_t
#define FTSHIM_RET_GEND ncclResult_t
#define FTSHIM_RET_INIT ncclResult_t
#define FTSHIM_RET_INIT_ALL ncclResult_t
#define FTSHIM_RET_DERIVE ncclResult_t
#define FTSHIM_RET_COLL ncclResult_t
#define FTSHIM_RET_P2P ncclResult_t
#define FTSHIM_RET_OP ncclResult_t
#define FTSHIM_RET_QUERY ncclResult_t
#define FTSHIM_RET_COUNT ncclResult_t
#define FTSHIM_RET_URANK ncclResult_t
#define FTSHIM_RET_CUDEV ncclResult_t
#define FTSHIM_RET_ASYNC ncclResult_t
#define FTSHIM_RET_LASTERR const char*
#define FTSHIM_RET_CLEANUP ncclResult_t
#define FTSHIM_RET_FINALIZE ncclResult_t
#define FTSHIM_RET_RELEASE ncclResult_t
#define X(kind, name, since, params, args, c, a1, a2) \
  typedef FTSHIM_RET_##kind(*ftshim_pfn_##name) params;
FTSHIM_NCCL_TABLE(X)
#undef X

static const char* const ftshim_names[FTSHIM_FN_COUNT] = {
#define X(kind, name, since, params, args, c, a1, a2) "nccl" #name,
    FTSHIM_NCCL_TABLE(X)
#undef X
};
static const char* const ftshim_psyms[FTSHIM_FN_COUNT] = {
#define X(kind, name, since, params, args, c, a1, a2) "pnccl" #name,
    FTSHIM_NCCL_TABLE(X)
#undef X
};
static const int ftshim_since[FTSHIM_FN_COUNT] = {
#define X(kind, name, since, params, args, c, a1, a2) since,
    FTSHIM_NCCL_TABLE(X)
#undef X
};

/* ---- the process state ---------------------------------------------------------------- */
#define FTSHIM_MISSING ((void*)1)
#define HELD_MAX 32

/* One communicator picked by an abort sweep. */
typedef struct {
  ftshim_comm_slot* slot;
  ftshim_report_entry* entry;
  int use_abort; /* revoke failed or unavailable: free it with abort */
} victim_t;

/* Everything the shim keeps in this process. Shared with other processes: only the page it
 * points to (ftshim_abi.h). Locks: `claim_lock` orders claims (a first NCCL call racing the
 * control thread); `reg_lock` orders registry inserts and abort sweeps, never a plain call. */
static struct {
  int mode;                      /* enum ftshim_mode; read on every call (relaxed) */
  const char* inert_reason;      /* why the shim does nothing here (static string) */
  ftshim_page* page;             /* the mapped control page, NULL when inert */
  void* nccl;                    /* dlopen(RTLD_NOLOAD) handle of libnccl, NULL until seen */
  void* real[FTSHIM_FN_COUNT];   /* resolved pnccl pointers; NULL unresolved, MISSING absent */
  int warned[FTSHIM_FN_COUNT];   /* the one-time "missing symbol" message was printed */
  pthread_mutex_t claim_lock;    /* try_claim() from a call and from the control thread */
  pthread_mutex_t reg_lock;      /* registry inserts and the abort sweep (never per call) */
  int resweep;                   /* a comm of an aborted epoch was registered during an abort */
  int debug;                     /* FTRUN_SHIM_DEBUG */
  int agent_fd;                  /* pidfd of the agent, -1 unavailable, -2 already gone */
  uint64_t last_request;         /* abort_request served last (control thread) */
  int thread_started;            /* the control thread runs (or is starting) */
  int exiting;                   /* exit() began: the control thread stops touching the loader */
  unsigned nccl_probes;          /* ticks that asked whether libnccl is loaded (control thread) */
  victim_t victims[FTSHIM_MAX_COMMS]; /* the sweep's communicators (under reg_lock) */
  victim_t freeing[FTSHIM_MAX_COMMS]; /* those of them freed with abort (under reg_lock) */
} g = {.mode = FTSHIM_MODE_INERT,
       .inert_reason = "not initialised",
       .claim_lock = PTHREAD_MUTEX_INITIALIZER,
       .reg_lock = PTHREAD_MUTEX_INITIALIZER,
       .agent_fd = -1};

/* Communicators the current thread queued inside an open NCCL group: they stay "in flight"
 * until ncclGroupEnd returns, because ncclGroupEnd launches their work. */
static __thread struct {
  int depth;
  int n;
  ftshim_comm_slot* held[HELD_MAX];
} t_grp __attribute__((tls_model("initial-exec")));

static const char ftshim_aborted_msg[] = "communicator was stopped by the ftrun agent (ftshim)";

/* ---- small utilities ------------------------------------------------------------------ */
static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* write(2) rather than stdio: the control thread must not take stdio locks that a frozen or
 * wedged application thread could be holding. */
static void ftshim_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void ftshim_log(const char* fmt, ...) {
  char buf[512];
  int n = snprintf(buf, sizeof buf, "ftrun-shim[%d]: ", (int)getpid());
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
  buf[n++] = '\n';
  ssize_t w = write(2, buf, (size_t)n);
  (void)w;
}
#define DEBUG(...) do { if (g.debug) ftshim_log(__VA_ARGS__); } while (0)

static void futex_wake(uint32_t* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}
static void futex_wait_ms(uint32_t* addr, uint32_t expected, uint32_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}
static void sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* ---- finding the real NCCL ------------------------------------------------------------ */
static void* nccl_handle(void) {
  void* h = A_LOAD(&g.nccl, ACQUIRE);
  if (h) return h;
  /* RTLD_NOLOAD: only find a libnccl the program already loaded, never load one. */
  h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_NOLOAD);
  if (h) A_STORE(&g.nccl, h, RELEASE);
  return h;
}

static __attribute__((noinline)) void* ftshim_resolve(int id) {
  void* p = A_LOAD(&g.real[id], ACQUIRE);
  if (p) return p == FTSHIM_MISSING ? NULL : p;
  void* h = nccl_handle();
  void* f = h ? dlsym(h, ftshim_psyms[id]) : NULL;
  /* A program linked against libnccl has it in the global scope: RTLD_NEXT finds it too. */
  if (!f) f = dlsym(RTLD_NEXT, ftshim_psyms[id]);
  if (f) {
    A_STORE(&g.real[id], f, RELEASE);
    return f;
  }
  if (h) A_STORE(&g.real[id], FTSHIM_MISSING, RELEASE); /* NCCL present, symbol absent */
  return NULL; /* NCCL not loaded (yet): do not cache */
}

static inline void* ftshim_real(int id) {
  void* p = A_LOAD(&g.real[id], RELAXED);
  if (LIKELY((uintptr_t)p > 1)) return p;
  return ftshim_resolve(id);
}

static int nccl_version(void) {
  ftshim_pfn_GetVersion f = (ftshim_pfn_GetVersion)ftshim_real(FTSHIM_ID_GetVersion);
  int v = 0;
  if (f && f(&v) != ncclSuccess) v = 0;
  return v;
}

static void fmt_version(int v, char* out, size_t n) {
  if (v <= 0) snprintf(out, n, "unknown");
  else if (v < 10000) snprintf(out, n, "%d.%d.%d", v / 1000, (v % 1000) / 100, v % 100);
  else snprintf(out, n, "%d.%d.%d", v / 10000, (v % 10000) / 100, v % 100);
}

/* The loaded NCCL lacks the function the caller wants (older release), or no NCCL is loaded
 * at all. Answer with an error code, and say so once per function. */
static __attribute__((noinline)) ncclResult_t ftshim_missing(int id) {
  int loaded = nccl_handle() != NULL || dlsym(RTLD_NEXT, "pncclGetVersion") != NULL;
  if (!A_LOAD(&g.warned[id], RELAXED) && !__atomic_exchange_n(&g.warned[id], 1, __ATOMIC_RELAXED)) {
    if (loaded) {
      char have[32], since[32];
      fmt_version(nccl_version(), have, sizeof have);
      fmt_version(ftshim_since[id], since, sizeof since);
      ftshim_log("%s is not in the loaded NCCL %s (it needs %s); returning ncclInvalidUsage",
                 ftshim_names[id], have, since);
    } else {
      ftshim_log("%s called but no libnccl is loaded in this process; returning ncclInternalError",
                 ftshim_names[id]);
    }
  }
  return loaded ? ncclInvalidUsage : ncclInternalError;
}

static void probe_nccl(ftshim_page* p) {
  if (!nccl_handle() && !dlsym(RTLD_NEXT, "pncclGetVersion")) return;
  int v = nccl_version();
  uint32_t caps = 0;
  if (ftshim_real(FTSHIM_ID_CommRevoke)) caps |= FTSHIM_CAP_REVOKE;
  if (ftshim_real(FTSHIM_ID_CommAbort)) caps |= FTSHIM_CAP_ABORT;
  /* Aborting several communicators inside one group is supported from 2.22.3. */
  if (v >= 22203 && ftshim_real(FTSHIM_ID_GroupStart) && ftshim_real(FTSHIM_ID_GroupEnd))
    caps |= FTSHIM_CAP_GROUP;
  A_STORE(&p->caps, caps, RELAXED);
  A_STORE(&p->nccl_version, (uint32_t)v, RELAXED);
  A_STORE(&p->owner_has_nccl, 1u, RELEASE);
}

/* ---- the registry (the page's communicator table) ------------------------------------- */
static inline uint32_t slot_hash(uint64_t a) {
  /* handles are heap pointers: drop the alignment bits, then Fibonacci hashing */
  return (uint32_t)(((a >> 4) * 0x9E3779B97F4A7C15ull) >> 56) & (FTSHIM_MAX_COMMS - 1);
}

/* Lock-free: keys are published with a release store and never removed (a stopped or
 * released entry stays as a tombstone), so a probe chain is never broken under a reader. */
static inline ftshim_comm_slot* slot_lookup(ftshim_page* p, const void* comm) {
  uint64_t a = (uint64_t)(uintptr_t)comm;
  if (!a) return NULL;
  uint32_t i = slot_hash(a);
  for (uint32_t n = 0; n < FTSHIM_MAX_COMMS; n++, i = (i + 1) & (FTSHIM_MAX_COMMS - 1)) {
    uint64_t k = A_LOAD(&p->comms[i].addr, ACQUIRE);
    if (k == a) return &p->comms[i];
    if (k == 0) return NULL;
  }
  return NULL;
}

static void claim_from_call(void);
static void start_thread(void);

/* The registry entry for `comm`, or NULL when untracked (shim inert, comm unknown). */
static inline ftshim_comm_slot* track(const void* comm) {
  int m = A_LOAD(&g.mode, RELAXED);
  if (LIKELY(m >= FTSHIM_MODE_ACTIVE)) return slot_lookup(g.page, comm);
  if (m == FTSHIM_MODE_CANDIDATE) {
    claim_from_call();
    if (A_LOAD(&g.mode, ACQUIRE) >= FTSHIM_MODE_ACTIVE) return slot_lookup(g.page, comm);
  }
  return NULL;
}

#define BIT(s) (1u << (s))
#define REJECTED 0x100u
/* Enter a call on a tracked comm if its state is in `ok`. The increment of `inflight` and
 * the state load are both seq_cst, and the abort sweep stores the state then loads
 * `inflight` (seq_cst): either the caller sees the new state, or the sweep sees the caller. */
static inline uint32_t slot_enter(ftshim_comm_slot* s, uint32_t ok) {
  A_ADD(&s->inflight, 1u, SEQ_CST);
  uint32_t st = A_LOAD(&s->state, SEQ_CST);
  if (LIKELY(ok & BIT(st))) return st;
  A_SUB(&s->inflight, 1u, RELEASE);
  return st | REJECTED;
}
static inline void slot_leave(ftshim_comm_slot* s) { A_SUB(&s->inflight, 1u, RELEASE); }

/* Remember that this thread queued work on `s` inside a group: keep it in flight until the
 * outermost ncclGroupEnd returns. */
static inline void group_note(ftshim_comm_slot* s) {
  for (int i = 0; i < t_grp.n; i++)
    if (t_grp.held[i] == s) return;
  if (t_grp.n < HELD_MAX) {
    A_ADD(&s->inflight, 1u, SEQ_CST);
    t_grp.held[t_grp.n++] = s;
  } /* else: more than HELD_MAX comms in one group; the extra ones are not held (documented) */
}

enum { NOTE_OTHER, NOTE_P2P, NOTE_COLLECTIVE };
static inline void slot_note_op(ftshim_comm_slot* s, int id, int what) {
  if (what != NOTE_OTHER) A_ADD(&s->seq, 1u, RELAXED);
  if (what == NOTE_COLLECTIVE) A_ADD(&s->coll_seq, 1u, RELAXED);
  A_STORE(&s->last_op, (uint32_t)id, RELAXED);
  if (t_grp.depth > 0) group_note(s);
}

/* Wait until an abort in progress on this comm has finished (the app is calling destroy,
 * deregister, finalize on it concurrently). */
static uint32_t slot_settle(ftshim_comm_slot* s) {
  uint32_t st;
  while ((st = A_LOAD(&s->state, ACQUIRE)) == FTSHIM_SLOT_ABORTING) sleep_us(200);
  return st;
}

static void wake_thread(ftshim_page* p) {
  A_ADD(&p->doorbell, 1u, SEQ_CST);
  futex_wake(&p->doorbell);
}

/* ---- communicator identity (comm_id) --------------------------------------------------
 * Agents compare a communicator's progress across ranks (a rank whose peers issued more
 * collectives on it than it did is the one they wait for), so every rank must name it
 * alike without talking to the others. Made from what every rank already shares: the
 * ncclUniqueId passed to init, or for a derived communicator (split, shrink, grow) the
 * parent's comm_id, the creating function, how many children the parent had before (ranks
 * derive collectively, in the same order) and the split color. FNV-1a, 64 bits; 0 is kept
 * for "unknown". */
static uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const unsigned char* b = data;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
#define FNV_BASIS 14695981039346656037ull
static uint64_t id_nonzero(uint64_t h) { return h ? h : 1; }
static uint64_t comm_id_of_unique(const ncclUniqueId* uid) {
  return uid ? id_nonzero(fnv1a(FNV_BASIS, uid, sizeof *uid)) : 0;
}
static uint64_t comm_id_derived(ftshim_comm_slot* parent, int creator, uint64_t salt) {
  if (!parent || !parent->comm_id) return 0;
  uint64_t parts[4] = {parent->comm_id, (uint64_t)creator,
                       (uint64_t)A_ADD(&parent->derived, 1u, RELAXED), salt};
  return id_nonzero(fnv1a(FNV_BASIS, parts, sizeof parts));
}
static uint64_t comm_id_local(void) { /* ncclCommInitAll: every rank lives in this process */
  uint64_t parts[2] = {(uint64_t)getpid(), now_ns()};
  return id_nonzero(fnv1a(FNV_BASIS, parts, sizeof parts));
}
/* Per function: the unique id an init call was given, and what tells a derive call's
 * children apart (the split color; a grow may also carry a unique id). */
#define FTSHIM_UID_CommInitRank (&commId)
#define FTSHIM_UID_CommInitRankConfig (&commId)
#define FTSHIM_UID_CommInitRankScalable (nId > 0 ? commIds : NULL)
#define FTSHIM_SALT_CommSplit ((uint64_t)(int64_t)color)
#define FTSHIM_SALT_CommShrink 0ull
#define FTSHIM_SALT_CommGrow 0ull
#define FTSHIM_DERIVED_UID_CommSplit NULL
#define FTSHIM_DERIVED_UID_CommShrink NULL
#define FTSHIM_DERIVED_UID_CommGrow uniqueId

/* Record a new communicator. A dead entry (stopped, or released) at the same address is
 * replaced: NCCL hands a freed address to the next communicator, the serial tells them apart. */
static void slot_register(void* comm, int creator, int rank, int size, uint64_t parent_addr,
                          uint64_t parent_serial, uint64_t epoch, uint64_t comm_id) {
  ftshim_page* p = g.page;
  uint64_t a = (uint64_t)(uintptr_t)comm;
  if (!a || !p) return;
  pthread_mutex_lock(&g.reg_lock);
  if (!A_LOAD(&p->owner_has_nccl, ACQUIRE) || !A_LOAD(&p->nccl_version, RELAXED)) probe_nccl(p);
  ftshim_comm_slot* target = NULL;
  ftshim_comm_slot* reuse = NULL;
  uint32_t i = slot_hash(a);
  for (uint32_t n = 0; n < FTSHIM_MAX_COMMS; n++, i = (i + 1) & (FTSHIM_MAX_COMMS - 1)) {
    ftshim_comm_slot* s = &p->comms[i];
    uint64_t k = A_LOAD(&s->addr, ACQUIRE);
    if (k == a) { target = s; break; }
    if (k == 0) { if (!reuse) reuse = s; break; }
    if (!reuse && A_LOAD(&s->state, ACQUIRE) == FTSHIM_SLOT_RELEASED) reuse = s;
  }
  if (!target) target = reuse;
  if (!target) {
    A_ADD(&p->overflow, 1u, RELAXED);
    pthread_mutex_unlock(&g.reg_lock);
    ftshim_log("communicator table full (%u): %p is not tracked", FTSHIM_MAX_COMMS, comm);
    return;
  }
  uint32_t old = A_LOAD(&target->state, ACQUIRE);
  if (target->addr == a && (old == FTSHIM_SLOT_LIVE || old == FTSHIM_SLOT_REVOKED))
    DEBUG("address %p reused while its entry was %u (released behind the shim's back)", comm, old);
  A_ADD(&target->change, 1u, SEQ_CST); /* odd: being rewritten */
  A_STORE(&target->state, (uint32_t)FTSHIM_SLOT_RELEASED, RELEASE);
  A_STORE(&target->inflight, 0u, RELAXED);
  A_STORE(&target->seq, 0ull, RELAXED);
  A_STORE(&target->last_op, (uint32_t)creator, RELAXED);
  target->serial = A_ADD(&p->next_serial, 1u, RELAXED) + 1;
  target->epoch = epoch;
  target->rank = rank;
  target->size = size;
  target->device = -1;
  target->creator = (uint32_t)creator;
  target->parent_serial = parent_serial;
  target->parent_addr = parent_addr;
  target->created_ns = now_ns();
  target->ended_ns = 0;
  target->comm_id = comm_id;
  A_STORE(&target->coll_seq, 0ull, RELAXED);
  A_STORE(&target->derived, 0u, RELAXED);
  A_STORE(&target->addr, a, RELEASE);
  A_STORE(&target->state, (uint32_t)FTSHIM_SLOT_LIVE, RELEASE);
  A_ADD(&target->change, 1u, SEQ_CST); /* even: stable */
  int stale = epoch < A_LOAD(&p->abort_epoch, ACQUIRE);
  pthread_mutex_unlock(&g.reg_lock);
  DEBUG("registered %p serial %llu epoch %llu by %s rank %d size %d", comm,
        (unsigned long long)target->serial, (unsigned long long)epoch,
        ftshim_names[creator], rank, size);
  if (stale) { /* created by a call that raced an abort of its epoch: sweep again */
    A_STORE(&g.resweep, 1, RELEASE);
    wake_thread(p);
  }
}

static inline uint64_t cur_epoch(void) {
  ftshim_page* p = g.page;
  return p ? A_LOAD(&p->current_epoch, ACQUIRE) : 0;
}

/* ---- interposer templates (one per kind) ---------------------------------------------- */
#define GET_REAL(name) ((ftshim_pfn_##name)ftshim_real(FTSHIM_ID_##name))
#define OK_LIVE BIT(FTSHIM_SLOT_LIVE)
#define OK_VALID (BIT(FTSHIM_SLOT_LIVE) | BIT(FTSHIM_SLOT_REVOKED))

#define FTSHIM_DEF_PASS(name, params, args, c, a1, a2)                       \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    return real args;                                                       \
  }

#define FTSHIM_DEF_PASS_STR(name, params, args, c, a1, a2)                   \
  FTSHIM_API const char* nccl##name params {                                \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) {                                                  \
      ftshim_missing(FTSHIM_ID_##name);                                     \
      return "unknown NCCL result (no libnccl loaded)";                     \
    }                                                                       \
    return real args;                                                       \
  }

#define FTSHIM_DEF_GSTART(name, params, args, c, a1, a2)                     \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ncclResult_t r = real args;                                             \
    if (r == ncclSuccess) t_grp.depth++;                                    \
    return r;                                                               \
  }

#define FTSHIM_DEF_GEND(name, params, args, c, a1, a2)                       \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ncclResult_t r = real args;                                             \
    if (t_grp.depth > 0 && --t_grp.depth == 0) group_release();             \
    return r;                                                               \
  }

#define FTSHIM_DEF_INIT(name, params, args, c, a1, a2)                       \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    int on = active_for_create();                                           \
    uint64_t epoch = cur_epoch();                                           \
    ncclResult_t r = real args;                                             \
    if (on && (r == ncclSuccess || r == ncclInProgress) && (c) && *(c))      \
      slot_register(*(c), FTSHIM_ID_##name, (a2), (a1), 0, 0, epoch,        \
                    comm_id_of_unique(FTSHIM_UID_##name));                  \
    return r;                                                               \
  }

#define FTSHIM_DEF_INIT_ALL(name, params, args, c, a1, a2)                   \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    int on = active_for_create();                                           \
    uint64_t epoch = cur_epoch();                                           \
    ncclResult_t r = real args;                                             \
    if (on && (r == ncclSuccess || r == ncclInProgress) && (c)) {            \
      uint64_t id_ = comm_id_local();                                       \
      for (int i_ = 0; i_ < (a1); i_++)                                     \
        if ((c)[i_]) slot_register((c)[i_], FTSHIM_ID_##name, i_, (a1), 0, 0, epoch, id_); \
    }                                                                       \
    return r;                                                               \
  }

/* Split/shrink/grow: allowed on a revoked parent (that is what revoke is for). */
#define FTSHIM_DEF_DERIVE(name, params, args, c, a1, a2)                     \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    int on = active_for_create();                                           \
    ftshim_comm_slot* s = on ? slot_lookup(g.page, (c)) : NULL;             \
    uint64_t pa = 0, ps = 0, id_ = 0;                                       \
    if (s) {                                                                \
      if (slot_enter(s, OK_VALID) & REJECTED) return ncclInvalidUsage;      \
      pa = s->addr; ps = s->serial;                                         \
      A_STORE(&s->last_op, (uint32_t)FTSHIM_ID_##name, RELAXED);            \
      id_ = comm_id_derived(s, FTSHIM_ID_##name, FTSHIM_SALT_##name);       \
    }                                                                       \
    if (FTSHIM_DERIVED_UID_##name)                                          \
      id_ = comm_id_of_unique(FTSHIM_DERIVED_UID_##name);                   \
    uint64_t epoch = cur_epoch();                                           \
    ncclResult_t r = real args;                                             \
    if (s) slot_leave(s);                                                   \
    if (on && (r == ncclSuccess || r == ncclInProgress) && (a1) && *(a1))    \
      slot_register(*(a1), FTSHIM_ID_##name, -1, -1, pa, ps, epoch, id_);   \
    return r;                                                               \
  }

/* A communication operation: counted in seq, and in coll_seq when `note` is a collective. */
#define FTSHIM_DEF_COUNTED(name, params, args, c, note)                      \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    if (UNLIKELY(slot_enter(s, OK_LIVE) & REJECTED)) return ncclInvalidUsage; \
    slot_note_op(s, FTSHIM_ID_##name, note);                                \
    ncclResult_t r = real args;                                             \
    slot_leave(s);                                                          \
    return r;                                                               \
  }
#define FTSHIM_DEF_COLL(name, params, args, c, a1, a2) \
  FTSHIM_DEF_COUNTED(name, params, args, c, NOTE_COLLECTIVE)
#define FTSHIM_DEF_P2P(name, params, args, c, a1, a2) \
  FTSHIM_DEF_COUNTED(name, params, args, c, NOTE_P2P)

#define FTSHIM_DEF_OP(name, params, args, c, a1, a2)                         \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    uint32_t st = slot_enter(s, OK_LIVE);                                   \
    if (UNLIKELY(st & REJECTED))                                            \
      /* a revoke asked by the app on a stopped comm has nothing left to do */ \
      return FTSHIM_ID_##name == FTSHIM_ID_CommRevoke ? ncclSuccess : ncclInvalidUsage; \
    slot_note_op(s, FTSHIM_ID_##name, NOTE_OTHER);                                   \
    ncclResult_t r = real args;                                             \
    slot_leave(s);                                                          \
    return r;                                                               \
  }

#define FTSHIM_DEF_QUERY(name, params, args, c, a1, a2)                      \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    if (slot_enter(s, OK_VALID) & REJECTED) return ncclInvalidUsage;        \
    ncclResult_t r = real args;                                             \
    slot_leave(s);                                                          \
    return r;                                                               \
  }

/* Count / user rank / device: forwarded while the memory is valid (the answer is cached in
 * the slot), answered from the slot once NCCL freed the communicator. */
#define FTSHIM_DEF_CACHED(name, params, args, c, out, field)                 \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    if (slot_enter(s, OK_VALID) & REJECTED) {                               \
      int v_ = A_LOAD(&s->field, RELAXED);                                  \
      if (v_ < 0 || !(out)) return ncclInvalidUsage;                        \
      *(out) = v_;                                                          \
      return ncclSuccess;                                                   \
    }                                                                       \
    ncclResult_t r = real args;                                             \
    if (r == ncclSuccess && (out) && s->field < 0) A_STORE(&s->field, *(out), RELAXED); \
    slot_leave(s);                                                          \
    return r;                                                               \
  }
#define FTSHIM_DEF_COUNT(name, params, args, c, a1, a2) \
  FTSHIM_DEF_CACHED(name, params, args, c, a1, size)
#define FTSHIM_DEF_URANK(name, params, args, c, a1, a2) \
  FTSHIM_DEF_CACHED(name, params, args, c, a1, rank)
#define FTSHIM_DEF_CUDEV(name, params, args, c, a1, a2) \
  FTSHIM_DEF_CACHED(name, params, args, c, a1, device)

/* torch's watchdog polls this every 100 ms: a stopped comm must read as failed. (NCCL itself
 * reports ncclSuccess for a revoked comm, and a freed one must not be touched.) */
#define FTSHIM_DEF_ASYNC(name, params, args, c, a1, a2)                      \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    if (slot_enter(s, OK_LIVE) & REJECTED) {                                \
      if (a1) *(a1) = ncclRemoteError;                                      \
      return ncclSuccess;                                                   \
    }                                                                       \
    ncclResult_t r = real args;                                             \
    slot_leave(s);                                                          \
    return r;                                                               \
  }

#define FTSHIM_DEF_LASTERR(name, params, args, c, a1, a2)                    \
  FTSHIM_API const char* nccl##name params {                                \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) {                                                  \
      ftshim_missing(FTSHIM_ID_##name);                                     \
      return "";                                                            \
    }                                                                       \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    if (slot_enter(s, OK_VALID) & REJECTED) return ftshim_aborted_msg;      \
    const char* r = real args;                                              \
    slot_leave(s);                                                          \
    return r;                                                               \
  }

/* Deregister & co on a stopped comm: succeed quietly (torch raises if deregister fails). A
 * revoked comm still has its memory: release the resource for real, hide any error. */
#define FTSHIM_DEF_CLEANUP(name, params, args, c, a1, a2)                    \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    for (;;) {                                                              \
      uint32_t st = slot_enter(s, OK_VALID);                                \
      if (!(st & REJECTED)) {                                               \
        ncclResult_t r = real args;                                         \
        slot_leave(s);                                                      \
        if (st == FTSHIM_SLOT_REVOKED && r != ncclSuccess) {                \
          DEBUG("%s on revoked %p returned %d: reported as success", ftshim_names[FTSHIM_ID_##name], (void*)(c), (int)r); \
          r = ncclSuccess;                                                  \
        }                                                                   \
        return r;                                                           \
      }                                                                     \
      if ((st & ~REJECTED) == FTSHIM_SLOT_ABORTING) { slot_settle(s); continue; } \
      return ncclSuccess;                                                   \
    }                                                                       \
  }

#define FTSHIM_DEF_FINALIZE(name, params, args, c, a1, a2)                   \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    for (;;) {                                                              \
      uint32_t st = slot_enter(s, OK_LIVE);                                 \
      if (!(st & REJECTED)) {                                               \
        ncclResult_t r = real args;                                         \
        slot_leave(s);                                                      \
        return r;                                                           \
      }                                                                     \
      if ((st & ~REJECTED) == FTSHIM_SLOT_ABORTING) { slot_settle(s); continue; } \
      return ncclSuccess; /* stopped: there is nothing left to flush */     \
    }                                                                       \
  }

#define FTSHIM_DEF_RELEASE(name, params, args, c, a1, a2)                    \
  FTSHIM_API ncclResult_t nccl##name params {                               \
    ftshim_pfn_##name real = GET_REAL(name);                                \
    if (UNLIKELY(!real)) return ftshim_missing(FTSHIM_ID_##name);           \
    ftshim_comm_slot* s = track(c);                                         \
    if (!s) return real args;                                               \
    return release_slot(s, (void*)(c), (ncclResult_t(*)(ncclComm_t))real, (a1)); \
  }

/* ---- release (destroy/abort called by the application) --------------------------------- */
static void group_release(void) {
  int n = t_grp.n;
  t_grp.n = 0;
  if (A_LOAD(&g.mode, RELAXED) < FTSHIM_MODE_ACTIVE) return; /* fork child: the page is not ours */
  for (int i = 0; i < n; i++) A_SUB(&t_grp.held[i]->inflight, 1u, RELEASE);
}

static int active_for_create(void) {
  int m = A_LOAD(&g.mode, RELAXED);
  if (m == FTSHIM_MODE_CANDIDATE) {
    claim_from_call();
    m = A_LOAD(&g.mode, ACQUIRE);
  }
  return m >= FTSHIM_MODE_ACTIVE;
}

static void slot_set_state(ftshim_comm_slot* s, uint32_t st) {
  s->ended_ns = now_ns();
  A_STORE(&s->state, st, RELEASE);
}

static ncclResult_t release_slot(ftshim_comm_slot* s, void* comm, ncclResult_t (*real)(ncclComm_t),
                                 int is_abort) {
  for (;;) {
    uint32_t st = A_LOAD(&s->state, ACQUIRE);
    switch (st) {
      case FTSHIM_SLOT_LIVE: {
        uint32_t e = FTSHIM_SLOT_LIVE;
        if (!A_CAS(&s->state, &e, (uint32_t)FTSHIM_SLOT_RELEASING)) continue;
        A_ADD(&s->inflight, 1u, SEQ_CST);
        ncclResult_t r = real((ncclComm_t)comm);
        A_SUB(&s->inflight, 1u, RELEASE);
        /* A failed destroy leaves the communicator allocated; an abort always frees it. */
        int gone = is_abort || r == ncclSuccess || r == ncclInProgress;
        slot_set_state(s, gone ? FTSHIM_SLOT_RELEASED : FTSHIM_SLOT_LIVE);
        return r;
      }
      case FTSHIM_SLOT_REVOKED: {
        uint32_t e = FTSHIM_SLOT_REVOKED;
        if (!A_CAS(&s->state, &e, (uint32_t)FTSHIM_SLOT_RELEASING)) continue;
        /* Release a revoked comm with abort, never destroy: from NCCL 2.31.2 destroy waits
         * in an untimed barrier for peers that may be gone. */
        ftshim_pfn_CommAbort ab = GET_REAL(CommAbort);
        ncclResult_t r = ab ? ab((ncclComm_t)comm) : ncclSuccess;
        if (r != ncclSuccess) DEBUG("abort of revoked %p returned %d", comm, (int)r);
        slot_set_state(s, FTSHIM_SLOT_RELEASED);
        return ncclSuccess;
      }
      case FTSHIM_SLOT_ABORTED: {
        uint32_t e = FTSHIM_SLOT_ABORTED;
        if (!A_CAS(&s->state, &e, (uint32_t)FTSHIM_SLOT_RELEASED)) continue;
        return ncclSuccess; /* NCCL already freed it: do not touch */
      }
      case FTSHIM_SLOT_ABORTING:
      case FTSHIM_SLOT_RELEASING:
        sleep_us(200); /* the shim's abort (or another thread's release) is in progress */
        continue;
      case FTSHIM_SLOT_RELEASED:
        return ncclSuccess; /* released twice: answering is safer than touching freed memory */
      default:
        return real((ncclComm_t)comm);
    }
  }
}

/* ---- the interposers ------------------------------------------------------------------ */
#define X(kind, name, since, params, args, c, a1, a2) \
  FTSHIM_DEF_##kind(name, params, args, c, a1, a2)
FTSHIM_NCCL_TABLE(X)
#undef X

/* ---- abort sweep ---------------------------------------------------------------------- */
static void drain(victim_t* v, uint32_t n, uint32_t ms) {
  uint64_t deadline = now_ns() + (uint64_t)ms * 1000000ull;
  for (;;) {
    uint32_t busy = 0;
    for (uint32_t i = 0; i < n; i++) busy += A_LOAD(&v[i].slot->inflight, ACQUIRE) != 0;
    if (!busy || now_ns() >= deadline) return;
    sleep_us(100);
  }
}

/* Stop every LIVE communicator whose epoch is < `epoch`. Runs on the control thread (or on
 * the thread that noticed the agent died). Writes the report into the page as it goes, so
 * that an agent that times out still sees how far it got. */
static void abort_sweep(uint64_t epoch, uint64_t request) {
  ftshim_page* p = g.page;
  victim_t* victims = g.victims;
  pthread_mutex_lock(&g.reg_lock);
  probe_nccl(p);
  ftshim_report* rep = &p->report;
  uint32_t caps = A_LOAD(&p->caps, RELAXED);
  uint32_t mech = FTSHIM_MECH_NONE;
  if (caps & FTSHIM_CAP_REVOKE) mech = FTSHIM_MECH_REVOKE;
  else if (caps & FTSHIM_CAP_GROUP) mech = FTSHIM_MECH_GROUP_ABORT;
  else if (caps & FTSHIM_CAP_ABORT) mech = FTSHIM_MECH_ABORT;
  else mech = FTSHIM_MECH_UNAVAILABLE;
  uint32_t drain_ms = A_LOAD(&p->drain_ms, RELAXED);
  if (drain_ms > 10000) drain_ms = 10000;

  A_STORE(&rep->phase, (uint32_t)FTSHIM_PHASE_SELECTING, RELEASE);
  rep->epoch = epoch;
  rep->request = request;
  rep->started_ns = now_ns();
  rep->finished_ns = 0;
  rep->group_result = 0;
  rep->n_unsafe = 0;
  rep->nccl_version = A_LOAD(&p->nccl_version, RELAXED);
  rep->current_index = 0;
  A_STORE(&rep->n_entries, 0u, RELEASE);

  uint32_t n = 0, ne = 0;
  for (uint32_t i = 0; i < FTSHIM_MAX_COMMS; i++) {
    ftshim_comm_slot* s = &p->comms[i];
    if (!A_LOAD(&s->addr, ACQUIRE) || s->epoch >= epoch) continue;
    uint32_t e = FTSHIM_SLOT_LIVE;
    uint32_t st = A_LOAD(&s->state, ACQUIRE);
    if (st != FTSHIM_SLOT_LIVE && st != FTSHIM_SLOT_RELEASING) continue;
    ftshim_report_entry* re = &rep->entries[ne];
    memset(re, 0, sizeof *re);
    re->addr = s->addr;
    re->serial = s->serial;
    re->epoch = s->epoch;
    re->rank = s->rank;
    re->state_before = st;
    if (st == FTSHIM_SLOT_RELEASING || !A_CAS(&s->state, &e, (uint32_t)FTSHIM_SLOT_ABORTING)) {
      /* The application is destroying it right now: that call owns it. */
      re->state_before = FTSHIM_SLOT_RELEASING;
      re->state_after = A_LOAD(&s->state, ACQUIRE);
      re->flags = FTSHIM_F_SKIPPED_RELEASING;
      re->inflight_before = A_LOAD(&s->inflight, ACQUIRE);
      ne++;
      continue;
    }
    re->inflight_before = A_LOAD(&s->inflight, SEQ_CST);
    re->mechanism = mech;
    victims[n].slot = s;
    victims[n].entry = re;
    victims[n].use_abort = mech != FTSHIM_MECH_REVOKE;
    n++;
    ne++;
  }
  A_STORE(&rep->n_entries, ne, RELEASE);
  rep->mechanism = n ? mech : FTSHIM_MECH_NONE;
  A_STORE(&rep->phase, (uint32_t)FTSHIM_PHASE_STOPPING, RELEASE);

  ftshim_pfn_CommRevoke revoke = GET_REAL(CommRevoke);
  ftshim_pfn_CommAbort abort_fn = GET_REAL(CommAbort);
  ftshim_pfn_GroupStart gstart = GET_REAL(GroupStart);
  ftshim_pfn_GroupEnd gend = GET_REAL(GroupEnd);

  /* 1. Revoke: stops in-flight work and frees nothing, so it is safe while another thread is
   *    inside NCCL on the comm; wait for those calls to come back afterwards. */
  if (mech == FTSHIM_MECH_REVOKE && n) {
    for (uint32_t i = 0; i < n; i++) {
      A_STORE(&rep->current_index, i, RELAXED);
      uint64_t t0 = now_ns();
      ncclResult_t r = revoke((ncclComm_t)(uintptr_t)victims[i].slot->addr, 0);
      victims[i].entry->elapsed_ns = now_ns() - t0;
      victims[i].entry->result = r;
      if (r == ncclSuccess) {
        slot_set_state(victims[i].slot, FTSHIM_SLOT_REVOKED);
        victims[i].entry->state_after = FTSHIM_SLOT_REVOKED;
      } else {
        victims[i].entry->flags |= FTSHIM_F_CALL_FAILED;
        victims[i].use_abort = 1; /* fall back to abort for this one */
        victims[i].entry->mechanism = caps & FTSHIM_CAP_GROUP ? FTSHIM_MECH_GROUP_ABORT : FTSHIM_MECH_ABORT;
      }
    }
    drain(victims, n, drain_ms);
    for (uint32_t i = 0; i < n; i++) {
      victims[i].entry->inflight_after = A_LOAD(&victims[i].slot->inflight, ACQUIRE);
      if (!victims[i].use_abort && victims[i].entry->inflight_after)
        victims[i].entry->flags |= FTSHIM_F_DRAIN_TIMEOUT; /* not unsafe: memory stays valid */
    }
  }

  /* 2. Abort (frees the communicator): first give calls in flight drain_ms to come back;
   *    whatever is still inside NCCL then races the free (NCCL's documented unsafe case). */
  uint32_t na = 0;
  for (uint32_t i = 0; i < n; i++) na += victims[i].use_abort;
  if (na) {
    victim_t* av = g.freeing;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++)
      if (victims[i].use_abort) av[k++] = victims[i];
    drain(av, k, drain_ms);
    for (uint32_t i = 0; i < k; i++) {
      uint32_t busy = A_LOAD(&av[i].slot->inflight, ACQUIRE);
      av[i].entry->inflight_after = busy;
      if (busy) {
        av[i].entry->flags |= FTSHIM_F_UNSAFE_INFLIGHT | FTSHIM_F_DRAIN_TIMEOUT;
        rep->n_unsafe++;
      }
    }
    int grouped = (caps & FTSHIM_CAP_GROUP) && k > 0;
    if (!abort_fn) {
      for (uint32_t i = 0; i < k; i++) {
        av[i].entry->mechanism = FTSHIM_MECH_UNAVAILABLE;
        av[i].entry->flags |= FTSHIM_F_CALL_FAILED;
        av[i].entry->result = ncclInvalidUsage;
        av[i].entry->state_after = FTSHIM_SLOT_ABORTING;
      }
    } else {
      /* Several communicators must be aborted inside one group or the abort can hang. */
      if (grouped) gstart();
      for (uint32_t i = 0; i < k; i++) {
        A_STORE(&rep->current_index, i, RELAXED);
        uint64_t t0 = now_ns();
        ncclResult_t r = abort_fn((ncclComm_t)(uintptr_t)av[i].slot->addr);
        av[i].entry->elapsed_ns += now_ns() - t0;
        av[i].entry->result = r;
        if (r != ncclSuccess) av[i].entry->flags |= FTSHIM_F_CALL_FAILED;
      }
      if (grouped) {
        uint64_t t0 = now_ns();
        rep->group_result = gend();
        uint64_t dt = now_ns() - t0; /* the group's work is shared: charge each its part */
        for (uint32_t i = 0; i < k; i++) av[i].entry->elapsed_ns += dt / k;
      }
      for (uint32_t i = 0; i < k; i++) {
        slot_set_state(av[i].slot, FTSHIM_SLOT_ABORTED);
        av[i].entry->state_after = FTSHIM_SLOT_ABORTED;
      }
    }
  }

  rep->finished_ns = now_ns();
  A_STORE(&rep->phase, (uint32_t)FTSHIM_PHASE_DONE, RELEASE);
  if (epoch != FTSHIM_EPOCH_ALL || request) {
    A_STORE(&p->ack_epoch, epoch, RELEASE);
    A_STORE(&p->ack_request, request, RELEASE);
  }
  A_ADD(&p->report_seq, 1u, SEQ_CST);
  futex_wake(&p->report_seq);
  pthread_mutex_unlock(&g.reg_lock);
  DEBUG("abort epoch %llu: %u comms, mechanism %u, %u unsafe, %.3f ms", (unsigned long long)epoch, n,
        mech, rep->n_unsafe, (double)(rep->finished_ns - rep->started_ns) / 1e6);
}

/* ---- owning the page ------------------------------------------------------------------ */
enum { CLAIM_WAIT = 0, CLAIM_OK = 1, CLAIM_NEVER = 2 };

static int pid_alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* Does `pid` have a libnccl mapped? Asked of the current owner before taking the page over:
 * its own owner_has_nccl flag lags by up to one tick after it loads NCCL. Claim path only. */
static int pid_has_nccl(pid_t pid) {
  char path[64], buf[8192];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  size_t have = 0;
  int found = 0;
  for (;;) {
    ssize_t n = read(fd, buf + have, sizeof buf - have);
    if (n <= 0) break;
    have += (size_t)n;
    if (memmem(buf, have, "libnccl", 7)) {
      found = 1;
      break;
    }
    if (have >= 6) { /* keep the tail: the name may be split across two reads */
      memmove(buf, buf + have - 6, 6);
      have = 6;
    }
  }
  close(fd);
  return found;
}

/* Decide who owns the page. The first process that has NCCL loaded (or that the agent named
 * with bind()) claims it; a process with NCCL may take it over from an owner without NCCL
 * (a wrapper shell that then started python); an exec keeps the pid and re-claims. Everyone
 * else (compilers, nvidia-smi, ... started by the worker) stays inert. */
static int try_claim(int have_nccl) {
  ftshim_page* p = g.page;
  pid_t self = getpid();
  for (;;) {
    int32_t owner = A_LOAD(&p->owner_pid, ACQUIRE);
    int32_t bound = A_LOAD(&p->bound_pid, ACQUIRE);
    int bound_me = bound == self;
    if (owner != 0 && owner != self) {
      int alive = pid_alive(owner);
      int owner_nccl = (int)A_LOAD(&p->owner_has_nccl, ACQUIRE) || (alive && pid_has_nccl(owner));
      if (alive && owner_nccl && !(bound_me && have_nccl && owner != bound)) return CLAIM_NEVER;
      if (alive && !have_nccl) return CLAIM_WAIT;
      if (!alive && !have_nccl && !bound_me) return CLAIM_WAIT;
    } else if (owner == 0 && !have_nccl && !bound_me) {
      return CLAIM_WAIT;
    }
    int32_t e = owner;
    if (owner == self || A_CAS(&p->owner_pid, &e, (int32_t)self)) break;
  }
  /* We own it now: a fresh registry (a previous owner's entries mean nothing here). */
  pthread_mutex_lock(&g.reg_lock);
  memset((void*)p->comms, 0, sizeof p->comms);
  A_STORE(&p->owner_has_nccl, 0u, RELEASE);
  if (have_nccl) probe_nccl(p);
  A_STORE(&p->abi_shim_version, FTSHIM_ABI_VERSION, RELAXED);
  A_ADD(&p->attach_count, 1u, RELAXED);
  A_STORE(&p->shim_state, (uint32_t)FTSHIM_STATE_ACTIVE, RELEASE);
  pthread_mutex_unlock(&g.reg_lock);
  A_STORE(&g.mode, FTSHIM_MODE_ACTIVE, RELEASE);
  DEBUG("claimed control page (nccl %s)", have_nccl ? "loaded" : "not loaded yet");
  return CLAIM_OK;
}

static void go_inert(const char* why) {
  A_STORE(&g.inert_reason, why, RELAXED);
  A_STORE(&g.mode, FTSHIM_MODE_INERT, RELEASE);
  DEBUG("inert: %s", why);
}

static void claim_from_call(void) {
  /* The application is calling NCCL: NCCL is loaded in this process. */
  pthread_mutex_lock(&g.claim_lock);
  if (A_LOAD(&g.mode, ACQUIRE) == FTSHIM_MODE_CANDIDATE) {
    int r = try_claim(1);
    if (r == CLAIM_NEVER) go_inert("another process owns the control page");
    if (r == CLAIM_OK) start_thread();
  }
  pthread_mutex_unlock(&g.claim_lock);
}

static int nccl_loaded(void) { return nccl_handle() != NULL; }

/* The control thread asks the loader about libnccl at most every 100th tick: dlopen takes
 * the loader's lock, which a process that is exiting (running library destructors) holds
 * too, and a program that never loads NCCL (a CPU-only worker) would otherwise ask for ever,
 * every tick. */
static int nccl_loaded_throttled(void) {
  if (A_LOAD(&g.nccl, ACQUIRE)) return 1;
  if (A_LOAD(&g.exiting, ACQUIRE)) return 0;
  return (g.nccl_probes++ % 100u == 0u) && nccl_loaded();
}

static int agent_alive(pid_t agent) {
  if (agent <= 0) return 1;
  if (g.agent_fd >= 0) {
    struct pollfd pfd = {g.agent_fd, POLLIN, 0};
    return poll(&pfd, 1, 0) == 0; /* a pidfd becomes readable when the process exits */
  }
  return pid_alive(agent);
}

static void agent_lost(void) {
  ftshim_page* p = g.page;
  ftshim_log("agent pid %d is gone: aborting every NCCL communicator and exiting (status %d)",
             (int)p->agent_pid, FTSHIM_EXIT_AGENT_LOST);
  abort_sweep(FTSHIM_EPOCH_ALL, 0);
  A_STORE(&p->shim_state, (uint32_t)FTSHIM_STATE_AGENT_LOST, RELEASE);
  _exit(FTSHIM_EXIT_AGENT_LOST); /* not exit(): atexit handlers could wait on wedged threads */
}

static void* control_thread(void* arg) {
  (void)arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals belong to the application's threads */
  prctl(PR_SET_NAME, "ftrun-shim", 0, 0, 0);
  ftshim_page* p = g.page;
  pid_t agent = A_LOAD(&p->agent_pid, RELAXED);
#ifdef SYS_pidfd_open
  if (agent > 0) {
    g.agent_fd = (int)syscall(SYS_pidfd_open, agent, 0);
    if (g.agent_fd < 0 && errno == ESRCH) g.agent_fd = -2; /* already gone */
  }
#endif
  for (;;) {
    uint32_t bell = A_LOAD(&p->doorbell, ACQUIRE);
    uint32_t tick = A_LOAD(&p->tick_ms, RELAXED);
    if (tick < 1 || tick > 1000) tick = 10;
    int mode = A_LOAD(&g.mode, ACQUIRE);
    if (mode == FTSHIM_MODE_CANDIDATE) {
      pthread_mutex_lock(&g.claim_lock);
      int r = A_LOAD(&g.mode, ACQUIRE) == FTSHIM_MODE_CANDIDATE ? try_claim(nccl_loaded_throttled())
                                                         : CLAIM_OK;
      if (r == CLAIM_NEVER) go_inert("another process owns the control page");
      pthread_mutex_unlock(&g.claim_lock);
      if (r == CLAIM_NEVER) return NULL;
      if (r == CLAIM_WAIT) {
        int32_t bound = A_LOAD(&p->bound_pid, ACQUIRE);
        if ((A_LOAD(&p->agent_flags, ACQUIRE) & FTSHIM_AGENT_CLOSED) ||
            (bound != 0 && bound != getpid())) {
          /* Not the worker: keep waiting for an NCCL call, without a thread. */
          A_STORE(&g.thread_started, 0, RELEASE);
          return NULL;
        }
        uint32_t st = A_LOAD(&p->shim_state, RELAXED);
        if (st == FTSHIM_STATE_NONE) A_STORE(&p->shim_state, (uint32_t)FTSHIM_STATE_WAITING, RELAXED);
        futex_wait_ms(&p->doorbell, bell, tick);
        continue;
      }
    }
    if (A_LOAD(&g.mode, ACQUIRE) != FTSHIM_MODE_ACTIVE) return NULL;
    if (A_LOAD(&p->owner_pid, ACQUIRE) != getpid()) { /* taken over by a process with NCCL */
      go_inert("ownership taken over by another process");
      return NULL;
    }
    A_ADD(&p->liveness, 1u, RELAXED);
    /* Fill in version and capabilities once the program loads NCCL (python: import torch). */
    if (!A_LOAD(&p->owner_has_nccl, ACQUIRE) && nccl_loaded_throttled()) probe_nccl(p);
    if (g.agent_fd == -2 || !agent_alive(agent)) agent_lost();
    if (A_LOAD(&p->agent_flags, ACQUIRE) & FTSHIM_AGENT_CLOSED) {
      /* The registry stays in use so stopped handles are still answered safely. */
      A_STORE(&p->shim_state, (uint32_t)FTSHIM_STATE_DETACHED, RELEASE);
      A_STORE(&g.mode, FTSHIM_MODE_DETACHED, RELEASE);
      DEBUG("agent closed the channel: detached");
      return NULL;
    }
    uint64_t req = A_LOAD(&p->abort_request, ACQUIRE);
    int resweep = __atomic_exchange_n(&g.resweep, 0, __ATOMIC_ACQ_REL);
    if (req != g.last_request || resweep) {
      g.last_request = req;
      abort_sweep(A_LOAD(&p->abort_epoch, ACQUIRE), req);
      continue;
    }
    futex_wait_ms(&p->doorbell, bell, tick);
  }
}

static void start_thread(void) {
  if (__atomic_exchange_n(&g.thread_started, 1, __ATOMIC_ACQ_REL)) return;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t th;
  int e = pthread_create(&th, &attr, control_thread, NULL);
  pthread_attr_destroy(&attr);
  if (e != 0) {
    ftshim_log("cannot start the control thread (%s): the shim only forwards", strerror(e));
    go_inert("control thread could not start");
  }
}

static void atfork_child(void) {
  /* Threads do not survive fork; the page mapping does (MAP_SHARED): never write to it. */
  go_inert("fork child of the worker");
  t_grp.n = 0;
}

/* Runs first in exit(), before library destructors: from here on the control thread must
 * not take the loader's lock (a dlopen racing the destructors aborted CPU workers at exit
 * about one run in three before this existed). */
static void mark_exiting(void) { A_STORE(&g.exiting, 1, RELEASE); }

/* Map the control page that FTRUN_SHIM_CONTROL names, claim it if this process may, and start
 * the control thread: a worker's start (the constructor), or a worker forked from a fork
 * server (ftshim_attach). On any failure the shim stays inert and says why. */
static void attach_page(void) {
  const char* dbg = getenv(FTSHIM_ENV_DEBUG);
  g.debug = dbg && *dbg && *dbg != '0';
  const char* path = getenv(FTSHIM_ENV_CONTROL);
  if (!path || !*path) {
    g.inert_reason = "no " FTSHIM_ENV_CONTROL " in the environment";
    return;
  }
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    g.inert_reason = "control page cannot be opened";
    DEBUG("cannot open %s: %s", path, strerror(errno));
    return;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(ftshim_page)) {
    close(fd);
    g.inert_reason = "control page too small (agent/shim version mismatch?)";
    ftshim_log("%s: %s", path, g.inert_reason);
    return;
  }
  void* m = mmap(NULL, sizeof(ftshim_page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    g.inert_reason = "control page cannot be mapped";
    return;
  }
  ftshim_page* p = (ftshim_page*)m;
  if (p->magic != FTSHIM_MAGIC || p->version != FTSHIM_ABI_VERSION || p->size < sizeof(ftshim_page) ||
      p->max_comms != FTSHIM_MAX_COMMS) {
    munmap(m, sizeof(ftshim_page));
    g.inert_reason = "control page has another layout version";
    ftshim_log("%s: %s (magic %llx version %u)", path, g.inert_reason,
               (unsigned long long)p->magic, p->version);
    return;
  }
  g.page = p;
  A_STORE(&g.mode, FTSHIM_MODE_CANDIDATE, RELEASE);
  int r = try_claim(nccl_loaded());
  if (r == CLAIM_NEVER) {
    go_inert("another process owns the control page");
    g.page = NULL;
    munmap(m, sizeof(ftshim_page));
    return;
  }
  /* A process that the agent bound to another pid (a child of the worker) waits for its
   * first NCCL call without a thread: nothing runs in compilers, shells, nvidia-smi ... */
  int32_t bound = A_LOAD(&p->bound_pid, ACQUIRE);
  if (r == CLAIM_OK || bound == 0 || bound == getpid()) start_thread();
}

__attribute__((constructor)) static void ftshim_init(void) {
  pthread_atfork(NULL, NULL, atfork_child);
  atexit(mark_exiting);
  attach_page();
}

/* A worker forked from a fork server that preloads the shim (ftrun --preload): the server had
 * no control page (no FTRUN_SHIM_CONTROL: inert, it never tracks a communicator), and the
 * fork copied none of its threads. Called once in the child, after its environment names the
 * worker's own page: this process starts as a spawned worker's shim starts, with state of its
 * own. A fork of a worker (a DataLoader process) holds the worker's page mapping and is left
 * inert: that page is the worker's. Returns the mode after the attempt (enum ftshim_mode):
 * candidate or active when attached, inert when not (ftshim_inert_reason() says why). */
FTSHIM_API int ftshim_attach(void) {
  if (g.page != NULL) return A_LOAD(&g.mode, ACQUIRE);
  pthread_mutex_init(&g.claim_lock, NULL); /* the server's one thread held neither at the fork */
  pthread_mutex_init(&g.reg_lock, NULL);
  g.thread_started = 0;
  g.agent_fd = -1;
  g.last_request = 0;
  g.resweep = 0;
  g.exiting = 0;
  g.nccl_probes = 0;
  t_grp.n = 0;
  t_grp.depth = 0;
  attach_page();
  return A_LOAD(&g.mode, ACQUIRE);
}

/* ---- introspection (tests, doctor) ---------------------------------------------------- */
FTSHIM_API int ftshim_status(void) { return A_LOAD(&g.mode, ACQUIRE); }
FTSHIM_API const char* ftshim_inert_reason(void) {
  return A_LOAD(&g.mode, ACQUIRE) >= FTSHIM_MODE_CANDIDATE ? "" : g.inert_reason;
}
FTSHIM_API uint32_t ftshim_function_count(void) { return FTSHIM_FN_COUNT; }
FTSHIM_API const char* ftshim_function_name(uint32_t id) {
  return id < FTSHIM_FN_COUNT ? ftshim_names[id] : NULL;
}

/* ftshim_<family>_name(value) and ftshim_enum_values, from the lists in ftshim_abi.h. */
#define NAME_CASE(family, sym, value, name) case sym: return name;
#define NAME_FN(list, family)                                          \
  FTSHIM_API const char* ftshim_##family##_name(uint32_t value) {      \
    switch (value) {                                                   \
      list(NAME_CASE)                                                  \
      default: return NULL;                                            \
    }                                                                  \
  }
FTSHIM_ENUM_FAMILIES(NAME_FN)
#undef NAME_FN
#undef NAME_CASE

#define ENUM_ROW(family, sym, value, name) {#family, (uint32_t)(sym), name},
#define ENUM_ROWS(list, family) list(ENUM_ROW)
FTSHIM_API const ftshim_enum_value ftshim_enum_values[] = {
    FTSHIM_ENUM_FAMILIES(ENUM_ROWS) {NULL, 0, NULL}};
#undef ENUM_ROWS
#undef ENUM_ROW

#define F(type, field) {#type "." #field, (uint32_t)offsetof(type, field), \
                        (uint32_t)sizeof(((type*)0)->field)}
FTSHIM_API const ftshim_field_info ftshim_layout_fields[] = {
    {"ftshim_page", 0, (uint32_t)sizeof(ftshim_page)},
    {"ftshim_comm_slot", 0, (uint32_t)sizeof(ftshim_comm_slot)},
    {"ftshim_report", 0, (uint32_t)sizeof(ftshim_report)},
    {"ftshim_report_entry", 0, (uint32_t)sizeof(ftshim_report_entry)},
    F(ftshim_page, magic), F(ftshim_page, version), F(ftshim_page, size),
    F(ftshim_page, max_comms), F(ftshim_page, agent_pid), F(ftshim_page, bound_pid),
    F(ftshim_page, tick_ms), F(ftshim_page, drain_ms), F(ftshim_page, agent_flags),
    F(ftshim_page, current_epoch), F(ftshim_page, abort_epoch),
    F(ftshim_page, abort_request), F(ftshim_page, doorbell), F(ftshim_page, report_seq),
    F(ftshim_page, owner_pid), F(ftshim_page, shim_state), F(ftshim_page, liveness),
    F(ftshim_page, ack_epoch), F(ftshim_page, ack_request), F(ftshim_page, nccl_version),
    F(ftshim_page, caps), F(ftshim_page, attach_count), F(ftshim_page, next_serial),
    F(ftshim_page, overflow), F(ftshim_page, owner_has_nccl), F(ftshim_page, abi_shim_version),
    F(ftshim_page, report), F(ftshim_page, comms),
    F(ftshim_report, epoch), F(ftshim_report, request), F(ftshim_report, started_ns),
    F(ftshim_report, finished_ns), F(ftshim_report, mechanism), F(ftshim_report, group_result),
    F(ftshim_report, n_entries), F(ftshim_report, n_unsafe), F(ftshim_report, nccl_version),
    F(ftshim_report, phase), F(ftshim_report, current_index), F(ftshim_report, entries),
    F(ftshim_report_entry, addr), F(ftshim_report_entry, serial),
    F(ftshim_report_entry, epoch), F(ftshim_report_entry, state_before),
    F(ftshim_report_entry, state_after), F(ftshim_report_entry, mechanism),
    F(ftshim_report_entry, result), F(ftshim_report_entry, inflight_before),
    F(ftshim_report_entry, inflight_after), F(ftshim_report_entry, elapsed_ns),
    F(ftshim_report_entry, flags), F(ftshim_report_entry, rank),
    F(ftshim_comm_slot, addr), F(ftshim_comm_slot, state), F(ftshim_comm_slot, inflight),
    F(ftshim_comm_slot, seq), F(ftshim_comm_slot, last_op), F(ftshim_comm_slot, change),
    F(ftshim_comm_slot, serial), F(ftshim_comm_slot, epoch), F(ftshim_comm_slot, rank),
    F(ftshim_comm_slot, size), F(ftshim_comm_slot, device), F(ftshim_comm_slot, creator),
    F(ftshim_comm_slot, parent_serial), F(ftshim_comm_slot, parent_addr),
    F(ftshim_comm_slot, created_ns), F(ftshim_comm_slot, ended_ns),
    F(ftshim_comm_slot, comm_id), F(ftshim_comm_slot, coll_seq), F(ftshim_comm_slot, derived),
    {NULL, 0, 0}};
#undef F

_Static_assert(sizeof(ftshim_comm_slot) == 128, "slot layout");
_Static_assert(sizeof(ftshim_report_entry) == 64, "report entry layout");
_Static_assert((FTSHIM_MAX_COMMS & (FTSHIM_MAX_COMMS - 1)) == 0, "table size is a power of two");
_Static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes, passed by value");
