"""``ftrun report EVENTS.jsonl [-o timeline.html|png]``: a finished (or running) job's faults
and recovery costs from its event log, as the table the agent prints at the end and a
timeline picture (ranks' steps over time with each fault, its detection, the recovery and
the joins), so that people can look instead of read.

The records come from :class:`ftrun.observe.faults.FaultBook`, the same code the agent runs
live, so the report and the console never disagree. The picture is drawn by plotly (HTML,
self-contained) or matplotlib (PNG): well-kept libraries, imported only by this command.
"""
