/* fake_nccl.c - a CPU test double of libnccl.so.2 for the shim's tests (no GPU needed).
 *
 * Symbol shape as in the real library: every function is a global pncclX with a weak alias
 * ncclX, no symbol versions, soname libnccl.so.2. Two builds:
 *   default        "2.32.3": has ncclCommRevoke and ncclCommShrink; destroy after a peer
 *                  aborted waits forever (the 2.31.2+ untimed barrier)
 *   -DFAKE_OLD     "2.26.2": no ncclCommRevoke/ncclCommShrink symbols at all (dlsym fails)
 *
 * The model (in-process only: the ranks of one communicator are threads of one process that
 * call ncclCommInitRank with the same unique id; a rank that never shows up is a dead peer):
 *  - collective number k of rank r completes when every rank of the clique has issued its
 *    collective number k. Until then:
 *      FAKE_NCCL_BLOCK=stream (default): the call returns at once and the work is queued on
 *        the "stream"; fakeStreamSynchronize(stream) blocks like cudaStreamSynchronize;
 *      FAKE_NCCL_BLOCK=host: the calling thread blocks inside the collective.
 *  - ncclCommAbort frees the communicator AT ONCE, without waiting for threads that are
 *    inside a call on it (NCCL's documented unsafe race), then sets the rank's stop flag
 *    (kernels and host loops poll it, as in NCCL) and wakes every waiter: a woken thread
 *    touches its freed comm, a heap-use-after-free that AddressSanitizer reports every time.
 *  - ncclCommRevoke sets the stop flag and frees nothing; later collectives return
 *    ncclInvalidUsage; ncclCommGetAsyncError reports ncclSuccess (as the real one does).
 *  - a stopped stream operation completes "as if done" (garbage output): fakeStreamSynchronize
 *    returns 1 so tests can tell.
 *  - FAKE_NCCL_CALL_US=N: every collective spends N microseconds inside the call, touching the
 *    communicator, so a test can catch an abort racing a call in flight.
 *  - FAKE_NCCL_SHARED_DIR=DIR: ranks may also be separate processes (as under a launcher):
 *    a clique's per-rank collective counts live in a file DIR/clique-<hash of the id>,
 *    mapped shared, and waiters poll it every 5 ms. The id travels between processes
 *    as the script chooses (a file, a store), as a real ncclUniqueId does. The stop flags
 *    stay per process, and the 2.31.2+ destroy barrier is not modelled across processes.
 *  - FAKE_NCCL_SYNC=spin: a waiter (host-blocked call or stream synchronisation) spins on
 *    the CPU, as CUDA's default synchronisation does, instead of sleeping.
 *  - FAKE_NCCL_REUSE_COMMS=1: the last freed communicator's memory is handed to the next one
 *    made, as any allocator may do; a test that needs the reuse gets it every time instead of
 *    when glibc's bins happen to line up (off by default, so AddressSanitizer still sees
 *    every free).
 * Guesses (not documented by NCCL, chosen to be conservative): a host-blocked collective
 * released by abort/revoke returns ncclRemoteError; collectives inside a group run at once
 * (no deferral to ncclGroupEnd); split/shrink only coordinate ranks within this process;
 * init does not wait for peers.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../ftshim_nccl_types.h"

#ifdef FAKE_OLD
#define FAKE_VERSION 22602
#else
#define FAKE_VERSION 23203
#define FAKE_HAVE_REVOKE 1
#endif

#define EXPORT __attribute__((visibility("default")))
/* pnccl##name is the implementation, nccl##name a weak alias of it (as in libnccl). */
#define DEF(ret, name, params)                                                     \
  EXPORT ret pnccl##name params;                                                   \
  EXPORT ret nccl##name params __attribute__((weak, alias("pnccl" #name)));         \
  EXPORT ret pnccl##name params

#define MAXR 64
#define COMM_LIVE 0x11CC0A11u
#define COMM_DEAD 0xDEADC0DEu

typedef struct clique {
  char id[128];
  int nranks;
  int refs;
  uint64_t own[MAXR];     /* collectives issued per rank (one process) */
  uint64_t* progress;     /* own, or the shared file's counts (FAKE_NCCL_SHARED_DIR) */
  int stopped[MAXR];      /* the rank's abort flag */
  int any_aborted;        /* some rank aborted: destroy would wait forever (2.31.2+) */
  int destroy_arrived;
  struct clique* next;
} clique;

