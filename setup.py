"""Build hook: compiles the native NCCL shim (csrc/) into ftrun/_native/.

Everything declarative lives in pyproject.toml; this file only exists because a plain C
shared library (not a Python extension) has to be built at install time.
"""

from setuptools import setup

setup()
