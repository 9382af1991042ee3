"""Facts of the host the agent runs on, each behind a small module: the network addresses
and interfaces (:mod:`~ftrun.host.hostnet`), the open-file limit (:mod:`~ftrun.host.fdlimit`),
the GPUs (:mod:`~ftrun.host.gpu`, through pynvml) and the Slurm allocation
(:mod:`~ftrun.host.slurm`). The agent and ``ftrun doctor`` read them; workers never do.
"""
