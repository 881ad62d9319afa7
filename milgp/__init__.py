"""milgp: deep multiple-instance learning with Gaussian processes.

What lives in each subpackage and module: the README, "Map of the package".
"""
__version__ = "0.1.0"