struct ncclComm {
  uint32_t magic;
  int rank, nranks, dev;
  int revoked;
  clique* cl;
  volatile uint64_t nops;
  int derives;            /* children derived from it (every rank derives in the same order) */
  void* regs[64];
};

typedef struct fake_stream {
  int n;
  struct { clique* cl; int rank; uint64_t k; } ops[256];
} fake_stream;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static clique* cliques;
static uint64_t id_counter;
static int live_comms;
static __thread int group_depth;

static int host_blocking(void) {
  const char* e = getenv("FAKE_NCCL_BLOCK");
  return e && strcmp(e, "host") == 0;
}
static long call_us(void) {
  const char* e = getenv("FAKE_NCCL_CALL_US");
  return e ? atol(e) : 0;
}

static void check(struct ncclComm* c, const char* fn) {
  if (c->magic != COMM_LIVE) {
    fprintf(stderr, "fake-nccl: %s on a freed or invalid communicator %p\n", fn, (void*)c);
    abort();
  }
}

static const char* shared_dir(void) {
  const char* d = getenv("FAKE_NCCL_SHARED_DIR");
  return d && *d ? d : NULL;
}
/* The per-rank counts of the clique `id` shared by every process (FAKE_NCCL_SHARED_DIR). */
static uint64_t* shared_progress(const char* id) {
  uint64_t h = 14695981039346656037ull;
  for (int i = 0; i < 128; i++) h = (h ^ (unsigned char)id[i]) * 1099511628211ull;
  char path[4096];
  snprintf(path, sizeof path, "%s/clique-%016llx", shared_dir(), (unsigned long long)h);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0 || ftruncate(fd, MAXR * sizeof(uint64_t)) != 0) {
    fprintf(stderr, "fake-nccl: cannot share clique counts in %s\n", path);
    abort();
  }
  void* m = mmap(NULL, MAXR * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) abort();
  return m;
}
static clique* clique_get(const char* id, int nranks) { /* mu held */
  for (clique* q = cliques; q; q = q->next)
    if (memcmp(q->id, id, 128) == 0) { q->refs++; return q; }
  clique* q = calloc(1, sizeof *q);
  memcpy(q->id, id, 128);
  q->nranks = nranks;
  q->refs = 1;
  q->progress = shared_dir() ? shared_progress(id) : q->own;
  q->next = cliques;
  cliques = q;
  return q;
}
static void clique_put(clique* q) { /* mu held */
  if (--q->refs) return;
  for (clique** pp = &cliques; *pp; pp = &(*pp)->next)
    if (*pp == q) { *pp = q->next; break; }
  if (q->progress != q->own) munmap(q->progress, MAXR * sizeof(uint64_t));
  free(q);
}
static int op_done(clique* q, uint64_t k) { /* mu held */
  for (int j = 0; j < q->nranks; j++)
    if (__atomic_load_n(&q->progress[j], __ATOMIC_SEQ_CST) < k) return 0;
  return 1;
}
/* FAKE_NCCL_SYNC=spin: waiters burn CPU instead of sleeping, as a CUDA synchronisation
 * spins while its context has a core to itself (cudaDeviceScheduleAuto). */
static int spinning(void) {
  const char* e = getenv("FAKE_NCCL_SYNC");
  return e && strcmp(e, "spin") == 0;
}
/* Wait for a change: a signal from this process, or (shared cliques) a poll of the file. */
static void wait_change(void) { /* mu held */
  if (spinning()) {
    pthread_mutex_unlock(&mu);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 1000000L);
    pthread_mutex_lock(&mu);
    return;
  }
  if (!shared_dir()) {
    pthread_cond_wait(&cv, &mu);
    return;
  }
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  t.tv_nsec += 5000000; /* 5 ms: a waiter's polls cost well under 1% of a core */
  if (t.tv_nsec >= 1000000000) { t.tv_sec++; t.tv_nsec -= 1000000000; }
  pthread_cond_timedwait(&cv, &mu, &t);
}

/* Through a volatile pointer: GCC would otherwise fuse malloc + memset(0) back into calloc. */
static void* (*volatile zero_fill)(void*, int, size_t) = memset;

/* The one freed communicator kept for FAKE_NCCL_REUSE_COMMS (guarded by mu). */
static struct ncclComm* recycled_comm;

