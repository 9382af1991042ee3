"""The decision core: what to do about a job's progress and faults, as pure rules.

Each module here takes observations (what the agents read from the store and from their
processes) and a clock reading, and returns verdicts; nothing here touches a store, a
process or real time. The supervisors (:mod:`ftrun.agent`) read, call a rule, and carry
out what it decided, so every rule is driven at its edges by ``tests/unit`` in
milliseconds, including the cases that must *not* decide.

* :mod:`~ftrun.decide.progress`: which member keeps the others waiting (stuck in an ended
  member epoch, or stalled inside the current one);
* :mod:`~ftrun.decide.deadline`: every in-process recovery's deadline, and the escalation
  when it passes;
* :mod:`~ftrun.decide.crashloop`: the same error again right after a recovery is the
  script's own bug, not a fault to absorb.
"""
