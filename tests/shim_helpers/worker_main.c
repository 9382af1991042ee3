/* worker_main.c - the test worker executable. Like python + torch: the program itself does not
 * link NCCL; it dlopens a library (libscenario.so, standing in for libtorch_cuda.so) with
 * RTLD_LOCAL, and that library has NEEDED libnccl.so.2 and calls ncclX through its PLT. So
 * libnccl is not in the global scope, and only the shim's dlopen(RTLD_NOLOAD) finds it.
 *   worker_main <scenario-lib> <command> [args...]
 *   worker_main --no-nccl      print the shim's status without ever loading NCCL */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static int threads(void) {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  struct dirent* e;
  while (d && (e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  if (d) closedir(d);
  return n;
}

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc >= 2 && strcmp(argv[1], "--no-nccl") == 0) {
    int (*st)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "ftshim_status");
    const char* (*why)(void) = (const char* (*)(void))dlsym(RTLD_DEFAULT, "ftshim_inert_reason");
    int nccl = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD) != NULL;
    printf("STATUS %d threads=%d nccl_loaded=%d reason=%s\n", st ? st() : -1, threads(), nccl,
           why ? why() : "-");
    return 0;
  }
  if (argc < 3) {
    fprintf(stderr, "usage: worker_main <scenario-lib> <command> [args]\n");
    return 2;
  }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  int (*run)(int, char**, int (*)(void)) = (int (*)(int, char**, int (*)(void)))dlsym(h, "scenario_run");
  return run(argc - 2, argv + 2, threads);
}