static int reuse_comms(void) {
  const char* v = getenv("FAKE_NCCL_REUSE_COMMS");
  return v && strcmp(v, "1") == 0;
}

static struct ncclComm* comm_new(const char* id, int nranks, int rank) {
  pthread_mutex_lock(&mu);
  struct ncclComm* c = recycled_comm;
  recycled_comm = NULL;
  pthread_mutex_unlock(&mu);
  /* malloc + memset like NCCL's own calloc helper (glibc's calloc skips the thread cache, so
   * it would almost never hand a freed communicator's address to the next one) */
  if (!c) c = malloc(sizeof *c);
  zero_fill(c, 0, sizeof *c);
  c->magic = COMM_LIVE;
  c->rank = rank;
  c->nranks = nranks;
  c->dev = 0;
  pthread_mutex_lock(&mu);
  c->cl = clique_get(id, nranks);
  live_comms++;
  pthread_mutex_unlock(&mu);
  return c;
}
static void comm_free(struct ncclComm* c) {
  pthread_mutex_lock(&mu);
  clique_put(c->cl);
  live_comms--;
  pthread_mutex_unlock(&mu);
  for (int i = 0; i < 64; i++) free(c->regs[i]);
  c->magic = COMM_DEAD;
  if (reuse_comms()) {
    pthread_mutex_lock(&mu);
    struct ncclComm* older = recycled_comm;
    recycled_comm = c;
    pthread_mutex_unlock(&mu);
    free(older);
    return;
  }
  free(c);
}

