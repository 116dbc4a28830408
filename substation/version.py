"""The package version, stamped on profile rows and configuration files."""
__version__ = "0.1.0"
