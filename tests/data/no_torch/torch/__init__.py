"""Put first on PYTHONPATH, this stands in for torch and refuses to be imported: a command
run with it proves that it never imports torch (tests/test_etcd.py: ``ftrun status`` and
``inject`` of an etcd-v3 job need an etcd client only)."""

raise ImportError("torch was imported (tests/data/no_torch)")
