"""CLI subcommands, one module each; see eyas/cli.py for the shared contract."""
