/* ftshim_nccl_types.h - the few NCCL types the shim needs, declared by the shim itself.
 *
 * Why not include nccl.h: it includes cuda_runtime.h, and the shim must build on a machine
 * without the CUDA toolkit (pip install on a login node, CI without GPUs). Every declaration
 * here is ABI-checked against the real nccl.h by tests/test_shim_nccl_real.py, which compiles
 * the real header against a tiny stub cuda_runtime.h.
 *
 * Rules followed here:
 *  - handles are opaque pointers; the shim never dereferences them;
 *  - enums are plain int-sized enums (the C ABI passes them as int);
 *  - ncclUniqueId is 128 bytes and passed BY VALUE to the init functions, so its size must
 *    match exactly;
 *  - versioned structs (ncclConfig_t, ncclSimInfo_t, ncclCollConfig_t, ...) are only passed
 *    through by pointer; the shim never copies them (their size changes between releases:
 *    ncclConfig_t is 96 bytes in 2.30.7 and 120 in 2.32.3). Only the leading fields are
 *    declared, as ftshim_nccl_config_head, for the ABI test.
 */
#ifndef FTSHIM_NCCL_TYPES_H
#define FTSHIM_NCCL_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
typedef struct CUstream_st* cudaStream_t;

#define FTSHIM_NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[FTSHIM_NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,  /* 2.13+ */
  ncclInProgress = 7,   /* 2.14+ */
  ncclTimeout = 8,      /* 2.30+ */
  ncclNumResults = 9
} ncclResult_t;

typedef enum { ftshim_nccl_redop_dummy = 0x7fffffff } ncclRedOp_t;       /* int-sized */
typedef enum { ftshim_nccl_dtype_dummy = 0x7fffffff } ncclDataType_t;    /* int-sized */
typedef enum { ftshim_nccl_resid_dummy = 0x7fffffff } ncclScalarResidence_t;
typedef enum { ftshim_nccl_memstat_dummy = 0x7fffffff } ncclCommMemStat_t;

/* Leading, never-reordered fields of every ncclConfig_t version (NCCL copies
 * min(config->size, its own size)). The full struct is opaque to the shim. */
typedef struct ftshim_nccl_config_head {
  size_t size;
  unsigned int magic;   /* NCCL_API_MAGIC 0xcafebeef */
  unsigned int version;
  int blocking;         /* offset 16 */
} ftshim_nccl_config_head;
typedef struct ncclConfig_opaque ncclConfig_t;
typedef struct ncclSimInfo_opaque ncclSimInfo_t;
typedef struct ncclCollConfig_opaque ncclCollConfig_t;           /* 2.32+ */
typedef struct ncclWaitSignalDesc_opaque ncclWaitSignalDesc_t;
typedef struct ncclCommProperties_opaque ncclCommProperties_t;   /* device API host side */
typedef struct ncclDevCommRequirements_opaque ncclDevCommRequirements_t;
typedef struct ncclDevComm_opaque ncclDevComm_t;

#define FTSHIM_NCCL_API_MAGIC 0xcafebeefu

#ifdef __cplusplus
}
#endif
#endif /* FTSHIM_NCCL_TYPES_H */
