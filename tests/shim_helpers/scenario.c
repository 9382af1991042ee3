/* scenario.c - libscenario.so: what a framework does with NCCL, in C, for the shim's tests.
 * Linked against the NCCL test double (csrc/fake_nccl) by soname libnccl.so.2; which build is
 * loaded (new/old, ASan or not) is chosen at run time with LD_LIBRARY_PATH.
 * Protocol: one line per event on stdout, "WORD values...", read by tests/test_shim.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ftshim_nccl_types.h"

extern char** environ;

ncclResult_t ncclGetVersion(int*);
ncclResult_t ncclGetUniqueId(ncclUniqueId*);
ncclResult_t ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int);
ncclResult_t ncclCommAbort(ncclComm_t);
ncclResult_t ncclCommDestroy(ncclComm_t);
ncclResult_t ncclCommFinalize(ncclComm_t);
ncclResult_t ncclCommRevoke(ncclComm_t, int);
ncclResult_t ncclCommShrink(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int);
ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t*);
ncclResult_t ncclCommCount(const ncclComm_t, int*);
ncclResult_t ncclCommUserRank(const ncclComm_t, int*);
ncclResult_t ncclCommRegister(const ncclComm_t, void*, size_t, void**);
ncclResult_t ncclCommDeregister(const ncclComm_t, void*);
ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                           cudaStream_t);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
const char* ncclGetLastError(ncclComm_t);
void* fakeStreamCreate(void);
int fakeStreamSynchronize(void*);

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static int shim_status(void) {
  int (*st)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "ftshim_status");
  return st ? st() : -1;
}
static const char* shim_reason(void) {
  const char* (*f)(void) = (const char* (*)(void))dlsym(RTLD_DEFAULT, "ftshim_inert_reason");
  return f ? f() : "-";
}
static ncclComm_t new_comm(int nranks, int rank) {
  ncclUniqueId id;
  ncclComm_t c = NULL;
  if (ncclGetUniqueId(&id) != ncclSuccess) { printf("FAIL getuniqueid\n"); exit(3); }
  ncclResult_t r = ncclCommInitRank(&c, nranks, id, rank);
  if (r != ncclSuccess) { printf("FAIL init %d\n", (int)r); exit(3); }
  return c;
}
#define AR(c, s) ncclAllReduce(NULL, NULL, 1, (ncclDataType_t)7, (ncclRedOp_t)0, (c), (cudaStream_t)(s))

/* torch's clean-up of a communicator after an error: async error, deregister, abort. */
static int torch_like_cleanup(ncclComm_t c, void* reg, int use_destroy) {
  ncclResult_t err = ncclSuccess;
  ncclResult_t r1 = ncclCommGetAsyncError(c, &err);
  ncclResult_t r2 = ncclCommDeregister(c, reg);
  const char* last = ncclGetLastError(c);
  ncclResult_t r3 = use_destroy ? ncclCommDestroy(c) : ncclCommAbort(c);
  ncclResult_t r4 = ncclCommAbort(c); /* a second release must also be harmless */
  int ok = r1 == ncclSuccess && err != ncclSuccess && r2 == ncclSuccess && r3 == ncclSuccess &&
           r4 == ncclSuccess && last != NULL;
  printf("CLEANUP %d async=%d/%d dereg=%d release=%d again=%d\n", ok, (int)r1, (int)err, (int)r2,
         (int)r3, (int)r4);
  return ok;
}

/* block <ncomms> [host] [destroy]: comms whose peer never comes; stream mode queues one
 * all-reduce per comm in a group and waits on the stream; host mode blocks inside the call. */
static int cmd_block(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1;
  int host = 0, use_destroy = 0;
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "host")) host = 1;
    if (!strcmp(argv[i], "destroy")) use_destroy = 1;
  }
  if (host) setenv("FAKE_NCCL_BLOCK", "host", 1);
  ncclComm_t comms[16];
  void* regs[16];
  static char buf[64];
  printf("COMMS");
  for (int i = 0; i < n; i++) {
    comms[i] = new_comm(2, 0);
    ncclCommRegister(comms[i], buf, sizeof buf, &regs[i]);
    printf(" %llu", (unsigned long long)(uintptr_t)comms[i]);
  }
  printf("\n");
  int stopped;
  if (host) {
    printf("BLOCKED\n");
    stopped = AR(comms[0], NULL) != ncclSuccess;
  } else {
    void* s = fakeStreamCreate();
    ncclGroupStart();
    for (int i = 0; i < n; i++) AR(comms[i], s);
    ncclGroupEnd();
    printf("BLOCKED\n");
    stopped = fakeStreamSynchronize(s);
  }
  printf("RELEASED %llu %d\n", (unsigned long long)now_ns(), stopped);
  /* the next collective on a stopped comm fails at once */
  printf("NEXT %d\n", (int)AR(comms[0], NULL));
  int ok = 1;
  for (int i = 0; i < n; i++) ok &= torch_like_cleanup(comms[i], regs[i], use_destroy);
  /* a new group forms and works */
  setenv("FAKE_NCCL_BLOCK", "stream", 1);
  ncclComm_t c = new_comm(1, 0);
  void* s = fakeStreamCreate();
  ncclResult_t r = AR(c, s);
  int st = fakeStreamSynchronize(s);
  ncclResult_t err = ncclSuccess;
  ncclCommGetAsyncError(c, &err);
  printf("NEWCOMM %d %d %d %d\n", (int)r, st, (int)err, (int)ncclCommDestroy(c));
  return ok ? 0 : 1;
}

