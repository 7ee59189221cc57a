"""The `spmd` command: the argument parser and commands (main), argparse types, the demo.

Its modules are internal. Importing `spmd.cli.main` does not import jax; a command imports
what it needs when it runs.
"""
