/* ftshim_table.h - the one table of NCCL functions the shim interposes (an X-macro).
 *
 * Every NCCL 2.32 nccl.h function that takes or creates a communicator is listed here, plus
 * the group calls (the shim must know when a thread is inside ncclGroupEnd, which launches
 * the work queued on several communicators) and three pass-through calls used by tests and
 * doctor. The interposers, the function-id enum, the name table and the pointer cache are all
 * generated from this list; tests/test_shim_nccl_real.py parses the real nccl.h and the real
 * library's exports and fails when a release adds a communicator function missing here.
 *
 * X(kind, name, since, params, args, c, a1, a2)
 *   kind   what the shim does with it (see ftshim.c, FTSHIM_DEF_<kind>)
 *   name   NCCL name without the "nccl" prefix; the shim defines ncclNAME and forwards to
 *          pncclNAME found in the loaded libnccl
 *   since  first NCCL version code with the function, 0 when it predates 2.12; only used in
 *          the one-time message printed when the loaded NCCL lacks it
 *   params/args   the prototype's parameter list and the matching argument list
 *   c, a1, a2     kind-specific argument expressions (communicator, out pointer, size, rank)
 *
 * Kinds: PASS/PASS_STR  forwarded, not tracked
 *        GSTART/GEND    group calls (tracked per thread)
 *        INIT           c = ncclComm_t* out, a1 = nranks, a2 = rank
 *        INIT_ALL       c = ncclComm_t* out array, a1 = ndev
 *        DERIVE         c = parent, a1 = ncclComm_t* out
 *        COLL           a collective: bumps the sequence number and the collective count
 *        P2P            a point-to-point operation: bumps the sequence number only (ranks of
 *                       one communicator issue different numbers of them)
 *        OP             other use of a live communicator
 *        QUERY/COUNT/URANK/CUDEV   read-only queries (answered from the registry once freed)
 *        ASYNC          ncclCommGetAsyncError (c = comm, a1 = ncclResult_t* out)
 *        LASTERR        ncclGetLastError (returns const char*)
 *        CLEANUP        releases a per-communicator resource (deregister, destroy op ...)
 *        FINALIZE       ncclCommFinalize
 *        RELEASE        ncclCommDestroy / ncclCommAbort (a1 = 1 for abort)
 */
#ifndef FTSHIM_TABLE_H
#define FTSHIM_TABLE_H

