"""The package's version, readable from every layer (the package root imports the vLLM plugin's registration)."""

__version__ = "0.1.0"
