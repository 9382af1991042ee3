/* ftshim_abi.h - the shared-memory control page between an ftrun agent and the shim in one
 * worker. This header is the single definition of the layout and of every integer state the
 * page, its report and the library's introspection use; ftrun/shim/abi.py mirrors it with
 * ctypes and Python enums, and tests/test_shim.py checks the mirror against what the built
 * library exports (ftshim_layout_fields, ftshim_enum_values, ftshim_<family>_name).
 *
 * Vocabulary: the shim counts in *comm epochs* (communicator epochs). A comm epoch is private
 * to one control page: the agent sets `current_epoch`, every communicator records the epoch
 * it was created in, and "abort epoch E" stops the communicators whose epoch is < E. It is
 * neither the job generation (the agent's rendezvous, gen/N, FTRUN_GENERATION) nor the member
 * epoch (the regroup supervisor's rgen/N): an agent that wants "every communicator made so
 * far" aborts current_epoch + 1 (ShimControl.abort_all) and never needs to map one counter
 * onto another.
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
#define FTSHIM_ABI_VERSION 3u              /* 3: slots carry comm_id and coll_seq */
#define FTSHIM_MAX_COMMS 256u              /* slots in the communicator table */
#define FTSHIM_ENV_CONTROL "FTRUN_SHIM_CONTROL" /* path of the control page file */
#define FTSHIM_ENV_DEBUG "FTRUN_SHIM_DEBUG"     /* 1: log attach/abort decisions to stderr */
#define FTSHIM_EXIT_AGENT_LOST 86          /* exit status of a worker whose agent died */
#define FTSHIM_EPOCH_ALL UINT64_MAX        /* abort epoch meaning "every communicator" */

/* ---- every integer state of the page, the report and the process ------------------------
 * Each FTSHIM_<FAMILY>S list below is the one definition of an enum family: one
 * X(family, SYMBOL, value, "name") per value, documented in the comment above it. The enum,
 * the library's exported name function ftshim_<family>_name(value) (NULL for a value it does
 * not know) and the ftshim_enum_values table are generated from the list; ftrun/shim/abi.py
 * mirrors each family as a Python enum (the bit sets as enum.IntFlag), and tests/test_shim.py
 * checks the mirror against the built library, value by value. */

/* comm_state (slot.state, entry.state_before/after): one communicator in the registry.
 *   empty      never used (ends a probe chain)
 *   live       usable; calls are forwarded
 *   aborting   the shim is stopping it; callers are turned away
 *   revoked    stopped with ncclCommRevoke: its memory is still valid
 *   aborted    stopped with ncclCommAbort: freed by NCCL
 *   releasing  the application is destroying/aborting it right now
 *   released   the application released it (a tombstone; the slot may be reused) */
#define FTSHIM_COMM_STATES(X)                          \
  X(comm_state, FTSHIM_SLOT_EMPTY, 0, "empty")         \
  X(comm_state, FTSHIM_SLOT_LIVE, 1, "live")           \
  X(comm_state, FTSHIM_SLOT_ABORTING, 2, "aborting")   \
  X(comm_state, FTSHIM_SLOT_REVOKED, 3, "revoked")     \
  X(comm_state, FTSHIM_SLOT_ABORTED, 4, "aborted")     \
  X(comm_state, FTSHIM_SLOT_RELEASING, 5, "releasing") \
  X(comm_state, FTSHIM_SLOT_RELEASED, 6, "released")

/* shim_state (page.shim_state): the page, as the agent sees it.
 *   none        no shim has looked at the page yet
 *   waiting     a candidate process waits for NCCL or bind() before it claims the page
 *   active      owner_pid owns the page and serves commands
 *   detached    the agent closed the channel; the shim only forwards
 *   agent_lost  the agent died: everything was aborted and the worker exits */
#define FTSHIM_SHIM_STATES(X)                             \
  X(shim_state, FTSHIM_STATE_NONE, 0, "none")             \
  X(shim_state, FTSHIM_STATE_WAITING, 1, "waiting")       \
  X(shim_state, FTSHIM_STATE_ACTIVE, 2, "active")         \
  X(shim_state, FTSHIM_STATE_DETACHED, 3, "detached")     \
  X(shim_state, FTSHIM_STATE_AGENT_LOST, 4, "agent_lost")

