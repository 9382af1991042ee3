"""The control plane: what agents (and workers) share through the rendezvous store.

* :mod:`~ftrun.control.store`: hosting torch's TCPStore and reading/writing JSON records;
* :mod:`~ftrun.control.auth`: the job secret and signed records;
* :mod:`~ftrun.control.rendezvous`: job generations (who runs, with which ranks), their ends;
* :mod:`~ftrun.control.heartbeat`: agents' heartbeats and the leader's monitor of them;
* :mod:`~ftrun.control.endwatch`: a held store wait on a generation's end;
* :mod:`~ftrun.control.etcd`: the same store operations on an etcd v3 cluster
  (``--rdzv-backend etcd-v3``), and the election of the job's writer.

Nothing here knows about local processes: the agent (:mod:`ftrun.agent`) and the worker
API (:mod:`ftrun.worker`) both build on it.
"""
