/* ftshim_abi.h - the shared-memory control page between an ftrun agent and the shim in one
 * worker. This header is the single definition of the layout; ftrun/shim.py mirrors it with
 * ctypes and tests/test_shim.py checks the mirror against the offsets the built library
 * exports (ftshim_layout_fields).
 *
 * Versioning: `magic` identifies the page, `version` the layout, `size` is sizeof(page) as the
 * agent built it. A shim refuses (stays inert) unless magic matches, version matches and size
 * is at least its own sizeof. New fields are only ever appended (version bump on any other
 * change).
 *
 * Ownership of fields: "agent:" fields are written only by the agent, "shim:" fields only by
 * the shim's owner process. All multi-byte fields are naturally aligned so that 4- and 8-byte
 * loads/stores are single-copy atomic on x86-64 and aarch64 (the agent reads them with plain
 * loads from Python).
 *
 * Wake-ups are futexes on 32-bit words of this MAP_SHARED page (shared futexes keyed by the
 * file page, so agent and worker need not map it at the same address):
 *   agent -> shim: increment `doorbell`, FUTEX_WAKE it;
 *   shim -> agent: increment `report_seq` after writing a report, FUTEX_WAKE it.
 */
#ifndef FTSHIM_ABI_H
#define FTSHIM_ABI_H

#include <stdint.h>

#define FTSHIM_MAGIC 0x314d494853544655ull /* "UFTSHIM1" little-endian */
#define FTSHIM_ABI_VERSION 1u
#define FTSHIM_MAX_COMMS 256u              /* slots in the communicator table */
#define FTSHIM_ENV_CONTROL "FTRUN_SHIM_CONTROL" /* path of the control page file */
#define FTSHIM_ENV_DEBUG "FTRUN_SHIM_DEBUG"     /* 1: log attach/abort decisions to stderr */
#define FTSHIM_EXIT_AGENT_LOST 86          /* exit status of a worker whose agent died */
#define FTSHIM_GEN_ALL UINT64_MAX          /* abort generation meaning "every communicator" */

/* Communicator slot states (slot.state). */
enum ftshim_comm_state {
  FTSHIM_SLOT_EMPTY = 0,      /* never used (ends a probe chain) */
  FTSHIM_SLOT_LIVE = 1,       /* usable; calls are forwarded */
  FTSHIM_SLOT_ABORTING = 2,   /* the shim is stopping it; callers are turned away */
  FTSHIM_SLOT_REVOKED = 3,    /* stopped with ncclCommRevoke: memory still valid */
  FTSHIM_SLOT_ABORTED = 4,    /* stopped with ncclCommAbort: freed by NCCL */
  FTSHIM_SLOT_RELEASING = 5,  /* the application is destroying/aborting it */
  FTSHIM_SLOT_RELEASED = 6    /* the application released it (tombstone, may be reused) */
};

/* Shim states (page.shim_state). */
enum ftshim_shim_state {
  FTSHIM_STATE_NONE = 0,      /* no shim has looked at the page yet */
  FTSHIM_STATE_WAITING = 1,   /* a candidate process waits for NCCL or bind() to claim it */
  FTSHIM_STATE_ACTIVE = 2,    /* owner_pid owns the page and serves commands */
  FTSHIM_STATE_DETACHED = 3,  /* the agent closed the channel; the shim only forwards */
  FTSHIM_STATE_AGENT_LOST = 4 /* the agent died: everything aborted, the worker exits */
};

/* Abort mechanisms (report.mechanism, entry.mechanism). */
enum ftshim_mechanism {
  FTSHIM_MECH_NONE = 0,        /* nothing to do */
  FTSHIM_MECH_REVOKE = 1,      /* ncclCommRevoke(comm, 0) per communicator: frees nothing */
  FTSHIM_MECH_GROUP_ABORT = 2, /* ncclGroupStart; ncclCommAbort each; ncclGroupEnd */
  FTSHIM_MECH_ABORT = 3,       /* ncclCommAbort without a group (NCCL < 2.22.3) */
  FTSHIM_MECH_UNAVAILABLE = 4  /* the loaded NCCL offers no abort at all */
};