/* race: a call always in flight (FAKE_NCCL_CALL_US) on a 1-rank comm, until one fails. */
static int cmd_race(void) {
  ncclComm_t c = new_comm(1, 0);
  printf("COMMS %llu\n", (unsigned long long)(uintptr_t)c);
  ncclResult_t r;
  long n = 0;
  while ((r = AR(c, NULL)) == ncclSuccess) {
    if (n++ == 0) printf("LOOPING\n");
  }
  printf("STOPPED %d %ld\n", (int)r, n);
  printf("RELEASE %d\n", (int)ncclCommAbort(c));
  return 0;
}

/* reuse: comm A is stopped by the agent; after releasing it, new comms are made until one
 * lands on A's address; that one must work normally. */
static int cmd_reuse(void) {
  static char buf[64];
  void* reg;
  ncclComm_t a = new_comm(2, 0);
  ncclCommRegister(a, buf, sizeof buf, &reg);
  printf("COMMS %llu\nREADY\n", (unsigned long long)(uintptr_t)a);
  ncclResult_t err = ncclSuccess;
  uint64_t deadline = now_ns() + 10000000000ull;
  while (err == ncclSuccess && now_ns() < deadline) {
    ncclCommGetAsyncError(a, &err);
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  printf("SEEN_ERROR %d\n", (int)err);
  ncclCommDeregister(a, reg);
  ncclCommAbort(a);
  ncclComm_t b = NULL, keep[64];
  int tries = 0, nkeep = 0;
  for (; tries < 64; tries++) {
    b = new_comm(1, 0);
    if (b == a) break;
    keep[nkeep++] = b; /* keep it allocated so that the next comm gets another address */
  }
  if (b != a) { printf("NOREUSE %d\n", tries); return 0; }
  void* s = fakeStreamCreate();
  ncclResult_t r = AR(b, s);
  int st = fakeStreamSynchronize(s);
  err = ncclSuccess;
  ncclResult_t ra = ncclCommGetAsyncError(b, &err);
  int count = -1;
  ncclCommCount(b, &count);
  printf("REUSED %llu %d %d %d %d %d %d\n", (unsigned long long)(uintptr_t)b, tries, (int)r, st,
         (int)ra, (int)err, count);
  char line[16];
  if (!fgets(line, sizeof line, stdin)) return 1; /* the test inspects the registry */
  printf("DESTROY %d\n", (int)ncclCommDestroy(b));
  for (int i = 0; i < nkeep; i++) ncclCommDestroy(keep[i]);
  return 0;
}

/* fork: the worker owns the page; a fork child and an exec'd child must stay inert. */
static int cmd_fork(int argc, char** argv, int (*threads)(void)) {
  (void)argc;
  ncclComm_t c = new_comm(1, 0);
  printf("PARENT %d\n", shim_status());
  pid_t pid = fork();
  if (pid == 0) {
    ncclComm_t cc = new_comm(1, 0); /* forwarded, never registered in the parent's page */
    void* s = fakeStreamCreate();
    int r = AR(cc, s) | fakeStreamSynchronize(s) | ncclCommDestroy(cc);
    printf("FORKCHILD %d %d threads=%d reason=%s\n", shim_status(), r, threads(), shim_reason());
    fflush(stdout);
    _exit(0);
  }
  int status;
  waitpid(pid, &status, 0);
  char* args[] = {argv[-2], argv[-1], "status", NULL}; /* worker_main <lib> status */
  if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ) != 0) return 1;
  waitpid(pid, &status, 0);
  printf("DONE %d\n", (int)ncclCommDestroy(c));
  return 0;
}

static int cmd_status(int (*threads)(void)) {
  int v = 0;
  ncclGetVersion(&v);
  printf("STATUS %d threads=%d version=%d reason=%s\n", shim_status(), threads(), v, shim_reason());
  return 0;
}

/* missing: functions the loaded NCCL lacks (run against the old build). */
static int cmd_missing(void) {
  ncclComm_t c = new_comm(1, 0), nc = NULL;
  int r1 = ncclCommRevoke(c, 0), r2 = ncclCommRevoke(c, 0);
  int r3 = ncclCommShrink(c, NULL, 0, &nc, NULL, 0);
  printf("MISSING %d %d %d\n", r1, r2, r3);
  ncclCommDestroy(c);
  return 0;
}

