"""Put first on a worker's PYTHONPATH by its ftrun agent: see ftrun/exithook.py."""

try:
    import ftrun.exithook
except ImportError:  # an interpreter without ftrun: the agent never points one here
    pass
else:
    ftrun.exithook.boot(__file__)