/* mechanism (report.mechanism, entry.mechanism): how communicators were stopped.
 *   none         nothing to do
 *   revoke       ncclCommRevoke(comm, 0) on each: frees nothing (NCCL 2.28.7+)
 *   group_abort  ncclGroupStart; ncclCommAbort on each; ncclGroupEnd (NCCL 2.22.3+)
 *   abort        ncclCommAbort one by one, without a group (older NCCL)
 *   unavailable  the loaded NCCL offers no abort at all */
#define FTSHIM_MECHANISMS(X)                                  \
  X(mechanism, FTSHIM_MECH_NONE, 0, "none")                   \
  X(mechanism, FTSHIM_MECH_REVOKE, 1, "revoke")               \
  X(mechanism, FTSHIM_MECH_GROUP_ABORT, 2, "group_abort")     \
  X(mechanism, FTSHIM_MECH_ABORT, 3, "abort")                 \
  X(mechanism, FTSHIM_MECH_UNAVAILABLE, 4, "unavailable")

/* report_phase (report.phase): how far the last abort got; an agent whose abort timed out
 * reads it to say where NCCL hung.
 *   idle       no abort has run on this page yet
 *   selecting  choosing the live communicators older than the abort epoch and marking them
 *              aborting (callers are turned away from then on)
 *   stopping   revoking/aborting them in NCCL and waiting for calls in flight to drain;
 *              report.current_index is the entry being processed
 *   done       the report is complete */
#define FTSHIM_REPORT_PHASES(X)                               \
  X(report_phase, FTSHIM_PHASE_IDLE, 0, "idle")               \
  X(report_phase, FTSHIM_PHASE_SELECTING, 1, "selecting")     \
  X(report_phase, FTSHIM_PHASE_STOPPING, 2, "stopping")       \
  X(report_phase, FTSHIM_PHASE_DONE, 3, "done")

/* mode (ftshim_status()): what the shim does in this process. Not in the page: every process
 * that preloads the shim (the worker, its compilers, shells ...) has its own.
 *   inert      forwards every call and tracks nothing (ftshim_inert_reason() says why)
 *   candidate  may claim the page at its first NCCL call, or at once when the agent binds it
 *   active     owns the page: tracks communicators, serves aborts, runs the control thread
 *   detached   the agent closed the channel; stopped handles are still answered safely */
#define FTSHIM_MODES(X)                           \
  X(mode, FTSHIM_MODE_INERT, 0, "inert")          \
  X(mode, FTSHIM_MODE_CANDIDATE, 1, "candidate")  \
  X(mode, FTSHIM_MODE_ACTIVE, 2, "active")        \
  X(mode, FTSHIM_MODE_DETACHED, 3, "detached")

/* entry_flag (entry.flags, a bit set): what went wrong, or was left alone, for one comm.
 *   unsafe_inflight    a thread was inside NCCL on it when NCCL freed it
 *   drain_timeout      calls in flight did not come back within drain_ms
 *   call_failed        the revoke/abort call returned an error
 *   skipped_releasing  the application was destroying it: that call owns it, left alone */
#define FTSHIM_ENTRY_FLAGS(X)                                           \
  X(entry_flag, FTSHIM_F_UNSAFE_INFLIGHT, 0x1, "unsafe_inflight")       \
  X(entry_flag, FTSHIM_F_DRAIN_TIMEOUT, 0x2, "drain_timeout")           \
  X(entry_flag, FTSHIM_F_CALL_FAILED, 0x4, "call_failed")               \
  X(entry_flag, FTSHIM_F_SKIPPED_RELEASING, 0x8, "skipped_releasing")

/* cap (page.caps, a bit set): what the loaded NCCL offers.
 *   revoke  ncclCommRevoke
 *   abort   ncclCommAbort
 *   group   several aborts may go inside one group (NCCL 2.22.3+) */
#define FTSHIM_CAPS(X)                        \
  X(cap, FTSHIM_CAP_REVOKE, 0x1, "revoke")    \
  X(cap, FTSHIM_CAP_ABORT, 0x2, "abort")      \
  X(cap, FTSHIM_CAP_GROUP, 0x4, "group")

/* agent_flag (page.agent_flags, a bit set).
 *   closed  the channel was closed normally: detach, do not abort */
#define FTSHIM_AGENT_FLAGS(X) \
  X(agent_flag, FTSHIM_AGENT_CLOSED, 0x1, "closed")

