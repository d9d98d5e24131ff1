"""dietserve: DietCode-style dynamic-shape BERT serving on Apache TVM."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dietserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
