"""The version of this deepinfer (the package facade, the probe cache and the backends report it)."""
__version__ = "0.1.0"
