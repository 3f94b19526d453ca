"""Build script. The pure-Python package always installs; the compiled extension fastgrad._C is
optional and is added by csrc/ when a toolchain is present (see README, "Building the extension")."""

from setuptools import setup

setup()
