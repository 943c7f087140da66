"""The package's version, where the package's face and the ranks' start-up check read it."""

__version__ = "0.1.0"
