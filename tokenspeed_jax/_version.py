"""The package version: the single source, read by setuptools (pyproject ``dynamic = ["version"]``) and
exported as ``tokenspeed_jax.__version__``."""

__version__ = "0.1.0"
