"""The client side: commands a person runs against a job that is already running.

* :mod:`~ftrun.client.jobref`: finding a job (the host's registry of live jobs, ``RUN_ID``
  or ``HOST:PORT`` or an etcd endpoint), written by the agent, read by the commands;
* :mod:`~ftrun.client.status`: ``ftrun status``, the job's live view;
* :mod:`~ftrun.client.inject`: ``ftrun inject``, a fault into a live job, checked before
  anything is touched;
* :mod:`~ftrun.client.faultspec`: the fault grammar ``ftrun inject`` and ``--inject`` share.

Nothing here imports torch or the agent's modules: a command answers in a fraction of a
second.
"""
