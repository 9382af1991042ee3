"""In-memory redundant state for sharded training: snapshots that outlive a worker.

A worker's registered state (model and optimizer state dicts with their DTensor shards,
any ``Stateful``) is captured every K committed steps into memory its node's agent owns
(tmpfs), asynchronously, and counted only when every rank's copy is complete (two phases
through the control store). After a fault every member restores the same, newest complete
snapshot. One concept a module:

* :mod:`ftrun.snapshot.format`: the file (JSON manifest + raw bytes + CRC-32, no pickle);
* :mod:`ftrun.snapshot.memory`: the node's directory, its naming, clean-up and size checks;
* :mod:`ftrun.snapshot.records`: the store records (phase 1, phase 2, the restore choice);
* :mod:`ftrun.snapshot.writer`: the copy into the mapped file and the background writer.

Neither the agent nor the worker side is imported here: both use this package.
"""

from __future__ import annotations