DEF(ncclResult_t, GetVersion, (int* version)) {
  if (!version) return ncclInvalidArgument;
  *version = FAKE_VERSION;
  return ncclSuccess;
}
DEF(const char*, GetErrorString, (ncclResult_t r)) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    default: return "fake error";
  }
}
DEF(const char*, GetLastError, (ncclComm_t comm)) {
  if (comm) check(comm, "ncclGetLastError");
  return "";
}
DEF(ncclResult_t, GetUniqueId, (ncclUniqueId* id)) {
  if (!id) return ncclInvalidArgument;
  memset(id, 0, sizeof *id);
  pthread_mutex_lock(&mu);
  uint64_t n = ++id_counter;
  pthread_mutex_unlock(&mu);
  snprintf(id->internal, sizeof id->internal, "fake-%d-%llu", (int)getpid(), (unsigned long long)n);
  return ncclSuccess;
}
DEF(ncclResult_t, CommInitRank, (ncclComm_t* comm, int nranks, ncclUniqueId id, int rank)) {
  if (!comm || nranks < 1 || nranks > MAXR || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = comm_new(id.internal, nranks, rank);
  return ncclSuccess;
}
DEF(ncclResult_t, CommInitRankConfig,
    (ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config)) {
  if (config) {
    const ftshim_nccl_config_head* h = (const ftshim_nccl_config_head*)config;
    if (h->magic != FTSHIM_NCCL_API_MAGIC) return ncclInvalidArgument;
  }
  return pncclCommInitRank(comm, nranks, id, rank);
}
DEF(ncclResult_t, CommInitAll, (ncclComm_t* comm, int ndev, const int* devlist)) {
  (void)devlist;
  ncclUniqueId id;
  pncclGetUniqueId(&id);
  for (int i = 0; i < ndev; i++) comm[i] = comm_new(id.internal, ndev, i);
  return ncclSuccess;
}
static ncclResult_t derive(struct ncclComm* c, int nranks, int rank, int tag, ncclComm_t* out) {
  char id[128];
  int n = c->derives++; /* every rank derives in the same order: the same child id */
  memcpy(id, c->cl->id, 128);
  snprintf(id + 96, 32, "/%d/%d", tag, n);
  *out = comm_new(id, nranks, rank);
  return ncclSuccess;
}
DEF(ncclResult_t, CommSplit, (ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                              ncclConfig_t* config)) {
  (void)key; (void)config;
  check(comm, "ncclCommSplit");
  if (color < 0) { *newcomm = NULL; return ncclSuccess; }
  return derive(comm, comm->nranks, comm->rank, color, newcomm);
}
#ifdef FAKE_HAVE_REVOKE
DEF(ncclResult_t, CommShrink, (ncclComm_t comm, int* excl, int nexcl, ncclComm_t* newcomm,
                               ncclConfig_t* config, int flags)) {
  (void)config; (void)flags;
  check(comm, "ncclCommShrink");
  int newrank = comm->rank;
  for (int i = 0; i < nexcl; i++) {
    if (excl[i] == comm->rank) { *newcomm = NULL; return ncclSuccess; }
    if (excl[i] < comm->rank) newrank--;
  }
  return derive(comm, comm->nranks - nexcl, newrank, 1000, newcomm);
}
DEF(ncclResult_t, CommRevoke, (ncclComm_t comm, int flags)) {
  if (!comm) return ncclInvalidArgument;
  check(comm, "ncclCommRevoke");
  if (flags != 0) return ncclInvalidArgument;
  pthread_mutex_lock(&mu);
  comm->revoked = 1;
  comm->cl->stopped[comm->rank] = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  return ncclSuccess;
}
#endif
DEF(ncclResult_t, CommFinalize, (ncclComm_t comm)) {
  if (!comm) return ncclInvalidArgument;
  check(comm, "ncclCommFinalize");
  return ncclSuccess;
}
DEF(ncclResult_t, CommDestroy, (ncclComm_t comm)) {
  if (!comm) return ncclSuccess;
  check(comm, "ncclCommDestroy");
#ifdef FAKE_HAVE_REVOKE
  if (comm->nranks > 1 && !comm->revoked && !shared_dir()) {
    /* 2.31.2+: an intra-node barrier without a timeout. A peer that aborted never arrives. */
    pthread_mutex_lock(&mu);
    clique* q = comm->cl;
    q->destroy_arrived++;
    while (q->destroy_arrived < q->nranks) pthread_cond_wait(&cv, &mu);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
  }
#endif
  comm_free(comm);
  return ncclSuccess;
}
DEF(ncclResult_t, CommAbort, (ncclComm_t comm)) {
  if (!comm) return ncclSuccess;
  check(comm, "ncclCommAbort");
  pthread_mutex_lock(&mu);
  clique* q = comm->cl;
  int r = comm->rank;
  q->refs++; /* the stop flag outlives the communicator */
  pthread_mutex_unlock(&mu);
  /* Freed first, without waiting for threads inside a call on it (NCCL's documented unsafe
   * race), and before any of them can wake: a woken thread's touch of its communicator then
   * always comes after the free, so AddressSanitizer reports every such race instead of
   * those the scheduler happens to order that way. */
  comm_free(comm);
  pthread_mutex_lock(&mu);
  q->stopped[r] = 1;
  q->any_aborted = 1;
  pthread_cond_broadcast(&cv);
  clique_put(q);
  pthread_mutex_unlock(&mu);
  return ncclSuccess;
}
DEF(ncclResult_t, CommGetAsyncError, (ncclComm_t comm, ncclResult_t* err)) {
  if (!comm || !err) return ncclInvalidArgument;
  check(comm, "ncclCommGetAsyncError");
  *err = ncclSuccess; /* also after revoke: the real library reports success there */
  return ncclSuccess;
}
DEF(ncclResult_t, CommCount, (const ncclComm_t comm, int* count)) {
  if (!comm || !count) return ncclInvalidArgument;
  check(comm, "ncclCommCount");
  *count = comm->nranks;
  return ncclSuccess;
}
DEF(ncclResult_t, CommUserRank, (const ncclComm_t comm, int* rank)) {
  if (!comm || !rank) return ncclInvalidArgument;
  check(comm, "ncclCommUserRank");
  *rank = comm->rank;
  return ncclSuccess;
}
DEF(ncclResult_t, CommCuDevice, (const ncclComm_t comm, int* dev)) {
  if (!comm || !dev) return ncclInvalidArgument;
  check(comm, "ncclCommCuDevice");
  *dev = comm->dev;
  return ncclSuccess;
}
DEF(ncclResult_t, CommRegister, (const ncclComm_t comm, void* buff, size_t size, void** handle)) {
  (void)buff; (void)size;
  check(comm, "ncclCommRegister");
  for (int i = 0; i < 64; i++)
    if (!comm->regs[i]) {
      comm->regs[i] = malloc(32);
      *handle = comm->regs[i];
      return ncclSuccess;
    }
  return ncclSystemError;
}
DEF(ncclResult_t, CommDeregister, (const ncclComm_t comm, void* handle)) {
  check(comm, "ncclCommDeregister");
  for (int i = 0; i < 64; i++)
    if (comm->regs[i] == handle) {
      free(handle);
      comm->regs[i] = NULL;
      return ncclSuccess;
    }
  return ncclInvalidArgument;
}
DEF(ncclResult_t, GroupStart, (void)) { group_depth++; return ncclSuccess; }
DEF(ncclResult_t, GroupEnd, (void)) {
  if (group_depth <= 0) return ncclInvalidUsage;
  group_depth--;
  return ncclSuccess;
}

/* The body of every collective. */
static ncclResult_t collective(struct ncclComm* c, cudaStream_t stream, const char* fn) {
  if (!c) return ncclInvalidArgument;
  check(c, fn);
  if (c->revoked) return ncclInvalidUsage;
  long us = call_us();
  for (long t = 0; t < us; t += 100) { /* a call in flight, touching its communicator */
    c->nops++;
    usleep(100);
  }
  pthread_mutex_lock(&mu);
  clique* q = c->cl;
  int r = c->rank;
  uint64_t k = __atomic_add_fetch(&q->progress[r], 1, __ATOMIC_SEQ_CST);
  if (host_blocking()) {
    q->refs++; /* the stop flag is read after an abort freed the communicator */
    while (!op_done(q, k) && !q->stopped[r]) wait_change();
    pthread_cond_broadcast(&cv);
    int stopped = q->stopped[r] && !op_done(q, k);
    clique_put(q);
    pthread_mutex_unlock(&mu);
    c->nops++; /* a freed comm here is the abort-during-call race (ASan reports it) */
    return stopped ? ncclRemoteError : ncclSuccess;
  }
  fake_stream* s = (fake_stream*)stream;
  if (s && s->n < 256) {
    q->refs++;
    s->ops[s->n].cl = q;
    s->ops[s->n].rank = r;
    s->ops[s->n].k = k;
    s->n++;
  }
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  c->nops++;
  return ncclSuccess;
}

#define COLL_ARGS_AR (const void* sb, void* rb, size_t n, ncclDataType_t dt, ncclRedOp_t op, \
                      ncclComm_t comm, cudaStream_t stream)