/* Abort report entry flags (entry.flags). */
#define FTSHIM_F_UNSAFE_INFLIGHT 0x1u /* a thread was inside NCCL on this comm when freed */
#define FTSHIM_F_DRAIN_TIMEOUT   0x2u /* in-flight calls did not drain within drain_ms */
#define FTSHIM_F_CALL_FAILED     0x4u /* the revoke/abort call returned an error */
#define FTSHIM_F_SKIPPED_RELEASING 0x8u /* the application was destroying it: left alone */

/* Agent flags (page.agent_flags). */
#define FTSHIM_AGENT_CLOSED 0x1u      /* channel closed normally: detach, do not abort */

typedef struct ftshim_comm_slot {   /* 128 bytes; the first cache line is the hot one */
  uint64_t addr;           /*   0 shim: handle value (the key); 0 = empty */
  uint32_t state;          /*   8 shim: enum ftshim_comm_state */
  uint32_t inflight;       /*  12 shim: threads inside an NCCL call on this comm */
  uint64_t seq;            /*  16 shim: communication operations issued (progress) */
  uint32_t last_op;        /*  24 shim: function id of the last operation (ftshim_function_name) */
  uint32_t change;         /*  28 shim: seqlock; odd while the fields below are rewritten */
  uint64_t serial;         /*  32 shim: creation serial, unique per page, starts at 1 */
  uint64_t generation;     /*  40 shim: page.current_generation when it was created */
  int32_t rank;            /*  48 shim: rank in the comm, -1 unknown */
  int32_t size;            /*  52 shim: ranks in the comm, -1 unknown */
  int32_t device;          /*  56 shim: CUDA device, -1 unknown */
  uint32_t creator;        /*  60 shim: function id that created it */
  uint64_t parent_serial;  /*  64 shim: serial of the parent (split/shrink/grow), 0 none */
  uint64_t parent_addr;    /*  72 shim: address of the parent, 0 none */
  uint64_t created_ns;     /*  80 shim: CLOCK_MONOTONIC at creation */
  uint64_t ended_ns;       /*  88 shim: CLOCK_MONOTONIC when stopped or released */
  uint8_t reserved[32];    /*  96 */
} ftshim_comm_slot;

typedef struct ftshim_report_entry {  /* 64 bytes */
  uint64_t addr;           /*  0 */
  uint64_t serial;         /*  8 */
  uint64_t generation;     /* 16 */
  uint32_t state_before;   /* 24 enum ftshim_comm_state */
  uint32_t state_after;    /* 28 */
  uint32_t mechanism;      /* 32 enum ftshim_mechanism */
  int32_t result;          /* 36 ncclResult_t of the revoke/abort call */
  uint32_t inflight_before;/* 40 threads inside NCCL on it when the abort began */
  uint32_t inflight_after; /* 44 ... when the shim gave up waiting / freed it */
  uint64_t elapsed_ns;     /* 48 time spent on this communicator */
  uint32_t flags;          /* 56 FTSHIM_F_* */
  int32_t rank;            /* 60 */
} ftshim_report_entry;

typedef struct ftshim_report {        /* written by the shim, complete when report_seq moves */
  uint64_t generation;     /*  0 abort generation this report answers */
  uint64_t request;        /*  8 page.abort_request it answers */
  uint64_t started_ns;     /* 16 CLOCK_MONOTONIC */
  uint64_t finished_ns;    /* 24 */
  uint32_t mechanism;      /* 32 enum ftshim_mechanism used */
  int32_t group_result;    /* 36 ncclGroupEnd result (group abort), else 0 */
  uint32_t n_entries;      /* 40 */
  uint32_t n_unsafe;       /* 44 entries with FTSHIM_F_UNSAFE_INFLIGHT */
  uint32_t nccl_version;   /* 48 ncclGetVersion of the loaded library, 0 unknown */
  uint32_t phase;          /* 52 0 idle, 1 draining, 2 calling NCCL, 3 done (for timeouts) */
  uint32_t current_index;  /* 56 entry being processed (for timeouts) */
  uint32_t reserved;       /* 60 */
  ftshim_report_entry entries[FTSHIM_MAX_COMMS]; /* 64 */
} ftshim_report;

