/* real_user.c - libreal_user.so: calls the three NCCL functions that work without a GPU,
 * linked against the real libnccl.so.2 (nvidia-nccl wheel) and loaded RTLD_LOCAL by
 * worker_main, as libtorch_cuda is. */
#include <stdio.h>
#include <string.h>

#include "ftshim_nccl_types.h"

ncclResult_t ncclGetVersion(int*);
ncclResult_t ncclGetUniqueId(ncclUniqueId*);
const char* ncclGetErrorString(ncclResult_t);

__attribute__((visibility("default"))) int scenario_run(int argc, char** argv, int (*threads)(void)) {
  (void)argc; (void)argv; (void)threads;
  int v = 0;
  ncclResult_t r1 = ncclGetVersion(&v);
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclResult_t r2 = ncclGetUniqueId(&id);
  int nonzero = 0;
  for (int i = 0; i < (int)sizeof id.internal; i++) nonzero |= id.internal[i] != 0;
  printf("REAL %d %d %d %d\n", (int)r1, v, (int)r2, nonzero);
  printf("ERRSTR %s\n", ncclGetErrorString(ncclInvalidUsage));
  fflush(stdout);
  char line[8];
  if (!fgets(line, sizeof line, stdin)) return 0; /* the test reads the control page meanwhile */
  return 0;
}