DEF(ncclResult_t, AllReduce, COLL_ARGS_AR) {
  (void)sb; (void)rb; (void)n; (void)dt; (void)op;
  return collective(comm, stream, "ncclAllReduce");
}
DEF(ncclResult_t, Broadcast, (const void* sb, void* rb, size_t n, ncclDataType_t dt, int root,
                              ncclComm_t comm, cudaStream_t stream)) {
  (void)sb; (void)rb; (void)n; (void)dt; (void)root;
  return collective(comm, stream, "ncclBroadcast");
}
DEF(ncclResult_t, AllGather, (const void* sb, void* rb, size_t n, ncclDataType_t dt,
                              ncclComm_t comm, cudaStream_t stream)) {
  (void)sb; (void)rb; (void)n; (void)dt;
  return collective(comm, stream, "ncclAllGather");
}
DEF(ncclResult_t, Send, (const void* sb, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm,
                         cudaStream_t stream)) {
  (void)sb; (void)n; (void)dt; (void)peer;
  return collective(comm, stream, "ncclSend");
}
DEF(ncclResult_t, Recv, (void* rb, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm,
                         cudaStream_t stream)) {
  (void)rb; (void)n; (void)dt; (void)peer;
  return collective(comm, stream, "ncclRecv");
}

/* ---- test-only entry points (not NCCL API) ---- */
EXPORT void* fakeStreamCreate(void) { return calloc(1, sizeof(fake_stream)); }
EXPORT void fakeStreamDestroy(void* s) { free(s); }
/* Like cudaStreamSynchronize: 0 when every queued operation completed, 1 when some were
 * stopped by an abort/revoke of their communicator (output is garbage). */
EXPORT int fakeStreamSynchronize(void* stream) {
  fake_stream* s = stream;
  int stopped = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < s->n; i++) {
    clique* q = s->ops[i].cl;
    while (!op_done(q, s->ops[i].k) && !q->stopped[s->ops[i].rank]) wait_change();
    if (!op_done(q, s->ops[i].k)) stopped = 1;
    clique_put(q);
  }
  s->n = 0;
  pthread_mutex_unlock(&mu);
  return stopped;
}
EXPORT int fakeLiveComms(void) {
  pthread_mutex_lock(&mu);
  int n = live_comms;
  pthread_mutex_unlock(&mu);
  return n;
}
