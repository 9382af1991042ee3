"""``python -m ftrun.doctor``: the same as ``ftrun doctor``."""

from ftrun.doctor import main

main()
