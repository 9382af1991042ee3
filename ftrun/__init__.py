"""ftrun: a fault-tolerant, drop-in replacement for torchrun.

The launcher lives in :mod:`ftrun.cli` and :mod:`ftrun.agent`; the optional in-worker API
is exported from here so that training scripts can ``import ftrun``.
"""

__version__ = "0.1.0"