/* Every family, for the generators: X(LIST, family). */
#define FTSHIM_ENUM_FAMILIES(X)          \
  X(FTSHIM_COMM_STATES, comm_state)      \
  X(FTSHIM_SHIM_STATES, shim_state)      \
  X(FTSHIM_MECHANISMS, mechanism)        \
  X(FTSHIM_REPORT_PHASES, report_phase)  \
  X(FTSHIM_MODES, mode)                  \
  X(FTSHIM_ENTRY_FLAGS, entry_flag)      \
  X(FTSHIM_CAPS, cap)                    \
  X(FTSHIM_AGENT_FLAGS, agent_flag)

#define FTSHIM_ENUM_CONST(family, sym, value, name) sym = value,
#define FTSHIM_ENUM_DECLARE(list, family) enum ftshim_##family { list(FTSHIM_ENUM_CONST) };
FTSHIM_ENUM_FAMILIES(FTSHIM_ENUM_DECLARE)
#undef FTSHIM_ENUM_DECLARE
#undef FTSHIM_ENUM_CONST

typedef struct ftshim_comm_slot {   /* 128 bytes; the first cache line is the hot one */
  uint64_t addr;           /*   0 shim: handle value (the key); 0 = empty */
  uint32_t state;          /*   8 shim: enum ftshim_comm_state */
  uint32_t inflight;       /*  12 shim: threads inside an NCCL call on this comm */
  uint64_t seq;            /*  16 shim: communication operations issued (progress) */
  uint32_t last_op;        /*  24 shim: function id of the last operation (ftshim_function_name) */
  uint32_t change;         /*  28 shim: seqlock; odd while the fields below are rewritten */
  uint64_t serial;         /*  32 shim: creation serial, unique per page, starts at 1 */
  uint64_t epoch;          /*  40 shim: page.current_epoch when it was created */
  int32_t rank;            /*  48 shim: rank in the comm, -1 unknown */
  int32_t size;            /*  52 shim: ranks in the comm, -1 unknown */
  int32_t device;          /*  56 shim: CUDA device, -1 unknown */
  uint32_t creator;        /*  60 shim: function id that created it */
  uint64_t parent_serial;  /*  64 shim: serial of the parent (split/shrink/grow), 0 none */
  uint64_t parent_addr;    /*  72 shim: address of the parent, 0 none */
  uint64_t created_ns;     /*  80 shim: CLOCK_MONOTONIC at creation */
  uint64_t ended_ns;       /*  88 shim: CLOCK_MONOTONIC when stopped or released */
  uint64_t comm_id;        /*  96 shim: the same on every rank of the communicator (a hash
                            *     of its ncclUniqueId, or of its parent's comm_id and the
                            *     derive call), so that agents can compare ranks; 0 unknown */
  uint64_t coll_seq;       /* 104 shim: collectives issued: seq without point-to-point calls,
                            *     which ranks of one comm issue in different numbers */
  uint32_t derived;        /* 112 shim: children derived from it so far (split/shrink/grow:
                            *     every rank derives in the same order, so the count agrees) */
  uint8_t reserved[12];    /* 116 */
} ftshim_comm_slot;

typedef struct ftshim_report_entry {  /* 64 bytes */
  uint64_t addr;           /*  0 */
  uint64_t serial;         /*  8 */
  uint64_t epoch;          /* 16 comm epoch it was created in */
  uint32_t state_before;   /* 24 enum ftshim_comm_state */
  uint32_t state_after;    /* 28 */
  uint32_t mechanism;      /* 32 enum ftshim_mechanism */
  int32_t result;          /* 36 ncclResult_t of the revoke/abort call */
  uint32_t inflight_before;/* 40 threads inside NCCL on it when the abort began */
  uint32_t inflight_after; /* 44 ... when the shim gave up waiting / freed it */
  uint64_t elapsed_ns;     /* 48 time spent on this communicator */
  uint32_t flags;          /* 56 enum ftshim_entry_flag bits */
  int32_t rank;            /* 60 */
} ftshim_report_entry;

