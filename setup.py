"""setuptools hook for the one thing pyproject.toml cannot say: cffi's build step."""

from setuptools import setup

setup(cffi_modules=["native/build_fabric.py:ffibuilder", "native/build_fabric.py:pages_builder",
                   "native/build_fabric.py:cref_builder"])
