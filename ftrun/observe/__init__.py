"""What is said about a job, from one stream of events: the projections people and programs
read, apart from the agent that emits the events.

* :mod:`~ftrun.observe.events`: the event names and the JSON-lines log (the contract every
  projection reads, the ``--events-file`` format);
* :mod:`~ftrun.observe.faults`: the fault book, one record per fault with what its recovery
  cost (detection, recovery, steps lost, goodput);
* :mod:`~ftrun.observe.metrics`: ``--metrics-port``, the Prometheus view;
* :mod:`~ftrun.observe.statusboard`: the live view ``ftrun status`` reads;
* :mod:`~ftrun.observe.summary`: the table printed when a job ends.

The agent emits; ``ftrun report`` (:mod:`ftrun.report`) and ``ftrun status`` read; nothing
here imports the agent.
"""