/* twoRanks: both ranks of one 2-rank comm live in this process (threads are not needed: the
 * fake does not wait for peers at init). Rank 0 aborts, rank 1 destroys: with 2.31.2+ semantics
 * that destroy never returns. With the shim, a revoked comm's destroy becomes an abort. */
static int cmd_peer_destroy(int argc, char** argv) {
  int via_agent = argc > 1 && !strcmp(argv[1], "agent");
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t r0, r1;
  ncclCommInitRank(&r0, 2, id, 0);
  ncclCommInitRank(&r1, 2, id, 1);
  printf("READY\n");
  if (via_agent) {
    ncclResult_t err = ncclSuccess;
    while (err == ncclSuccess) {
      ncclCommGetAsyncError(r1, &err);
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
    }
  } else {
    ncclCommAbort(r0);
  }
  printf("DESTROYING\n");
  ncclResult_t r = ncclCommDestroy(r1);
  if (via_agent) ncclCommDestroy(r0);
  printf("DESTROYED %d\n", (int)r);
  return 0;
}

/* split: a parent made in comm epoch 0, a child split from it after the agent moved to
 * epoch 1; the agent aborts epoch 1: only the parent stops. */
static int cmd_split(void) {
  char line[16];
  ncclComm_t parent = new_comm(1, 0), child = NULL;
  printf("PARENT %llu\n", (unsigned long long)(uintptr_t)parent);
  if (!fgets(line, sizeof line, stdin)) return 1;
  ncclResult_t r = ncclCommSplit(parent, 0, 0, &child, NULL);
  printf("CHILD %d %llu\n", (int)r, (unsigned long long)(uintptr_t)child);
  if (!fgets(line, sizeof line, stdin)) return 1;
  void* s = fakeStreamCreate();
  ncclResult_t rc = AR(child, s);
  int st = fakeStreamSynchronize(s);
  ncclResult_t rp = AR(parent, NULL);
  int n = -1;
  ncclCommCount(parent, &n); /* answered from the registry once the parent is gone */
  printf("OPS %d %d %d %d\n", (int)rc, st, (int)rp, n);
  printf("RELEASE %d %d\n", (int)ncclCommDestroy(child), (int)ncclCommAbort(parent));
  return 0;
}

/* bench <iters>: ns per ncclCommCount and per all-reduce launch.
 * The call's cost is the fastest block of BENCH_BLOCK calls: a block takes microseconds, so
 * most blocks run without a preemption, while one timed loop of all the calls on a loaded
 * machine measured the scheduler as much as the shim (73 ns against 3 in one CI run). */
#define BENCH_BLOCK 1000
static int cmd_bench(int argc, char** argv) {
  long iters = argc > 1 ? atol(argv[1]) : 1000000;
  ncclComm_t c = new_comm(1, 0);
  int n = 0;
  for (long i = 0; i < BENCH_BLOCK; i++) ncclCommCount(c, &n);
  uint64_t fastest = UINT64_MAX;
  for (long done = 0; done < iters; done += BENCH_BLOCK) {
    uint64_t t0 = now_ns();
    for (long i = 0; i < BENCH_BLOCK; i++) ncclCommCount(c, &n);
    uint64_t took = now_ns() - t0;
    if (took < fastest) fastest = took;
  }
  void* s = fakeStreamCreate();
  long coll = iters / 10;
  uint64_t t2 = now_ns();
  for (long i = 0; i < coll; i++) {
    AR(c, s);
    if ((i & 127) == 127) fakeStreamSynchronize(s);
  }
  fakeStreamSynchronize(s);
  uint64_t t3 = now_ns();
  printf("BENCH %.2f %.2f %d\n", (double)fastest / BENCH_BLOCK, (double)(t3 - t2) / (double)coll,
         shim_status());
  ncclCommDestroy(c);
  return 0;
}

__attribute__((visibility("default"))) int scenario_run(int argc, char** argv, int (*threads)(void)) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char* cmd = argv[0];
  if (!strcmp(cmd, "block")) return cmd_block(argc, argv);
  if (!strcmp(cmd, "race")) return cmd_race();
  if (!strcmp(cmd, "reuse")) return cmd_reuse();
  if (!strcmp(cmd, "fork")) return cmd_fork(argc, argv, threads);
  if (!strcmp(cmd, "status")) return cmd_status(threads);
  if (!strcmp(cmd, "missing")) return cmd_missing();
  if (!strcmp(cmd, "peer-destroy")) return cmd_peer_destroy(argc, argv);
  if (!strcmp(cmd, "bench")) return cmd_bench(argc, argv);
  if (!strcmp(cmd, "split")) return cmd_split();
  fprintf(stderr, "unknown scenario %s\n", cmd);
  return 2;
}