#define FTSHIM_NCCL_TABLE(X) \
  X(PASS,     GetVersion, 0, (int* version), (version), 0, 0, 0) \
  X(PASS,     GetUniqueId, 0, (ncclUniqueId* uniqueId), (uniqueId), 0, 0, 0) \
  X(PASS_STR, GetErrorString, 0, (ncclResult_t result), (result), 0, 0, 0) \
  X(GSTART,   GroupStart, 0, (void), (), 0, 0, 0) \
  X(GEND,     GroupEnd, 0, (void), (), 0, 0, 0) \
  X(GEND,     GroupSimulateEnd, 21900, (ncclSimInfo_t* simInfo), (simInfo), 0, 0, 0) \
  X(INIT,     CommInitRank, 0, (ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank), \
    (comm, nranks, commId, rank), comm, nranks, rank) \
  X(INIT,     CommInitRankConfig, 21400, \
    (ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config), \
    (comm, nranks, commId, rank, config), comm, nranks, rank) \
  X(INIT,     CommInitRankScalable, 22300, \
    (ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds, \
     ncclConfig_t* config), (newcomm, nranks, myrank, nId, commIds, config), newcomm, nranks, myrank) \
  X(INIT_ALL, CommInitAll, 0, (ncclComm_t* comm, int ndev, const int* devlist), \
    (comm, ndev, devlist), comm, ndev, 0) \
  X(DERIVE,   CommSplit, 21800, \
    (ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config), \
    (comm, color, key, newcomm, config), comm, newcomm, 0) \
  X(DERIVE,   CommShrink, 22703, \
    (ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm, \
     ncclConfig_t* config, int shrinkFlags), \
    (comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags), comm, newcomm, 0) \
  X(DERIVE,   CommGrow, 22902, \
    (ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank, ncclComm_t* newcomm, \
     ncclConfig_t* config), (comm, nRanks, uniqueId, rank, newcomm, config), comm, newcomm, 0) \
  X(FINALIZE, CommFinalize, 21400, (ncclComm_t comm), (comm), comm, 0, 0) \
  X(RELEASE,  CommDestroy, 0, (ncclComm_t comm), (comm), comm, 0, 0) \
  X(RELEASE,  CommAbort, 0, (ncclComm_t comm), (comm), comm, 1, 0) \
  X(OP,       CommRevoke, 22807, (ncclComm_t comm, int revokeFlags), (comm, revokeFlags), comm, 0, 0) \
  X(QUERY,    CommGetUniqueId, 22902, (ncclComm_t comm, ncclUniqueId* uniqueId), \
    (comm, uniqueId), comm, 0, 0) \
  X(LASTERR,  GetLastError, 21300, (ncclComm_t comm), (comm), comm, 0, 0) \
  X(ASYNC,    CommGetAsyncError, 0, (ncclComm_t comm, ncclResult_t* asyncError), \
    (comm, asyncError), comm, asyncError, 0) \
  X(COUNT,    CommCount, 0, (const ncclComm_t comm, int* count), (comm, count), comm, count, 0) \
  X(CUDEV,    CommCuDevice, 0, (const ncclComm_t comm, int* device), (comm, device), comm, device, 0) \
  X(URANK,    CommUserRank, 0, (const ncclComm_t comm, int* rank), (comm, rank), comm, rank, 0) \
  X(OP,       CommRegister, 21900, (const ncclComm_t comm, void* buff, size_t size, void** handle), \
    (comm, buff, size, handle), comm, 0, 0) \
  X(CLEANUP,  CommDeregister, 21900, (const ncclComm_t comm, void* handle), (comm, handle), comm, 0, 0) \
  X(OP,       CommSuspend, 22907, (ncclComm_t comm, int flags), (comm, flags), comm, 0, 0) \
  X(OP,       CommResume, 22907, (ncclComm_t comm), (comm), comm, 0, 0) \
  X(QUERY,    CommMemStats, 22907, (ncclComm_t comm, ncclCommMemStat_t stat, uint64_t* value), \
    (comm, stat, value), comm, 0, 0) \
  X(OP,       CommWindowRegister, 22700, \
    (ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags), \
    (comm, buff, size, win, winFlags), comm, 0, 0) \
  X(CLEANUP,  CommWindowDeregister, 22700, (ncclComm_t comm, ncclWindow_t win), (comm, win), comm, 0, 0) \
  X(QUERY,    WinGetUserPtr, 0, (ncclComm_t comm, ncclWindow_t win, void** outUserPtr), \
    (comm, win, outUserPtr), comm, 0, 0) \
  X(OP,       RedOpCreatePreMulSum, 21100, \
    (ncclRedOp_t* op, void* scalar, ncclDataType_t datatype, ncclScalarResidence_t residence, \
     ncclComm_t comm), (op, scalar, datatype, residence, comm), comm, 0, 0) \
  X(CLEANUP,  RedOpDestroy, 21100, (ncclRedOp_t op, ncclComm_t comm), (op, comm), comm, 0, 0) \
  X(COLL,     Reduce, 0, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, \
     int root, ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, count, datatype, op, root, comm, stream), comm, 0, 0) \
  X(COLL,     Bcast, 0, \
    (void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream), \
    (buff, count, datatype, root, comm, stream), comm, 0, 0) \
  X(COLL,     Broadcast, 0, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, \
     ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, count, datatype, root, comm, stream), comm, 0, 0) \
  X(COLL,     AllReduce, 0, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, \
     ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, count, datatype, op, comm, stream), comm, 0, 0) \
  X(COLL,     ReduceScatter, 0, \
    (const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, \
     ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, recvcount, datatype, op, comm, stream), comm, 0, 0) \
  X(COLL,     AllGather, 0, \
    (const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, \
     ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, sendcount, datatype, comm, stream), comm, 0, 0) \
  X(COLL,     AlltoAll, 22800, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, \
     cudaStream_t stream), (sendbuff, recvbuff, count, datatype, comm, stream), comm, 0, 0) \
  X(COLL,     Gather, 22800, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, \
     ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, count, datatype, root, comm, stream), comm, 0, 0) \
  X(COLL,     Scatter, 22800, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, \
     ncclComm_t comm, cudaStream_t stream), \
    (sendbuff, recvbuff, count, datatype, root, comm, stream), comm, 0, 0) \
  X(P2P,      Send, 0, \
    (const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, \
     cudaStream_t stream), (sendbuff, count, datatype, peer, comm, stream), comm, 0, 0) \
  X(P2P,      Recv, 0, \
    (void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, \
     cudaStream_t stream), (recvbuff, count, datatype, peer, comm, stream), comm, 0, 0) \
  X(P2P,      PutSignal, 0, \
    (const void* localbuff, size_t count, ncclDataType_t datatype, int peer, ncclWindow_t peerWin, \
     size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, \
     cudaStream_t stream), \
    (localbuff, count, datatype, peer, peerWin, peerWinOffset, sigIdx, ctx, flags, comm, stream), \
    comm, 0, 0) \
  X(P2P,      Signal, 0, \
    (int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream), \
    (peer, sigIdx, ctx, flags, comm, stream), comm, 0, 0) \
  X(P2P,      WaitSignal, 0, \
    (int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm, cudaStream_t stream), \
    (nDesc, signalDescs, comm, stream), comm, 0, 0) \
  X(COLL,     AllReduceConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, \
     ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, count, datatype, op, comm, stream, config), comm, 0, 0) \
  X(COLL,     BroadcastConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, \
     ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, count, datatype, root, comm, stream, config), comm, 0, 0) \
  X(COLL,     ReduceConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, \
     int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, count, datatype, op, root, comm, stream, config), comm, 0, 0) \
  X(COLL,     AllGatherConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, \
     ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, sendcount, datatype, comm, stream, config), comm, 0, 0) \
  X(COLL,     ReduceScatterConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, \
     ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, recvcount, datatype, op, comm, stream, config), comm, 0, 0) \
  X(COLL,     AlltoAllConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, \
     cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, count, datatype, comm, stream, config), comm, 0, 0) \
  X(COLL,     GatherConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, \
     ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, count, datatype, root, comm, stream, config), comm, 0, 0) \
  X(COLL,     ScatterConfig, 23200, \
    (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, \
     ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t* config), \
    (sendbuff, recvbuff, count, datatype, root, comm, stream, config), comm, 0, 0) \
  /* Host side of the device API (nccl_device/core.h): they take a communicator too. */ \
  X(QUERY,    CommQueryProperties, 0, (ncclComm_t comm, ncclCommProperties_t* props), \
    (comm, props), comm, 0, 0) \
  X(OP,       DevCommCreate, 0, \
    (ncclComm_t comm, const ncclDevCommRequirements_t* reqs, ncclDevComm_t* outDevComm), \
    (comm, reqs, outDevComm), comm, 0, 0) \
  X(CLEANUP,  DevCommDestroy, 0, (ncclComm_t comm, const ncclDevComm_t* devComm), \
    (comm, devComm), comm, 0, 0)

#endif /* FTSHIM_TABLE_H */