typedef struct ftshim_report {        /* written by the shim, complete when report_seq moves */
  uint64_t epoch;          /*  0 abort epoch this report answers */
  uint64_t request;        /*  8 page.abort_request it answers */
  uint64_t started_ns;     /* 16 CLOCK_MONOTONIC */
  uint64_t finished_ns;    /* 24 */
  uint32_t mechanism;      /* 32 enum ftshim_mechanism used */
  int32_t group_result;    /* 36 ncclGroupEnd result (group abort), else 0 */
  uint32_t n_entries;      /* 40 */
  uint32_t n_unsafe;       /* 44 entries with FTSHIM_F_UNSAFE_INFLIGHT */
  uint32_t nccl_version;   /* 48 ncclGetVersion of the loaded library, 0 unknown */
  uint32_t phase;          /* 52 enum ftshim_report_phase (for timeouts) */
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
  uint32_t agent_flags;        /*  36 agent: enum ftshim_agent_flag bits */
  uint64_t current_epoch;      /*  40 agent: comm epoch given to new communicators */
  uint64_t abort_epoch;        /*  48 agent: abort comms with epoch < this */
  uint64_t abort_request;      /*  56 agent: incremented with every abort command */
  uint32_t doorbell;           /*  64 agent: futex word, bumped after every command */
  uint32_t report_seq;         /*  68 shim: futex word, bumped after every report */
  /* status (shim) */
  int32_t owner_pid;           /*  72 shim: process that owns the page (CAS-claimed) */
  uint32_t shim_state;         /*  76 shim: enum ftshim_shim_state */
  uint64_t liveness;           /*  80 shim: +1 every tick_ms while the process runs */
  uint64_t ack_epoch;          /*  88 shim: abort epoch last completed */
  uint64_t ack_request;        /*  96 shim: abort_request last completed */
  uint32_t nccl_version;       /* 104 shim: version of the loaded NCCL, 0 unknown */
  uint32_t caps;               /* 108 shim: enum ftshim_cap bits of the loaded NCCL */
  uint64_t attach_count;       /* 112 shim: claims so far (exec of the owner re-claims) */
  uint64_t next_serial;        /* 120 shim: last creation serial handed out */
  uint64_t overflow;           /* 128 shim: communicators not tracked (table full) */
  uint32_t owner_has_nccl;     /* 136 shim: the owner has NCCL loaded */
  uint32_t abi_shim_version;   /* 140 shim: FTSHIM_ABI_VERSION of the attached shim */
  uint64_t reserved[14];       /* 144 */
  ftshim_report report;        /* 256 */
  ftshim_comm_slot comms[FTSHIM_MAX_COMMS];
} ftshim_page;

/* Layout description exported by the library so that a mirror can be checked. */
typedef struct ftshim_field_info {
  const char* name;     /* "struct.field" */
  uint32_t offset;
  uint32_t size;
} ftshim_field_info;

/* Every value of every enum family above, exported for the same purpose. */
typedef struct ftshim_enum_value {
  const char* family;   /* "comm_state", "mode", ... (the X-list's first argument) */
  uint32_t value;
  const char* name;     /* "live", "agent_lost", ... */
} ftshim_enum_value;

#ifdef __cplusplus
extern "C" {
#endif
/* Exported by libftrun_shim.so. */
extern const ftshim_field_info ftshim_layout_fields[];   /* ends with name == NULL */
extern const ftshim_enum_value ftshim_enum_values[];     /* ends with family == NULL */
const char* ftshim_function_name(uint32_t id);            /* NULL past the end */
uint32_t ftshim_function_count(void);
int ftshim_status(void);        /* this process: enum ftshim_mode */
/* In a worker forked from a fork server that preloads the shim: attach to the page the
 * environment names now, as a spawned worker does at its start. Returns enum ftshim_mode
 * (inert: not attached, ftshim_inert_reason() says why). */
int ftshim_attach(void);
const char* ftshim_inert_reason(void);
/* The name of a value of each family ("live", "group_abort" ...), NULL when unknown:
 * ftshim_comm_state_name, ftshim_shim_state_name, ftshim_mechanism_name,
 * ftshim_report_phase_name, ftshim_mode_name, ftshim_entry_flag_name (one bit),
 * ftshim_cap_name (one bit), ftshim_agent_flag_name (one bit). */
#define FTSHIM_ENUM_NAME_DECLARE(list, family) const char* ftshim_##family##_name(uint32_t value);
FTSHIM_ENUM_FAMILIES(FTSHIM_ENUM_NAME_DECLARE)
#undef FTSHIM_ENUM_NAME_DECLARE
#ifdef __cplusplus
}
#endif

#endif /* FTSHIM_ABI_H */
