"""egressd's packages, found rather than listed (pyproject.toml holds everything else).

Every directory under egressd/ that holds modules is a package (most are namespace packages, with no
__init__.py); data/ (the presets) and dashboard/static/ are package data. The mitmproxy addons live
in addons/ and are installed as egressd.addons, never as a top-level `addons`.
"""

from setuptools import find_namespace_packages, setup

DATA = ["egressd.data", "egressd.data.*", "egressd.dashboard.static", "*.__pycache__"]
PACKAGES = find_namespace_packages(include=["egressd", "egressd.*"], exclude=DATA)

setup(packages=[*PACKAGES, "egressd.addons"], package_dir={"egressd.addons": "addons"})
