"""``python -m ftrun`` is the same program as the ``ftrun`` console script."""

from ftrun.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
