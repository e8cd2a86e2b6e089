"""Command-line interface: thin wrappers over the Python API, one module per subcommand."""
