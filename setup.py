"""setuptools hook for the one thing pyproject.toml cannot say: cffi's build step."""

from setuptools import setup

setup(cffi_modules=["native/build_fabric.py:ffibuilder", "native/build_pages.py:ffibuilder",
                   "native/build_cref.py:ffibuilder"])