typedef struct ftshim_page {
  /* identification (agent, written once before the worker starts) */
  uint64_t magic;              /*   0 FTSHIM_MAGIC */
  uint32_t version;            /*   8 FTSHIM_ABI_VERSION */
  uint32_t size;               /*  12 sizeof(ftshim_page) */
  uint32_t max_comms;          /*  16 FTSHIM_MAX_COMMS */
  int32_t agent_pid;           /*  20 agent: the shim aborts everything and exits when it dies */
  /* commands (agent) */
  int32_t bound_pid;           /*  24 agent: the worker pid (bind); 0 = not told yet */
  uint32_t tick_ms;            /*  28 agent: liveness period of the shim thread (1..1000) */
  uint32_t drain_ms;           /*  32 agent: wait for in-flight calls before freeing */
  uint32_t agent_flags;        /*  36 agent: FTSHIM_AGENT_* */
  uint64_t current_generation; /*  40 agent: generation given to new communicators */
  uint64_t abort_generation;   /*  48 agent: abort comms with generation < this */
  uint64_t abort_request;      /*  56 agent: incremented with every abort command */
  uint32_t doorbell;           /*  64 agent: futex word, bumped after every command */
  uint32_t report_seq;         /*  68 shim: futex word, bumped after every report */
  /* status (shim) */
  int32_t owner_pid;           /*  72 shim: process that owns the page (CAS-claimed) */
  uint32_t shim_state;         /*  76 shim: enum ftshim_shim_state */
  uint64_t liveness;           /*  80 shim: +1 every tick_ms while the process runs */
  uint64_t ack_generation;     /*  88 shim: abort generation last completed */
  uint64_t ack_request;        /*  96 shim: abort_request last completed */
  uint32_t nccl_version;       /* 104 shim: version of the loaded NCCL, 0 unknown */
  uint32_t caps;               /* 108 shim: FTSHIM_CAP_* of the loaded NCCL */
  uint64_t attach_count;       /* 112 shim: claims so far (exec of the owner re-claims) */
  uint64_t next_serial;        /* 120 shim: last creation serial handed out */
  uint64_t overflow;           /* 128 shim: communicators not tracked (table full) */
  uint32_t owner_has_nccl;     /* 136 shim: the owner has NCCL loaded */
  uint32_t abi_shim_version;   /* 140 shim: FTSHIM_ABI_VERSION of the attached shim */
  uint64_t reserved[14];       /* 144 */
  ftshim_report report;        /* 256 */
  ftshim_comm_slot comms[FTSHIM_MAX_COMMS];
} ftshim_page;

/* Capabilities of the loaded NCCL (page.caps). */
#define FTSHIM_CAP_REVOKE 0x1u
#define FTSHIM_CAP_ABORT  0x2u
#define FTSHIM_CAP_GROUP  0x4u

/* Layout description exported by the library so that a mirror can be checked. */
typedef struct ftshim_field_info {
  const char* name;     /* "struct.field" */
  uint32_t offset;
  uint32_t size;
} ftshim_field_info;

#ifdef __cplusplus
extern "C" {
#endif
/* Exported by libftrun_shim.so. */
extern const ftshim_field_info ftshim_layout_fields[];   /* ends with name == NULL */
const char* ftshim_function_name(uint32_t id);            /* NULL past the end */
uint32_t ftshim_function_count(void);
int ftshim_status(void);        /* this process: 0 inert, 1 candidate, 2 active, 3 detached */
const char* ftshim_inert_reason(void);
#ifdef __cplusplus
}
#endif

#endif /* FTSHIM_ABI_H */
