"""Click subcommands, one module each, imported lazily by :mod:`mpinfer.cli`.

Each command parses options into one config object and calls one public API function.
"""
