"""The wheel's layout: the repository's top-level folders inprocess/, checkpoint/, rerun/ and
straggler/ install as ``restartable/inprocess/...`` and so on (restartable/__init__.py says why).
Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

SUBPACKAGES = ("inprocess", "checkpoint", "rerun", "straggler")

setup(
    packages=[
        "restartable",
        *(f"restartable.{p}" for p in find_packages(include=[f"{s}*" for s in SUBPACKAGES])),
    ],
    package_dir={"restartable": "restartable", **{f"restartable.{s}": s for s in SUBPACKAGES}},
)
