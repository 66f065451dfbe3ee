"""The package's version (pyproject.toml's, checked by tests/test_cli.py): `kvrestore.__version__`."""

__version__ = "0.1.0"
